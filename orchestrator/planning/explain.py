"""The plan in words: why it was chosen, how it runs, and why a job cannot be planned."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

from ..choices import AccumSync, Compression, Recompute
from ..config import JobConfig
from ..topology.model import ClusterTopology, Device
from .compute import unlisted_note
from .cost import Estimate, JobContext, estimate, expert_routing, ties_head
from .layout import ClusterLayout, Wirings
from .memory import CUDA_CONTEXT_BYTES, MEMORY_MARGIN
from .mesh import AXES, EXPERT_AXES, Mesh
from .model_math import ModelShape, model_flops_per_step
from .pipeline import stage_share
from .plan import Alternative, _gb
from .search import NEAR_TIE, Constraints, SearchResult, asks_for_ddp_hooks


def fit_reason(priced: Estimate, ctx: JobContext, fits: bool) -> str:
    cap = ctx.speed.memory_bytes
    room = (f"{_gb(ctx.usable_bytes)} usable of {_gb(cap)} on {ctx.speed.name} after a {MEMORY_MARGIN:.0%} margin"
            + (f" and {CUDA_CONTEXT_BYTES / 2**30:.0f} GiB for the CUDA context" if ctx.on_gpu else ""))
    if fits:
        return f"needs {_gb(priced.memory.total)} per rank, {room}"
    return (f"does not fit by {_gb(priced.memory.total - ctx.usable_bytes)}: needs {_gb(priced.memory.total)} per "
            f"rank, {room}")


def compare(pct: float) -> str:
    """How an alternative's step time compares with the chosen plan's, in words."""
    if pct >= 0:
        return f"slower by {pct:.2f}%" if pct < 1 else f"slower by {pct:.1f}%"
    if pct >= -NEAR_TIE * 100:
        return f"within {NEAR_TIE:.0%} of the chosen plan, which is simpler"
    return f"faster by {-pct:.1f}%, but the config forced the chosen plan"


def alternative(priced: Estimate, fits: bool, best: Estimate, ctx: JobContext) -> Alternative:
    choice = priced.choice
    if fits:
        pct = (priced.total_s / best.total_s - 1) * 100 if best.total_s > 0 else 0.0
        reason = compare(pct)
    else:
        reason = fit_reason(priced, ctx, False)
    return Alternative(strategy=choice.strategy, mesh=choice.mesh, fits=fits, reason=reason,
                       micro_batch_size=choice.micro_batch,
                       recompute=choice.recompute, compression=choice.compression, step_time_s=round(priced.total_s, 6),
                       memory_per_rank=priced.memory.total,
                       cp_attention=choice.cp_attention if choice.mesh.cp > 1 else None)


def _describe_axis(axis: str, cluster_layout: ClusterLayout, ctx: JobContext) -> str:
    size = cluster_layout.mesh.size(axis)
    inside = cluster_layout.per_node[axis]
    ring = cluster_layout.rings[axis]
    where = []
    if inside > 1:
        where.append(f"{inside} per node on links of {ring.gbps:g} GB/s at worst")
    if size > inside:
        where.append(f"{size // inside} nodes over the network ({ctx.net_gbps:g} GB/s per node)")
    return f"{axis} ({size} ranks per group): " + "; ".join(where)


def explain(res: SearchResult, ctx: JobContext, cons: Constraints, topo: ClusterTopology,
             suggestion: str) -> list[str]:
    priced, cluster_layout = res.best, res.layout
    assert priced is not None and cluster_layout is not None, "explained only once a plan was chosen and laid out"
    choice, m = priced.choice, priced.memory
    node = topo.nodes[0]
    lines = [
        f"model: {ctx.params / 1e6:.2f}M parameters, "
        f"{model_flops_per_step(ctx.shape, ctx.global_batch) / 1e12:.3g} TFLOP "
        f"per step ({ctx.global_batch} sequences of {ctx.shape.seq} tokens)",
        f"cluster: {len(topo.nodes)} node(s) x {node.num_devices} {ctx.speed.name}"
        + (f", network {ctx.net_gbps:g} GB/s per node, {ctx.net_lat_us:g} us" if len(topo.nodes) > 1 else ""),
        f"chosen: {choice.strategy} on {choice.mesh}, micro-batch {choice.micro_batch}, recompute {choice.recompute}, "
        f"{priced.sync.grad_accum_steps} accumulation step(s)"
        + (f" (forced: {', '.join(cons.forced())})" if cons.forced() else ""),
        f"precision: {ctx.layout.name}",
        f"memory per rank: params {_gb(m.params)}, grads {_gb(m.grads)}, optimizer {_gb(m.optimizer)}, "
        f"activations {_gb(m.activations)}, buffers {_gb(m.buffers)}; total {_gb(m.total)} "
        f"({fit_reason(priced, ctx, res.fits)})",
        f"step time: compute {priced.compute_s * 1e3:.2f} ms, communication {priced.comm_s * 1e3:.2f} ms of which "
        f"{priced.exposed_comm_s * 1e3:.2f} ms exposed, total {priced.total_s * 1e3:.2f} ms"
        + (" (" + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in priced.comm_parts.items()) + ")"
           if priced.comm_parts else ""),
    ]
    if ctx.calibration.applied:
        lines.append(ctx.calibration.describe())
    if cluster_layout.uniform:
        lines.append("layout: every pair of devices on a node is joined by equal links, so any layout is equal; "
                     "ranks follow device order")
    else:
        lines.append("layout: the most talkative axis on the fastest links; "
                     + "; ".join(_describe_axis(a, cluster_layout, ctx) for a in ("tp", "dp_shard", "dp_replicate")
                                 if cluster_layout.mesh.size(a) > 1))
    lines += axis_lines(res, ctx, topo)
    lines.append(f"gradient sync: {priced.schedule}; bucket {priced.sync.bucket_mb:g} MB, "
                 f"compression {priced.sync.compression}, "
                 f"overlap {'on' if priced.sync.overlap else 'off (gloo shares the CPU cores with compute)'}")
    if priced.sync.grad_accum_steps > 1:
        lines.append(accum_line(priced, ctx, cluster_layout, cons))
    if res.fits:
        lines.append(_search_line(res, priced, ctx))
    elif suggestion:
        lines.append(suggestion)
    if not ctx.shape.tp_capable:
        lines.append("tensor parallelism: none, the model declares no tensor-parallel plan")
    if priced.execution.pipeline is not None:
        lines += pipeline_lines(priced, ctx, cluster_layout, topo)
    elif cons.pp == 1 and len(topo.nodes) > 1:
        lines.append("pipeline: none, parallel.pp=1; parallel.pp=auto (the default) also searches pipelines "
                     "whose stages fill whole nodes")
    elif cons.pp is None and len(topo.nodes) > 1 and asks_for_ddp_hooks(cons):
        lines.append("pipeline: none searched: parallel.sync=hierarchical and parallel.compression=powersgd are "
                     "DDP comm hooks, which a pipeline's FSDP2 stages do not run (parallel.pp=2 forces one)")
    lines += [f"runs as: {note}" for note in priced.execution.notes]
    return lines


def _search_line(res: SearchResult, priced: Estimate, ctx: JobContext) -> str:
    """How many choices fitted and the runner-up's distance."""
    fitting = [r for r in res.runners_up if r.fits(ctx.usable_bytes)]
    why = f"fastest of {len(fitting) + 1} fitting (strategy, mesh) choices, {res.evaluated} candidates estimated"
    if fitting:
        r = fitting[0]
        why += f"; runner-up {r.choice.strategy} on {r.choice.mesh}: {compare((r.total_s / priced.total_s - 1) * 100)}"
    return why


