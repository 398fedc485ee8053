"""The plan: what the runtime builds (mesh, rank placement, sync) and why.

`plan_job(cfg, topology)` is deterministic: the same job and topology give the same plan.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from ..choices import AccumSync, Choice, Compression, Precision, Recompute, Strategy, SyncAlgorithm
from ..config import JobConfig
from ..errors import ModelTooLarge, PlanError
from ..topology.model import ClusterTopology, Device
from ..units import format_bytes
from .calibration import UNCALIBRATED, Calibration, CompileGain
from .cluster_view import LeftOut, describe_domains, nvlink_view, plannable, real_ranks
from .compile import EAGER, CompilePlan, decide
from .compute import DeviceSpeed, device_speed, unlisted_note
from .cost import Estimate, JobContext, estimate, ties_head
from .gpus import known_names, lookup
from .layout import ClusterLayout, Wirings, node_name
from .memory import CUDA_CONTEXT_BYTES, MEMORY_MARGIN, MemoryBreakdown, byte_layout, usable_bytes
from .mesh import Mesh, RankPlacement
from .model_math import ModelShape, flops_per_step, forward_flops_per_token_layers, model_flops_per_step, param_count
from .model_spec import ModelSpec
from .nics import assign_nics
from .pipeline import Pipeline, stage_share
from .resolve import Execution
from .search import MAX_ALTERNATIVES, NEAR_TIE, Constraints, SearchResult, asks_for_ddp_hooks, search
from .sync import SyncPlan, powersgd_ratio


@dataclass(frozen=True)
class ModelSummary:
    """The model as the planner priced it."""

    params: int
    """Distinct parameters."""
    flops_per_step: float
    """Model FLOPs of one optimizer step (MFU's numerator)."""
    peak_tflops_per_rank: float
    """The device peak the compute model used; MFU is measured against it."""
    name: str = "gpt"
    """The model's factory (`module:callable`) or architecture; `gpt` for the built-in GPT."""
    blocks: int = 0
    """Repeated blocks (the unit of FSDP wrapping and activation checkpointing)."""
    block_class: str = "Block"
    """Class name of the repeated block."""
    tp_plan: bool = True
    """Whether the model declares a tensor-parallel plan (without one the plan keeps tp=1)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one optimizer step on each rank."""

    compute_s: float
    """Forward, backward (and recomputation) matmuls, plus the optimizer step."""
    comm_s: float
    """All communication of the step, hidden or not."""
    exposed_comm_s: float
    """The part of comm_s that compute does not hide."""
    total_s: float
    """compute_s + bubble_s + exposed_comm_s."""
    bubble_s: float = 0.0
    """Seconds the pipeline's slowest stage idles in its schedule's warm-up and cool-down."""

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class Alternative:
    """A runner-up or a rejected candidate, and why it was not chosen."""

    strategy: Strategy
    mesh: Mesh
    fits: bool
    reason: str
    micro_batch_size: int | None = None
    recompute: Recompute | None = None
    compression: Compression | None = None
    step_time_s: float | None = None
    """Predicted step time; None for a candidate that could not be estimated."""
    memory_per_rank: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"strategy": str(self.strategy), "mesh": self.mesh.to_dict(), "micro_batch_size": self.micro_batch_size,
                "recompute": None if self.recompute is None else str(self.recompute),
                "compression": None if self.compression is None else str(self.compression), "fits": self.fits,
                "reason": self.reason, "step_time_s": self.step_time_s, "memory_per_rank": self.memory_per_rank}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Alternative":
        opt = lambda enum, v: None if v is None else enum(v)  # noqa: E731
        return cls(strategy=Strategy(d["strategy"]), mesh=Mesh.from_dict(d["mesh"]), fits=bool(d["fits"]),
                   reason=d["reason"], micro_batch_size=d.get("micro_batch_size"),
                   recompute=opt(Recompute, d.get("recompute")), compression=opt(Compression, d.get("compression")),
                   step_time_s=d.get("step_time_s"), memory_per_rank=d.get("memory_per_rank"))


def _execution_to_dict(ex: Execution) -> dict[str, Any]:
    def plain(v: Any) -> Any:
        """A JSON value: choices by name, the mesh and pipeline by field, notes as a list."""
        if isinstance(v, (Mesh, Pipeline)):
            return v.to_dict()
        if isinstance(v, tuple):
            return list(v)
        return str(v) if isinstance(v, Choice) else v

    return {f.name: plain(getattr(ex, f.name)) for f in fields(ex)}


