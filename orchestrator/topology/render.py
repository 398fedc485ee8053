"""Pictures of a cluster topology: a text summary for terminals and an SVG drawing.

The text form is what `probe` prints: per node its GPUs, NVLink domains, NICs and NUMA halves,
then the link matrix in `nvidia-smi topo -m` style with the GB/s each path is expected to
carry. The SVG puts a node's GPUs on a ring, shades each NUMA half, draws every link with its
width by bandwidth and its colour by kind, collapses an NVSwitch island into a hub, and sets
each NIC beside the GPU it is closest to.
"""

from __future__ import annotations

import io
import math
from xml.sax.saxutils import escape

from rich import box
from rich.console import Console
from rich.table import Table

from .model import ClusterTopology, Link, NodeTopology

# Path ranks, nearest first: how far a NIC or GPU pair travels over PCIe.
_PATH_RANK = {"nvlink": 0, "pix": 1, "pxb": 2, "phb": 3, "node": 4, "sys": 5, "shm": 6, "net": 7}
_KIND_LABEL = {
    "nvlink": "NVLink",
    "pix": "PCIe, one switch (PIX)",
    "pxb": "PCIe, several switches (PXB)",
    "phb": "PCIe via host bridge (PHB)",
    "node": "PCIe across host bridges (NODE)",
    "sys": "across sockets (SYS)",
    "shm": "shared memory (CPU slots)",
}
_COLOUR = {
    "nvlink": "#76b900",
    "pix": "#1f77b4",
    "pxb": "#4a9fd8",
    "phb": "#8e6bbf",
    "node": "#e08a1e",
    "sys": "#9a9a9a",
    "shm": "#6b8e9a",
    "net": "#555555",
}
# Far paths fade so the fast ones read first; a node has n(n-1)/2 of them.
_OPACITY = {"nvlink": 0.9, "pix": 0.85, "pxb": 0.8, "phb": 0.7, "node": 0.6, "sys": 0.35, "shm": 0.5}
_DASH = {"node": "6 4", "sys": "3 4", "shm": "2 3"}
_NUMA_FILL = ("#eaf2fb", "#fdf0e2", "#eef7e6", "#f5eaf7", "#fbeaea", "#e9f6f5", "#f7f5e4", "#efefef")
_NUMA_EDGE = ("#9cc0e6", "#efb877", "#a9d68c", "#c9a3d6", "#e3a0a0", "#93d0c9", "#d8cf8c", "#bbbbbb")


def _cell(link: Link) -> str:
    tag = f"NV{link.nvlinks}" if link.kind == "nvlink" else link.kind.upper()
    mark = "!" if link.degraded else ("*" if link.measured else "")
    return f"{tag} {link.bandwidth_gbps:g}{mark}"


def _ranges(indices: list[int]) -> str:
    """[0,1,2,3,6] -> '0-3,6'."""
    out: list[str] = []
    for i in sorted(indices):
        if out and "-" not in out[-1].split(",")[-1] and int(out[-1].split(",")[-1]) == i - 1:
            out[-1] = f"{out[-1]}-{i}"
        elif out and "-" in out[-1] and int(out[-1].rsplit("-", 1)[1]) == i - 1:
            out[-1] = f"{out[-1].rsplit('-', 1)[0]}-{i}"
        else:
            out.append(str(i))
    return ",".join(out)


def _node_title(node: NodeTopology, i: int) -> str:
    who = node.hostname or f"node {i}"
    if node.node_id:
        who += f" [ray node {node.node_id[:12]}]"  # simulated nodes share one host name
    kinds = {d.kind for d in node.devices}
    what = f"{node.num_devices} CPU slot(s)" if kinds == {"cpu"} else f"{node.num_devices} GPU(s)"
    if node.gpu_name and kinds != {"cpu"}:
        what += f" · {node.gpu_name}"
    src = f" ({node.source})" if node.source else ""
    return f"{who}{src}: {what}"


def _nearest_path(paths: dict[int, str]) -> tuple[str, list[int]]:
    if not paths:
        return "", []
    best = min(paths.values(), key=lambda k: _PATH_RANK.get(k, 9))
    return best, sorted(g for g, k in paths.items() if k == best)


