"""The plan for people: text that explains the choice, and an SVG of the ranks on the topology."""

from __future__ import annotations

import math
from html import escape

from ..topology.model import ClusterTopology
from ..units import format_bytes
from .mesh import AXES, RankPlacement
from .plan import Plan

# Link colours by kind, fastest first (NVLink green, PCIe paths warming to red, CPU slots grey).
_LINK_COLOURS = {"nvlink": "#2e7d32", "pix": "#1565c0", "pxb": "#1976d2", "phb": "#f9a825", "node": "#ef6c00",
                 "sys": "#c62828", "shm": "#757575", "net": "#6a1b9a"}
_GROUP_COLOURS = ("#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d", "#666666")
_MAX_NODES_DRAWN = 4


def _bytes(x: float | None) -> str:
    return format_bytes(x)


def render_text(plan: Plan, topology: ClusterTopology | None = None) -> str:
    """The plan as a person reads it: choice, memory, step time, layout, runners-up."""
    out = []
    mesh = str(plan.mesh)
    status = "fits" if plan.fits else "DOES NOT FIT"
    out.append(f"plan: {plan.strategy} on {mesh} ({plan.world_size} ranks), micro-batch {plan.micro_batch_size}, "
               f"recompute {plan.recompute}: {status}")
    out.append(f"  {plan.reason}")
    out.append("")
    out.append("memory per rank")
    for k in ("params", "grads", "optimizer", "activations", "buffers", "total"):
        out.append(f"  {k:<12}{_bytes(getattr(plan.memory_per_rank, k)):>12}")
    st = plan.step_time
    out.append("step time")
    out.append(f"  {'compute':<16}{st.compute_s * 1e3:>10.2f} ms")
    out.append(f"  {'communication':<16}{st.comm_s * 1e3:>10.2f} ms")
    out.append(f"  {'  exposed':<16}{st.exposed_comm_s * 1e3:>10.2f} ms")
    if plan.execution.pipeline is not None:
        out.append(f"  {'pipeline bubble':<16}{st.bubble_s * 1e3:>10.2f} ms")
    out.append(f"  {'total':<16}{st.total_s * 1e3:>10.2f} ms")
    s = plan.sync
    out.append(f"gradient sync: {s.algorithm}, bucket {s.bucket_mb:g} MB, compression {s.compression}, "
               f"{s.grad_accum_steps} accumulation step(s), overlap {'on' if s.overlap else 'off'}")
    out.append("")
    out.append("layout (rank -> node:gpu" + ("/nic" if any(r.nic for r in plan.ranks) else "") + ")")
    out.extend(_layout_lines(plan))
    out.append("")
    out.append("why")
    out.extend(f"  {line}" for line in plan.explanation)
    if plan.alternatives:
        out.append("")
        out.append("alternatives")
        extras = [(f" mb={a.micro_batch_size} rc={a.recompute}" if a.micro_batch_size is not None else "")
                  + (f" {a.cp_attention}" if a.cp_attention else "") for a in plan.alternatives]
        width = max([24] + [len(extra) + 1 for extra in extras])  # context-parallel rows name their attention
        for a, extra in zip(plan.alternatives, extras):
            m = "x".join(str(a.mesh.size(ax)) for ax in AXES if ax != "cp" or a.mesh.cp > 1)
            t = f"{a.step_time_s * 1e3:.2f} ms" if a.step_time_s is not None else "-"
            memory = _bytes(a.memory_per_rank)
            out.append(f"  {a.strategy:<6} {m:<14}{extra:<{width}} {t:>12}  {memory:>10}  {a.reason}")
    return "\n".join(out)


def _layout_lines(plan: Plan) -> list[str]:
    """The TP groups of the first nodes, in rank order; larger clusters repeat the same layout."""
    lines = []
    by_node: dict[str, list[RankPlacement]] = {}
    for r in plan.ranks:
        by_node.setdefault(r.node, []).append(r)
    tp = plan.mesh.tp
    for i, (node, ranks) in enumerate(by_node.items()):
        if i == _MAX_NODES_DRAWN:
            lines.append(f"  ... {len(by_node) - i} more node(s), laid out the same way")
            break
        cells = []
        for k in range(0, len(ranks), tp):
            grp = ranks[k:k + tp]
            cell = " ".join(f"r{r.rank}:{r.gpu}" + (f"/{r.nic}" if r.nic else "") for r in grp)
            cells.append(f"[{cell}]" if tp > 1 else cell)
        lines.append(f"  {node}: " + " ".join(cells))
    return lines


