"""The network between nodes, as the planner sees it: one bandwidth and latency per node.

Computed here alone, from the NICs that carry a node's traffic to other nodes, whether the
nodes were probed live or described from a capture.
"""

from __future__ import annotations

from .model import Network, Nic, NodeTopology

# NIC-to-GPU paths that put a NIC on the GPU's side of the host (GPUDirect RDMA distance).
_CLOSE_PATHS = ("pix", "pxb", "phb")
_RDMA_KINDS = ("infiniband", "roce", "efa")


def scale_out_nics(node: NodeTopology) -> list[Nic]:
    """The NICs that carry a node's traffic to other nodes.

    On a GPU node those near a GPU (NCCL picks the NIC closest to each GPU and leaves the
    storage or management ports alone); without path information the RDMA NICs; failing
    that every NIC.
    """
    close = [n for n in node.nics if any(p in _CLOSE_PATHS for p in n.gpu_paths.values())]
    if close:
        return close
    rdma = [n for n in node.nics if n.kind in _RDMA_KINDS]
    return rdma or list(node.nics)


def network_from_nodes(nodes: list[NodeTopology]) -> Network:
    """Per-node scale-out bandwidth: the slowest node's summed NIC line rate, in GB/s.

    The Network default stands when any node's NIC speeds are unknown: one unknown node could
    be the slowest, and a figure that overstates the network misleads the planner more than
    the conservative default.
    """
    totals = []
    for node in nodes:
        speeds = [n.speed_gbps for n in scale_out_nics(node)]
        if not speeds or any(s is None for s in speeds):
            return Network()
        totals.append(sum(s for s in speeds if s is not None) / 8)  # Gbit/s -> GB/s
    if not totals:
        return Network()
    return Network(bandwidth_gbps=round(min(totals), 3), latency_us=Network().latency_us, source="nics")
