"""Load a topology from a file of any supported format, sniffed from its content.

The formats: this project's JSON (a NodeTopology, or a ClusterTopology as `probe --json`
prints it), NCCL topology XML, and the text of `nvidia-smi topo -m`. The same loader serves
`probe --from`, `plan --topology` and nodes that declare their wiring through
`ORCHESTRATOR_TOPOLOGY_FILE`.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from ..errors import TopologyError
from .fabric import complete_xml
from .model import ClusterTopology, Network, NodeTopology
from .nccl_xml import parse_nccl_xml
from .network import network_from_nodes
from .smi import parse_topo_matrix

FORMATS = "this project's topology JSON, NCCL topology XML or `nvidia-smi topo -m` text"


def _read(path: str | os.PathLike) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        raise TopologyError(f"{path}: topology file not found") from None
    except IsADirectoryError:
        raise TopologyError(f"{path}: is a directory, expected a topology file ({FORMATS})") from None
    except OSError as e:
        raise TopologyError(f"{path}: cannot read topology file: {e.strerror or e}") from None


# What other tools print, named in the one line that refuses them.
_FOREIGN = (
    (re.compile(r"ROCm System Management Interface|(Weight|Hops|Link Type) between two GPUs"),
     "`rocm-smi --showtopo` output (AMD GPUs)"),
    (re.compile(r"\b(Machine|Package|NUMANode|PU) L#\d+|^Machine \(", re.M), "`lstopo` output (hwloc)"),
)
_SMI_HEADER = re.compile(r"^[^\w\n]*GPU0[ \t]+GPU1\b|^[^\w\n]*GPU0[ \t]+(?!X\b)\S", re.M)


def _sniff(text: str) -> str:
    head = text.lstrip("\ufeff \t\r\n")
    # A `[user@host ~]$ nvidia-smi topo -m` prompt above a matrix starts like a JSON array.
    if head.startswith("{") or (head.startswith("[") and not _SMI_HEADER.search(text)):
        return "json"
    if head.startswith("<"):
        return "xml"
    if "Unidirectional P2P" in text or "P2P Connectivity Matrix" in text:
        return "p2p-test"
    if "Link 0:" in text and "GPU0" not in text:
        return "nvlink-status"
    for pattern, what in _FOREIGN:
        if pattern.search(text):
            return f"foreign:{what}"
    return "smi"


def _json_nodes(text: str, where: str) -> tuple[list[NodeTopology], Network | None]:
    try:
        data: Any = json.loads(text)
    except json.JSONDecodeError as e:
        raise TopologyError(f"{where}: line {e.lineno}, column {e.colno}: invalid JSON: {e.msg}") from None
    if not isinstance(data, dict):
        raise TopologyError(f"{where}: line 1, column 1: expected a JSON object (a node, or {{\"nodes\": [...]}})")
    try:
        if "nodes" in data:
            if not isinstance(data["nodes"], list) or not data["nodes"]:
                raise TopologyError(f"{where}: key `nodes` must be a non-empty list of nodes")
            cluster = ClusterTopology.from_dict(data)
            nodes, network = cluster.nodes, (cluster.network if "network" in data else None)
        elif "devices" in data:
            nodes, network = [NodeTopology.from_dict(data)], None
        else:
            keys = ", ".join(sorted(data)[:6]) or "none"
            raise TopologyError(
                f"{where}: a topology JSON has key `nodes` (a cluster) or `devices` (a node); found {keys}")
    except TypeError as e:
        # dataclass constructors name the offending key: "unexpected keyword argument 'x'"
        raise TopologyError(f"{where}: {e}".replace("__init__() ", "")) from None
    except (ValueError, AttributeError) as e:
        raise TopologyError(f"{where}: {e}") from None
    for i, node in enumerate(nodes):
        try:
            node.check()
        except ValueError as e:
            raise TopologyError(f"{where}: nodes[{i}]: {e}") from None
    return nodes, network


def _parse_single(text: str, where: str, gpu_name: str | None) -> NodeTopology:
    kind = _sniff(text)
    if kind == "xml":
        node = complete_xml(parse_nccl_xml(text, source=where), text, gpu_name, where)
    elif kind == "smi":
        node = parse_topo_matrix(text, source=where, gpu_names=gpu_name)
    elif kind.startswith("foreign:"):
        raise TopologyError(f"{where}: is {kind.split(':', 1)[1]}, which this planner does not read; give {FORMATS}")
    elif kind == "p2p-test":
        raise TopologyError(f"{where}: is p2pBandwidthLatencyTest output, which measures but does not describe "
                            f"the wiring; give {FORMATS}")
    else:
        raise TopologyError(f"{where}: is `nvidia-smi nvlink -s` output, which has lane rates but no topology; "
                            f"give {FORMATS}")
    if gpu_name:
        for d in node.devices:
            d.name = d.name or gpu_name
    return node


def load_topology_file(path: str | os.PathLike, gpu_name: str | None = None) -> NodeTopology:
    """The one node a file describes (a cluster JSON gives its first node).

    `gpu_name` names the GPU model for formats that do not (`topo -m`, NCCL XML), which sets
    NVLink rates. Raises TopologyError naming the file for a missing, unreadable or bad file.
    """
    where = os.fspath(path)
    text = _read(path)
    if not text.strip():
        raise TopologyError(f"{where}: line 1, column 1: the file is empty; expected {FORMATS}")
    if _sniff(text) == "json":
        node = _json_nodes(text, where)[0][0]
    else:
        node = _parse_single(text, where, gpu_name)
    if not node.source:
        node.source = f"declared:{where}"
    return node


def load_cluster_file(path: str | os.PathLike, gpu_name: str | None = None) -> ClusterTopology:
    """Every node a file describes; a single-node format becomes a one-node cluster.

    When the file gives no network, the figure is summed from the scale-out NICs' line rates
    where they are known, as for a probed cluster.
    """
    where = os.fspath(path)
    text = _read(path)
    if not text.strip():
        raise TopologyError(f"{where}: line 1, column 1: the file is empty; expected {FORMATS}")
    network: Network | None = None
    if _sniff(text) == "json":
        nodes, network = _json_nodes(text, where)
    else:
        nodes = [_parse_single(text, where, gpu_name)]
    return ClusterTopology(nodes=nodes, network=network or network_from_nodes(nodes))
