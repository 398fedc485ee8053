"""Which nodes of a probed cluster a plan may use, and how NVLink domains group them.

Every caller that plans (the `plan` command, the driver, recovery) asks here, so the probe's
picture, the plan, placement and the driver's choice of GPU or CPU workers agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..serialize import to_plain
from ..topology.model import ClusterTopology, NodeTopology
from .layout import ClusterLayout, node_name
from .mesh import RankPlacement


@dataclass(frozen=True)
class LeftOut:
    """A node the plan does not use, and why."""

    node: str
    """Ray node id, or `probed node <i>` (its position in the probed cluster) for a capture."""
    hostname: str
    reason: str

    def to_dict(self) -> dict[str, str]:
        return to_plain(self)

    def __str__(self) -> str:
        host = f" ({self.hostname})" if self.hostname else ""
        return f"{self.node}{host}: {self.reason}"


def _name(node: NodeTopology, i: int) -> str:
    # A capture's nodes are named `node<i>` in the plan by their place among the kept nodes,
    # so a left-out one is named by its place in the probed cluster instead.
    return node.node_id if node.node_id is not None else f"probed node {i}"


def has_gpu(node: NodeTopology) -> bool:
    """Whether the node has a GPU a rank can get: probed, and offered by Ray where Ray says."""
    return any(d.kind == "gpu" for d in node.devices) and node.ray_gpus != 0


def plannable(topology: ClusterTopology) -> tuple[ClusterTopology, tuple[LeftOut, ...]]:
    """The nodes a plan runs on, and those it leaves out.

    Where any node has a GPU Ray offers, the plan is a GPU plan over those nodes: a GPU-less
    node (a Ray head without GPUs, a CPU-only helper, a GPU machine whose Ray node offers no
    GPU) runs no rank and is left out by name. CPU slots are planned only on a cluster with no
    GPU at all. Nodes without any device are left out either way.
    """
    gpu = any(has_gpu(n) for n in topology.nodes)
    keep, left = [], []
    for i, n in enumerate(topology.nodes):
        if not n.devices:
            left.append(LeftOut(_name(n, i), n.hostname, "no GPU and no CPU slot"))
        elif gpu and not has_gpu(n):
            why = ("Ray offers no GPU on it (started with --num-gpus=0)" if n.devices[0].kind == "gpu"
                   else "no GPU (a GPU plan runs on the GPU nodes only)")
            left.append(LeftOut(_name(n, i), n.hostname, why))
        elif not gpu and n.devices[0].kind == "gpu":
            left.append(LeftOut(_name(n, i), n.hostname, "Ray offers no GPU on it (started with --num-gpus=0)"))
        else:
            keep.append(n)
    if not left:
        return topology, ()
    return ClusterTopology(nodes=keep, network=topology.network), tuple(left)


@dataclass(frozen=True)
class DomainView:
    """The cluster as the layout sees it: each multi-node NVLink domain as one node."""

    topology: ClusterTopology
    """Nodes outside any multi-node domain as they are; each domain merged into one node
    whose devices are its members' GPUs in member order, joined by NVLink across members."""
    members: tuple[dict[int, tuple[int, int]], ...]
    """Per node of `topology`: its device index -> (index of the real node in the planned
    cluster, device index there)."""
    domains: tuple[tuple[str, tuple[int, ...]], ...]
    """(fabric clique, real node indices) of every domain of more than one node."""


def nvlink_view(topology: ClusterTopology) -> DomainView:
    """Merge the nodes that share a fabric cluster UUID and clique (GB200 NVL72, multi-node
    NVLink) into one node each, so tensor parallelism and shard groups, which the layout keeps
    inside a node, may span a domain's nodes and never leave it."""
    from ..topology.model import fabric_clique

    by_clique: dict[str, list[int]] = {}
    for i, n in enumerate(topology.nodes):
        clique = fabric_clique(n)
        if clique:
            by_clique.setdefault(clique, []).append(i)
    domains = {c: idx for c, idx in by_clique.items() if len(idx) > 1}
    if not domains:
        ident = tuple({d.index: (i, d.index) for d in n.devices} for i, n in enumerate(topology.nodes))
        return DomainView(topology, ident, ())
    merged_at = {idx[0]: c for c, idx in domains.items()}
    inside = {i for idx in domains.values() for i in idx}
    nodes, members = [], []
    for i, n in enumerate(topology.nodes):
        if i in merged_at:
            node, mem = _merge([topology.nodes[j] for j in domains[merged_at[i]]], merged_at[i])
            nodes.append(node)
            members.append({pos: (domains[merged_at[i]][m], d) for pos, (m, d) in enumerate(mem)})
        elif i not in inside:
            nodes.append(n)
            members.append({d.index: (i, d.index) for d in n.devices})
    # A domain's traffic to other domains leaves through all of its members' NICs; the
    # network figure is per planned node, so it grows with the domain (where all are domains).
    size = min(len(idx) for idx in domains.values()) if len(inside) == len(topology.nodes) else 1
    net = topology.network
    network = type(net)(bandwidth_gbps=net.bandwidth_gbps * size, latency_us=net.latency_us, source=net.source)
    return DomainView(ClusterTopology(nodes=nodes, network=network), tuple(members),
                      tuple((c, tuple(idx)) for c, idx in domains.items()))


