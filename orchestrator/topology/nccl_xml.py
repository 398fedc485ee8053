"""Read NCCL topology XML (the `NCCL_TOPO_FILE` / `NCCL_TOPO_DUMP_FILE` format).

The file is a tree: `<system>` holds one `<cpu>` per NUMA node, each holds the PCIe hierarchy
as nested `<pci>` elements (switches are `<pci>` elements holding others), and the leaves are
GPUs (`<pci class="0x03....">` with a `<gpu dev= sm=>` child, whose `<nvlink target= count=
tclass=>` children name the far end) and NICs (`<pci class="0x02....">` with `<nic><net
name= speed=>`). Cloud vendors ship partial files (AWS p4d/p5/g5) that NCCL merges with what
it detects, so a file may omit classes or GPU children: such entries become warnings, not
guesses.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

from ..errors import TopologyError
from .bandwidth import estimate, pcie_gbps
from .model import Device, Link, Nic, NodeTopology, all_pairs, nvlink_domains

_GT_PER_S_TO_GEN = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}
# Compute capability major -> NVLink generation (6.0 P100 ... 10.0 B200).
_SM_TO_NVLINK_GEN = {6: 1, 7: 2, 8: 3, 9: 4, 10: 5}
_CLASS_NVSWITCH = "0x068000"


@dataclass
class XmlGpu:
    """A GPU of the XML tree."""

    busid: str
    """PCI bus id of its `<pci>` element."""
    dev: int | None
    """CUDA device index from `<gpu dev=>`; None when the file leaves it to NCCL."""
    sm: int | None
    """Compute capability times ten (90 for H100); None when absent."""
    chain: list[ET.Element]
    """Elements from the `<cpu>` down to the GPU's own `<pci>`."""
    nvlinks: list[tuple[str, int, str]] = field(default_factory=list)
    """(target bus id, lane count, target PCI class) per `<nvlink>`."""


@dataclass
class XmlNic:
    """A network port of the XML tree."""

    name: str
    speed_gbps: float | None
    kind: str
    busid: str | None
    chain: list[ET.Element]


@dataclass
class NcclSystem:
    """What a NCCL topology file declares, before it becomes a NodeTopology."""

    gpus: list[XmlGpu]
    nics: list[XmlNic]
    switches: list[str]
    """Bus ids of PCIe bridges/switches (`class 0x0604..`) that hold devices."""
    nvswitches: list[str]
    """Bus ids of NVSwitches named as NVLink targets."""
    numa: dict[int, str | None]
    """NUMA id -> CPU list of each `<cpu>` (None when the file gives no affinity)."""
    warnings: list[str]


def _mask_to_cpulist(mask: str | None) -> str | None:
    """`000000ff,ffff0000,00ffffff` (32-bit words, most significant first) -> `0-23,48-71`."""
    if not mask:
        return None
    try:
        bits = int(mask.replace(",", ""), 16)
    except ValueError:
        return None
    ranges: list[str] = []
    cpu, start = 0, None
    while bits >> cpu or start is not None:
        on = bool(bits >> cpu & 1)
        if on and start is None:
            start = cpu
        elif not on and start is not None:
            ranges.append(f"{start}-{cpu - 1}" if cpu - 1 > start else str(start))
            start = None
        cpu += 1
    return ",".join(ranges) or None


def _pcie(el: ET.Element) -> tuple[int | None, int | None]:
    """(generation, width) of the link above a `<pci>` element."""
    speed, width = el.get("link_speed", ""), el.get("link_width", "")
    gen = None
    try:
        gen = _GT_PER_S_TO_GEN.get(float(speed.split()[0]))
    except (ValueError, IndexError):
        pass
    return gen, int(width) if width.isdigit() and int(width) > 0 else None


def _int(value: str | None) -> int | None:
    return int(value) if value is not None and value.strip().isdigit() else None