def _stages_on(plan: Plan, node: str) -> str:
    """` - pipeline stage(s) ...: blocks ...` for a node's ranks; '' without a pipeline."""
    pl = plan.execution.pipeline
    if pl is None:
        return ""
    per_stage = plan.world_size // pl.stages
    stages = sorted({r.rank // per_stage for r in plan.ranks if r.node == node})
    blocks = []
    for s in stages:
        for c in pl.chunks_of(s):
            a, b = pl.block_range(c)
            blocks.append(f"{a}-{b - 1}")
    return f" - stage {', '.join(map(str, stages))}: blocks {', '.join(blocks)}"


def render_svg(plan: Plan, topology: ClusterTopology) -> str:
    """Each drawn node's devices on a circle, links coloured by kind and drawn wider the faster
    they are, each rank labelled on its device and coloured by its group on the chattiest
    axis that has groups (tp, else HSDP's dp_shard; plain data parallelism is one group)."""
    nodes = topology.nodes[:_MAX_NODES_DRAWN]
    m = plan.mesh
    axis = "tp" if m.tp > 1 else "dp_shard" if m.dp_shard > 1 and m.dp_replicate > 1 else None
    group_of = {r: g for g, ranks in enumerate(plan.groups[axis]) for r in ranks} if axis else {}
    what = f"colour = {axis} group" if axis else "one data-parallel group"
    size, pad = 360, 30
    width = max(size * len(nodes) + pad, 620)  # room for the title and the legend
    height = size + 90
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             'font-family="sans-serif" font-size="11">',
             f'<text x="{pad}" y="20" font-size="14">{escape(plan.strategy)} on '
             f'{escape(str(plan.mesh))}; {escape(what)}</text>']
    rank_of: dict[tuple[str, int], int] = {(r.node, r.gpu): r.rank for r in plan.ranks}
    node_names = list(dict.fromkeys(r.node for r in plan.ranks))
    max_bw = max((l.bandwidth_gbps for n in nodes for l in n.links), default=1.0) or 1.0
    for i, node in enumerate(nodes):
        name = node_names[i] if i < len(node_names) else f"node{i}"
        cx, cy, rad = pad + i * size + size / 2 - 15, 40 + size / 2, size / 2 - 50
        devs = sorted(d.index for d in node.devices)
        pos = {d: (cx + rad * math.cos(2 * math.pi * k / len(devs) - math.pi / 2),
                   cy + rad * math.sin(2 * math.pi * k / len(devs) - math.pi / 2)) for k, d in enumerate(devs)}
        parts.append(f'<text x="{cx - 30}" y="{cy + rad + 45}">{escape(name)}{escape(_stages_on(plan, name))}</text>')
        for l in sorted(node.links, key=lambda l: l.bandwidth_gbps):
            (x1, y1), (x2, y2) = pos[l.a], pos[l.b]
            w = 0.5 + 5 * l.bandwidth_gbps / max_bw
            parts.append(f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" '
                         f'stroke="{_LINK_COLOURS.get(l.kind, "#999")}" stroke-width="{w:.2f}" opacity="0.6">'
                         f'<title>{l.a}-{l.b} {l.kind} {l.bandwidth_gbps:g} GB/s</title></line>')
        for d in devs:
            x, y = pos[d]
            rank = rank_of.get((name, d))
            colour = _GROUP_COLOURS[group_of.get(rank, 0) % len(_GROUP_COLOURS)] if rank is not None else "#ccc"
            parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="18" fill="{colour}" stroke="#222"/>')
            label = f"r{rank}" if rank is not None else "-"
            parts.append(f'<text x="{x:.1f}" y="{y - 2:.1f}" text-anchor="middle" fill="white">{label}</text>')
            parts.append(f'<text x="{x:.1f}" y="{y + 10:.1f}" text-anchor="middle" fill="white" '
                         f'font-size="9">gpu{d}</text>')
    if len(topology.nodes) > len(nodes):
        parts.append(f'<text x="{pad}" y="{height - 10}">... {len(topology.nodes) - len(nodes)} more node(s), '
                     'laid out the same way</text>')
    kinds = [k for k in _LINK_COLOURS if any(l.kind == k for n in nodes for l in n.links)]
    x = pad
    parts.append(f'<text x="{x}" y="{height - 25}" fill="#444">links (wider = faster):</text>')
    x += 140
    for k in kinds:
        parts.append(f'<line x1="{x}" y1="{height - 29}" x2="{x + 22}" y2="{height - 29}" '
                     f'stroke="{_LINK_COLOURS[k]}" stroke-width="4"/>')
        parts.append(f'<text x="{x + 27}" y="{height - 25}" fill="#444">{escape(k)}</text>')
        x += 40 + 7 * len(k)
    parts.append("</svg>")
    return "\n".join(parts)