def _execution_from_dict(d: dict[str, Any]) -> Execution:
    return Execution(
        strategy=Strategy(d["strategy"]), mesh=Mesh.from_dict(d["mesh"]), device=d["device"],
        wrapping=Strategy(d["wrapping"]),
        shard_group=int(d["shard_group"]), ddp_reduces=bool(d["ddp_reduces"]), zero_optimizer=bool(d["zero_optimizer"]),
        reshard_after_forward=bool(d["reshard_after_forward"]), fsdp_replicates=bool(d["fsdp_replicates"]),
        autocast=None if d["autocast"] is None else Precision(d["autocast"]), param_dtype=Precision(d["param_dtype"]),
        loss_scaling=bool(d["loss_scaling"]), sync_algorithm=SyncAlgorithm(d["sync_algorithm"]),
        compression=Compression(d["compression"]), compression_warmup_steps=int(d["compression_warmup_steps"]),
        recompute=Recompute(d["recompute"]), bucket_mb=float(d["bucket_mb"]), flat_reason=d.get("flat_reason", ""),
        notes=tuple(d.get("notes", ())),
        pipeline=None if d.get("pipeline") is None else Pipeline.from_dict(d["pipeline"]),
        # Plans written before the choice existed ran every micro-step but the last in no_sync().
        reduce_every_micro_step=bool(d.get("reduce_every_micro_step", False)),
    )


@dataclass(frozen=True)
class Plan:
    """How a job runs on a cluster. The runtime receives this object itself; `to_dict()` is
    the JSON contract of plan.json and `plan --json`."""

    model: ModelSummary
    strategy: Strategy
    """`ddp`, `zero1`, `zero2`, `zero3` or `hsdp`."""
    mesh: Mesh
    ranks: tuple[RankPlacement, ...]
    """Where every global rank runs, in rank order."""
    memory_per_rank: MemoryBreakdown
    """Predicted peak bytes of one rank."""
    fits: bool
    """Whether memory_per_rank.total fits the usable memory of every rank."""
    reason: str
    """One line: why this plan (or why it does not fit)."""
    step_time: StepTime
    sync: SyncPlan
    execution: Execution
    """What really runs (`resolve`): wrapping, precision, sync and compression schedule."""
    micro_batch_size: int
    """Sequences per rank per forward/backward."""
    recompute: Recompute
    alternatives: tuple[Alternative, ...] = ()
    """The runners-up and rejected candidates, each with its reason."""
    explanation: tuple[str, ...] = ()
    """Lines that explain the choice to a person."""
    left_out: tuple[LeftOut, ...] = ()
    """Nodes of the probed cluster that run no rank (a GPU-less head under a GPU plan), and why."""
    compile: CompilePlan = EAGER
    """Whether the blocks run compiled (`torch.compile`), priced against the run's length.
    `step_time` is the eager step the search compared candidates by (compiling speeds every
    candidate's blocks alike); `run_step_s` is the step that runs."""

    def __post_init__(self) -> None:
        if len(self.ranks) != self.mesh.world_size:
            raise ValueError(f"mesh {self.mesh} has {self.mesh.world_size} ranks, the plan places {len(self.ranks)}")
        if [r.rank for r in self.ranks] != list(range(len(self.ranks))):
            raise ValueError("plan ranks must be listed in rank order, 0..world_size-1")
        if self.execution.mesh != self.mesh or self.execution.strategy != self.strategy:
            raise ValueError(f"the execution is for {self.execution.strategy} on {self.execution.mesh}, "
                             f"the plan is {self.strategy} on {self.mesh}")

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    @property
    def run_step_s(self) -> float:
        """Predicted seconds of the step that runs: compiled blocks' saving taken off."""
        return self.step_time.total_s - self.compile.saving_s_per_step

    @property
    def groups(self) -> dict[str, list[list[int]]]:
        """Axis -> the rank sets varying along it (init_device_mesh's numbering)."""
        return self.mesh.groups()

    @property
    def node_of_rank(self) -> tuple[str, ...]:
        return tuple(r.node for r in self.ranks)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.to_dict(),
            "strategy": str(self.strategy),
            "mesh": self.mesh.to_dict(),
            "ranks": [r.to_dict() for r in self.ranks],
            "groups": self.groups,
            "memory_per_rank": self.memory_per_rank.to_dict(),
            "fits": self.fits,
            "reason": self.reason,
            "step_time": self.step_time.to_dict(),
            "sync": self.sync.to_dict(),
            "execution": _execution_to_dict(self.execution),
            "alternatives": [a.to_dict() for a in self.alternatives],
            "micro_batch_size": self.micro_batch_size,
            "recompute": str(self.recompute),
            "world_size": self.world_size,
            "explanation": list(self.explanation),
            "left_out": [x.to_dict() for x in self.left_out],
            "compile": self.compile.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        return cls(
            model=ModelSummary(**d["model"]),
            strategy=Strategy(d["strategy"]),
            mesh=Mesh.from_dict(d["mesh"]),
            ranks=tuple(RankPlacement(int(r["rank"]), str(r["node"]), int(r["gpu"]), nic=r.get("nic"),
                                      nvlink_domain=r.get("nvlink_domain")) for r in d["ranks"]),
            memory_per_rank=MemoryBreakdown(**{k: int(v) for k, v in d["memory_per_rank"].items()}),
            fits=bool(d["fits"]),
            reason=d["reason"],
            step_time=StepTime(**{k: float(v) for k, v in d["step_time"].items()}),
            sync=SyncPlan.from_dict(d["sync"]),
            execution=_execution_from_dict(d["execution"]),
            micro_batch_size=int(d["micro_batch_size"]),
            recompute=Recompute(d["recompute"]),
            alternatives=tuple(Alternative.from_dict(a) for a in d.get("alternatives", [])),
            explanation=tuple(d.get("explanation", [])),
            left_out=tuple(LeftOut(**x) for x in d.get("left_out", [])),
            compile=CompilePlan.from_dict(d["compile"]) if "compile" in d else EAGER,
        )


