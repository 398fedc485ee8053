"""Alpha-beta costs of the collectives NCCL (or gloo) runs, and of a group on the topology.

Times in seconds for n bytes over p ranks with per-hop latency alpha and link bandwidth B.
The bandwidth terms are nccl-tests' bus-bandwidth factors: an all-reduce moves 2(p-1)/p of
the buffer over the slowest link of its ring, a reduce-scatter or all-gather (p-1)/p. A tree
all-reduce (NCCL's double binary tree) pays 2 log2(p) hops of latency instead of 2(p-1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Fixed cost of launching one collective (kernel launch, proxy hand-off).
LAUNCH_S = 8e-6


def bus_factor(op: str, p: int) -> float:
    """nccl-tests' busbw / algbw factor of a collective over p ranks."""
    if p < 1:
        raise ValueError(f"a group has at least one rank, got {p}")
    if op == "all_reduce":
        return 2 * (p - 1) / p
    if op in ("reduce_scatter", "all_gather"):
        return (p - 1) / p
    raise ValueError(f"unknown collective {op!r}; known: all_reduce, reduce_scatter, all_gather")


def _check(nbytes: float, bw_gbps: float) -> None:
    if nbytes < 0:
        raise ValueError(f"message size must be >= 0 bytes, got {nbytes}")
    if bw_gbps <= 0:
        raise ValueError(f"link bandwidth must be > 0 GB/s, got {bw_gbps}")


def ring_all_reduce(nbytes: float, p: int, bw_gbps: float, lat_us: float) -> float:
    """Ring all-reduce: 2(p-1) steps of latency, 2(p-1)/p n / B."""
    _check(nbytes, bw_gbps)
    if p == 1 or nbytes == 0:
        return 0.0
    return LAUNCH_S + 2 * (p - 1) * lat_us * 1e-6 + bus_factor("all_reduce", p) * nbytes / (bw_gbps * 1e9)


def tree_all_reduce(nbytes: float, p: int, bw_gbps: float, lat_us: float) -> float:
    """Double-binary-tree all-reduce: 2 log2(p) hops of latency, about 2 n / B of bandwidth."""
    _check(nbytes, bw_gbps)
    if p == 1 or nbytes == 0:
        return 0.0
    return LAUNCH_S + 2 * math.ceil(math.log2(p)) * lat_us * 1e-6 + 2 * nbytes / (bw_gbps * 1e9)


def all_reduce(nbytes: float, p: int, bw_gbps: float, lat_us: float) -> tuple[float, str]:
    """(seconds, `ring` or `tree`): the faster of the two, as NCCL's tuner picks."""
    ring = ring_all_reduce(nbytes, p, bw_gbps, lat_us)
    tree = tree_all_reduce(nbytes, p, bw_gbps, lat_us)
    return (tree, "tree") if tree < ring else (ring, "ring")


def reduce_scatter(nbytes: float, p: int, bw_gbps: float, lat_us: float) -> float:
    """Ring reduce-scatter of an n-byte buffer: p-1 steps, (p-1)/p n / B."""
    _check(nbytes, bw_gbps)
    if p == 1 or nbytes == 0:
        return 0.0
    return LAUNCH_S + (p - 1) * lat_us * 1e-6 + bus_factor("reduce_scatter", p) * nbytes / (bw_gbps * 1e9)


def all_gather(nbytes: float, p: int, bw_gbps: float, lat_us: float) -> float:
    """Ring all-gather producing an n-byte buffer: the mirror of reduce-scatter."""
    return reduce_scatter(nbytes, p, bw_gbps, lat_us)


@dataclass(frozen=True)
class GroupLinks:
    """What one process group of a mesh axis runs over, as its ring sees it."""

    size: int
    """Ranks in the group."""
    per_node: int
    """Members of the group on each node it spans."""
    intra_gbps: float
    """Bottleneck bandwidth of the group's ring inside a node (inf when per_node is 1)."""
    intra_lat_us: float
    """Worst one-way latency of the ring's links inside a node."""
    inter_gbps: float
    """The group's share of the network between nodes (inf when it stays in one node)."""
    inter_lat_us: float
    """One-way latency between nodes."""

    def __post_init__(self) -> None:
        if self.size < 1 or self.per_node < 1 or self.size % self.per_node:
            raise ValueError(f"a group of {self.size} ranks cannot have {self.per_node} on each node")

    @property
    def nodes(self) -> int:
        return self.size // self.per_node

    @property
    def flat_gbps(self) -> float:
        """Bottleneck of one ring through every member: the slowest link it crosses."""
        return min(self.intra_gbps, self.inter_gbps)

    @property
    def flat_lat_us(self) -> float:
        return max(self.intra_lat_us if self.per_node > 1 else 0.0, self.inter_lat_us if self.nodes > 1 else 0.0)


def group_all_reduce(nbytes: float, g: GroupLinks, algorithm: str = "auto") -> tuple[float, str]:
    """(seconds, schedule) of an all-reduce over a group.

    `flat` is one ring (or tree) through every member, bound by the slowest link it crosses;
    `hierarchical` reduce-scatters inside each node, all-reduces 1/per_node of the buffer
    between nodes (per_node rings side by side, together owning the group's network share),
    then all-gathers inside each node. `auto` takes the faster.
    """
    if algorithm not in ("auto", "flat", "hierarchical"):
        raise ValueError(f"algorithm must be auto, flat or hierarchical, got {algorithm!r}")
    if g.size == 1 or nbytes == 0:
        return 0.0, "flat"
    flat, kind = all_reduce(nbytes, g.size, g.flat_gbps, g.flat_lat_us)
    if g.nodes == 1 or g.per_node == 1 or algorithm == "flat":
        return flat, f"flat {kind}"
    m = g.per_node
    inner = reduce_scatter(nbytes, m, g.intra_gbps, g.intra_lat_us) + all_gather(nbytes, m, g.intra_gbps, g.intra_lat_us)
    outer, okind = all_reduce(nbytes / m, g.nodes, g.inter_gbps / m, g.inter_lat_us)
    hier = inner + outer
    if algorithm == "hierarchical" or hier < flat:
        return hier, f"hierarchical ({okind} between nodes)"
    return flat, f"flat {kind}"


def group_reduce_scatter(nbytes: float, g: GroupLinks) -> float:
    """Reduce-scatter of an n-byte buffer over the group's ring."""
    return reduce_scatter(nbytes, g.size, g.flat_gbps, g.flat_lat_us) if g.size > 1 else 0.0


def group_all_gather(nbytes: float, g: GroupLinks) -> float:
    """All-gather into an n-byte buffer over the group's ring."""
    return all_gather(nbytes, g.size, g.flat_gbps, g.flat_lat_us) if g.size > 1 else 0.0
