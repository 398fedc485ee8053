"""Which nodes of a probed cluster a plan may use, and how NVLink domains group them.

Every caller that plans (the `plan` command, the driver, recovery) asks here, so the probe's
picture, the plan, placement and the driver's choice of GPU or CPU workers agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..topology.model import ClusterTopology, NodeTopology


@dataclass(frozen=True)
class LeftOut:
    """A node the plan does not use, and why."""

    node: str
    """Ray node id, or `probed node <i>` (its position in the probed cluster) for a capture."""
    hostname: str
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"node": self.node, "hostname": self.hostname, "reason": self.reason}

    def __str__(self) -> str:
        host = f" ({self.hostname})" if self.hostname else ""
        return f"{self.node}{host}: {self.reason}"


def _name(node: NodeTopology, i: int) -> str:
    # A capture's nodes are named `node<i>` in the plan by their place among the kept nodes,
    # so a left-out one is named by its place in the probed cluster instead.
    return node.node_id if node.node_id is not None else f"probed node {i}"


def has_gpu(node: NodeTopology) -> bool:
    return any(d.kind == "gpu" for d in node.devices)


def plannable(topology: ClusterTopology) -> tuple[ClusterTopology, tuple[LeftOut, ...]]:
    """The nodes a plan runs on, and those it leaves out.

    Where any node has a GPU, the plan is a GPU plan over the GPU nodes: a GPU-less node (a
    Ray head without GPUs, a CPU-only helper) runs no rank and is left out by name. CPU slots
    are planned only on a cluster with no GPU at all. Nodes without any device are left out
    either way.
    """
    gpu = any(has_gpu(n) for n in topology.nodes)
    keep, left = [], []
    for i, n in enumerate(topology.nodes):
        if not n.devices:
            left.append(LeftOut(_name(n, i), n.hostname, "no GPU and no CPU slot"))
        elif gpu and not has_gpu(n):
            left.append(LeftOut(_name(n, i), n.hostname, "no GPU (a GPU plan runs on the GPU nodes only)"))
        else:
            keep.append(n)
    if not left:
        return topology, ()
    return ClusterTopology(nodes=keep, network=topology.network), tuple(left)