def _gb(x: float) -> str:
    return format_bytes(x)


def model_shape(cfg: JobConfig, spec: ModelSpec | None = None) -> ModelShape:
    """The model the planner prices: the measured `spec`, or the built-in GPT's formulas."""
    return ModelShape.from_config(cfg.model) if spec is None else ModelShape.from_spec(spec)


def job_context(cfg: JobConfig, topology: ClusterTopology, spec: ModelSpec | None = None,
                calibration: Calibration = UNCALIBRATED) -> JobContext:
    """What every candidate plan of `cfg` on `topology` shares (model, device speed and memory,
    byte layout, network), as `plan_job` prices them; PlanError as `plan_job` raises it. With it
    and `cost.estimate`, any (strategy, mesh, layout) can be priced exactly as the planner does."""
    return _context(cfg, nvlink_view(plannable(topology)[0]).topology, model_shape(cfg, spec), calibration)


def _context(cfg: JobConfig, topo: ClusterTopology, shape: ModelShape,
             calibration: Calibration = UNCALIBRATED) -> JobContext:
    if topo.num_devices == 0:
        raise PlanError("the cluster has no devices to plan for (no GPU and no CPU slot)")
    kinds = {d.kind for n in topo.nodes for d in n.devices}
    if len(kinds) > 1:
        raise PlanError("the cluster mixes GPUs and CPU slots; plan for one kind "
                        "(GPUs, or cluster.num_workers CPU slots)")
    on_gpu = kinds == {"gpu"}
    if cfg.cluster.gpu and lookup(cfg.cluster.gpu) is None:
        # A model asked for by name must be one the table knows: a typo would plan with defaults.
        raise PlanError(f"key 'cluster.gpu': {cfg.cluster.gpu!r} is not a listed GPU model; listed: "
                        f"{', '.join(known_names())}; leave it unset to plan an unlisted GPU from its measured "
                        "or the default figures")
    speeds: list[DeviceSpeed] = []
    for node in topo.nodes:
        speeds += [device_speed(d, cfg.train.precision, cfg.cluster.gpu) for d in node.devices]
    speed = min(speeds, key=lambda s: (s.peak_tflops, s.memory_bytes))
    memory = min(s.memory_bytes for s in speeds)
    speed = DeviceSpeed(speed.name, speed.peak_tflops, speed.mem_gbps, memory, speed.sms)
    c = cfg.cluster
    net_gbps = topo.network.bandwidth_gbps if c.inter_node_gbps is None else c.inter_node_gbps
    net_lat = topo.network.latency_us if c.inter_node_latency_us is None else c.inter_node_latency_us
    device = "gpu" if on_gpu else "cpu"
    return JobContext(
        shape=shape, params=param_count(shape), global_batch=cfg.train.global_batch_size,
        layout=byte_layout(cfg.train.precision, device), speed=speed, on_gpu=on_gpu,
        usable_bytes=usable_bytes(memory, on_gpu), net_gbps=net_gbps, net_lat_us=net_lat,
        gpus_per_node=topo.nodes[0].num_devices, powersgd_ratio=powersgd_ratio(shape),
        precision=cfg.train.precision, max_steps=cfg.train.max_steps, calibration=calibration,
    )


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


