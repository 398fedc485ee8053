"""A described cluster: one node's capture repeated N times, with a network between them."""

from __future__ import annotations

from ..topology.bandwidth import estimate, nvlink_gen_for
from ..topology.model import ClusterTopology, Network, NodeTopology


def with_gpu(node: NodeTopology, gpu: str) -> NodeTopology:
    """A copy of `node` whose devices are `gpu`, with unmeasured NVLink rates re-estimated for it
    (captures like `topo -m` do not name the GPU, and the lane rate depends on the model)."""
    copy = NodeTopology.from_dict(node.to_dict())
    for d in copy.devices:
        d.name = gpu
    gen = nvlink_gen_for(gpu)
    for l in copy.links:
        if l.kind == "nvlink" and not l.measured:
            l.nvlink_gen = l.nvlink_gen or gen
            l.bandwidth_gbps, l.latency_us = estimate("nvlink", l.nvlinks, l.nvlink_gen, name=gpu)
    return copy


def describe_cluster(node: NodeTopology, nodes: int, network: Network, gpu: str | None = None) -> ClusterTopology:
    """`nodes` copies of `node` (the same wiring everywhere), named `node0`, `node1`, ...

    The copies are one object: a described cluster of a thousand nodes costs one node's memory,
    and the planner lays it out once."""
    if nodes < 1:
        raise ValueError(f"a cluster has at least one node, got {nodes}")
    base = with_gpu(node, gpu) if gpu else NodeTopology.from_dict(node.to_dict())
    base.node_id = None
    return ClusterTopology(nodes=[base] * nodes, network=network)