def read_nccl_system(text: str, source: str = "nccl-xml") -> NcclSystem:
    """Walk the XML tree. Raises TopologyError naming line and column for malformed XML."""
    try:
        root = ET.fromstring(text)
    except ET.ParseError as e:
        line, col = e.position
        what = re.sub(r":? line \d+, column \d+$", "", str(e))  # expat repeats the (0-based) position
        raise TopologyError(f"{source}: line {line}, column {col + 1}: not well-formed XML: {what}") from None
    if root.tag != "system":
        raise TopologyError(f"{source}: line 1, column 1: the root element is <{root.tag}>; "
                            "a NCCL topology file has <system>")
    gpus: list[XmlGpu] = []
    nics: list[XmlNic] = []
    switches: list[str] = []
    unclassified: list[str] = []
    numa: dict[int, str | None] = {}
    warnings: list[str] = []

    def walk(el: ET.Element, chain: list[ET.Element]) -> None:
        for child in el:
            if child.tag == "pci":
                visit_pci(child, chain + [child])
            elif child.tag == "nic":
                add_nics(child, None, chain)

    def add_nics(nic: ET.Element, pci: ET.Element | None, chain: list[ET.Element]) -> None:
        nets = nic.findall("net")
        busid = pci.get("busid") if pci is not None else None
        vendor = (pci.get("vendor") or "").lower() if pci is not None else ""
        each: list[ET.Element | None] = [*nets] or [None]
        for net in each:
            name = net.get("name") if net is not None else None
            speed = _int(net.get("speed")) if net is not None else None
            nics.append(XmlNic(
                name=name or busid or f"nic{len(nics)}",
                speed_gbps=speed / 1000 if speed else None,  # NCCL writes Mbit/s
                kind=_nic_kind(name or "", vendor),
                busid=busid,
                chain=chain,
            ))

    def visit_pci(pci: ET.Element, chain: list[ET.Element]) -> None:
        cls = (pci.get("class") or "").lower()
        busid = pci.get("busid") or "?"
        gpu = pci.find("gpu")
        if gpu is not None or cls.startswith("0x03"):
            sm = _int(gpu.get("sm")) if gpu is not None else None
            links = []
            for nv in gpu.findall("nvlink") if gpu is not None else []:
                count = _int(nv.get("count")) or 0
                if count > 0 and nv.get("target"):
                    links.append((nv.get("target", "").lower(), count, (nv.get("tclass") or "").lower()))
            gpus.append(XmlGpu(busid=busid.lower(), dev=_int(gpu.get("dev")) if gpu is not None else None,
                               sm=sm, chain=chain, nvlinks=links))
        elif pci.find("nic") is not None:
            add_nics(pci.find("nic"), pci, chain)  # type: ignore[arg-type]
        elif cls.startswith("0x02"):
            nics.append(XmlNic(name=busid, speed_gbps=None, kind=_nic_kind("", (pci.get("vendor") or "").lower()),
                               busid=busid, chain=chain))
        elif cls.startswith("0x0604"):
            if len(pci):
                switches.append(busid)
            walk(pci, chain)
        elif cls == _CLASS_NVSWITCH:
            pass  # NVSwitches are counted from the GPUs' nvlink targets
        elif len(pci):
            walk(pci, chain)
        else:
            unclassified.append(busid)

    cpus = root.findall("cpu")
    for cpu in cpus:
        numaid = _int(cpu.get("numaid"))
        if numaid is None:
            raise TopologyError(f"{source}: a <cpu> element has numaid={cpu.get('numaid')!r}; "
                                "it must be a NUMA node number")
        if numaid in numa:
            raise TopologyError(f"{source}: <cpu numaid=\"{numaid}\"> appears twice")
        numa[numaid] = _mask_to_cpulist(cpu.get("affinity"))
        walk(cpu, [cpu])
    if not cpus:
        raise TopologyError(f"{source}: <system> holds no <cpu> element; "
                            "NCCL topology files put devices under <cpu numaid=...>")
    if unclassified:
        warnings.append(
            f"{source}: {len(unclassified)} PCI device(s) without a class ({', '.join(unclassified)}): "
            "NCCL fills these in from sysfs at run time, so they are not counted as GPUs or NICs"
        )
    nvswitches = sorted({t for g in gpus for t, _, c in g.nvlinks if c == _CLASS_NVSWITCH})
    return NcclSystem(gpus=gpus, nics=nics, switches=switches, nvswitches=nvswitches, numa=numa, warnings=warnings)


def _nic_kind(name: str, vendor: str) -> str:
    if name.startswith("rdmap") or vendor == "0x1d0f":
        return "efa"
    if name.startswith(("mlx", "ib", "bnxt_re", "irdma")):
        return "infiniband" if name.startswith(("mlx", "ib")) else "roce"
    if name.startswith(("eth", "en")):
        return "ethernet"
    return "unknown"


def _path_kind(a: list[ET.Element], b: list[ET.Element]) -> tuple[str, list[ET.Element]]:
    """nvidia-smi path kind between two tree positions, and the `<pci>` links it crosses."""
    if a[0] is not b[0]:
        crossed = [e for e in a[1:] + b[1:] if e.tag == "pci"]
        return "sys", crossed
    common = 0
    while common < min(len(a), len(b)) and a[common] is b[common]:
        common += 1
    crossed = [e for e in a[common:] + b[common:] if e.tag == "pci"]
    if common == 1:
        # NCCL's XML does not tell a CPU's host bridges apart; NCCL itself ranks every path
        # through the CPU as PHB, and so do we.
        return "phb", crossed
    # Below a shared bridge: one level on each side is a switch's downstream ports (PIX).
    return ("pix" if len(a) - common <= 1 and len(b) - common <= 1 else "pxb"), crossed