def _alternative(e: Estimate, fits: bool, best: Estimate, ctx: JobContext) -> Alternative:
    c = e.choice
    if fits:
        pct = (e.total_s / best.total_s - 1) * 100 if best.total_s > 0 else 0.0
        reason = _compare(pct)
    else:
        reason = _fit_reason(e, ctx, False)
    return Alternative(strategy=c.strategy, mesh=c.mesh, fits=fits, reason=reason, micro_batch_size=c.micro_batch,
                       recompute=c.recompute, compression=c.compression, step_time_s=round(e.total_s, 6),
                       memory_per_rank=e.memory.total)


def _describe_axis(axis: str, cl: ClusterLayout, ctx: JobContext) -> str:
    size = cl.mesh.size(axis)
    inside = cl.per_node[axis]
    ring = cl.rings[axis]
    where = []
    if inside > 1:
        where.append(f"{inside} per node on links of {ring.gbps:g} GB/s at worst")
    if size > inside:
        where.append(f"{size // inside} nodes over the network ({ctx.net_gbps:g} GB/s per node)")
    return f"{axis} ({size} ranks per group): " + "; ".join(where)


def _explain(res: SearchResult, ctx: JobContext, cons: Constraints, topo: ClusterTopology,
             suggestion: str) -> list[str]:
    e, cl, c = res.best, res.layout, res.best.choice
    m = e.memory
    node = topo.nodes[0]
    lines = [
        f"model: {ctx.params / 1e6:.2f}M parameters, "
        f"{model_flops_per_step(ctx.shape, ctx.global_batch) / 1e12:.3g} TFLOP "
        f"per step ({ctx.global_batch} sequences of {ctx.shape.seq} tokens)",
        f"cluster: {len(topo.nodes)} node(s) x {node.num_devices} {ctx.speed.name}"
        + (f", network {ctx.net_gbps:g} GB/s per node, {ctx.net_lat_us:g} us" if len(topo.nodes) > 1 else ""),
        f"chosen: {c.strategy} on {c.mesh}, micro-batch {c.micro_batch}, recompute {c.recompute}, "
        f"{e.sync.grad_accum_steps} accumulation step(s)"
        + (f" (forced: {', '.join(cons.forced())})" if cons.forced() else ""),
        f"precision: {ctx.layout.name}",
        f"memory per rank: params {_gb(m.params)}, grads {_gb(m.grads)}, optimizer {_gb(m.optimizer)}, "
        f"activations {_gb(m.activations)}, buffers {_gb(m.buffers)}; total {_gb(m.total)} "
        f"({_fit_reason(e, ctx, res.fits)})",
        f"step time: compute {e.compute_s * 1e3:.2f} ms, communication {e.comm_s * 1e3:.2f} ms of which "
        f"{e.exposed_comm_s * 1e3:.2f} ms exposed, total {e.total_s * 1e3:.2f} ms"
        + (" (" + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in e.comm_parts.items()) + ")" if e.comm_parts else ""),
    ]
    if ctx.calibration.applied:
        lines.append(ctx.calibration.describe())
    if cl.uniform:
        lines.append("layout: every pair of devices on a node is joined by equal links, so any layout is equal; "
                     "ranks follow device order")
    else:
        lines.append("layout: the most talkative axis on the fastest links; "
                     + "; ".join(_describe_axis(a, cl, ctx) for a in ("tp", "dp_shard", "dp_replicate")
                                 if cl.mesh.size(a) > 1))
    lines.append(f"gradient sync: {e.schedule}; bucket {e.sync.bucket_mb:g} MB, compression {e.sync.compression}, "
                 f"overlap {'on' if e.sync.overlap else 'off (gloo shares the CPU cores with compute)'}")
    if e.sync.grad_accum_steps > 1:
        lines.append(accum_line(e, ctx, cl, cons))
    if res.fits:
        fitting = [r for r in res.runners_up if r.fits(ctx.usable_bytes)]
        why = f"fastest of {len(fitting) + 1} fitting (strategy, mesh) choices, {res.evaluated} candidates estimated"
        if fitting:
            r = fitting[0]
            why += f"; runner-up {r.choice.strategy} on {r.choice.mesh}: " \
                   f"{_compare((r.total_s / e.total_s - 1) * 100)}"
        lines.append(why)
    elif suggestion:
        lines.append(suggestion)
    if not ctx.shape.tp_capable:
        lines.append("tensor parallelism: none, the model declares no tensor-parallel plan")
    if e.execution.pipeline is not None:
        lines += pipeline_lines(e, ctx, cl, topo)
    elif cons.pp == 1 and len(topo.nodes) > 1:
        lines.append("pipeline: none, parallel.pp=1; parallel.pp=auto (the default) also searches pipelines "
                     "whose stages fill whole nodes")
    elif cons.pp is None and len(topo.nodes) > 1 and asks_for_ddp_hooks(cons):
        lines.append("pipeline: none searched: parallel.sync=hierarchical and parallel.compression=powersgd are "
                     "DDP comm hooks, which a pipeline's FSDP2 stages do not run (parallel.pp=2 forces one)")
    lines += [f"runs as: {note}" for note in e.execution.notes]
    return lines


