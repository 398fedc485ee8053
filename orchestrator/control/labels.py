"""Ray node labels of a probed node: what the planner and placement's label selectors care about.

Every node advertises the GPU model, how many GPUs, which NVLink domain they form, and how many
RDMA NIC rails leave the node (`node-labels` prints them for `ray start --labels`); placement
pins a rank of a multi-node NVLink domain with the domain label.
"""

from __future__ import annotations

import re

from ..topology.model import NodeTopology, fabric_clique

PREFIX = "orchestrator.io/"
NONE = "none"
NVLINK_DOMAIN_LABEL = f"{PREFIX}nvlink-domain"
# NICs that carry GPU traffic between nodes; `unknown` is what `nvidia-smi topo -m` legends
# give, and that matrix lists only the HCAs NCCL can use, never plain Ethernet ports.
RAIL_KINDS = ("infiniband", "roce", "efa", "unknown")
_MAX_VALUE = 63  # Kubernetes label value syntax, which Ray enforces for node labels


def label_value(text: str) -> str:
    """`text` as a valid label value: [A-Za-z0-9._-], at most 63 characters, alphanumeric ends."""
    value = re.sub(r"[^A-Za-z0-9._-]+", "-", text)[:_MAX_VALUE]
    value = value.strip("-._")
    return value or NONE


def gpu_model(node: NodeTopology) -> str:
    """The short model name the planner uses (`H100`, `A100-40GB`), else the product name."""
    from ..planning.gpus import lookup

    gpus = [d for d in node.devices if d.kind == "gpu"]
    if not gpus:
        return NONE
    names = {d.name for d in gpus}
    if len(names) != 1 or not gpus[0].name:
        return "mixed" if len(names) > 1 else "unknown"
    spec = lookup(gpus[0].name)
    return label_value(spec.name if spec is not None else gpus[0].name.removeprefix("NVIDIA "))


def domain_label(clique: str) -> str:
    """The label value of a multi-node NVLink fabric clique (`<uuid>/<id>` -> `<uuid>.<id>`)."""
    return label_value(clique.replace("/", "."))


def nvlink_domain(node: NodeTopology) -> str:
    """The multi-node NVLink fabric clique when there is one, else `<host>-0` for the node's own
    NVLink island (so nodes never share a domain by accident), else `none`."""
    clique = fabric_clique(node)
    if clique:
        return domain_label(clique)
    if node.nvlink_domains:
        return label_value(f"{node.hostname or node.node_id or 'node'}-0")
    return NONE


def topology_source(node: NodeTopology) -> str:
    """How the labels were found: `nvml`, `nvidia-smi`, `declared` (ORCHESTRATOR_TOPOLOGY_FILE),
    `cpu`, or `file` for a capture read by path."""
    word = node.source.split(":", 1)[0]
    return label_value(word) if re.fullmatch(r"[A-Za-z][A-Za-z0-9-]*", word) else "file"


def node_labels(node: NodeTopology) -> dict[str, str]:
    """The Ray node labels of one probed node (every value a valid label value)."""
    gpus = [d for d in node.devices if d.kind == "gpu"]
    largest = max((len(g) for g in node.nvlink_domains), default=0)
    rails = [n for n in node.nics if n.kind in RAIL_KINDS]
    return {
        f"{PREFIX}gpu": gpu_model(node),
        f"{PREFIX}gpus": str(len(gpus)),
        NVLINK_DOMAIN_LABEL: nvlink_domain(node),
        f"{PREFIX}nvlink-domain-size": str(largest),
        f"{PREFIX}nic-rails": str(len(rails)),
        f"{PREFIX}topology-source": topology_source(node),
    }


def format_labels(labels: dict[str, str]) -> str:
    """Ray's `--labels` form: `key=value,key=value`."""
    return ",".join(f"{k}={v}" for k, v in labels.items())
