"""The planning flow: a job and a topology in, the fastest plan that fits out (`plan_job`).

`plan_job(cfg, topology)` is deterministic: the same job and topology give the same plan.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..config import JobConfig
from ..errors import ModelTooLarge, PlanError
from ..topology.model import ClusterTopology
from .calibration import UNCALIBRATED, Calibration, CompileGain
from .cluster_view import LeftOut, describe_domains, nvlink_view, plannable, real_ranks
from .compile import CompilePlan, decide
from .compute import DeviceSpeed, device_speed
from .cost import Estimate, JobContext
from .explain import (
    alternative,
    explain,
    fit_reason,
    forced_accum_does_not_fit,
    nothing_plannable,
    too_large,
    unlisted,
)
from .gpus import known_names, lookup
from .layout import Wirings, node_name
from .memory import byte_layout, usable_bytes
from .model_math import ModelShape, flops_per_step, forward_flops_per_token_layers, model_flops_per_step, param_count
from .model_spec import ModelSpec
from .nics import assign_nics
from .plan import Alternative, ModelSummary, Plan, StepTime, _gb
from .search import MAX_ALTERNATIVES, Constraints, SearchResult, search
from .sync import powersgd_ratio


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
    speed = DeviceSpeed(speed.name, speed.peak_tflops, speed.mem_gbps, memory, speed.sms, speed.datasheet_tflops)
    cluster = cfg.cluster
    net_gbps = topo.network.bandwidth_gbps if cluster.inter_node_gbps is None else cluster.inter_node_gbps
    net_lat = topo.network.latency_us if cluster.inter_node_latency_us is None else cluster.inter_node_latency_us
    device = "gpu" if on_gpu else "cpu"
    return JobContext(
        shape=shape, params=param_count(shape), global_batch=cfg.train.global_batch_size,
        layout=byte_layout(cfg.train.precision, device), speed=speed, on_gpu=on_gpu,
        usable_bytes=usable_bytes(memory, on_gpu), net_gbps=net_gbps, net_lat_us=net_lat,
        gpus_per_node=topo.nodes[0].num_devices, powersgd_ratio=powersgd_ratio(shape),
        precision=cfg.train.precision, max_steps=cfg.train.max_steps, calibration=calibration,
    )


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
    tp_heads = _tp_heads(cfg, shape, spec)
    _check_experts(cfg, spec)
    try:
        wirings = Wirings.of(topology)
    except ValueError as error:
        raise PlanError(f"cannot lay out ranks: {error}") from error
    constraints = Constraints.from_config(cfg)
    result = search(ctx, wirings, constraints, tp_heads)
    best, cluster_layout = result.best, result.layout
    # The search lays out the ranks of the plan it chooses: it returns both or neither.
    if best is None or cluster_layout is None:
        raise PlanError(nothing_plannable(cfg, wirings, constraints, shape, result))
    suggestion = "" if result.fits else _unforced_suggestion(ctx, wirings, constraints, tp_heads, result, best, spec)
    if result.fits:
        reason = f"fastest plan that fits; {fit_reason(best, ctx, True)}"
    else:
        reason = f"{fit_reason(best, ctx, False)}; {suggestion}"  # a plan that fits nowhere raised above
    ranks, nic_notes = assign_nics(real_ranks(view, real, cluster_layout),
                                   {node_name(node, i): node for i, node in enumerate(real.nodes)})
    nic_notes = nic_notes if ctx.on_gpu else []  # CPU slots talk gloo over the host's own route
    model = _model_summary(ctx, spec)
    compiled, gain_note = _compile_plan(cfg, ctx, best, model, spec)
    return Plan(
        model=model,
        ranks=ranks,
        memory_per_rank=best.memory,
        fits=result.fits,
        reason=reason,
        step_time=StepTime(best.compute_s, best.comm_s, best.exposed_comm_s, best.total_s, best.bubble_s),
        # What was priced, with the schedule and bucket the estimate settled on; its notes say
        # what runs differently from the request, for the explanation and the runtime alike.
        execution=replace(best.execution, sync_algorithm=best.sync.algorithm, bucket_mb=best.sync.bucket_mb),
        micro_batch_size=best.choice.micro_batch,
        grad_accum_steps=best.sync.grad_accum_steps,
        alternatives=_alternatives(result, best, ctx),
        explanation=tuple(explain(result, ctx, constraints, topology, suggestion) + unlisted(topology, cfg)
                          + [f"compile: {compiled.reason}"] + gain_note
                          + describe_domains(view, real) + nic_notes + [f"left out: {x}" for x in left_out]),
        left_out=left_out,
        compile=compiled,
    )


def _alternatives(result: SearchResult, best: Estimate, ctx: JobContext) -> tuple[Alternative, ...]:
    """The runners-up, each against the chosen plan `best`, then the rejected candidates."""
    return tuple([alternative(runner_up, runner_up.fits(ctx.usable_bytes), best, ctx)
                  for runner_up in result.runners_up[:MAX_ALTERNATIVES]]
                 + [Alternative(strategy=rejected.strategy, mesh=rejected.mesh, fits=False, reason=rejected.reason)
                    for rejected in result.rejected[:MAX_ALTERNATIVES]])


def _tp_heads(cfg: JobConfig, shape: ModelShape, spec: ModelSpec | None) -> int:
    """The head count every tensor-parallel degree must divide; PlanError where the config
    forces a pipeline or tensor parallelism the model cannot run."""
    if spec is not None and not spec.pipeline_ends and cfg.parallel.pp not in ("auto", 1):
        raise PlanError(f"key 'parallel.pp': {spec.name} names no ends (embed, head) to cut a pipeline at, so only "
                        f"pp=1 can run; got {cfg.parallel.pp}")
    if not shape.tp_capable and cfg.parallel.tp not in ("auto", 1):
        raise PlanError(f"key 'parallel.tp': {spec.name if spec else 'the model'} declares no tensor-parallel plan, "
                        f"so only tp=1 can run; got {cfg.parallel.tp}")
    # A model without a tensor-parallel plan gets none: no head count but 1 divides by tp > 1.
    return (math.gcd(spec.heads, spec.kv_heads) if spec else shape.heads) if shape.tp_capable else 1


def _check_experts(cfg: JobConfig, spec: ModelSpec | None) -> None:
    """PlanError where `parallel.ep` is forced to what the model's experts cannot run: above one
    on a dense model, or not dividing the routed experts."""
    ep = cfg.parallel.ep
    if not isinstance(ep, int) or ep == 1:
        return
    if spec is None or spec.experts is None:
        raise PlanError(f"key 'parallel.ep': {spec.name if spec else 'the model'} is dense (no experts to split), so "
                        f"only ep=1 runs; got {ep}")
    experts = spec.experts
    if experts.experts % ep:
        allowed = ", ".join(str(d) for d in range(1, experts.experts + 1) if experts.experts % d == 0)
        raise PlanError(f"key 'parallel.ep': must divide the {experts.experts} routed experts of {spec.name}, got "
                        f"{ep}; allowed: {allowed}")


def _unforced_suggestion(ctx: JobContext, wirings: Wirings, constraints: Constraints, tp_heads: int,
                         result: SearchResult, best: Estimate, spec: ModelSpec | None) -> str:
    """For a forced plan `best` (the result's) that does not fit: the plan that fits without the forced choices, in
    words. ModelTooLarge when none fits at all; PlanError when a forced accumulation sync is
    all that keeps it from fitting."""
    free = search(ctx, wirings, Constraints(allow_compression=constraints.allow_compression), tp_heads) \
        if constraints.forced() else result
    if free.best is None or not free.fits:
        raise ModelTooLarge(too_large(ctx, wirings, free if free.best is not None else result,
                                      f"model {spec.name}" if spec else "the GPT"))
    if constraints.accum_sync is not None:
        relaxed = search(ctx, wirings, replace(constraints, accum_sync=None), tp_heads)
        if relaxed.best is not None and relaxed.fits:
            raise PlanError(forced_accum_does_not_fit(best, relaxed.best, ctx, constraints.accum_sync))
    choice = free.best.choice
    return (f"without the forced choices, {choice.strategy} on {choice.mesh} with micro-batch "
            f"{choice.micro_batch} and recompute {choice.recompute} fits ({_gb(free.best.memory.total)} per rank)")


def _model_summary(ctx: JobContext, spec: ModelSpec | None) -> ModelSummary:
    shape = ctx.shape
    return ModelSummary(params=ctx.params, flops_per_step=model_flops_per_step(shape, ctx.global_batch),
                        peak_tflops_per_rank=ctx.speed.peak_tflops, name=spec.name if spec else "gpt",
                        datasheet_tflops_per_rank=ctx.speed.datasheet_tflops,
                        blocks=shape.layers, block_class=spec.block_class if spec else "Block",
                        tp_plan=shape.tp_capable)


def _compile_plan(cfg: JobConfig, ctx: JobContext, best: Estimate, model: ModelSummary,
                  spec: ModelSpec | None) -> tuple[CompilePlan, list[str]]:
    """Whether the chosen plan's blocks run compiled, and the line saying why a calibration's
    compile figure was not used (empty where it was, or there is none)."""
    gain, gain_note = measured_gain(ctx.calibration, model)
    # The optimizer's share of compute_s is counted with the blocks': a slight overstatement of
    # the saving, which the run's length outweighs or not by far more.
    share = block_share(ctx.shape, ctx.global_batch, str(best.choice.recompute))
    compiled = replace(decide(str(cfg.train.compile), ctx.device, best.compute_s * share, cfg.train.max_steps,
                              spec.graph_break if spec else None, gain, ctx.calibration.source), block_share=share,
                       block_compute_s=best.compute_s * share)
    return compiled, gain_note


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