LINK_AXES = ("tp", "cp", "ep", "dp_shard", "efsdp", "dp_replicate", "pp")
"""Axes the explanation places on links, innermost first (the expert mesh's beside the dense one's)."""


def _link_kind(gbps: float, topo: ClusterTopology) -> str:
    """The kind of in-node link a ring's bottleneck is (`NVLink`, `PCIe`, ...)."""
    kinds = {l.kind for n in topo.nodes for l in n.links if math.isclose(l.bandwidth_gbps, gbps)}
    kind = "nvlink" if "nvlink" in kinds else (sorted(kinds)[0] if kinds else "")
    return {"nvlink": "NVLink island", "": "links"}.get(kind, f"{kind.upper() if len(kind) <= 4 else kind} links")


def axis_links(cluster_layout: ClusterLayout, ctx: JobContext, topo: ClusterTopology) -> list[str]:
    """Which link each axis with more than one rank sits on: inside one island (a node, or a
    multi-node NVLink domain planned as one), over the NICs between them, or both."""
    mesh, out = cluster_layout.mesh, []
    for axis in LINK_AXES:
        size = mesh.size(axis)
        inside = cluster_layout.per_node.get(axis, 1)
        if size <= 1 or axis not in cluster_layout.rings:
            continue
        island = _link_kind(cluster_layout.rings[axis].gbps, topo)
        if size <= inside:
            out.append(f"{axis}: {island} (node 0)")
        elif inside > 1:
            out.append(f"{axis}: {island} ({inside} per node) and NIC across {size // inside} nodes")
        else:
            out.append(f"{axis}: NIC")
    return out or ["one rank: none"]


