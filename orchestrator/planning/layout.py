"""Rank layout: which GPU of which node each global rank of the mesh sits on.

The mesh is (dp_replicate, dp_shard, cp, tp) with tp varying fastest, as `init_device_mesh`
numbers it, and node n holds the ranks [n*g, (n+1)*g). What is left to choose is the order
of a node's GPUs under its local ranks; that order decides which links each axis's rings
cross. The axes are placed innermost first (tp, then cp, then the part of dp_shard inside the
node, then dp_replicate), each on the best links the axes before it left: the tensor-parallel
groups take the set partition of the GPUs whose worst ring is fastest (NVLink-bridged pairs,
the GPUs under one PCIe switch, the fully connected quads of a cube mesh), the next axis then
aligns those groups so that its own rings are fastest. Nodes with the same wiring get the same
order, computed once; ties keep the GPUs' own order, so equal links give the identity layout.

A node here is an NVLink island: an HGX node, or a multi-node NVLink domain (NVL72) the
cluster view merged into one. Context- and expert-parallel groups are the next-innermost
ranks after tp, so they stay inside an island whenever they fit in one. The expert axis is a
second factorisation of the same ranks: its groups are runs of `ep` consecutive ranks, its
all-to-all priced by the slowest pair of members it joins, and the experts' FSDP group
(`efsdp`) is strided by ep.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from functools import lru_cache

from ..topology.model import ClusterTopology, NodeTopology
from .mesh import Mesh

# Beyond these counts the exhaustive searches fall back to greedy construction.
_MAX_CYCLES = 50_000
_MAX_PARTITIONS = 20_000


@dataclass(frozen=True)
class NodeWiring:
    """A node's links as the layout search needs them: hashable, so equal nodes share a layout."""

    devices: tuple[int, ...]
    """Device indices in the node's order."""
    links: tuple[tuple[int, int, float, float, str], ...]
    """(a, b, GB/s, latency us, kind) for every pair a < b."""

    @classmethod
    def of(cls, node: NodeTopology) -> "NodeWiring":
        devices = tuple(sorted(d.index for d in node.devices))
        links = tuple(sorted((l.a, l.b, float(l.bandwidth_gbps), float(l.latency_us), l.kind) for l in node.links))
        return cls(devices, links)

    def table(self) -> dict[tuple[int, int], tuple[float, float]]:
        t: dict[tuple[int, int], tuple[float, float]] = {}
        for a, b, bw, lat, _ in self.links:
            t[(a, b)] = t[(b, a)] = (bw, lat)
        return t

    @property
    def uniform(self) -> bool:
        """Every pair joined by the same kind and bandwidth of link (an NVSwitch, one PCIe switch)."""
        return len({(bw, kind) for _, _, bw, _, kind in self.links}) <= 1


@dataclass(frozen=True)
class RingStats:
    """The links one axis's rings cross inside a node (the worst ring over the node's groups)."""

    gbps: float
    """Bottleneck bandwidth; inf when the axis has one member per node."""
    lat_us: float
    """Worst one-way latency of a crossed link; 0 when the axis has one member per node."""


@dataclass(frozen=True)
class NodeLayout:
    """The order of one node's GPUs under its local ranks, and what each axis gets from it."""

    order: tuple[int, ...]
    """GPU index of local rank 0, 1, ..., g-1."""
    rings: dict[str, RingStats] = field(hash=False, compare=False)
    """Per axis: bottleneck of its rings inside the node."""
    uniform: bool = False
    """True when every pair of GPUs has equal links, so any layout is as good as another."""


