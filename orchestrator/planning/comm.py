"""Alpha-beta costs of the collectives NCCL (or gloo) runs, and of a group on the topology.

Times in seconds for n bytes over p ranks with per-hop latency alpha and link bandwidth B.
The bandwidth terms are nccl-tests' bus-bandwidth factors: an all-reduce moves 2(p-1)/p of
the buffer over the slowest link of its ring, a reduce-scatter or all-gather (p-1)/p. A tree
all-reduce (NCCL's double binary tree) pays 2 log2(p) hops of latency instead of 2(p-1).

gloo on CPU is priced as torch's ProcessGroupGloo runs it, not as NCCL: all-reduce is gloo's
ring (reduce-scatter then all-gather in pipelined segments), with the reduction done by the
CPU; `reduce_scatter_tensor` is a clone of the input, a full all-reduce of it and a copy of
the rank's chunk (ProcessGroupGloo::reduce_scatter_tensor_coalesced); `all_gather_into_tensor`
is gloo's ring all-gather into a fresh flat buffer (two whole half-chunks per step, not
pipelined segments) followed by a copy into the output. Every rank of a ring sends and
receives at once, and over TCP on one host both directions' copies run on the same cores,
so a ring step moves bytes at a fraction of the ping-pong bandwidth the probe measures
(one direction at a time): `GLOO_RING_SLOWDOWN` for the pipelined all-reduce ring,
`GLOO_CHUNK_SLOWDOWN` for all-gather's whole chunks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Fixed cost of launching one collective (kernel launch, proxy hand-off).
LAUNCH_S = 8e-6
# gloo's cost per ring step between processes (a round of its own threads over TCP or shared
# memory), far above the link's own latency; NCCL's is in the link figures.
GLOO_STEP_US = 25.0
# A collective (unlike the probe's send/recv) is queued to ProcessGroupGloo's worker thread and
# waited for: two thread hand-offs, which dominate small messages on a busy host.
GLOO_LAUNCH_US = 150.0
# Time a gloo ring step takes per byte over the ping-pong's time per byte (see the module
# docstring); fitted to 2 gloo ranks on a 2-core host, 4 KiB to 16 MiB (benchmarks/cost_model.py).
GLOO_RING_SLOWDOWN = 2.0
GLOO_CHUNK_SLOWDOWN = 2.8
# Between nodes the two directions of a ring step cross a full-duplex wire that, not the
# host's cores, is the bottleneck: the one-host slowdown does not apply to the wire. What is
# left of all-gather's is its whole, unpipelined chunks. Checked on shaped links between
# network namespaces (benchmarks/cost_model.py --shaped), not fitted to them.
GLOO_WIRE_RING_SLOWDOWN = 1.0
GLOO_WIRE_CHUNK_SLOWDOWN = GLOO_CHUNK_SLOWDOWN / GLOO_RING_SLOWDOWN
# Memory passes of reduce-scatter's clone into a fresh buffer: every page of it is faulted in
# and zeroed by the kernel before the copy writes it.
GLOO_FRESH_BUFFER_PASSES = 3


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


def _memory_s(nbytes: float, mem_gbps: float, passes: float = 2) -> float:
    """A copy or an in-place reduction of n bytes on the host: each byte read and written once."""
    return passes * nbytes / (mem_gbps * 1e9)


def gloo_all_reduce(nbytes: float, p: int, bw_gbps: float, lat_us: float, mem_gbps: float,
                    over_wire: bool = False) -> float:
    """gloo's ring all-reduce on CPU: 2(p-1) steps of gloo's latency, 2(p-1)/p n at the ring's
    share of the bandwidth, and the CPU's sum of (p-1)/p n bytes into the buffer. `over_wire`:
    the ring's bottleneck is a network link between nodes, not TCP inside one host."""
    _check(nbytes, bw_gbps)
    if p == 1 or nbytes == 0:
        return 0.0
    steps = 2 * (p - 1)
    slowdown = GLOO_WIRE_RING_SLOWDOWN if over_wire else GLOO_RING_SLOWDOWN
    wire = bus_factor("all_reduce", p) * nbytes * slowdown / (bw_gbps * 1e9)
    return GLOO_LAUNCH_US * 1e-6 + steps * (lat_us + GLOO_STEP_US) * 1e-6 + wire + \
        _memory_s((p - 1) / p * nbytes, mem_gbps)


def gloo_reduce_scatter(nbytes: float, p: int, bw_gbps: float, lat_us: float, mem_gbps: float,
                        over_wire: bool = False) -> float:
    """torch's gloo reduce-scatter of an n-byte input: clone it, all-reduce all n bytes, copy
    out the rank's n/p."""
    if p == 1 or nbytes == 0:
        return 0.0
    clone = _memory_s(nbytes, mem_gbps, 2 * GLOO_FRESH_BUFFER_PASSES)
    return clone + gloo_all_reduce(nbytes, p, bw_gbps, lat_us, mem_gbps, over_wire) + \
        _memory_s(nbytes / p, mem_gbps)