def render_text(cluster: ClusterTopology) -> str:
    """A plain-text summary of every node, then its link matrix with GB/s per direction."""
    buf = io.StringIO()
    # Plain text: names such as `[ray node ...]` or `mlx5_[0]` must not be read as markup.
    console = Console(file=buf, width=240, color_system=None, force_terminal=False, markup=False,
                      highlight=False, emoji=False)
    net = cluster.network
    console.print(
        f"cluster: {len(cluster.nodes)} node(s), {cluster.num_devices} device(s); "
        f"network {net.bandwidth_gbps:g} GB/s per node, {net.latency_us:g} us ({net.source})"
    )
    for i, node in enumerate(cluster.nodes):
        console.print()
        console.print(_node_title(node, i))
        devs = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
        measured = any(d.measured_tflops for d in node.devices)
        for col in ("device", "name", "memory", "NUMA", "CPUs", "PCIe", "bus id") + (("TFLOP/s*",) if measured else ()):
            devs.add_column(col)
        for d in node.devices:
            mem = f"{d.memory_bytes / 2**30:.0f} GiB" if d.memory_bytes else "-"
            pcie = f"Gen{d.pcie_gen} x{d.pcie_width}" if d.pcie_gen and d.pcie_width else "-"
            label = f"{'GPU' if d.kind == 'gpu' else 'CPU'}{d.index}" + (" (MIG)" if d.mig else "")
            row = [label, d.name or "-", mem, "-" if d.numa_node is None else str(d.numa_node),
                   d.cpu_affinity or "-", pcie, d.pci_bus_id or "-"]
            if measured:
                row.append(f"{d.measured_tflops:.3g}" if d.measured_tflops else "-")
            devs.add_row(*row)
        if node.devices:
            console.print(devs)
        else:
            console.print("  no devices")
        if node.nvlink_domains:
            doms = "  ".join(f"[{_ranges(d)}]" for d in node.nvlink_domains)
            console.print(f"  NVLink domains: {doms}")
        elif any(d.kind == "gpu" for d in node.devices):
            console.print("  NVLink domains: none (PCIe only)")
        by_numa: dict[int, list[int]] = {}
        for d in node.devices:
            if d.numa_node is not None:
                by_numa.setdefault(d.numa_node, []).append(d.index)
        if by_numa or node.numa_nodes:
            halves = [f"{n}: {'devices ' + _ranges(by_numa[n]) if n in by_numa else 'no device'}"
                      for n in sorted(set(node.numa_nodes) | set(by_numa))]
            console.print(f"  NUMA: {'; '.join(halves)}")
        if node.nics:
            nics = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
            for col in ("NIC", "kind", "speed", "NUMA", "nearest devices"):
                nics.add_column(col)
            for n in node.nics:
                kind, near = _nearest_path(n.gpu_paths)
                nics.add_row(n.name, n.kind, f"{n.speed_gbps:g} Gb/s" if n.speed_gbps else "-",
                             "-" if n.numa_node is None else str(n.numa_node),
                             f"{kind.upper()} to {_ranges(near)}" if near else "-")
            console.print(nics)
        if node.num_devices > 1:
            console.print("  links (kind and GB/s per direction; * measured, ! degraded):")
            console.print(_matrix(node))
        for w in node.warnings:
            console.print(f"  warning: {w}")
    return buf.getvalue()


def _matrix(node: NodeTopology) -> Table:
    t = Table(box=box.SIMPLE, show_edge=False, pad_edge=False)
    idx = [d.index for d in node.devices]
    prefix = {d.index: ("GPU" if d.kind == "gpu" else "CPU") for d in node.devices}
    t.add_column("")
    for j in idx:
        t.add_column(f"{prefix[j]}{j}", justify="left")
    for n in node.nics:
        t.add_column(n.name, justify="left")
    for i in idx:
        row = [f"{prefix[i]}{i}"]
        row += ["X" if i == j else _cell(node.link(i, j)) for j in idx]
        row += [n.gpu_paths.get(i, "-").upper() for n in node.nics]
        t.add_row(*row)
    return t


# ---------------------------------------------------------------- SVG


def _fmt(x: float) -> str:
    return f"{x:.1f}".rstrip("0").rstrip(".")


def _stroke(bw: float, top: float) -> float:
    # Linear in GB/s above a hairline, so a PCIe path reads as a fraction of an NVLink one.
    return 1.2 + 10.0 * max(bw, 0.0) / top if top > 0 else 1.5