def in_node_shape(mesh: Mesh, g: int) -> Mesh:
    """The members of each axis inside one node of g ranks; ValueError when the mesh does not
    cut into whole nodes. A pipeline stage either fills whole nodes or several stages share a
    node (pp is the outermost axis, so it is the last to enter a node). The expert axis is
    placed alike (`expert_in_node`), not here: it refactors the same ranks."""
    rep, shard, cp, tp = mesh.dp_replicate, mesh.dp_shard, mesh.cp, mesh.tp
    if g < 1:
        raise ValueError(f"a node needs at least one device, got {g}")
    if tp > g or g % tp:
        raise ValueError(f"tp={tp} must divide the {g} devices of a node (tensor parallelism stays inside a node)")
    stage = rep * shard * cp * tp
    if mesh.pp > 1:
        if stage < g:
            if g % stage or mesh.pp % (g // stage):
                raise ValueError(f"a pipeline stage of {stage} ranks must divide a node's {g} devices, and the "
                                 f"{mesh.pp} stages fill whole nodes")
            return Mesh(rep, shard, tp, pp=g // stage, cp=cp)
        if stage % g:
            raise ValueError(f"a pipeline stage of {stage} ranks must fill whole nodes of {g} devices")
    rest = g // tp
    if cp >= rest:
        if cp % rest:
            raise ValueError(f"cp={cp} must be a multiple of the {rest} tp groups of a node, or divide it")
        return Mesh(1, 1, tp, cp=rest)
    if rest % cp:
        raise ValueError(f"cp={cp} must divide the {rest} tp groups of a node, or be a multiple of it")
    rest //= cp
    if shard >= rest:
        if shard % rest:
            raise ValueError(f"dp_shard={shard} must be a multiple of the {rest} tp groups of a node, or divide it")
        return Mesh(1, rest, tp, cp=cp)
    if rest % shard:
        raise ValueError(f"dp_shard={shard} must divide the {rest} tp groups of a node, or be a multiple of it")
    if rep * shard * cp * tp < g:
        raise ValueError(f"the mesh {mesh} has fewer ranks than one node's {g} devices")
    return Mesh(rest // shard, shard, tp, cp=cp)


def expert_in_node(mesh: Mesh, shape_in: Mesh) -> tuple[int, int]:
    """(ep, efsdp) members inside one node: an expert group is `ep` consecutive ranks of the
    node's `dp_shard x cp x tp` block, so it fills what of that block the node holds (and
    spans nodes beyond it); the experts' FSDP group takes the rest."""
    borrowed_in = shape_in.dp_shard * shape_in.cp * shape_in.tp
    ep_in = math.gcd(mesh.ep, borrowed_in)
    if mesh.ep > borrowed_in and mesh.ep % borrowed_in:
        raise ValueError(f"ep={mesh.ep} must be a multiple of the {borrowed_in} ranks of dp_shard x cp x tp a node "
                         f"holds, or divide them")
    return ep_in, borrowed_in // ep_in


def _ring(members: list[int], closed: bool,
          table: dict[tuple[int, int], tuple[float, float]]) -> tuple[float, float, float]:
    """(bottleneck GB/s, worst latency us, summed GB/s) of a ring (or a path) through members."""
    if len(members) < 2:
        return math.inf, 0.0, 0.0
    pairs = list(zip(members, members[1:]))
    if closed and len(members) > 2:
        pairs.append((members[-1], members[0]))
    bws = [table[p][0] for p in pairs]
    return min(bws), max(table[p][1] for p in pairs), sum(bws)


def _dihedral(item: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Rotations and reflections of a ring's order: all keep its links."""
    n = len(item)
    rots = [item[i:] + item[:i] for i in range(n)]
    seen: dict[tuple[int, ...], None] = {}
    for r in rots + [tuple(reversed(r)) for r in rots]:
        seen.setdefault(r, None)
    return list(seen)


def _score_group(group: list[tuple[int, ...]], closed: bool, table) -> tuple[float, float, float, float]:
    """(worst ring bottleneck, worst pair, worst latency, summed ring bandwidth) over the rings
    of aligned members. The worst pair breaks ties between equal rings: a set whose every pair
    is fast (a fully connected quad) lets NCCL run several rings and trees at once."""
    worst, pair, lat, total = math.inf, math.inf, 0.0, 0.0
    for p in range(len(group[0])):
        members = [it[p] for it in group]
        bw, l, s = _ring(members, closed, table)
        worst, lat, total = min(worst, bw), max(lat, l), total + s
        for i, a in enumerate(members):
            for b in members[i + 1:]:
                pair = min(pair, table[(a, b)][0])
    return worst, pair, lat, total


def _better(a: tuple[float, float, float, float], b: tuple[float, float, float, float] | None) -> bool:
    """Faster bottleneck first, then the faster worst pair, lower latency, more bandwidth overall."""
    if b is None:
        return True
    return (a[0], a[1], -a[2], a[3]) > (b[0], b[1], -b[2], b[3])


def _best_group(items: list[tuple[int, ...]], closed: bool, variants: bool, table):
    """Best ring order (and item variants) of a set of items: the first item stays first and
    in its own order, which loses nothing (rings are symmetric under rotation, and a common
    re-ordering of every item only renames the positions)."""
    first, rest = items[0], items[1:]
    best, best_score = None, None
    n_orders = math.factorial(len(rest))
    if n_orders > _MAX_CYCLES:
        return _greedy_group(items, closed, table)
    for perm in itertools.permutations(rest):
        if closed and len(perm) > 1 and perm[0] > perm[-1]:
            continue  # the reflected ring is the same ring
        choices = [_dihedral(it) if variants else [it] for it in perm]
        for var in itertools.product(*choices):
            group = [first, *var]
            s = _score_group(group, closed, table)
            if _better(s, best_score):
                best, best_score = group, s
    return best, best_score


def _greedy_group(items, closed, table):
    group, left = [items[0]], list(items[1:])
    while left:
        nxt = max(left, key=lambda it: table[(group[-1][0], it[0])][0])
        group.append(nxt)
        left.remove(nxt)
    return group, _score_group(group, closed, table)


def _partitions(n: int, k: int):
    """Set partitions of range(n) into blocks of k, lowest element first in each block."""
    if n == 0:
        yield []
        return
    idx = list(range(n))

    def rec(left: list[int]):
        if not left:
            yield []
            return
        head, rest = left[0], left[1:]
        for comp in itertools.combinations(rest, k - 1):
            remain = [x for x in rest if x not in comp]
            for tail in rec(remain):
                yield [(head, *comp), *tail]

    yield from rec(idx)


def _count_partitions(n: int, k: int) -> int:
    return math.factorial(n) // (math.factorial(k) ** (n // k) * math.factorial(n // k))


def _arrange(items: list[tuple[int, ...]], k: int, closed: bool, variants: bool, table):
    """Cut items into groups of k and order each group so that the worst ring is fastest.

    Returns (the items of each group flattened in order, the worst group's score)."""
    if k == 1:
        return list(items), (math.inf, math.inf, 0.0, 0.0)
    cache: dict[tuple[int, ...], tuple] = {}

    def group_of(block: tuple[int, ...]):
        if block not in cache:
            cache[block] = _best_group([items[i] for i in block], closed, variants, table)
        return cache[block]

    best, best_score = None, None
    if _count_partitions(len(items), k) <= _MAX_PARTITIONS:
        candidates = _partitions(len(items), k)
    else:
        candidates = iter([_greedy_partition(len(items), k, group_of)])
    for part in candidates:
        groups = [group_of(b) for b in part]
        score = (min(s[0] for _, s in groups), min(s[1] for _, s in groups), max(s[2] for _, s in groups),
                 sum(s[3] for _, s in groups))
        if _better(score, best_score):
            best, best_score = groups, score
    assert best is not None, "every cut of the items into groups of k yields at least one partition"
    flat = [tuple(x for it in grp for x in it) for grp, _ in best]
    return flat, best_score


def _greedy_partition(n: int, k: int, group_of):
    left, part = list(range(n)), []
    while left:
        head = left[0]
        comps = itertools.islice(itertools.combinations(left[1:], k - 1), 2000)
        block = max(((head, *c) for c in comps),
                    key=lambda b: (group_of(b)[1][0], group_of(b)[1][1], group_of(b)[1][3]))
        part.append(block)
        left = [x for x in left if x not in block]
    return part


@lru_cache(maxsize=256)
def node_layout(wiring: NodeWiring, shape_in: tuple[int, ...], spans: tuple[bool, ...],
                topology_aware: bool = True, expert_group: int = 1) -> NodeLayout:
    """Order a node's GPUs for the in-node mesh `shape_in` = (rep, shard, tp) members, or
    (rep, shard, cp, tp) with context parallelism (`spans` alike).

    `expert_group`: the shard members one expert-parallel group takes (its ranks over tp x cp's),
    where it takes more than one: the shard members are first cut into such groups whose worst
    pair is fastest (an all-to-all joins every pair), and the shard ring then runs through them.
    `spans[i]` says whether axis i continues on other nodes (its in-node ring is then a path
    between the node's network ports, not a closed ring). With `topology_aware` False the
    ranks keep the devices' own order (what a scheduler blind to the links gives: local rank j
    on device j), and only the rings that order crosses are measured."""
    if len(shape_in) == 3:
        shape_in, spans = (shape_in[0], shape_in[1], 1, shape_in[2]), (spans[0], spans[1], False, spans[2])
    rep_in, shard_in, cp_in, tp_in = shape_in
    if rep_in * shard_in * cp_in * tp_in != len(wiring.devices):
        raise ValueError(f"in-node mesh {shape_in} does not cover the node's {len(wiring.devices)} devices")
    table = wiring.table()
    rings: dict[str, RingStats] = {}
    if wiring.uniform or not topology_aware:
        order = wiring.devices
    else:
        items: list[tuple[int, ...]] = [(d,) for d in wiring.devices]
        items, _ = _arrange(items, tp_in, closed=not spans[3], variants=False, table=table)
        items, _ = _arrange(items, cp_in, closed=not spans[2], variants=tp_in > 1, table=table)
        if expert_group > 1:
            items, _ = _arrange(items, expert_group, closed=True, variants=tp_in * cp_in > 1, table=table)
            items, _ = _arrange(items, shard_in // expert_group, closed=not spans[1], variants=True, table=table)
        else:
            items, _ = _arrange(items, shard_in, closed=not spans[1], variants=tp_in * cp_in > 1, table=table)
        items, _ = _arrange(items, rep_in, closed=not spans[0], variants=False, table=table)
        order = tuple(x for it in items for x in it)
    axes = [("tp", 1, tp_in, spans[3]), ("dp_shard", tp_in * cp_in, shard_in, spans[1]),
            ("dp_replicate", tp_in * cp_in * shard_in, rep_in, spans[0])]
    if cp_in > 1 or spans[2]:
        # FSDP shards over dp_shard x cp: one ring through both.
        axes += [("cp", tp_in, cp_in, spans[2]), ("dp_shard_cp", tp_in, cp_in * shard_in, spans[1] or spans[2])]
    for axis, stride, size, span in axes:
        worst, lat = math.inf, 0.0
        block = stride * size
        for base in range(0, len(order), block):
            for off in range(stride):
                members = [order[base + off + i * stride] for i in range(size)]
                bw, l, _ = _ring(members, not span, table)
                worst, lat = min(worst, bw), max(lat, l)
        rings[axis] = RingStats(worst, lat)
    return NodeLayout(order=tuple(order), rings=rings, uniform=wiring.uniform)


def node_name(node: NodeTopology, i: int) -> str:
    """The node's Ray id, or `node<i>` for a capture read from a file."""
    return node.node_id if node.node_id is not None else f"node{i}"


@dataclass(frozen=True)
class Wirings:
    """The distinct wirings of a cluster's nodes and which one each node has."""

    unique: tuple[NodeWiring, ...]
    """Each distinct wiring once, in order of first appearance."""
    node_index: tuple[int, ...]
    """For every node of the topology, its wiring's position in `unique`."""
    devices_per_node: int
    """Devices on every node (the same on all; checked)."""

    @classmethod
    def of(cls, topo: ClusterTopology) -> "Wirings":
        sizes = sorted({n.num_devices for n in topo.nodes})
        if len(sizes) != 1:
            raise ValueError(f"every node must have the same number of devices, got {sizes}")
        seen: dict[NodeWiring, int] = {}
        index = []
        # Nodes that are one object (a described cluster of N copies) need hashing once.
        by_id: dict[int, int] = {}
        for n in topo.nodes:
            if id(n) not in by_id:
                by_id[id(n)] = seen.setdefault(NodeWiring.of(n), len(seen))
            index.append(by_id[id(n)])
        return cls(tuple(seen), tuple(index), sizes[0])


@dataclass
class ClusterLayout:
    """Layouts of every node for one mesh (nodes with equal wiring share one)."""

    mesh: Mesh
    shape_in: Mesh
    """Members of each axis inside one node."""
    layouts: tuple[NodeLayout, ...]
    """One per distinct wiring (`Wirings.unique`)."""
    node_index: tuple[int, ...]
    """For every node, the position of its layout in `layouts`."""
    rings: dict[str, RingStats]
    """Per axis: the worst in-node ring over all nodes."""
    per_node: dict[str, int]
    """Per axis: members of one group on each node it spans."""

    @property
    def uniform(self) -> bool:
        """True when every node's links are all equal (any layout is as good as another)."""
        return all(l.uniform for l in self.layouts)


def cluster_layout(wirings: Wirings, mesh: Mesh, topology_aware: bool = True,
                   routes_experts: bool = False) -> ClusterLayout:
    """Lay the mesh out on the cluster; ValueError when the mesh does not cut into its nodes.
    `topology_aware` False keeps every node's device order (see `node_layout`).
    `routes_experts`: the model has experts, so the expert axes are laid out even at ep=1
    (where the experts' FSDP group is the whole dp_shard x cp x tp block)."""
    g = wirings.devices_per_node
    world = mesh.world_size
    if world != g * len(wirings.node_index):
        raise ValueError(f"the mesh {mesh} has {world} ranks, the cluster {g * len(wirings.node_index)} devices")
    shape_in = in_node_shape(mesh, g)
    pp_in, rep_in = shape_in.pp, shape_in.dp_replicate
    spans = tuple(mesh.size(axis) > shape_in.size(axis) for axis in ("pp", "dp_replicate", "dp_shard", "tp"))
    # Stages sharing a node are laid out as outer replicas; their own links are measured below.
    if mesh.cp > 1:
        cp_spans = mesh.cp > shape_in.cp
        inner: tuple[int, ...] = (pp_in * rep_in, shape_in.dp_shard, shape_in.cp, shape_in.tp)
        inner_spans: tuple[bool, ...] = (spans[0] or spans[1], spans[2], cp_spans, spans[3])
    else:
        inner, inner_spans = (pp_in * rep_in, shape_in.dp_shard, shape_in.tp), (spans[0] or spans[1],) + spans[2:]
    expert_group = _expert_group(mesh, shape_in) if mesh.ep > 1 else 1
    layouts = tuple(node_layout(w, inner, inner_spans, topology_aware, expert_group) for w in wirings.unique)
    if pp_in > 1:
        layouts = tuple(_with_pipeline(l, w, shape_in, spans) for l, w in zip(layouts, wirings.unique))
    per_node = shape_in.to_dict()
    if mesh.cp > 1:
        per_node["cp"] = shape_in.cp
        per_node["dp_shard_cp"] = shape_in.dp_shard * shape_in.cp
    if mesh.ep > 1 or routes_experts:
        ep_in, efsdp_in = expert_in_node(mesh, shape_in)
        per_node["ep"], per_node["efsdp"] = ep_in, efsdp_in
        layouts = tuple(_with_experts(l, w, ep_in, efsdp_in) for l, w in zip(layouts, wirings.unique))
    rings = {}
    for axis in AXIS_ORDER + tuple(axis for axis in EXTRA_AXES if axis in per_node):
        stats = [l.rings.get(axis, RingStats(math.inf, 0.0)) for l in layouts]
        rings[axis] = RingStats(min(s.gbps for s in stats), max(s.lat_us for s in stats))
    return ClusterLayout(mesh, shape_in, layouts, wirings.node_index, rings, per_node)


AXIS_ORDER = ("tp", "dp_shard", "dp_replicate", "pp")
EXTRA_AXES = ("cp", "dp_shard_cp", "ep", "efsdp")
"""Axes laid out only where the mesh has them: context parallelism (and the FSDP group it
joins), and the expert mesh's two."""


def _expert_group(mesh: Mesh, shape_in: Mesh) -> int:
    """The shard members inside a node one expert group takes (1 where it fits in tp x cp, or
    does not cut the node's shard members evenly)."""
    ep_in, _ = expert_in_node(mesh, shape_in)
    inner = shape_in.tp * shape_in.cp
    if ep_in <= inner or ep_in % inner or shape_in.dp_shard % (ep_in // inner):
        return 1
    return ep_in // inner


def _with_experts(layout: NodeLayout, wiring: NodeWiring, ep_in: int, efsdp_in: int) -> NodeLayout:
    """The links of the expert axes inside a node: an expert group's all-to-all joins every
    pair of its `ep_in` consecutive local ranks, so its worst pair bounds it; the experts' FSDP
    ring takes every `ep_in`-th rank of each block of `ep_in x efsdp_in`."""
    table, order = wiring.table(), layout.order
    rings = dict(layout.rings)
    worst, lat = math.inf, 0.0
    for base in range(0, len(order), ep_in):
        members = order[base:base + ep_in]
        for i, a in enumerate(members):
            for b in members[i + 1:]:
                worst, lat = min(worst, table[(a, b)][0]), max(lat, table[(a, b)][1])
    rings["ep"] = RingStats(worst, lat)
    worst, lat = math.inf, 0.0
    block = ep_in * efsdp_in
    for base in range(0, len(order), block):
        for off in range(ep_in):
            bw, l, _ = _ring([order[base + off + i * ep_in] for i in range(efsdp_in)], True, table)
            worst, lat = min(worst, bw), max(lat, l)
    rings["efsdp"] = RingStats(worst, lat)
    return NodeLayout(order=layout.order, rings=rings, uniform=layout.uniform)


def _with_pipeline(layout: NodeLayout, wiring: NodeWiring, shape_in: Mesh, spans: tuple[bool, ...]) -> NodeLayout:
    """The rings of dp_replicate and pp when several stages share a node: a stage's replicas
    are strided by dp_shard x tp inside the stage, consecutive stages by the stage's size, and
    pp is a path (point-to-point sends between neighbours), never a ring."""
    table, order = wiring.table(), layout.order
    inner = shape_in.dp_replicate * shape_in.dp_shard * shape_in.cp * shape_in.tp
    rings = dict(layout.rings)
    for axis, stride, size, closed, block in (
            ("dp_replicate", shape_in.dp_shard * shape_in.cp * shape_in.tp, shape_in.dp_replicate, not spans[1],
             inner),
            ("pp", inner, shape_in.pp, False, len(order))):
        worst, lat = math.inf, 0.0
        for base in range(0, len(order), block):
            for off in range(stride):
                bw, l, _ = _ring([order[base + off + i * stride] for i in range(size)], closed, table)
                worst, lat = min(worst, bw), max(lat, l)
        rings[axis] = RingStats(worst, lat)
    return NodeLayout(order=layout.order, rings=rings, uniform=layout.uniform)