def gloo_all_gather(nbytes: float, p: int, bw_gbps: float, lat_us: float, mem_gbps: float,
                    over_wire: bool = False) -> float:
    """gloo's ring all-gather into an n-byte buffer: the rank's own n/p copied in, p-1 steps of
    two half-chunks each, then the flat buffer copied to the output."""
    _check(nbytes, bw_gbps)
    if p == 1 or nbytes == 0:
        return 0.0
    slowdown = GLOO_WIRE_CHUNK_SLOWDOWN if over_wire else GLOO_CHUNK_SLOWDOWN
    wire = bus_factor("all_gather", p) * nbytes * slowdown / (bw_gbps * 1e9)
    return GLOO_LAUNCH_US * 1e-6 + 2 * (p - 1) * (lat_us + GLOO_STEP_US) * 1e-6 + wire + \
        _memory_s(nbytes / p + nbytes, mem_gbps)


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
    gloo_mem_gbps: float | None = None
    """None: NCCL on GPUs. Otherwise the group runs gloo on CPU (`gloo_*` costs), and this is
    the host's memory bandwidth for gloo's copies and reductions, GB/s."""

    def __post_init__(self) -> None:
        if self.size < 1 or self.per_node < 1 or self.size % self.per_node:
            raise ValueError(f"a group of {self.size} ranks cannot have {self.per_node} on each node")

    @property
    def nodes(self) -> int:
        return self.size // self.per_node

    @property
    def wire_bound(self) -> bool:
        """A flat ring's slowest link is the network between nodes (not a path inside one)."""
        return self.nodes > 1 and self.inter_gbps <= self.intra_gbps

    @property
    def flat_gbps(self) -> float:
        """Bottleneck of one ring through every member: the slowest link it crosses."""
        return min(self.intra_gbps, self.inter_gbps)

    @property
    def flat_lat_us(self) -> float:
        return max(self.intra_lat_us if self.per_node > 1 else 0.0, self.inter_lat_us if self.nodes > 1 else 0.0)


def group_all_reduce(nbytes: float, g: GroupLinks, algorithm: str = "auto") -> tuple[float, str]:
    """(seconds, schedule) of an all-reduce over a group; the schedule starts with the
    algorithm that runs, `flat` or `hierarchical`.

    `flat` is one ring (or tree) through every member, bound by the slowest link it crosses;
    `hierarchical` reduce-scatters inside each node, all-reduces 1/per_node of the buffer
    between nodes (per_node rings side by side, together owning the group's network share),
    then all-gathers inside each node. `auto` takes the faster. A group on one node, or with
    one member per node, has no second level: hierarchical is then the flat ring, and the
    schedule says so when hierarchical was asked for. On gloo the three steps are gloo's own
    collectives (the runtime's DDP hook issues them), priced as gloo runs them.
    """
    if algorithm not in ("auto", "flat", "hierarchical"):
        raise ValueError(f"algorithm must be auto, flat or hierarchical, got {algorithm!r}")
    if g.size == 1 or nbytes == 0:
        return 0.0, "flat"
    mem = g.gloo_mem_gbps
    if mem is not None:
        flat, name = gloo_all_reduce(nbytes, g.size, g.flat_gbps, g.flat_lat_us, mem, g.wire_bound), "flat gloo ring"
    else:
        flat, kind = all_reduce(nbytes, g.size, g.flat_gbps, g.flat_lat_us)
        name = f"flat {kind}"
    if algorithm == "flat":
        return flat, name
    if g.nodes == 1 or g.per_node == 1:
        if algorithm == "hierarchical":
            why = "the group is on one node" if g.nodes == 1 else "the group has one member per node"
            return flat, f"{name} (hierarchical degenerates to flat: {why})"
        return flat, name
    m = g.per_node
    if mem is not None:
        inner = gloo_reduce_scatter(nbytes, m, g.intra_gbps, g.intra_lat_us, mem) + \
            gloo_all_gather(nbytes, m, g.intra_gbps, g.intra_lat_us, mem)
        outer = gloo_all_reduce(nbytes / m, g.nodes, g.inter_gbps / m, g.inter_lat_us, mem, over_wire=True)
        okind = "gloo ring"
    else:
        inner = reduce_scatter(nbytes, m, g.intra_gbps, g.intra_lat_us) + \
            all_gather(nbytes, m, g.intra_gbps, g.intra_lat_us)
        outer, okind = all_reduce(nbytes / m, g.nodes, g.inter_gbps / m, g.inter_lat_us)
    hier = inner + outer
    if algorithm == "hierarchical" or hier < flat:
        return hier, f"hierarchical ({okind} between nodes)"
    return flat, name