def axis_lines(res: SearchResult, ctx: JobContext, topo: ClusterTopology) -> list[str]:
    """The links each axis sits on, a Mixture of Experts' two factorisations, and why the plan
    has the context and expert parallelism it has. Dense plans without context parallelism
    keep the lines they always had."""
    assert res.best is not None and res.layout is not None, "a chosen plan is laid out"
    mesh = res.best.choice.mesh
    moe = ctx.shape.spec is not None and ctx.shape.spec.experts is not None
    lines = ["links: " + "; ".join(axis_links(res.layout, ctx, topo))] if mesh.cp > 1 or moe else []
    if moe:
        lines.append(factorisations(mesh, res.layout, ctx))
    return lines + res.notes


def factorisations(mesh: Mesh, cluster_layout: ClusterLayout, ctx: JobContext) -> str:
    """The two factorisations of a Mixture of Experts' ranks, and its routing where an expert
    group spans islands."""
    line = (f"factorisations: dense {' x '.join(f'{a}={n}' for a, n in zip(AXES, mesh.shape))}; "
            f"experts {' x '.join(f'{a}={n}' for a, n in zip(EXPERT_AXES, mesh.expert_shape))}")
    routing = expert_routing(ctx, cluster_layout)
    if routing is not None:
        line += (f"; the expert group spans {routing.groups} islands, so routing is node-limited: "
                 f"{routing.groups} groups (one per island), each token to at most {routing.top_groups}")
    return line


GRAD_PARTS = ("grad all-reduce", "grad reduce-scatter", "replica all-reduce")
"""The `Estimate.comm_parts` that carry gradients."""


def _grad_traffic(priced: Estimate) -> float:
    return sum(priced.comm_parts.get(k, 0.0) for k in GRAD_PARTS)


def accum_line(priced: Estimate, ctx: JobContext, cluster_layout: ClusterLayout, cons: Constraints) -> str:
    """One line: when the plan reduces gradients under accumulation, and why (the memory or the
    time of the other way, priced on the same plan)."""
    runs, accum, chosen = priced.execution, priced.sync.grad_accum_steps, priced.sync.accum_sync
    head = f"gradient accumulation: {chosen}"
    if runs.pipeline is not None:
        return (f"{head}: torch's pipeline stages keep gradient sync off until the last of the {accum} micro-batches, "
                f"so each rank keeps its stage's unsharded gradients ({_gb(priced.memory.grads)}) until then")
    if runs.ddp_reduces:
        return (f"{head}: {runs.wrapping} keeps whole gradients ({_gb(priced.memory.grads)}) between micro-steps "
                f"either way "
                f"and reduces them once, on the last of the {accum}")
    forced = f" (forced: parallel.accum_sync={cons.accum_sync})" if cons.accum_sync is not None else ""
    other = estimate(ctx, cluster_layout, replace(priced.choice, accum_sync=AccumSync.per_micro_step
                                      if chosen == AccumSync.last_micro_step else AccumSync.last_micro_step))
    usable = ctx.usable_bytes
    dtype = str(runs.compression) if runs.compression in (Compression.fp16, Compression.bf16) else "fp32"
    if chosen == AccumSync.last_micro_step:
        last, per = priced, other
        what = (f"FSDP2 keeps the unsharded {dtype} gradients ({_gb(priced.memory.grads)} per rank) until the last "
                f"of the "
                f"{accum} micro-steps and reduces once")
    else:
        last, per = other, priced
        what = f"FSDP2 reduce-scatters after each of the {accum} micro-steps and keeps sharded gradients " \
               f"({_gb(priced.memory.grads)} per rank)"
    saved = f"{(_grad_traffic(per) - _grad_traffic(last)) * 1e3:.2f} ms"
    gain = per.total_s - last.total_s
    pace = f"{abs(gain) * 1e3:.2f} ms per step {'faster' if gain >= 0 else 'slower'}"
    if chosen == AccumSync.last_micro_step:
        extra = priced.memory.total - other.memory.total
        cost = f"for {_gb(extra)} more per rank" if extra > 0 else "at no more memory (nothing to shard)"
        why = f"{saved} less gradient traffic and {pace} than per_micro_step, {cost} " \
              f"({_gb(priced.memory.total)} of {_gb(usable)} usable)"
    elif not last.fits(usable):
        why = (f"keeping unsharded gradients until the last would save {saved} of gradient traffic but need "
               f"{_gb(last.memory.total)} per rank, over the {_gb(usable)} usable")
    else:
        why = (f"last_micro_step would move {saved} less gradient traffic and be {pace}, for "
               f"{_gb(last.memory.total - priced.memory.total)} more per rank ({_gb(last.memory.total)} of "
               f"{_gb(usable)} usable)")
    return f"{head}{forced}: {what}: {why}"


