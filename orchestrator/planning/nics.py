"""A NIC per rank: the network port nearest each rank's GPU, rail-aligned across nodes.

Nearest is by the probed PCIe path from the NIC to the GPU, PIX < PXB < PHB < NODE < SYS (the
capture's own matrix, or NVML and sysfs on a live node). GPUs that share their nearest NICs
(two GPUs under one switch with two HCAs) take them in turn, so no NIC carries two ranks while
an equally near one carries none. Ranks that exchange data across nodes are those with the
same local rank (node n holds ranks [n*g, (n+1)*g)); they use the same rail, the NIC of the
same name, wherever that NIC is among the nearest on both nodes, and the plan says where the
wiring does not allow it.
"""

from __future__ import annotations

from dataclasses import replace

from ..topology.model import Nic, NodeTopology
from .mesh import RankPlacement

PATH_ORDER = ("pix", "pxb", "phb", "node", "sys")
"""PCIe path kinds from a NIC to a GPU, nearest first."""
_ETHERNET = "ethernet"
_MAX_NOTES = 4


def candidate_nics(node: NodeTopology) -> list[Nic]:
    """The NICs that may carry a rank's traffic: those with a known path to some GPU, the
    RDMA ports among them where there are any (plain Ethernet then carries management and
    storage, not NCCL)."""
    known = [n for n in node.nics if n.gpu_paths]
    rdma = [n for n in known if n.kind != _ETHERNET]
    return rdma or known


def nearest_nics(node: NodeTopology, gpu: int) -> list[str]:
    """Names of the NICs nearest device `gpu` of `node` (all at the same, shortest path), in
    the node's NIC order; [] when no NIC has a path to it."""
    best, names = len(PATH_ORDER), []
    for n in candidate_nics(node):
        kind = n.gpu_paths.get(gpu)
        if kind not in PATH_ORDER:
            continue
        rank = PATH_ORDER.index(kind)
        if rank < best:
            best, names = rank, [n.name]
        elif rank == best:
            names.append(n.name)
    return names


def _balanced(node: NodeTopology, gpus: list[int]) -> dict[int, str | None]:
    """GPU -> its nearest NIC, spreading GPUs that share nearest NICs over them (GPU order)."""
    load: dict[str, int] = {}
    out: dict[int, str | None] = {}
    for g in sorted(gpus):
        near = nearest_nics(node, g)
        if not near:
            out[g] = None
            continue
        pick = min(near, key=lambda name: (load.get(name, 0), near.index(name)))
        load[pick] = load.get(pick, 0) + 1
        out[g] = pick
    return out


def assign_nics(ranks: tuple[RankPlacement, ...], nodes: dict[str, NodeTopology]
                ) -> tuple[tuple[RankPlacement, ...], list[str]]:
    """`ranks` with each one's NIC, and lines for the plan's explanation.

    `nodes` maps each rank's node name (as in `RankPlacement.node`) to its topology."""
    by_node: dict[str, list[RankPlacement]] = {}
    for r in ranks:
        by_node.setdefault(r.node, []).append(r)
    # Nodes that are one object (a described cluster) share one assignment.
    cache: dict[tuple[int, tuple[int, ...]], dict[int, str | None]] = {}
    chosen: dict[int, str | None] = {}
    for name, rs in by_node.items():
        node = nodes[name]
        key = (id(node), tuple(r.gpu for r in rs))
        if key not in cache:
            cache[key] = _balanced(node, [r.gpu for r in rs])
        for r in rs:
            chosen[r.rank] = cache[key][r.gpu]
    if not any(v is not None for v in chosen.values()):
        return ranks, ["NICs: none probed with a path to a GPU; NCCL chooses the network ports itself"]

    notes: list[str] = []
    names = list(by_node)
    if len(names) > 1:
        ref = by_node[names[0]]
        misaligned = []
        aligned_cache: dict[tuple[int, tuple[int, ...]], list[tuple[int, str | None, str | None]]] = {}
        for name in names[1:]:
            rs, node = by_node[name], nodes[name]
            key = (id(node), tuple(r.gpu for r in rs))
            if key not in aligned_cache:
                aligned_cache[key] = []
                for j, r in enumerate(rs):
                    want = chosen[ref[j].rank] if j < len(ref) else None
                    if want is not None and want in nearest_nics(node, r.gpu):
                        aligned_cache[key].append((j, want, None))
                    else:
                        aligned_cache[key].append((j, chosen[r.rank], want))
            for j, nic, want in aligned_cache[key]:
                chosen[rs[j].rank] = nic
                if want is not None and nic != want:
                    misaligned.append(f"local rank {j} uses {want} on {names[0]} but {nic or 'no NIC'} on {name}")
        if misaligned:
            more = f" (and {len(misaligned) - _MAX_NOTES} more)" if len(misaligned) > _MAX_NOTES else ""
            notes.append("rails: not aligned where the wiring does not allow it: "
                         + "; ".join(misaligned[:_MAX_NOTES]) + more
                         + "; their traffic between nodes changes rail (through the network's spine)")
        else:
            notes.append("rails: aligned, every local rank uses the NIC of the same name on every node")
    first = by_node[names[0]]
    notes.insert(0, "NICs (nearest to each GPU by PCIe path): "
                 + ", ".join(f"r{r.rank}:{chosen[r.rank] or '-'}" for r in first)
                 + (f" on {names[0]}" if len(names) > 1 else ""))
    return tuple(replace(r, nic=chosen[r.rank]) for r in ranks), notes