@dataclass(frozen=True)
class NcclProtocol:
    """One of NCCL's protocols as its tuner prices a ring (src/graph/tuning.cc: baseLat,
    hwLat, and the share of each line that carries data)."""

    name: str
    base_us: float
    """Fixed latency of one collective."""
    nvlink_step_us: float
    """Latency of a ring step inside a node, over NVLink."""
    net_step_us: float
    """Latency of a ring step that crosses the network."""
    data_share: float
    """Payload bytes per byte on the wire (LL128 sends 120 of every 128)."""

    def latency_s(self, g: GroupLinks) -> float:
        """Latency of one ring all-gather or reduce-scatter over the group: the base, then
        p-1 steps, nodes-1 of them across the network, each at least this protocol's step
        latency and the link's own."""
        inter_steps = g.nodes - 1
        intra_steps = g.size - 1 - inter_steps
        return LAUNCH_S + (self.base_us + intra_steps * max(self.nvlink_step_us, g.intra_lat_us)
                           + inter_steps * max(self.net_step_us, g.inter_lat_us)) * 1e-6


# Simple moves large messages at full bandwidth; LL128 trades 1/16 of it for far shorter steps.
# (LL, half the bandwidth, only wins below the sizes FSDP's units have.)
NCCL_RING_PROTOCOLS = (
    NcclProtocol("Simple", base_us=8.4, nvlink_step_us=3.4, net_step_us=14.0, data_share=1.0),
    NcclProtocol("LL128", base_us=14.0, nvlink_step_us=1.9, net_step_us=4.0, data_share=120 / 128),
)


def nccl_ring_seconds(nbytes: float, g: GroupLinks, units: int = 1) -> float:
    """An n-byte ring all-gather or reduce-scatter over an NCCL group, issued as `units`
    collectives of equal size (FSDP2 issues one per unit), each at the protocol NCCL's tuner
    would pick for it: its latency (`NcclProtocol.latency_s`) and (p-1)/p of the bytes over
    the ring's slowest link."""
    if g.size == 1 or nbytes == 0:
        return 0.0
    if units < 1:
        raise ValueError(f"a buffer goes out in at least one collective, got {units}")
    wire = bus_factor("all_gather", g.size) * nbytes / units / (g.flat_gbps * 1e9)
    return units * min(p.latency_s(g) + wire / p.data_share for p in NCCL_RING_PROTOCOLS)


def group_reduce_scatter(nbytes: float, g: GroupLinks, units: int = 1) -> float:
    """Reduce-scatter of an n-byte buffer over the group's ring, in `units` collectives."""
    if g.size == 1:
        return 0.0
    if g.gloo_mem_gbps is not None:
        one = gloo_reduce_scatter(nbytes / units, g.size, g.flat_gbps, g.flat_lat_us, g.gloo_mem_gbps, g.wire_bound)
        return units * one
    return nccl_ring_seconds(nbytes, g, units)


def group_all_gather(nbytes: float, g: GroupLinks, units: int = 1) -> float:
    """All-gather into an n-byte buffer over the group's ring, in `units` collectives."""
    if g.size == 1:
        return 0.0
    if g.gloo_mem_gbps is not None:
        one = gloo_all_gather(nbytes / units, g.size, g.flat_gbps, g.flat_lat_us, g.gloo_mem_gbps, g.wire_bound)
        return units * one
    return nccl_ring_seconds(nbytes, g, units)


def group_all_to_all(intra_bytes: float, inter_bytes: float, g: GroupLinks) -> float:
    """An all-to-all over the group where each rank sends `intra_bytes` to members on its own
    node and `inter_bytes` to members on others: both flows run at once, the in-node one over
    the slowest pair of members (`RingStats` of an all-to-all axis), the other over the rank's
    share of the node's network (every member sends at once); the slower bounds it. On gloo
    each of the p-1 peers costs a step of gloo's latency, and the rank copies what it sends
    and receives through host memory."""
    if g.size == 1 or intra_bytes + inter_bytes == 0:
        return 0.0
    if intra_bytes < 0 or inter_bytes < 0:
        raise ValueError(f"bytes sent are >= 0, got {intra_bytes} in the node and {inter_bytes} across")
    inside = intra_bytes / (g.intra_gbps * 1e9) if intra_bytes else 0.0
    across = inter_bytes / (g.inter_gbps / g.per_node * 1e9) if inter_bytes else 0.0
    latency = (g.intra_lat_us if intra_bytes else 0.0) + (g.inter_lat_us if inter_bytes else 0.0)
    if g.gloo_mem_gbps is not None:
        steps = (g.size - 1) * (latency + GLOO_STEP_US) * 1e-6
        return GLOO_LAUNCH_US * 1e-6 + steps + GLOO_RING_SLOWDOWN * max(inside, across) + \
            _memory_s(2 * (intra_bytes + inter_bytes), g.gloo_mem_gbps)
    return LAUNCH_S + latency * 1e-6 + max(inside, across)