GRAD_PARTS = ("grad all-reduce", "grad reduce-scatter", "replica all-reduce")
"""The `Estimate.comm_parts` that carry gradients."""


def _grad_traffic(e: Estimate) -> float:
    return sum(e.comm_parts.get(k, 0.0) for k in GRAD_PARTS)


def accum_line(e: Estimate, ctx: JobContext, cl: ClusterLayout, cons: Constraints) -> str:
    """One line: when the plan reduces gradients under accumulation, and why (the memory or the
    time of the other way, priced on the same plan)."""
    ex, accum, chosen = e.execution, e.sync.grad_accum_steps, e.sync.accum_sync
    head = f"gradient accumulation: {chosen}"
    if ex.pipeline is not None:
        return (f"{head}: torch's pipeline stages keep gradient sync off until the last of the {accum} micro-batches, "
                f"so each rank keeps its stage's unsharded gradients ({_gb(e.memory.grads)}) until then")
    if ex.ddp_reduces:
        return (f"{head}: {ex.wrapping} keeps whole gradients ({_gb(e.memory.grads)}) between micro-steps either way "
                f"and reduces them once, on the last of the {accum}")
    forced = f" (forced: parallel.accum_sync={cons.accum_sync})" if cons.accum_sync is not None else ""
    other = estimate(ctx, cl, replace(e.choice, accum_sync=AccumSync.per_micro_step
                                      if chosen == AccumSync.last_micro_step else AccumSync.last_micro_step))
    usable = ctx.usable_bytes
    dtype = str(ex.compression) if ex.compression in (Compression.fp16, Compression.bf16) else "fp32"
    if chosen == AccumSync.last_micro_step:
        last, per = e, other
        what = (f"FSDP2 keeps the unsharded {dtype} gradients ({_gb(e.memory.grads)} per rank) until the last of the "
                f"{accum} micro-steps and reduces once")
    else:
        last, per = other, e
        what = f"FSDP2 reduce-scatters after each of the {accum} micro-steps and keeps sharded gradients " \
               f"({_gb(e.memory.grads)} per rank)"
    saved = f"{(_grad_traffic(per) - _grad_traffic(last)) * 1e3:.2f} ms"
    gain = per.total_s - last.total_s
    pace = f"{abs(gain) * 1e3:.2f} ms per step {'faster' if gain >= 0 else 'slower'}"
    if chosen == AccumSync.last_micro_step:
        extra = e.memory.total - other.memory.total
        cost = f"for {_gb(extra)} more per rank" if extra > 0 else "at no more memory (nothing to shard)"
        why = f"{saved} less gradient traffic and {pace} than per_micro_step, {cost} " \
              f"({_gb(e.memory.total)} of {_gb(usable)} usable)"
    elif not last.fits(usable):
        why = (f"keeping unsharded gradients until the last would save {saved} of gradient traffic but need "
               f"{_gb(last.memory.total)} per rank, over the {_gb(usable)} usable")
    else:
        why = (f"last_micro_step would move {saved} less gradient traffic and be {pace}, for "
               f"{_gb(last.memory.total - e.memory.total)} more per rank ({_gb(last.memory.total)} of "
               f"{_gb(usable)} usable)")
    return f"{head}{forced}: {what}: {why}"