def _merge(parts: list[NodeTopology], clique: str) -> tuple[NodeTopology, list[tuple[int, int]]]:
    """One node of the members' GPUs; pairs on different members are joined as the members'
    own NVLink pairs are (through the fabric's NVSwitches)."""
    from ..topology.bandwidth import estimate, nvlink_gen_for
    from ..topology.model import Device, Link, Nic, all_pairs, nvlink_domains

    devices: list[Device] = []
    links: list[Link] = []
    nics: list[Nic] = []
    mem: list[tuple[int, int]] = []
    offset: list[int] = []
    for m, p in enumerate(parts):
        offset.append(len(devices))
        remap = {}
        for d in sorted(p.devices, key=lambda d: d.index):
            remap[d.index] = len(devices)
            mem.append((m, d.index))
            devices.append(Device(**{**d.__dict__, "index": len(devices)}))
        links += [Link(**{**l.__dict__, "a": remap[l.a], "b": remap[l.b]}) for l in p.links]
        nics += [Nic(**{**n.__dict__, "gpu_paths": {remap[g]: k for g, k in n.gpu_paths.items() if g in remap}})
                 for n in p.nics]
    own = [l for p in parts for l in p.links if l.kind == "nvlink"]
    if own:
        like = min(own, key=lambda l: l.bandwidth_gbps)
        lanes, gen, bw, lat = like.nvlinks, like.nvlink_gen, like.bandwidth_gbps, like.latency_us
    else:  # one GPU per member: its lanes all go to the fabric (18 on Hopper and Blackwell)
        gen = nvlink_gen_for(devices[0].name) if devices else None
        lanes = 18
        bw, lat = estimate("nvlink", nvlinks=lanes, nvlink_gen=gen, name=devices[0].name if devices else "")
    member = [m for m, _ in mem]
    links += [Link(a=a, b=b, kind="nvlink", nvlinks=lanes, nvlink_gen=gen, bandwidth_gbps=bw, latency_us=lat,
                   via_switch=True) for a, b in all_pairs(range(len(devices))) if member[a] != member[b]]
    node = NodeTopology(hostname=f"NVLink domain {clique}", source="nvlink-domain", devices=devices, links=links,
                        nics=nics, nvlink_domains=nvlink_domains(list(range(len(devices))), links),
                        numa_nodes=sorted({x for p in parts for x in p.numa_nodes}))
    return node, mem


def real_ranks(view: DomainView, topology: ClusterTopology, layout: ClusterLayout) -> tuple[RankPlacement, ...]:
    """Every global rank on its real node and GPU: the layout's order of each planned node's
    devices, mapped back through the domains it merged."""
    clique = {i: c for c, idx in view.domains for i in idx}
    out: list[RankPlacement] = []
    for n in range(len(view.topology.nodes)):
        for dev in layout.layouts[layout.node_index[n]].order:
            i, gpu = view.members[n][dev]
            out.append(RankPlacement(len(out), node_name(topology.nodes[i], i), gpu, nvlink_domain=clique.get(i)))
    return tuple(out)


def describe_domains(view: DomainView, topology: ClusterTopology) -> list[str]:
    """Lines for the plan's explanation: which nodes form each multi-node NVLink domain."""
    if not view.domains:
        return []
    parts = [f"{c}: {', '.join(node_name(topology.nodes[i], i) for i in idx)}" for c, idx in view.domains]
    return ["NVLink domains across nodes (shared fabric clique), each planned as one node whose tensor-parallel "
            "and shard groups may span its nodes but never leave it: " + "; ".join(parts)]