def _switch_islands(node: NodeTopology) -> list[list[int]]:
    """NVLink domains whose every pair goes through an NVSwitch (drawn as a hub)."""
    out = []
    for dom in node.nvlink_domains:
        pairs = [(a, b) for i, a in enumerate(dom) for b in dom[i + 1:]]
        if len(dom) > 2 and all(node.link(a, b).via_switch for a, b in pairs):
            out.append(dom)
    return out


def _svg_node(node: NodeTopology, title: str, y0: float, width: float) -> tuple[list[str], float]:
    """SVG elements for one node starting at y0, and the height used."""
    parts: list[str] = []
    n = node.num_devices
    box_w, box_h = 96.0, 50.0
    radius = max(130.0, n * (box_w + 26) / (2 * math.pi))
    nic_ring = radius + (96 if node.nics else 40)
    r_out = nic_ring + 34
    cx, cy = 40 + r_out, y0 + 56 + r_out
    stray = [nic for nic in node.nics if _nic_anchor(nic) is None]
    height = 56 + 2 * r_out + (56 if stray else 16)
    parts.append(f'<text x="24" y="{_fmt(y0 + 32)}" class="title">{escape(_clip(title, 100))}</text>')
    if not n:
        parts.append(f'<text x="24" y="{_fmt(y0 + 62)}" class="note">no devices</text>')
        return parts, 90.0 + 18 * len(node.warnings)

    order = [d.index for d in node.devices]
    # Half a step off the top, so two NUMA halves of equal size split down the middle.
    angle = {i: -math.pi / 2 + math.pi / n + 2 * math.pi * k / n for k, i in enumerate(order)}
    pos = {i: (cx + radius * math.cos(a), cy + radius * math.sin(a)) for i, a in angle.items()}
    numa_of = {d.index: d.numa_node for d in node.devices}
    numas = sorted({v for v in numa_of.values() if v is not None})
    shade = {m: k % len(_NUMA_FILL) for k, m in enumerate(numas)}
    step = 2 * math.pi / n

    # NUMA halves: a shaded sector behind each contiguous run of GPUs on one NUMA node.
    runs: list[tuple[int | None, list[int]]] = []
    for i in order:
        if runs and runs[-1][0] == numa_of[i]:
            runs[-1][1].append(i)
        else:
            runs.append((numa_of[i], [i]))
    if len(runs) > 1 and runs[0][0] == runs[-1][0]:
        first = runs.pop(0)
        runs[-1] = (runs[-1][0], runs[-1][1] + first[1])
    for m, members in runs:
        if m is None:
            continue
        k = shade[m]
        r_in = radius - 62
        if len(members) == n:
            # One NUMA node holds every device: the shade is a full ring.
            parts.append(f'<circle cx="{_fmt(cx)}" cy="{_fmt(cy)}" r="{_fmt((r_in + r_out) / 2)}" fill="none" '
                         f'stroke="{_NUMA_FILL[k]}" stroke-width="{_fmt(r_out - r_in)}"/>')
            for r in (r_in, r_out):
                parts.append(f'<circle cx="{_fmt(cx)}" cy="{_fmt(cy)}" r="{_fmt(r)}" fill="none" '
                             f'stroke="{_NUMA_EDGE[k]}"/>')
            continue
        a0 = angle[members[0]] - step / 2 + 0.02
        a1 = a0 + step * len(members) - 0.04
        large = 1 if a1 - a0 > math.pi else 0
        corners = ((r_out, a0), (r_out, a1), (r_in, a1), (r_in, a0))
        pts = [(cx + r * math.cos(a), cy + r * math.sin(a)) for r, a in corners]
        outline = (f"M{_fmt(pts[0][0])},{_fmt(pts[0][1])} "
                   f"A{_fmt(r_out)},{_fmt(r_out)} 0 {large} 1 {_fmt(pts[1][0])},{_fmt(pts[1][1])} "
                   f"L{_fmt(pts[2][0])},{_fmt(pts[2][1])} "
                   f"A{_fmt(r_in)},{_fmt(r_in)} 0 {large} 0 {_fmt(pts[3][0])},{_fmt(pts[3][1])} Z")
        parts.append(f'<path d="{outline}" fill="{_NUMA_FILL[k]}" stroke="{_NUMA_EDGE[k]}" stroke-width="1"/>')

    # Widths scale to the node's fastest link but never below a Gen5 x16 slot, so a PCIe-only
    # node does not draw its paths as thick as an NVLink board would.
    top = max([64.0] + [l.bandwidth_gbps for l in node.links])
    hubs = _switch_islands(node)
    in_hub = {(a, b) for dom in hubs for i, a in enumerate(dom) for b in dom[i + 1:]}
    links = sorted((l for l in node.links if (l.a, l.b) not in in_hub),
                   key=lambda l: (-_PATH_RANK.get(l.kind, 9), l.bandwidth_gbps))
    for l in links:
        (x1, y1), (x2, y2) = pos[l.a], pos[l.b]
        # Bow chords slightly toward the centre so parallel paths stay apart.
        mx, my = (x1 + x2) / 2, (y1 + y2) / 2
        qx, qy = mx + (cx - mx) * 0.25, my + (cy - my) * 0.25
        dash = f' stroke-dasharray="{_DASH[l.kind]}"' if l.kind in _DASH else ""
        colour = "#d62728" if l.degraded else _COLOUR.get(l.kind, "#444")
        parts.append(
            f'<path d="M{_fmt(x1)},{_fmt(y1)} Q{_fmt(qx)},{_fmt(qy)} {_fmt(x2)},{_fmt(y2)}" fill="none" '
            f'stroke="{colour}" stroke-width="{_fmt(_stroke(l.bandwidth_gbps, top))}" '
            f'stroke-opacity="{_OPACITY.get(l.kind, 0.8)}"{dash}>'
            f"<title>{escape(f'{l.a}-{l.b}: {_cell(l)} GB/s, {l.latency_us:g} us')}</title></path>"
        )
    for k, dom in enumerate(hubs):
        hx, hy = cx, cy + (k - (len(hubs) - 1) / 2) * 70
        sample = node.link(dom[0], dom[1])
        for i in dom:
            x, y = pos[i]
            parts.append(f'<line x1="{_fmt(x)}" y1="{_fmt(y)}" x2="{_fmt(hx)}" y2="{_fmt(hy)}" '
                         f'stroke="{_COLOUR["nvlink"]}" '
                         f'stroke-width="{_fmt(_stroke(sample.bandwidth_gbps, top))}" stroke-opacity="0.85"/>')
        parts.append(f'<rect x="{_fmt(hx - 78)}" y="{_fmt(hy - 26)}" width="156" height="52" rx="8" class="hub"/>')
        parts.append(f'<text x="{_fmt(hx)}" y="{_fmt(hy - 5)}" text-anchor="middle" class="hubname">NVSwitch</text>')
        parts.append(f'<text x="{_fmt(hx)}" y="{_fmt(hy + 14)}" text-anchor="middle" class="hubsub">'
                     f'NV{sample.nvlinks} · {sample.bandwidth_gbps:g} GB/s per GPU</text>')

    for d in node.devices:
        x, y = pos[d.index]
        edge = _NUMA_EDGE[shade[d.numa_node]] if d.numa_node in shade else "#888"
        label = f"{'GPU' if d.kind == 'gpu' else 'CPU'} {d.index}"
        sub = _short_name(d.name) or (f"NUMA {d.numa_node}" if d.numa_node is not None else "")
        parts.append(f'<g><title>{escape(_device_tip(d))}</title>'
                     f'<rect x="{_fmt(x - box_w / 2)}" y="{_fmt(y - box_h / 2)}" '
                     f'width="{_fmt(box_w)}" height="{_fmt(box_h)}" '
                     f'rx="7" class="dev" style="stroke:{edge}"/>'
                     f'<rect x="{_fmt(x - box_w / 2)}" y="{_fmt(y - box_h / 2)}" '
                     f'width="{_fmt(box_w)}" height="6" rx="3" fill="{edge}"/>'
                     f'<text x="{_fmt(x)}" y="{_fmt(y + 3)}" text-anchor="middle" '
                     f'class="devname">{escape(label)}</text>'
                     f'<text x="{_fmt(x)}" y="{_fmt(y + 18)}" text-anchor="middle" '
                     f'class="devsub">{escape(sub)}</text></g>')

    # NICs sit outside the ring beside the GPU they reach best; several at one GPU fan out.
    # NICs that reach every GPU across the sockets line up under the ring.
    slots: dict[int, list] = {}
    for nic in node.nics:
        anchor = _nic_anchor(nic)
        if anchor is not None:
            slots.setdefault(anchor, []).append(nic)
    for anchor, nics in slots.items():
        # More than two NICs at one GPU (p5: four EFA ports each) read better as one badge.
        groups = [nics] if len(nics) > 2 else [[nic] for nic in nics]
        spread = min(step * 0.6, 0.22 * (len(groups) - 1))
        for k, group in enumerate(groups):
            a = angle[anchor] + (spread * (k / (len(groups) - 1) - 0.5) if len(groups) > 1 else 0.0)
            x, y = cx + nic_ring * math.cos(a), cy + nic_ring * math.sin(a)
            kind = group[0].gpu_paths[anchor]
            gx, gy = pos[anchor]
            gx, gy = gx + (x - gx) * 0.3, gy + (y - gy) * 0.3
            dash = f' stroke-dasharray="{_DASH[kind]}"' if kind in _DASH else ""
            parts.append(f'<line x1="{_fmt(gx)}" y1="{_fmt(gy)}" x2="{_fmt(x)}" y2="{_fmt(y)}" '
                         f'stroke="{_COLOUR.get(kind, "#888")}" stroke-width="{2 + len(group) - 1}"{dash}/>')
            parts.append(_nic_box(group, x, y))
    row_y = cy + r_out + 30
    for k, nic in enumerate(stray):
        parts.append(_nic_box([nic], cx + (k - (len(stray) - 1) / 2) * 110, row_y))
    if stray:
        parts.append(f'<text x="{_fmt(cx - (len(stray) + 1) / 2 * 110)}" y="{_fmt(row_y + 4)}" text-anchor="end" '
                     f'class="numa">SYS to every GPU:</text>')

    parts += _legend(node, cx + r_out + 40, y0 + 70, top, shade)
    wy = y0 + height + 8
    for w in node.warnings:
        parts.append(f'<text x="24" y="{_fmt(wy)}" class="warn">⚠ {escape(_clip(w, 150))}</text>')
        wy += 18
    return parts, height + 18 * len(node.warnings) + 8