def pipeline_lines(e: Estimate, ctx: JobContext, cl: ClusterLayout, topo: ClusterTopology,
                   max_stages: int = 6) -> list[str]:
    """The pipeline in words: schedule, bubble, point-to-point cost and link, and which blocks
    sit on which ranks (the first and last stages when there are many)."""
    pl, mesh = e.execution.pipeline, e.choice.mesh
    per_stage = mesh.world_size // mesh.pp
    g = ctx.gpus_per_node
    inside = cl.per_node["pp"] > 1 and mesh.pp == cl.per_node["pp"]
    link = (f"links inside a node ({cl.rings['pp'].gbps:g} GB/s at worst)" if inside
            else f"the network ({ctx.net_gbps:g} GB/s per node)")
    lines = [f"pipeline: {pl.schedule}, {pl.stages} stages x {pl.virtual} chunk(s) per rank, {pl.microbatches} "
             f"micro-batches; bubble {pl.bubble:.1%} of busy time ({e.bubble_s * 1e3:.2f} ms); point-to-point "
             f"{e.comm_parts.get('pipeline p2p', 0.0) * 1e3:.2f} ms per step between adjacent stages over {link}"]
    # torch's stages allocate a receive buffer per micro-batch and boundary up front: with many
    # micro-batches they, not the model, can be what does not fit.
    most = max(stage_share(ctx.shape, pl, s).recv_buffers for s in range(pl.stages))
    one = e.choice.micro_batch * ctx.shape.seq * ctx.shape.hidden * ctx.layout.activation
    lines.append(f"receive buffers: up to {most} per rank, one per micro-batch for each activation and gradient a "
                 f"stage receives, held by torch's stages all run long: {_gb(most * one)}")
    # The built-in GPT (no measured spec) ties its head to the embedding; a measured spec says.
    tied = ties_head(ctx.shape)
    head = "head (tied copy of the embedding)" if tied else "head"
    shown = list(range(pl.stages)) if pl.stages <= max_stages else \
        list(range(max_stages // 2)) + list(range(pl.stages - max_stages // 2, pl.stages))
    for s in shown:
        ranges = []
        for c in pl.chunks_of(s):
            a, b = pl.block_range(c)
            ranges.append(f"{a}-{b - 1}" if b - a > 1 else f"{a}")
        extra = (" + embeddings" if s == 0 else "") + (f" + final norm, {head} and loss"
                                                       if s == (pl.chunks - 1) % pl.stages else "")
        lo, hi = s * per_stage, (s + 1) * per_stage - 1
        nodes = sorted({lo // g, hi // g})
        where = f"node {nodes[0]}" if len(nodes) == 1 else f"nodes {nodes[0]}-{nodes[-1]}"
        lines.append(f"stage {s}: blocks {', '.join(ranges)}{extra}; ranks {lo}-{hi} ({where})")
        if pl.stages > max_stages and s == max_stages // 2 - 1:
            lines.append(f"... {pl.stages - max_stages} more stages")
    return lines


def plan_job(cfg: JobConfig, topology: ClusterTopology, spec: ModelSpec | None = None, *,
             left_out: tuple[LeftOut, ...] = (), calibration: Calibration = UNCALIBRATED) -> Plan:
    """Plan `cfg` on `topology`: the fastest plan that fits, or, when the config forces choices
    that cannot fit, the forced plan with fits=False and the reason. PlanError when nothing at
    all can be planned (no devices, an unknown GPU, a batch no mesh divides), when no plan at
    all fits (`too_large`: the least memory it would need and what would help), and when a
    forced `parallel.accum_sync` is all that keeps the plan from fitting.

    Nodes `plannable` leaves out (GPU-less nodes of a GPU cluster) run no rank; `left_out`
    adds those a caller already set aside, so the plan names them all. `spec` is the measured
    model (`workloads.inspect.model_spec`); None plans the built-in GPT of `cfg.model` by its
    formulas. `calibration` scales the cost model's terms by what a trial on this cluster
    measured (`planning/calibration.py`)."""
    real, more = plannable(topology)
    left_out = tuple(left_out) + more
    view = nvlink_view(real)
    topology = view.topology
    shape = model_shape(cfg, spec)
    ctx = _context(cfg, topology, shape, calibration)
    if spec is not None and not spec.pipeline_ends and cfg.parallel.pp not in ("auto", 1):
        raise PlanError(f"key 'parallel.pp': {spec.name} names no ends (embed, head) to cut a pipeline at, so only "
                        f"pp=1 can run; got {cfg.parallel.pp}")
    if not shape.tp_capable and cfg.parallel.tp not in ("auto", 1):
        raise PlanError(f"key 'parallel.tp': {spec.name if spec else 'the model'} declares no tensor-parallel plan, "
                        f"so only tp=1 can run; got {cfg.parallel.tp}")
    # A model without a tensor-parallel plan gets none: no head count but 1 divides by tp > 1.
    tp_heads = (math.gcd(spec.heads, spec.kv_heads) if spec else shape.heads) if shape.tp_capable else 1
    try:
        wirings = Wirings.of(topology)
    except ValueError as e:
        raise PlanError(f"cannot lay out ranks: {e}") from e
    cons = Constraints.from_config(cfg)
    res = search(ctx, wirings, cons, tp_heads)
    if res.best is None:
        raise PlanError(_nothing_plannable(cfg, wirings, cons, shape, res))
    suggestion = ""
    if not res.fits:
        free = search(ctx, wirings, Constraints(allow_compression=cons.allow_compression), tp_heads) \
            if cons.forced() else res
        if free.best is None or not free.fits:
            raise ModelTooLarge(too_large(ctx, wirings, free if free.best is not None else res,
                                      f"model {spec.name}" if spec else "the GPT"))
        if cons.accum_sync is not None:
            relaxed = search(ctx, wirings, replace(cons, accum_sync=None), tp_heads)
            if relaxed.best is not None and relaxed.fits:
                raise PlanError(_forced_accum_does_not_fit(res.best, relaxed.best, ctx, cons.accum_sync))
        c = free.best.choice
        suggestion = (f"without the forced choices, {c.strategy} on {c.mesh} with micro-batch "
                      f"{c.micro_batch} and recompute {c.recompute} fits ({_gb(free.best.memory.total)} per rank)")
    e, cl = res.best, res.layout
    if res.fits:
        reason = f"fastest plan that fits; {_fit_reason(e, ctx, True)}"
    else:
        reason = f"{_fit_reason(e, ctx, False)}; {suggestion}"  # a plan that fits nowhere raised above
    alternatives = [_alternative(r, r.fits(ctx.usable_bytes), e, ctx) for r in res.runners_up[:MAX_ALTERNATIVES]]
    alternatives += [Alternative(strategy=r.strategy, mesh=r.mesh, fits=False, reason=r.reason)
                     for r in res.rejected[:MAX_ALTERNATIVES]]
    ranks, nic_notes = assign_nics(real_ranks(view, real, cl), {node_name(n, i): n for i, n in enumerate(real.nodes)})
    nic_notes = nic_notes if ctx.on_gpu else []  # CPU slots talk gloo over the host's own route
    model = ModelSummary(params=ctx.params, flops_per_step=model_flops_per_step(shape, ctx.global_batch),
                         peak_tflops_per_rank=ctx.speed.peak_tflops, name=spec.name if spec else "gpt",
                         blocks=shape.layers, block_class=spec.block_class if spec else "Block",
                         tp_plan=shape.tp_capable)
    gain, gain_note = measured_gain(ctx.calibration, model)
    # The optimizer's share of compute_s is counted with the blocks': a slight overstatement of
    # the saving, which the run's length outweighs or not by far more.
    share = block_share(shape, ctx.global_batch, str(e.choice.recompute))
    compiled = replace(decide(str(cfg.train.compile), ctx.device, e.compute_s * share, cfg.train.max_steps,
                              spec.graph_break if spec else None, gain, ctx.calibration.source), block_share=share,
                       block_compute_s=e.compute_s * share)
    return Plan(
        model=model,
        strategy=e.choice.strategy,
        mesh=e.choice.mesh,
        ranks=ranks,
        memory_per_rank=e.memory,
        fits=res.fits,
        reason=reason,
        step_time=StepTime(e.compute_s, e.comm_s, e.exposed_comm_s, e.total_s, e.bubble_s),
        sync=e.sync,
        # What was priced, with the schedule and bucket the estimate settled on; its notes say
        # what runs differently from the request, for the explanation and the runtime alike.
        execution=replace(e.execution, sync_algorithm=e.sync.algorithm, bucket_mb=e.sync.bucket_mb),
        micro_batch_size=e.choice.micro_batch,
        recompute=e.choice.recompute,
        alternatives=tuple(alternatives),
        explanation=tuple(_explain(res, ctx, cons, topology, suggestion) + _unlisted(topology, cfg)
                          + [f"compile: {compiled.reason}"] + gain_note
                          + describe_domains(view, real) + nic_notes + [f"left out: {x}" for x in left_out]),
        left_out=left_out,
        compile=compiled,
    )


def measured_gain(calibration: Calibration, model: ModelSummary) -> tuple[CompileGain | None, list[str]]:
    """The calibration's compile figure where it was measured on this model, else None, with a
    line saying why it was not used: another model's blocks compile to other graphs."""
    g = calibration.compile
    if g is None or g.same_model(model.name, model.block_class, model.params):
        return g, []
    return None, [f"compile: the calibration's compile figure ({calibration.source}) was measured on {g.model} "
                  f"({g.block_class}, {g.params:,} parameters), not this model ({model.name}, {model.block_class}, "
                  f"{model.params:,}): priced from the table instead"]


def block_share(shape: ModelShape, batch: int, recompute: str) -> float:
    """The share of a step's FLOPs spent in the repeated blocks (recomputation included): what
    compiling them speeds up. The rest is the embeddings, the head and the loss."""
    step = flops_per_step(shape, batch, recompute)
    outside = flops_per_step(shape, batch, "none") - 3 * batch * shape.seq * forward_flops_per_token_layers(shape)
    return max(0.0, min(1.0, (step - outside) / step))


def too_large(ctx: JobContext, wirings: Wirings, res: SearchResult, name: str) -> str:
    """One line for a model no plan fits: what its most memory-frugal plan (`res.best`, the
    least memory of every candidate the search formed) needs against what a device has, which
    levers that plan already pulls, and how many devices would hold it.

    The device count scales that plan: its model states shard over every rank (full sharding,
    and tensor and pipeline parallelism divide them too), its activations and buffers do not,
    so `n` devices hold it once states x world / n + the rest fits the usable memory."""
    e = res.best
    assert e is not None
    c, m, ex = e.choice, e.memory, e.execution
    world, g = wirings.devices_per_node * len(wirings.node_index), wirings.devices_per_node
    usable, unit = ctx.usable_bytes, "device" if ctx.on_gpu else "CPU slot"
    nodes = len(wirings.node_index)
    frugal = f"{c.strategy} on {c.mesh}, micro-batch {c.micro_batch}, recompute {c.recompute}"
    if e.sync.grad_accum_steps > 1 and e.sync.accum_sync == AccumSync.per_micro_step:
        frugal += ", gradients reduce-scattered every micro-step"
    devices = f"{world} {ctx.speed.name}" if ctx.on_gpu else f"{world} CPU slots"
    line = (f"{name} ({ctx.params / 1e9:.2f}B parameters) does not fit {devices} at any plan: the most "
            f"memory-frugal one ({frugal}) needs {_gb(m.total)} per {unit}, {_gb(usable)} usable of "
            f"{_gb(ctx.speed.memory_bytes)}")
    spent = []
    if c.recompute == Recompute.full:
        spent.append("full recomputation")
    if c.micro_batch == 1:
        spent.append("micro-batch 1")
    if ex.pipeline is not None:
        spent.append(f"a pipeline of {ex.pipeline.stages} stages")
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


def _forced_accum_does_not_fit(forced: Estimate, fits: Estimate, ctx: JobContext, accum: AccumSync) -> str:
    """One line for a forced `parallel.accum_sync` that no plan fits while the other way does."""
    other = fits.sync.accum_sync
    return (f"key 'parallel.accum_sync': {accum} does not fit: at its least it needs {_gb(forced.memory.total)} per "
            f"rank (gradients {_gb(forced.memory.grads)}), {_gb(ctx.usable_bytes)} usable; {other} fits "
            f"({fits.choice.strategy} on {fits.choice.mesh}, {_gb(fits.memory.total)} per rank): use "
            f"parallel.accum_sync={other} or auto")


def _unlisted(topo: ClusterTopology, cfg: JobConfig) -> list[str]:
    """One line per GPU model the table does not list, saying how it was planned."""
    nodes: dict[str, list[str]] = {}
    first: dict[str, Device] = {}
    for i, node in enumerate(topo.nodes):
        for d in node.devices:
            if d.name not in first and unlisted_note(d, "", cfg.cluster.gpu) is not None:
                first[d.name] = d
        for name in {d.name for d in node.devices} & set(first):
            nodes.setdefault(name, []).append(node.hostname or node.node_id or f"node {i}")
    return [unlisted_note(first[name], where[0] if len(where) == 1 else f"{len(where)} nodes", cfg.cluster.gpu)
            for name, where in nodes.items()]


def _nothing_plannable(cfg: JobConfig, wirings: Wirings, cons: Constraints, shape: ModelShape,
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
