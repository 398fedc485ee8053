"""Write a node's PCI tree as NCCL topology XML (the `NCCL_TOPO_FILE` format).

For NCCL what matters in such a file is a PCI tree functionally equivalent to the host's:
GPUs and NICs it discovers itself, and switches may be re-created with bus ids that do not
exist (NVIDIA/nccl issues 1843 and nccl-tests 86). So the file holds `<cpu>` and `<pci>`
elements only: one `<cpu>` per NUMA node, the GPUs and NICs as leaves at their real bus ids,
and synthetic bridges (`ffff:ff:NN.0`, as the cloud vendors' files name theirs) that put
every pair at the distance the model gives it:

    PIX  both under one bridge
    PXB  under different bridges below one common bridge
    PHB  under one `<cpu>` with no common bridge (NCCL's XML cannot tell NODE from PHB)
    SYS  under different `<cpu>` elements

NVLink is not written: NCCL reads it from the GPUs. `nccl_xml.parse_nccl_xml` reads the file
back to the same GPU and NIC distances.
"""

from __future__ import annotations

from xml.sax.saxutils import quoteattr

from .model import NodeTopology

_GEN_GT_S = {1: "2.5", 2: "5", 3: "8", 4: "16", 5: "32", 6: "64"}
_CLASS_GPU = "0x030200"
_CLASS_BRIDGE = "0x060400"
_NIC_CLASS = {"infiniband": "0x020700"}
_EFA_VENDOR = "0x1d0f"
_CLOSE = ("pix", "pxb")


class _Sets:
    """Union-find over endpoint keys."""

    def __init__(self, keys: list[str]) -> None:
        self.parent = {k: k for k in keys}

    def find(self, k: str) -> str:
        while self.parent[k] != k:
            self.parent[k] = self.parent[self.parent[k]]
            k = self.parent[k]
        return k

    def join(self, a: str, b: str) -> None:
        self.parent[self.find(a)] = self.find(b)

    def groups(self, keys: list[str]) -> list[list[str]]:
        out: dict[str, list[str]] = {}
        for k in keys:
            out.setdefault(self.find(k), []).append(k)
        return list(out.values())


def _cpumask(cpus: str | None) -> str | None:
    """`0-3,8` -> NCCL's affinity mask (32-bit hex words, most significant first)."""
    from .model import parse_cpu_list

    if not cpus:
        return None
    bits = 0
    for c in parse_cpu_list(cpus):
        bits |= 1 << c
    words: list[str] = []
    while bits or not words:
        words.append(f"{bits & 0xFFFFFFFF:08x}")
        bits >>= 32
    return ",".join(reversed(words))


def bus_id(text: str) -> str:
    """NVML pads the PCI domain to 8 hex digits; NCCL and sysfs write 4."""
    domain, _, rest = text.strip().lower().partition(":")
    return f"{int(domain, 16):04x}:{rest}" if rest else domain


def missing_bus_ids(node: NodeTopology) -> list[int]:
    """Devices whose PCI bus id the model lacks (a file for NCCL must name every GPU's)."""
    return [d.index for d in node.devices if not d.pci_bus_id]


def nccl_topology_xml(node: NodeTopology) -> str:
    """The node's PCI tree as NCCL topology XML. ValueError when a GPU's bus id is unknown:
    NCCL matches the file's GPUs to its own by bus id, so a file without them misleads it.
    NICs without a bus id are left out (NCCL finds them, just not their distance)."""
    missing = missing_bus_ids(node)
    if missing:
        raise ValueError(f"GPU(s) {', '.join(map(str, missing))} have no PCI bus id in the topology")
    gpus = {f"g{d.index}": d for d in node.devices}
    nics = {f"n{i}": n for i, n in enumerate(node.nics) if n.pci_bus_id}
    keys = list(gpus) + list(nics)
    dist: dict[tuple[str, str], str] = {}
    for l in node.links:
        if l.kind in ("pix", "pxb", "phb", "node", "sys"):
            dist[(f"g{l.a}", f"g{l.b}")] = l.kind
    for k, n in nics.items():
        for g, kind in n.gpu_paths.items():
            if f"g{g}" in gpus:
                dist[(k, f"g{g}")] = kind

    same_cpu, close, pix = _Sets(keys), _Sets(keys), _Sets(keys)
    for (a, b), kind in dist.items():
        if kind != "sys":
            same_cpu.join(a, b)
        if kind in _CLOSE:
            close.join(a, b)
        if kind == "pix":
            pix.join(a, b)

    def numa_of(members: list[str]) -> int | None:
        known = [gpus[k].numa_node if k in gpus else nics[k].numa_node for k in members]
        return next((n for n in known if n is not None), None)

    cpus: dict[int, list[str]] = {}
    spare = max([n for n in node.numa_nodes] + [d.numa_node or 0 for d in node.devices] + [-1]) + 1
    for members in same_cpu.groups(keys):
        numa = numa_of(members)
        if numa is None:
            numa, spare = spare, spare + 1
        cpus.setdefault(numa, []).extend(members)

    bridge = iter(range(1, 256))
    lines = ['<system version="1">']
    for numa in sorted(cpus):
        members = cpus[numa]
        affinity = _cpumask(next((gpus[k].cpu_affinity for k in members if k in gpus and gpus[k].cpu_affinity), None))
        lines.append(f'  <cpu numaid="{numa}"' + (f' affinity="{affinity}"' if affinity else "") + ">")
        for group in close.groups(members):
            if len(group) == 1:
                lines.append(_leaf(group[0], gpus, nics, 4))
                continue
            sub = pix.groups(group)
            lines.append(_bridge_open(next(bridge), 4))
            if len(sub) == 1:
                lines += [_leaf(k, gpus, nics, 6) for k in group]
            else:
                for s in sub:
                    lines.append(_bridge_open(next(bridge), 6))
                    lines += [_leaf(k, gpus, nics, 8) for k in s]
                    lines.append("      </pci>")
            lines.append("    </pci>")
        lines.append("  </cpu>")
    lines.append("</system>")
    return "\n".join(lines) + "\n"


def _bridge_open(n: int, indent: int) -> str:
    return " " * indent + f'<pci busid="ffff:ff:{n:02x}.0" class="{_CLASS_BRIDGE}" vendor="0xffff" device="0xffff">'


def _link(gen: int | None, width: int | None) -> str:
    out = f' link_speed="{_GEN_GT_S[gen]} GT/s"' if gen in _GEN_GT_S else ""
    return out + (f' link_width="{width}"' if width else "")


def _leaf(key: str, gpus, nics, indent: int) -> str:
    pad = " " * indent
    if key in gpus:
        d = gpus[key]
        return (f'{pad}<pci busid={quoteattr(bus_id(d.pci_bus_id))} class="{_CLASS_GPU}" vendor="0x10de"'
                f'{_link(d.pcie_gen, d.pcie_width)}/>')
    n = nics[key]
    vendor = f' vendor="{_EFA_VENDOR}"' if n.kind == "efa" else ""
    return f'{pad}<pci busid={quoteattr(bus_id(n.pci_bus_id))} class="{_NIC_CLASS.get(n.kind, "0x020000")}"{vendor}/>'