def pipeline_lines(priced: Estimate, ctx: JobContext, cluster_layout: ClusterLayout, topo: ClusterTopology,
                   max_stages: int = 6) -> list[str]:
    """The pipeline in words: schedule, bubble, point-to-point cost and link, and which blocks
    sit on which ranks (the first and last stages when there are many)."""
    pipeline, mesh = priced.execution.pipeline, priced.choice.mesh
    assert pipeline is not None, "only a plan that runs a pipeline has pipeline lines"
    per_stage = mesh.world_size // mesh.pp
    g = ctx.gpus_per_node
    inside = cluster_layout.per_node["pp"] > 1 and mesh.pp == cluster_layout.per_node["pp"]
    link = (f"links inside a node ({cluster_layout.rings['pp'].gbps:g} GB/s at worst)" if inside
            else f"the network ({ctx.net_gbps:g} GB/s per node)")
    lines = [f"pipeline: {pipeline.schedule}, {pipeline.stages} stages x {pipeline.virtual} chunk(s) per rank, "
             f"{pipeline.microbatches} micro-batches; bubble {pipeline.bubble:.1%} of busy time "
             f"({priced.bubble_s * 1e3:.2f} ms); point-to-point "
             f"{priced.comm_parts.get('pipeline p2p', 0.0) * 1e3:.2f} ms per step between adjacent stages over {link}"]
    # torch's stages allocate a receive buffer per micro-batch and boundary up front: with many
    # micro-batches they, not the model, can be what does not fit.
    most = max(stage_share(ctx.shape, pipeline, s).recv_buffers for s in range(pipeline.stages))
    one = priced.choice.micro_batch * ctx.shape.seq * ctx.shape.hidden * ctx.layout.activation
    lines.append(f"receive buffers: up to {most} per rank, one per micro-batch for each activation and gradient a "
                 f"stage receives, held by torch's stages all run long: {_gb(most * one)}")
    # The built-in GPT (no measured spec) ties its head to the embedding; a measured spec says.
    tied = ties_head(ctx.shape)
    head = "head (tied copy of the embedding)" if tied else "head"
    shown = list(range(pipeline.stages)) if pipeline.stages <= max_stages else \
        list(range(max_stages // 2)) + list(range(pipeline.stages - max_stages // 2, pipeline.stages))
    for s in shown:
        ranges = []
        for chunk in pipeline.chunks_of(s):
            a, b = pipeline.block_range(chunk)
            ranges.append(f"{a}-{b - 1}" if b - a > 1 else f"{a}")
        extra = (" + embeddings" if s == 0 else "") + (f" + final norm, {head} and loss"
                                                       if s == (pipeline.chunks - 1) % pipeline.stages else "")
        lo, hi = s * per_stage, (s + 1) * per_stage - 1
        nodes = sorted({lo // g, hi // g})
        where = f"node {nodes[0]}" if len(nodes) == 1 else f"nodes {nodes[0]}-{nodes[-1]}"
        lines.append(f"stage {s}: blocks {', '.join(ranges)}{extra}; ranks {lo}-{hi} ({where})")
        if pipeline.stages > max_stages and s == max_stages // 2 - 1:
            lines.append(f"... {pipeline.stages - max_stages} more stages")
    return lines


def too_large(ctx: JobContext, wirings: Wirings, res: SearchResult, name: str) -> str:
    """One line for a model no plan fits: what its most memory-frugal plan (`res.best`, the
    least memory of every candidate the search formed) needs against what a device has, which
    levers that plan already pulls, and how many devices would hold it.

    The device count scales that plan: its model states shard over every rank (full sharding,
    and tensor and pipeline parallelism divide them too), its activations and buffers do not,
    so `n` devices hold it once states x world / n + the rest fits the usable memory."""
    priced = res.best
    assert priced is not None
    choice, m, runs = priced.choice, priced.memory, priced.execution
    world, g = wirings.devices_per_node * len(wirings.node_index), wirings.devices_per_node
    usable, unit = ctx.usable_bytes, "device" if ctx.on_gpu else "CPU slot"
    nodes = len(wirings.node_index)
    frugal = f"{choice.strategy} on {choice.mesh}, micro-batch {choice.micro_batch}, recompute {choice.recompute}"
    if priced.sync.grad_accum_steps > 1 and priced.sync.accum_sync == AccumSync.per_micro_step:
        frugal += ", gradients reduce-scattered every micro-step"
    devices = f"{world} {ctx.speed.name}" if ctx.on_gpu else f"{world} CPU slots"
    line = (f"{name} ({ctx.params / 1e9:.2f}B parameters) does not fit {devices} at any plan: the most "
            f"memory-frugal one ({frugal}) needs {_gb(m.total)} per {unit}, {_gb(usable)} usable of "
            f"{_gb(ctx.speed.memory_bytes)}")
    spent = []
    if choice.recompute == Recompute.full:
        spent.append("full recomputation")
    if choice.micro_batch == 1:
        spent.append("micro-batch 1")
    if runs.pipeline is not None:
        spent.append(f"a pipeline of {runs.pipeline.stages} stages")
    if spent:
        line += f"; it already runs {', '.join(spent)} (activations {_gb(m.activations)})"
    if nodes == 1 and ctx.shape.layers > 1 and (ctx.shape.spec is None or ctx.shape.spec.pipeline_ends):
        line += "; pipelines are searched on 2 nodes or more (their stages fill whole nodes)"
    states = m.params + m.grads + m.optimizer
    rest = m.total - states
    if rest >= usable:
        return (line + f"; more {unit}s alone do not help: what does not shard over them (activations "
                f"{_gb(m.activations)}, buffers {_gb(m.buffers)}) already needs more than that; a shorter sequence "
                f"or a smaller model would")
    need = math.ceil(world * states / (usable - rest))
    return (line + f"; more {unit}s would: its model states ({_gb(states)} per {unit}) shard over them and "
            f"{_gb(rest)} does not, so at least {need} {unit}s ({math.ceil(need / g)} nodes of {g})")


def forced_accum_does_not_fit(forced: Estimate, fits: Estimate, ctx: JobContext, accum: AccumSync) -> str:
    """One line for a forced `parallel.accum_sync` that no plan fits while the other way does."""
    other = fits.sync.accum_sync
    return (f"key 'parallel.accum_sync': {accum} does not fit: at its least it needs {_gb(forced.memory.total)} per "
            f"rank (gradients {_gb(forced.memory.grads)}), {_gb(ctx.usable_bytes)} usable; {other} fits "
            f"({fits.choice.strategy} on {fits.choice.mesh}, {_gb(fits.memory.total)} per rank): use "
            f"parallel.accum_sync={other} or auto")


def unlisted(topo: ClusterTopology, cfg: JobConfig) -> list[str]:
    """One line per GPU model the table does not list, saying how it was planned."""
    nodes: dict[str, list[str]] = {}
    first: dict[str, Device] = {}
    for i, node in enumerate(topo.nodes):
        for d in node.devices:
            if d.name not in first and unlisted_note(d, "", cfg.cluster.gpu) is not None:
                first[d.name] = d
        for name in {d.name for d in node.devices} & set(first):
            nodes.setdefault(name, []).append(node.hostname or node.node_id or f"node {i}")
    return [note for name, where in nodes.items()
            if (note := unlisted_note(first[name], where[0] if len(where) == 1 else f"{len(where)} nodes",
                                      cfg.cluster.gpu)) is not None]


def nothing_plannable(cfg: JobConfig, wirings: Wirings, cons: Constraints, shape: ModelShape,
                       res: SearchResult) -> str:
    world = wirings.devices_per_node * len(wirings.node_index)
    gb = cfg.train.global_batch_size
    # The smallest data-parallel sizes any tensor-parallel degree allows: a batch must be a multiple of one.
    g = wirings.devices_per_node
    tps = [cons.tp] if cons.tp else [t for t in range(1, g + 1) if g % t == 0 and shape.heads % t == 0]
    dps = sorted({world // t for t in tps if world % t == 0})
    if dps and all(gb % d for d in dps):
        ok = " or ".join(f"{d} (tp={world // d})" for d in dps)
        # A pipeline divides the data-parallel size by p but needs p micro-batches on every
        # rank, so no batch smaller than the smallest data-parallel size fits with one either.
        pipe = (f"; a pipeline does not help below {dps[0]} sequences (p stages need p micro-batches "
                "on every data-parallel rank)") if cons.pp != 1 and gb < dps[0] else ""
        return (f"train.global_batch_size={gb} is not a multiple of the data-parallel size on {world} ranks; "
                f"use a multiple of {ok}{pipe}")
    reasons = Counter(r.reason for r in res.rejected)
    first = reasons.most_common(1)[0][0] if reasons else "no mesh matches the cluster"
    return f"no plan can be laid out on {world} ranks under " + (", ".join(cons.forced()) or "these settings") + \
        f": {first}"