def _bottleneck(elements: list[ET.Element]) -> tuple[int | None, int | None]:
    """The PCIe (gen, width) of the slowest link crossed, (None, None) when no link says."""
    known = [(g, w) for g, w in (_pcie(e) for e in elements) if g is not None]
    if not known:
        return None, None
    return min(known, key=lambda gw: pcie_gbps(gw[0], gw[1]))


def parse_nccl_xml(text: str, source: str = "nccl-xml") -> NodeTopology:
    """A NodeTopology from a NCCL topology file: GPUs, the link between each pair, NICs."""
    system = read_nccl_system(text, source)
    warnings = list(system.warnings)
    buses = [g.busid for g in system.gpus]
    if len(set(buses)) != len(buses):
        dup = sorted(b for b in buses if buses.count(b) > 1)[0]
        raise TopologyError(f"{source}: GPU bus id {dup} appears twice; each GPU has its own <pci busid=...>")
    # CUDA numbers GPUs in PCI bus id order unless the file says `dev=`.
    devs = [g.dev for g in system.gpus if g.dev is not None]
    if devs and len(devs) != len(system.gpus):
        raise TopologyError(f"{source}: some <gpu> elements have dev= and some do not; give it on all or none")
    if len(set(devs)) != len(devs):
        raise TopologyError(f"{source}: two <gpu> elements share dev={sorted(d for d in devs if devs.count(d) > 1)[0]}")
    ordered = sorted(system.gpus, key=lambda g: (g.dev if g.dev is not None else 0, g.busid))
    index = {g.busid: (g.dev if g.dev is not None else i) for i, g in enumerate(ordered)}
    by_bus = {g.busid: g for g in ordered}

    devices = []
    for g in ordered:
        cpu = g.chain[0]
        numaid = _int(cpu.get("numaid"))
        gen, width = _pcie(g.chain[-1])
        devices.append(Device(index=index[g.busid], name="", pci_bus_id=g.busid, numa_node=numaid,
                              cpu_affinity=system.numa.get(numaid) if numaid is not None else None,
                              pcie_gen=gen, pcie_width=width))
    devices.sort(key=lambda d: d.index)

    links: list[Link] = []
    for ba, bb in ((a.busid, b.busid) for a, b in _pairs(ordered)):
        ga, gb = by_bus[ba], by_bus[bb]
        a, b = index[ba], index[bb]
        direct = sum(c for t, c, _ in ga.nvlinks if t == bb) or sum(c for t, c, _ in gb.nvlinks if t == ba)
        to_switch = [sum(c for t, c, cls in g.nvlinks if cls == _CLASS_NVSWITCH) for g in (ga, gb)]
        nv_gen = _SM_TO_NVLINK_GEN.get((ga.sm or 0) // 10)
        if direct:
            bw, lat = estimate("nvlink", nvlinks=direct, nvlink_gen=nv_gen)
            links.append(Link(a=a, b=b, kind="nvlink", nvlinks=direct, nvlink_gen=nv_gen, bandwidth_gbps=bw,
                              latency_us=lat))
        elif min(to_switch) > 0:
            lanes = min(to_switch)
            bw, lat = estimate("nvlink", nvlinks=lanes, nvlink_gen=nv_gen)
            links.append(Link(a=a, b=b, kind="nvlink", nvlinks=lanes, nvlink_gen=nv_gen, bandwidth_gbps=bw,
                              latency_us=lat, via_switch=True))
        else:
            kind, crossed = _path_kind(ga.chain, gb.chain)
            gen, width = _bottleneck(crossed)
            bw, lat = estimate(kind, pcie_gen=gen, pcie_width=width)
            links.append(Link(a=a, b=b, kind=kind, bandwidth_gbps=bw, latency_us=lat))

    nics = []
    for n in system.nics:
        paths = {index[g.busid]: _path_kind(n.chain, g.chain)[0] for g in ordered}
        numaid = _int(n.chain[0].get("numaid")) if n.chain and n.chain[0].tag == "cpu" else None
        nics.append(Nic(name=n.name, speed_gbps=n.speed_gbps, kind=n.kind, numa_node=numaid,
                        pci_bus_id=n.busid, gpu_paths=paths))

    if not devices:
        warnings.append(f"{source}: the file declares no GPU (no <pci> with a <gpu> child or a 0x03 class)")
    node = NodeTopology(source=source, devices=devices, links=links, nics=nics,
                        numa_nodes=sorted(system.numa), warnings=warnings)
    node.nvlink_domains = nvlink_domains([d.index for d in devices], links)
    node.check()
    return node


def _pairs(gpus: list[XmlGpu]) -> list[tuple[XmlGpu, XmlGpu]]:
    return [(gpus[i], gpus[j]) for i, j in all_pairs(range(len(gpus)))]