def _nic_anchor(nic) -> int | None:
    """The GPU a NIC is drawn beside: its nearest one, unless every path crosses the sockets."""
    kind, near = _nearest_path(nic.gpu_paths)
    return near[0] if near and kind in ("pix", "pxb", "phb", "node") else None


def _nic_box(nics: list, x: float, y: float) -> str:
    """One NIC, or a badge for several at one GPU; the tooltip names each with its path."""
    tips = []
    for nic in nics:
        kind, near = _nearest_path(nic.gpu_paths)
        speed = f" {nic.speed_gbps:g} Gb/s" if nic.speed_gbps else ""
        path = f"{kind.upper()} to GPU {_ranges(near)}" if near else "no GPU path"
        tips.append(f"{nic.name} ({nic.kind}{speed}): " + path)
    speeds = {nic.speed_gbps for nic in nics}
    speed = f" {speeds.pop():g}G" if len(speeds) == 1 and None not in speeds else ""
    label = _clip(nics[0].name + speed, 18) if len(nics) == 1 else f"{len(nics)} × {nics[0].kind.upper()}{speed}"
    w = 14 + 6.2 * len(label)
    return (f'<g><title>{escape(chr(10).join(tips))}</title>'
            f'<rect x="{_fmt(x - w / 2)}" y="{_fmt(y - 11)}" width="{_fmt(w)}" '
            f'height="22" rx="11" class="nic"/><text x="{_fmt(x)}" y="{_fmt(y + 4)}" text-anchor="middle" '
            f'class="nicname">{escape(label)}</text></g>')


