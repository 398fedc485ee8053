"""The plan: what the runtime builds (mesh, rank placement, sync) and why.

`plan_job(cfg, topology)` is deterministic: the same job and topology give the same plan.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ..config import JobConfig
from ..errors import PlanError
from ..topology.model import ClusterTopology
from .compute import DeviceSpeed, device_speed
from .cost import Estimate, JobContext
from .gpus import known_names
from .layout import AXES, ClusterLayout, Wirings, mesh_groups, rank_placements
from .memory import CUDA_CONTEXT_BYTES, MEMORY_MARGIN, byte_layout, usable_bytes
from .model_math import ModelShape, model_flops_per_step, param_count
from .search import MAX_ALTERNATIVES, NEAR_TIE, Constraints, SearchResult, search
from .sync import powersgd_ratio

GB = 1e9


@dataclass
class StepTime:
    """Predicted seconds of one optimizer step on each rank."""

    compute_s: float
    """Forward, backward (and recomputation) matmuls, plus the optimizer step."""
    comm_s: float
    """All communication of the step, hidden or not."""
    exposed_comm_s: float
    """The part of comm_s that compute does not hide."""
    total_s: float
    """compute_s + exposed_comm_s."""


@dataclass
class Plan:
    """How a job runs on a cluster; `to_dict()` is the JSON contract of `plan --json`."""

    model: dict[str, Any]
    """`params` (distinct parameters), `flops_per_step` (model FLOPs of one optimizer step),
    `peak_tflops_per_rank` (the device peak the compute model used; MFU is measured against it)."""
    strategy: str
    """`ddp`, `zero1`, `zero2`, `zero3` or `hsdp`."""
    mesh: dict[str, int]
    """Axis -> size, always `dp_replicate`, `dp_shard`, `tp` in that order."""
    ranks: list[dict[str, Any]]
    """`{rank, node, gpu}` per global rank: the node's id (`node<i>` for a capture) and GPU index."""
    groups: dict[str, list[list[int]]]
    """Axis -> the rank sets varying along it (init_device_mesh's numbering)."""
    memory_per_rank: dict[str, int]
    """Bytes: `params`, `grads`, `optimizer`, `activations`, `buffers`, `total`."""
    fits: bool
    """Whether memory_per_rank.total fits the usable memory of every rank."""
    reason: str
    """One line: why this plan (or why it does not fit)."""
    step_time: dict[str, float]
    """`compute_s`, `comm_s`, `exposed_comm_s`, `total_s`."""
    sync: dict[str, Any]
    """`bucket_mb`, `algorithm`, `compression`, `grad_accum_steps`, `overlap`."""
    alternatives: list[dict[str, Any]]
    """The runners-up and rejected candidates, each with its reason."""
    micro_batch_size: int
    """Sequences per rank per forward/backward."""
    recompute: str
    """`none`, `selective` or `full`."""
    world_size: int
    """Ranks in all."""
    explanation: list[str] = field(default_factory=list)
    """Lines that explain the choice to a person."""

    def __post_init__(self) -> None:
        if list(self.mesh) != list(AXES):
            raise ValueError(f"mesh must have the axes {', '.join(AXES)} in that order, got {list(self.mesh)}")
        size = self.mesh["dp_replicate"] * self.mesh["dp_shard"] * self.mesh["tp"]
        if size != self.world_size:
            raise ValueError(f"mesh {self.mesh} has {size} ranks, world_size is {self.world_size}")

    @property
    def mesh_shape(self) -> tuple[int, int, int]:
        return self.mesh["dp_replicate"], self.mesh["dp_shard"], self.mesh["tp"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": dict(self.model),
            "strategy": self.strategy,
            "mesh": dict(self.mesh),
            "ranks": [dict(r) for r in self.ranks],
            "groups": {k: [list(g) for g in v] for k, v in self.groups.items()},
            "memory_per_rank": dict(self.memory_per_rank),
            "fits": self.fits,
            "reason": self.reason,
            "step_time": dict(self.step_time),
            "sync": dict(self.sync),
            "alternatives": [dict(a) for a in self.alternatives],
            "micro_batch_size": self.micro_batch_size,
            "recompute": self.recompute,
            "world_size": self.world_size,
            "explanation": list(self.explanation),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        mesh = {a: int(d["mesh"][a]) for a in AXES}
        return cls(
            model=dict(d["model"]),
            strategy=d["strategy"],
            mesh=mesh,
            ranks=[{"rank": int(r["rank"]), "node": str(r["node"]), "gpu": int(r["gpu"])} for r in d["ranks"]],
            groups={k: [list(map(int, g)) for g in v] for k, v in d["groups"].items()},
            memory_per_rank={k: int(v) for k, v in d["memory_per_rank"].items()},
            fits=bool(d["fits"]),
            reason=d["reason"],
            step_time={k: float(v) for k, v in d["step_time"].items()},
            sync=dict(d["sync"]),
            alternatives=[dict(a) for a in d.get("alternatives", [])],
            micro_batch_size=int(d["micro_batch_size"]),
            recompute=d["recompute"],
            world_size=int(d["world_size"]),
            explanation=list(d.get("explanation", [])),
        )


def _gb(x: float) -> str:
    return f"{x / GB:.2f} GB" if abs(x) >= 0.1 * GB else f"{x / 1e6:.1f} MB"


def _mesh_str(mesh: tuple[int, int, int]) -> str:
    return " x ".join(f"{a}={n}" for a, n in zip(AXES, mesh))


def _host_memory_per_slot(slots: int) -> int:
    """A CPU slot's share of the host's physical memory (what a CPU probe leaves unsaid)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 16 * 2**30
    return total // max(slots, 1)


def job_context(cfg: JobConfig, topology: ClusterTopology) -> JobContext:
    """What every candidate plan of `cfg` on `topology` shares (model, device speed and memory,
    byte layout, network), as `plan_job` prices them; PlanError as `plan_job` raises it. With it
    and `cost.estimate`, any (strategy, mesh, layout) can be priced exactly as the planner does."""
    return _context(cfg, topology, ModelShape.from_config(cfg.model))[0]


def _context(cfg: JobConfig, topo: ClusterTopology, shape: ModelShape) -> tuple[JobContext, str]:
    if topo.num_devices == 0:
        raise PlanError("the cluster has no devices to plan for (no GPU and no CPU slot)")
    kinds = {d.kind for n in topo.nodes for d in n.devices}
    if len(kinds) > 1:
        raise PlanError("the cluster mixes GPUs and CPU slots; plan for one kind (GPUs, or cluster.num_workers CPU slots)")
    on_gpu = kinds == {"gpu"}
    speeds: list[DeviceSpeed] = []
    for node in topo.nodes:
        for d in node.devices:
            s = device_speed(d, cfg.train.precision, cfg.cluster.gpu)
            if s is None:
                raise PlanError(f"GPU {d.name or '(unnamed)'} on {node.hostname or node.node_id or 'a node'} is not in the "
                                f"planner's table; set cluster.gpu (or --gpu) to one of: {', '.join(known_names())}")
            speeds.append(s)
    speed = min(speeds, key=lambda s: (s.peak_tflops, s.memory_bytes))
    memory = min(s.memory_bytes for s in speeds)
    if not on_gpu:
        memory = min(topo.nodes[0].devices[0].memory_bytes or _host_memory_per_slot(topo.nodes[0].num_devices), memory or 1 << 62)
    speed = DeviceSpeed(speed.name, speed.peak_tflops, speed.mem_gbps, memory)
    # As the runtime resolves it: `auto` is bf16 autocast on GPU and fp32 on CPU; an explicit
    # bf16/fp16 autocasts on CPU too (byte_layout knows both).
    precision = cfg.train.precision
    net_gbps = topo.network.bandwidth_gbps
    net_lat = topo.network.latency_us
    if cfg.cluster.inter_node_gbps is not None:
        net_gbps, net_lat = cfg.cluster.inter_node_gbps, cfg.cluster.inter_node_latency_us
    ctx = JobContext(
        shape=shape, params=param_count(shape), global_batch=cfg.train.global_batch_size,
        layout=byte_layout(precision, "gpu" if on_gpu else "cpu"), speed=speed, on_gpu=on_gpu,
        usable_bytes=usable_bytes(memory, on_gpu), net_gbps=net_gbps, net_lat_us=net_lat,
        gpus_per_node=topo.nodes[0].num_devices, powersgd_ratio=powersgd_ratio(shape),
    )
    return ctx, precision


def _fit_reason(e: Estimate, ctx: JobContext, fits: bool) -> str:
    cap = ctx.speed.memory_bytes
    room = (f"{_gb(ctx.usable_bytes)} usable of {_gb(cap)} on {ctx.speed.name} after a {MEMORY_MARGIN:.0%} margin"
            + (f" and {CUDA_CONTEXT_BYTES / 2**30:.0f} GiB for the CUDA context" if ctx.on_gpu else ""))
    if fits:
        return f"needs {_gb(e.memory.total)} per rank, {room}"
    return f"does not fit by {_gb(e.memory.total - ctx.usable_bytes)}: needs {_gb(e.memory.total)} per rank, {room}"


def _compare(pct: float) -> str:
    """How an alternative's step time compares with the chosen plan's, in words."""
    if pct >= 0:
        return f"slower by {pct:.2f}%" if pct < 1 else f"slower by {pct:.1f}%"
    if pct >= -NEAR_TIE * 100:
        return f"within {NEAR_TIE:.0%} of the chosen plan, which is simpler"
    return f"faster by {-pct:.1f}%, but the config forced the chosen plan"


def _alt_dict(e: Estimate, fits: bool, best: Estimate, ctx: JobContext) -> dict[str, Any]:
    c = e.choice
    if fits:
        pct = (e.total_s / best.total_s - 1) * 100 if best.total_s > 0 else 0.0
        reason = _compare(pct)
    else:
        reason = _fit_reason(e, ctx, False)
    return {
        "strategy": c.strategy, "mesh": dict(zip(AXES, c.mesh)), "micro_batch_size": c.micro_batch,
        "recompute": c.recompute, "compression": c.compression, "fits": fits, "reason": reason,
        "step_time_s": round(e.total_s, 6), "memory_per_rank": e.memory.total,
    }


def _describe_axis(axis: str, cl: ClusterLayout, ctx: JobContext) -> str:
    size = cl.mesh[AXES.index(axis)]
    inside = cl.per_node[axis]
    ring = cl.rings[axis]
    where = []
    if inside > 1:
        where.append(f"{inside} per node on links of {ring.gbps:g} GB/s at worst")
    if size > inside:
        where.append(f"{size // inside} nodes over the network ({ctx.net_gbps:g} GB/s per node)")
    return f"{axis} ({size} ranks per group): " + "; ".join(where)


def _explain(res: SearchResult, ctx: JobContext, cons: Constraints, precision: str, topo: ClusterTopology,
             suggestion: str) -> list[str]:
    e, cl, c = res.best, res.layout, res.best.choice
    m = e.memory
    node = topo.nodes[0]
    lines = [
        f"model: {ctx.params / 1e6:.2f}M parameters, {model_flops_per_step(ctx.shape, ctx.global_batch) / 1e12:.3g} TFLOP "
        f"per step ({ctx.global_batch} sequences of {ctx.shape.seq} tokens)",
        f"cluster: {len(topo.nodes)} node(s) x {node.num_devices} {ctx.speed.name}"
        + (f", network {ctx.net_gbps:g} GB/s per node, {ctx.net_lat_us:g} us" if len(topo.nodes) > 1 else ""),
        f"chosen: {c.strategy} on {_mesh_str(c.mesh)}, micro-batch {c.micro_batch}, recompute {c.recompute}, "
        f"{e.sync.grad_accum_steps} accumulation step(s)"
        + (f" (forced: {', '.join(cons.forced())})" if cons.forced() else ""),
        f"precision: {ctx.layout.name}",
        f"memory per rank: params {_gb(m.params)}, grads {_gb(m.grads)}, optimizer {_gb(m.optimizer)}, "
        f"activations {_gb(m.activations)}, buffers {_gb(m.buffers)}; total {_gb(m.total)} ({_fit_reason(e, ctx, res.fits)})",
        f"step time: compute {e.compute_s * 1e3:.2f} ms, communication {e.comm_s * 1e3:.2f} ms of which "
        f"{e.exposed_comm_s * 1e3:.2f} ms exposed, total {e.total_s * 1e3:.2f} ms"
        + (" (" + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in e.comm_parts.items()) + ")" if e.comm_parts else ""),
    ]
    if cl.uniform:
        lines.append("layout: every pair of devices on a node is joined by equal links, so any layout is equal; "
                     "ranks follow device order")
    else:
        lines.append("layout: the most talkative axis on the fastest links; "
                     + "; ".join(_describe_axis(a, cl, ctx) for a in ("tp", "dp_shard", "dp_replicate")
                                 if cl.mesh[AXES.index(a)] > 1))
    lines.append(f"gradient sync: {e.schedule}; bucket {e.sync.bucket_mb:g} MB, compression {e.sync.compression}, "
                 f"overlap {'on' if e.sync.overlap else 'off (gloo shares the CPU cores with compute)'}")
    if res.fits:
        fitting = [r for r in res.runners_up if r.fits(ctx.usable_bytes)]
        why = f"fastest of {len(fitting) + 1} fitting (strategy, mesh) choices, {res.evaluated} candidates estimated"
        if fitting:
            r = fitting[0]
            why += f"; runner-up {r.choice.strategy} on {_mesh_str(r.choice.mesh)}: " \
                   f"{_compare((r.total_s / e.total_s - 1) * 100)}"
        lines.append(why)
    elif suggestion:
        lines.append(suggestion)
    return lines


def plan_job(cfg: JobConfig, topology: ClusterTopology) -> Plan:
    """Plan `cfg` on `topology`: the fastest plan that fits, or, when the config forces choices
    that cannot fit, the forced plan with fits=False and the reason. PlanError only when
    nothing at all can be planned (no devices, an unknown GPU, a batch no mesh divides)."""
    shape = ModelShape.from_config(cfg.model)
    ctx, precision = _context(cfg, topology, shape)
    try:
        wirings = Wirings.of(topology)
    except ValueError as e:
        raise PlanError(f"cannot lay out ranks: {e}") from e
    cons = Constraints.from_config(cfg)
    res = search(ctx, wirings, cons, shape.heads)
    if res.best is None:
        raise PlanError(_nothing_plannable(cfg, wirings, cons, shape, res))
    suggestion = ""
    if not res.fits and cons.forced():
        free = search(ctx, wirings, Constraints(allow_compression=cons.allow_compression), shape.heads)
        if free.best is not None and free.fits:
            c = free.best.choice
            suggestion = (f"without the forced choices, {c.strategy} on {_mesh_str(c.mesh)} with micro-batch "
                          f"{c.micro_batch} and recompute {c.recompute} fits ({_gb(free.best.memory.total)} per rank)")
    e, cl = res.best, res.layout
    if res.fits:
        reason = f"fastest plan that fits; {_fit_reason(e, ctx, True)}"
    else:
        reason = _fit_reason(e, ctx, False) + (f"; {suggestion}" if suggestion else "; no plan fits this cluster")
    alternatives = [_alt_dict(r, r.fits(ctx.usable_bytes), e, ctx) for r in res.runners_up[:MAX_ALTERNATIVES]]
    alternatives += [{"strategy": r.strategy, "mesh": dict(zip(AXES, r.mesh)), "fits": False, "reason": r.reason,
                      "step_time_s": None, "memory_per_rank": None} for r in res.rejected[:MAX_ALTERNATIVES]]
    mesh = e.choice.mesh
    return Plan(
        model={"params": ctx.params, "flops_per_step": model_flops_per_step(shape, ctx.global_batch),
               "peak_tflops_per_rank": ctx.speed.peak_tflops},
        strategy=e.choice.strategy,
        mesh=dict(zip(AXES, mesh)),
        ranks=rank_placements(topology, cl),
        groups=mesh_groups(mesh),
        memory_per_rank=e.memory.to_dict(),
        fits=res.fits,
        reason=reason,
        step_time={"compute_s": e.compute_s, "comm_s": e.comm_s, "exposed_comm_s": e.exposed_comm_s, "total_s": e.total_s},
        sync=e.sync.to_dict(),
        alternatives=alternatives,
        micro_batch_size=e.choice.micro_batch,
        recompute=e.choice.recompute,
        world_size=ctx.gpus_per_node * len(topology.nodes),
        explanation=_explain(res, ctx, cons, precision, topology, suggestion),
    )


def _nothing_plannable(cfg: JobConfig, wirings: Wirings, cons: Constraints, shape: ModelShape, res: SearchResult) -> str:
    world = wirings.devices_per_node * len(wirings.node_index)
    gb = cfg.train.global_batch_size
    # The smallest data-parallel sizes any tensor-parallel degree allows: a batch must be a multiple of one.
    g = wirings.devices_per_node
    tps = [cons.tp] if cons.tp else [t for t in range(1, g + 1) if g % t == 0 and shape.heads % t == 0]
    dps = sorted({world // t for t in tps if world % t == 0})
    if dps and all(gb % d for d in dps):
        ok = " or ".join(f"{d} (tp={world // d})" for d in dps)
        return (f"train.global_batch_size={gb} is not a multiple of the data-parallel size on {world} ranks; "
                f"use a multiple of {ok}")
    reasons = Counter(r.reason for r in res.rejected)
    first = reasons.most_common(1)[0][0] if reasons else "no mesh matches the cluster"
    return f"no plan can be laid out on {world} ranks under " + (", ".join(cons.forced()) or "these settings") + \
        f": {first}"
