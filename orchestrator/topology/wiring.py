"""Faults a node's wiring shows by itself, found from its topology alone (a probe or a capture).

What the checks look for is what goes wrong on real machines, judged against the node's own
GPUs rather than a list of models:

- an NVLink bridge missing or degraded: a GPU with fewer NVLink lanes than the GPUs beside it
  (or none where the others have NVLink), a GPU pair with fewer lanes than the machine's other
  pairs of the same kind (a lane down behind an NVSwitch shows as `NV12` among `NV18`s);
- a bridged pair that spans NUMA nodes: two GPUs bridged to each other alone, on different
  sockets, so every host-side transfer of one of them crosses the socket link;
- a GPU without a near NIC on a machine whose other GPUs have one on their PCIe switch, so its
  inter-node traffic crosses the host bridge or the socket link.

Pure Python: `doctor --from CAPTURE` runs these on a capture, `doctor` on each probed node.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from ..serialize import to_plain
from .model import Link, NodeTopology

_NEAR = ("pix", "pxb")
"""NIC paths that stay under one PCIe switch (GPUDirect RDMA at full rate)."""
_PATHS = ("pix", "pxb", "phb", "node", "sys")
"""PCIe path kinds, nearest first."""


def _distance(path: str) -> int:
    return _PATHS.index(path) if path in _PATHS else len(_PATHS)


def nearest_gpus(gpu_paths: dict) -> dict[str, Any]:
    """{"path", "gpus"}: a NIC's nearest PCIe path kind and the GPUs at it; {} when none is known."""
    known = {int(g): p for g, p in gpu_paths.items() if p in _PATHS}
    if not known:
        return {}
    best = min(known.values(), key=_distance)
    return {"path": best, "gpus": sorted(g for g, p in known.items() if p == best)}


@dataclass(frozen=True)
class Finding:
    """One fault: `fail` (the node should not run a long job as it is) or `warn`."""

    level: str
    text: str

    def to_dict(self) -> dict[str, str]:
        return to_plain(self)


def _lanes(node: NodeTopology) -> dict[int, int]:
    """NVLink lanes per GPU: behind an NVSwitch each peer shows the GPU's own lanes, so the
    most any pair shows; direct links split the GPU's lanes among its peers, so their sum."""
    out = {d.index: 0 for d in node.devices if d.kind == "gpu"}
    for link in node.links:
        if link.kind != "nvlink":
            continue
        for g in (link.a, link.b):
            out[g] = max(out[g], link.nvlinks) if link.via_switch else out[g] + link.nvlinks
    return out


def _nvlink_findings(node: NodeTopology) -> list[Finding]:
    lanes = _lanes(node)
    with_nvlink = {g: n for g, n in lanes.items() if n}
    if not with_nvlink:
        return []
    out = []
    most = max(with_nvlink.values())
    without = sorted(g for g, n in lanes.items() if not n)
    if without:
        names = ", ".join(f"GPU{g}" for g in without)
        out.append(Finding("fail", f"{names} {'has' if len(without) == 1 else 'have'} no NVLink while "
                                   f"{len(with_nvlink)} other GPUs have {most} lanes: a bridge missing or down"))
    for g, n in sorted(with_nvlink.items()):
        if n < most:
            out.append(Finding("fail", f"GPU{g} has {n} NVLink lanes where other GPUs have {most}: "
                                       f"{most - n} down or a bridge degraded"))
    # Pairs through a switch all show the GPUs' lanes; one pair below the rest names a lane down.
    switched = [l for l in node.links if l.kind == "nvlink" and l.via_switch]
    if switched:
        usual = Counter(l.nvlinks for l in switched).most_common(1)[0][0]
        out += [Finding("warn", f"GPU{l.a}-GPU{l.b} shows {l.nvlinks} NVLink lanes where other pairs show {usual}")
                for l in switched if l.nvlinks < usual and lanes[l.a] == most and lanes[l.b] == most]
    return out


def _bridged_pairs(node: NodeTopology) -> list[Link]:
    """Direct NVLink pairs whose two GPUs have no other NVLink peer (2-GPU bridges)."""
    direct = [l for l in node.links if l.kind == "nvlink" and not l.via_switch]
    peers = Counter(g for l in direct for g in (l.a, l.b))
    return [l for l in direct if peers[l.a] == 1 and peers[l.b] == 1]


def _numa_findings(node: NodeTopology) -> list[Finding]:
    numa = {d.index: d.numa_node for d in node.devices}
    return [Finding("warn", f"GPU{l.a}-GPU{l.b} are bridged by NVLink but sit on NUMA nodes {numa[l.a]} and "
                            f"{numa[l.b]}: their host transfers cross the socket link")
            for l in _bridged_pairs(node)
            if numa[l.a] is not None and numa[l.b] is not None and numa[l.a] != numa[l.b]]


def _nic_findings(node: NodeTopology) -> list[Finding]:
    rdma = [n for n in node.nics if n.gpu_paths]
    if len(rdma) < 2:
        return []
    gpus = [d.index for d in node.devices if d.kind == "gpu"]
    near = {g: [n.name for n in rdma if n.gpu_paths.get(g) in _NEAR] for g in gpus}
    if not any(near.values()):
        return []  # no GPU has a NIC on its switch: a machine built that way, nothing to compare
    out = []
    for g in gpus:
        if near[g]:
            continue
        best = min((n.gpu_paths.get(g, "sys") for n in rdma), key=_distance)
        out.append(Finding("warn", f"GPU{g} has no NIC on its PCIe switch (the nearest is {best.upper()} away) "
                                   "while other GPUs do: its inter-node traffic crosses the host"))
    return out


def check_wiring(node: NodeTopology) -> list[Finding]:
    """Every fault the node's wiring shows, failures first."""
    found = _nvlink_findings(node) + _numa_findings(node) + _nic_findings(node)
    return sorted(found, key=lambda f: f.level != "fail")