def _legend(node: NodeTopology, x: float, y: float, top: float, shade: dict[int, int]) -> list[str]:
    out = [f'<text x="{_fmt(x)}" y="{_fmt(y)}" class="legendhead">Links</text>']
    kinds = sorted({l.kind for l in node.links} | {k for n in node.nics for k in n.gpu_paths.values()},
                   key=lambda k: _PATH_RANK.get(k, 9))
    y += 10
    for kind in kinds:
        widest = max((l.bandwidth_gbps for l in node.links if l.kind == kind), default=0.0)
        sw = _stroke(widest, top) if widest else 1.6
        dash = f' stroke-dasharray="{_DASH[kind]}"' if kind in _DASH else ""
        y += 24
        out.append(f'<line x1="{_fmt(x)}" y1="{_fmt(y)}" x2="{_fmt(x + 40)}" y2="{_fmt(y)}" '
                   f'stroke="{_COLOUR.get(kind, "#444")}" stroke-width="{_fmt(sw)}"{dash}/>')
        figure = f" · up to {widest:g} GB/s" if widest else ""
        text = escape(_KIND_LABEL.get(kind, kind) + figure)
        out.append(f'<text x="{_fmt(x + 50)}" y="{_fmt(y + 4)}" class="legend">{text}</text>')
    y += 30
    out.append(f'<text x="{_fmt(x)}" y="{_fmt(y)}" class="legendnote">width grows with GB/s per direction</text>')
    if node.nics:
        y += 26
        out.append(f'<rect x="{_fmt(x)}" y="{_fmt(y - 11)}" width="40" height="18" rx="9" class="nic"/>')
        out.append(f'<text x="{_fmt(x + 50)}" y="{_fmt(y + 3)}" class="legend">NIC, beside its nearest GPU</text>')
    for m, k in shade.items():
        members = [d for d in node.devices if d.numa_node == m]
        cpus = next((d.cpu_affinity for d in members if d.cpu_affinity), None)
        y += 26
        out.append(f'<rect x="{_fmt(x)}" y="{_fmt(y - 11)}" width="40" height="18" '
                   f'fill="{_NUMA_FILL[k]}" stroke="{_NUMA_EDGE[k]}"/>')
        text = f"NUMA {m}: devices {_ranges([d.index for d in members])}" + (f", CPUs {cpus}" if cpus else "")
        out.append(f'<text x="{_fmt(x + 50)}" y="{_fmt(y + 3)}" class="legend">{escape(text)}</text>')
    return out


def _short_name(name: str) -> str:
    for prefix in ("NVIDIA ", "Tesla "):
        if name.startswith(prefix):
            name = name[len(prefix):]
    return _clip(name, 15)


def _clip(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 1] + "…"


def _device_tip(d) -> str:
    bits = [f"{d.kind.upper()} {d.index}", d.name, d.pci_bus_id or "",
            f"NUMA {d.numa_node}" if d.numa_node is not None else "",
            f"CPUs {d.cpu_affinity}" if d.cpu_affinity else ""]
    return " · ".join(b for b in bits if b)


_STYLE = """
text { font-family: 'DejaVu Sans', 'Helvetica Neue', Arial, sans-serif; fill: #222; }
.title { font-size: 18px; font-weight: bold; }
.note { font-size: 13px; fill: #666; }
.numa { font-size: 12px; fill: #555; }
.dev { fill: #ffffff; stroke-width: 2; }
.devname { font-size: 14px; font-weight: bold; }
.devsub { font-size: 10px; fill: #555; }
.hub { fill: #1d2a10; stroke: #76b900; stroke-width: 2; }
.hubname { font-size: 14px; font-weight: bold; fill: #ffffff; }
.hubsub { font-size: 10px; fill: #cfe8a9; }
.nic { fill: #fff7e0; stroke: #b58900; stroke-width: 1.2; }
.nicname { font-size: 10px; fill: #5c4500; }
.legendhead { font-size: 14px; font-weight: bold; }
.legend { font-size: 12px; }
.legendnote { font-size: 11px; fill: #666; font-style: italic; }
.warn { font-size: 12px; fill: #a15c00; }
"""


def _node_width(node: NodeTopology) -> float:
    radius = max(130.0, node.num_devices * (96.0 + 26) / (2 * math.pi))
    return 2 * (radius + 96 + 34) + 40 + 40 + 380


def render_svg(cluster: ClusterTopology) -> str:
    """An SVG drawing of every node of the cluster, one panel per node, top to bottom."""
    width = max((_node_width(n) for n in cluster.nodes), default=600.0)
    body: list[str] = []
    y = 10.0
    for i, node in enumerate(cluster.nodes):
        parts, h = _svg_node(node, _node_title(node, i), y, width)
        if i:
            body.append(f'<line x1="20" y1="{_fmt(y)}" x2="{_fmt(width - 20)}" y2="{_fmt(y)}" stroke="#ddd"/>')
        body += parts
        y += h + 10
    if not cluster.nodes:
        body.append('<text x="24" y="40" class="title">no nodes</text>')
        y = 60
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_fmt(width)}" height="{_fmt(y)}" '
        f'viewBox="0 0 {_fmt(width)} {_fmt(y)}" font-size="12">'
        f"<style>{_STYLE}</style>"
        f'<rect width="100%" height="100%" fill="#ffffff"/>' + "".join(body) + "</svg>\n"
    )
