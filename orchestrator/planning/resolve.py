"""What really runs: the one statement of how a planned strategy is executed.

A plan names a strategy on a mesh; torch cannot run every combination as named (DDP cannot
reduce DTensor gradients, ZeroRedundancyOptimizer cannot hold DTensor shards, PowerSGD is a
DDP comm hook, gloo has no bf16 reduction, fp16 needs a loss scaler). `resolve` turns the
request into an `Execution` that says what the runtime will do instead, and why. The memory
model, the cost model and the runtime all call it, so what is priced is what runs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from ..choices import AccumSync, Compression, CpAttention, Precision, Recompute, Strategy, SyncAlgorithm
from ..errors import PlanError
from .mesh import Mesh
from .pipeline import Pipeline

DEVICE_KINDS = ("gpu", "cpu")
# torch's PowerSGDState.start_powerSGD_iter: plain all-reduce for the first iterations while
# error feedback settles. Its docs suggest about 10% of training; it must be at least 2 when
# error feedback or warm start is on (both are, by default).
POWERSGD_WARMUP_FRACTION = 0.1
POWERSGD_MIN_WARMUP = 2


class Unsupported(PlanError):
    """The runtime cannot execute this combination at all; the message says why and what would run."""


@dataclass(frozen=True)
class Execution:
    """How the runtime executes a planned strategy on a mesh."""

    # Plans without context parallelism read and write as they did before it had a choice.
    PLAIN_OMIT_AT_DEFAULT: ClassVar[tuple[str, ...]] = ("cp_attention",)

    strategy: Strategy
    """The strategy as planned (what the user asked for or the planner chose)."""
    mesh: Mesh
    device: str
    """`gpu` (NCCL) or `cpu` (gloo): the kind of device the ranks run on."""
    wrapping: Strategy
    """The strategy whose wrapping runs: the planned one, or zero2 (FSDP2 without resharding
    after forward) for ddp and zero1 with tensor parallelism."""
    shard_group: int
    """Ranks each model state is sharded over (1: replicated)."""
    ddp_reduces: bool
    """Gradients are reduced by DistributedDataParallel (buckets, comm hooks); else by FSDP2."""
    zero_optimizer: bool
    """ZeroRedundancyOptimizer shards the optimizer state (zero1 without tensor parallelism)."""
    reshard_after_forward: bool
    """FSDP2 frees gathered weights after each unit's forward (zero3, hsdp)."""
    fsdp_replicates: bool
    """FSDP2 runs on the 2-D (dp_replicate, dp_shard) mesh, replicating across dp_replicate
    (hsdp, and ddp with tensor parallelism); else it shards over all data-parallel ranks."""
    autocast: Precision | None
    """The dtype forward and backward autocast to (bf16 or fp16); None for fp32."""
    param_dtype: Precision
    """The dtype FSDP2 all-gathers weights in (the autocast dtype, torchtitan's policy)."""
    loss_scaling: bool
    """fp16 runs with a GradScaler."""
    sync_algorithm: SyncAlgorithm
    """The data-parallel all-reduce that runs: flat or hierarchical (auto only while the cost
    model still chooses between them)."""
    compression: Compression
    """The gradient compression that runs."""
    compression_warmup_steps: int
    """Optimizer steps of plain all-reduce before PowerSGD starts compressing (0 otherwise)."""
    recompute: Recompute
    bucket_mb: float
    """DDP's bucket_cap_mb (DDP reducers only)."""
    flat_reason: str = ""
    """Why a hierarchical all-reduce cannot run here ("" where it can)."""
    notes: tuple[str, ...] = ()
    """What runs differently from the request, and why (one sentence each)."""
    pipeline: Pipeline | None = None
    """The pipeline that runs over the mesh's pp axis (stage split, schedule, micro-batches);
    None without one."""
    cp_attention: CpAttention = CpAttention.allgather_kv
    """How attention sees the whole sequence under context parallelism (mesh.cp > 1): the K/V
    all-gather or the head all-to-all (Ulysses); the all-gather, unused, at cp=1."""
    reduce_every_micro_step: bool = False
    """Under gradient accumulation, the runtime runs every micro-step with gradient sync on
    (no `no_sync()`), so FSDP2 reduce-scatters after each backward and keeps only sharded
    gradients; False: every micro-step but the last runs inside `no_sync()`, keeping whole
    (DDP) or unsharded (FSDP2) gradients until the last one reduces them. Only an FSDP2
    wrapping without a pipeline is ever True (`SyncPlan.accum_sync`)."""

    @property
    def world_size(self) -> int:
        return self.mesh.world_size


def resolve_precision(precision: Precision | str, device: str) -> Precision | None:
    """The autocast dtype of `train.precision` on a device kind: `auto` is bf16 on GPU and
    fp32 (None) on CPU; an explicit bf16 or fp16 autocasts on CPU too."""
    precision = Precision(precision)
    if device not in DEVICE_KINDS:
        raise ValueError(f"device kind must be one of {', '.join(DEVICE_KINDS)}, got {device!r}")
    if precision == Precision.fp32 or (precision == Precision.auto and device == "cpu"):
        return None
    return Precision.fp16 if precision == Precision.fp16 else Precision.bf16


def wrapping_of(strategy: Strategy | str, tp: int) -> Strategy:
    """The strategy whose wrapping runs: with tensor parallelism DDP cannot reduce DTensor
    gradients and ZeroRedundancyOptimizer cannot hold DTensor shards, so ddp and zero1 run as
    FSDP2 without resharding after forward (zero2's wrapping; ddp's over a shard group of one)."""
    strategy = Strategy(strategy)
    return Strategy.zero2 if tp > 1 and strategy in (Strategy.ddp, Strategy.zero1) else strategy


def accum_sync_of(ex: Execution) -> AccumSync:
    """The accumulation sync `ex` runs, as a choice."""
    return AccumSync.per_micro_step if ex.reduce_every_micro_step else AccumSync.last_micro_step


def powersgd_warmup(max_steps: int) -> int:
    """Steps of plain all-reduce before PowerSGD compresses: about 10% of the run, at least 2."""
    return max(POWERSGD_MIN_WARMUP, round(POWERSGD_WARMUP_FRACTION * max_steps))


def resolve(
    strategy: Strategy | str,
    mesh: Mesh,
    *,
    precision: Precision | str,
    device: str,
    recompute: Recompute | str = Recompute.none,
    compression: Compression | str = Compression.none,
    algorithm: SyncAlgorithm | str = SyncAlgorithm.flat,
    bucket_mb: float = 25.0,
    max_steps: int = 0,
    pipeline: Pipeline | None = None,
    accum_sync: AccumSync | str = AccumSync.last_micro_step,
    cp_attention: CpAttention | str = CpAttention.allgather_kv,
) -> Execution:
    """How `strategy` on `mesh` runs; Unsupported when it cannot run at all.

    `algorithm=auto` stays auto where a hierarchical all-reduce could run (the cost model then
    picks), and becomes flat where it cannot. `max_steps` sizes PowerSGD's warm-up.
    With pp > 1, `pipeline` (from `pipeline.resolve_pipeline`) says how the stages run; FSDP2
    then keeps gathered weights across the micro-batches (torchtitan's default with a
    pipeline: resharding after every micro-batch's forward would all-gather m times).
    `accum_sync=per_micro_step` reduces gradients every micro-step where FSDP2 reduces them
    without a pipeline; elsewhere it runs as `last_micro_step`, with a note.
    """
    if device not in DEVICE_KINDS:
        raise ValueError(f"device kind must be one of {', '.join(DEVICE_KINDS)}, got {device!r}")
    strategy, recompute = Strategy(strategy), Recompute(recompute)
    compression, algorithm, accum_sync = Compression(compression), SyncAlgorithm(algorithm), AccumSync(accum_sync)
    _check_request(strategy, mesh, recompute, compression, accum_sync, bucket_mb, pipeline)
    if mesh.pp == 1:
        pipeline = None
    notes: list[str] = []
    wrapping = _wrapping(strategy, mesh, pipeline, notes)
    ddp_reduces = wrapping in (Strategy.ddp, Strategy.zero1)
    autocast = resolve_precision(precision, device)
    loss_scaling = autocast == Precision.fp16
    _check_loss_scaling(loss_scaling, strategy, mesh)
    compression = _compression(compression, device, ddp_reduces, notes)
    if pipeline is not None and wrapping in (Strategy.zero3, Strategy.hsdp):
        notes.append(f"{strategy} with pp={mesh.pp} keeps gathered weights through the step (no reshard after "
                     f"forward): each of the {pipeline.microbatches} micro-batches would otherwise all-gather them")
    reduce_every = _reduce_every(accum_sync, wrapping, ddp_reduces, pipeline, notes)
    why_flat = _flat_reason(strategy, wrapping, mesh.tp, ddp_reduces, compression)
    if why_flat and algorithm != SyncAlgorithm.flat:
        if algorithm == SyncAlgorithm.hierarchical:
            notes.append(f"hierarchical all-reduce runs flat: {why_flat}")
        algorithm = SyncAlgorithm.flat
    return Execution(
        strategy=strategy, mesh=mesh, device=device, wrapping=wrapping, shard_group=_shard_group(strategy, mesh),
        ddp_reduces=ddp_reduces,
        zero_optimizer=wrapping == Strategy.zero1,
        reshard_after_forward=wrapping in (Strategy.zero3, Strategy.hsdp) and pipeline is None,
        fsdp_replicates=not ddp_reduces and strategy in (Strategy.ddp, Strategy.hsdp),
        autocast=autocast, param_dtype=autocast or Precision.fp32, loss_scaling=loss_scaling,
        sync_algorithm=algorithm, compression=compression,
        compression_warmup_steps=powersgd_warmup(max_steps) if compression == Compression.powersgd else 0,
        recompute=recompute, bucket_mb=float(bucket_mb), flat_reason=why_flat, notes=tuple(notes), pipeline=pipeline,
        reduce_every_micro_step=reduce_every, cp_attention=_cp_attention(cp_attention, mesh),
    )


def _cp_attention(requested: CpAttention | str, mesh: Mesh) -> CpAttention:
    """The context-parallel attention that runs: the requested one under cp > 1 (the planner
    has checked the heads divide), the all-gather, unused, at cp=1."""
    attention = CpAttention(requested)
    if attention == CpAttention.auto:
        raise ValueError("cp_attention=auto is a config value; a plan holds allgather_kv or ulysses")
    return attention if mesh.cp > 1 else CpAttention.allgather_kv


def _check_request(strategy: Strategy, mesh: Mesh, recompute: Recompute, compression: Compression,
                   accum_sync: AccumSync, bucket_mb: float, pipeline: Pipeline | None) -> None:
    """ValueError for a request `resolve` cannot take; Unsupported for ddp asked to shard."""
    if strategy == Strategy.auto or recompute == Recompute.auto or compression == Compression.auto \
            or accum_sync == AccumSync.auto:
        raise ValueError("resolve takes concrete choices; `auto` is the planner's to decide")
    if not bucket_mb > 0:
        raise ValueError(f"bucket_mb must be positive, got {bucket_mb!r}")
    if mesh.pp > 1 and (pipeline is None or pipeline.stages != mesh.pp):
        raise ValueError(f"a mesh with pp={mesh.pp} needs a pipeline of {mesh.pp} stages, got {pipeline}")
    if strategy == Strategy.ddp and mesh.dp_shard > 1:
        raise Unsupported(f"ddp does not shard: dp_shard must be 1, got {mesh.dp_shard} (use hsdp or zero*)")


def _wrapping(strategy: Strategy, mesh: Mesh, pipeline: Pipeline | None, notes: list[str]) -> Strategy:
    """What wraps the model for `strategy` on `mesh`, with a note where that is not the strategy."""
    tp = mesh.tp
    wrapping = wrapping_of(strategy, tp)
    if wrapping != strategy:
        notes.append(f"{strategy} with tp={tp} runs as FSDP2 (zero2's wrapping"
                     + (", nothing sharded)" if strategy == Strategy.ddp else ")")
                     + ": DDP and ZeroRedundancyOptimizer cannot handle DTensor parameters")
    elif pipeline is not None and strategy in (Strategy.ddp, Strategy.zero1):
        # torch's pipeline stages drive FSDP2's gradient sync over the micro-batches (no sync
        # until the last backward, then one reduction); DDP's reducer is prepared at forward
        # time, which a schedule interleaving micro-batches does not fit. torchtitan composes
        # pipelines with FSDP2 only, for the same reason.
        wrapping = Strategy.zero2
        notes.append(f"{strategy} with pp={mesh.pp} runs as FSDP2 (zero2's wrapping"
                     + (", nothing sharded)" if strategy == Strategy.ddp else ")")
                     + ": torch's pipeline stages sync gradients through FSDP2")
    return wrapping


def _shard_group(strategy: Strategy, mesh: Mesh) -> int:
    """Ranks the model states are sharded over (context-parallel ranks join the shard group,
    as FSDP shards over dp_shard x cp)."""
    if strategy == Strategy.ddp:
        return 1
    return (mesh.dp_shard if strategy == Strategy.hsdp else mesh.dp) * mesh.cp


def _check_loss_scaling(loss_scaling: bool, strategy: Strategy, mesh: Mesh) -> None:
    """Unsupported where fp16's loss scaling cannot run (it runs with DDP only)."""
    tp = mesh.tp
    if loss_scaling and mesh.pp > 1:
        raise Unsupported(f"train.precision=fp16 needs loss scaling, which runs with DDP only, not with pp={mesh.pp}; "
                          f"use train.precision=bf16")
    if loss_scaling and not (strategy == Strategy.ddp and tp == 1):
        raise Unsupported(
            f"train.precision=fp16 needs loss scaling, which runs with DDP only (tp=1), not {strategy} with tp={tp}; "
            f"use train.precision=bf16, or parallel.strategy=ddp parallel.tp=1"
        )


def _compression(compression: Compression, device: str, ddp_reduces: bool, notes: list[str]) -> Compression:
    """The gradient compression that runs, with a note where the requested one is skipped."""
    if compression == Compression.bf16 and device == "cpu":
        notes.append("bf16 gradient compression skipped: it needs the NCCL backend, CPU ranks use gloo")
        return Compression.none
    if compression == Compression.powersgd and not ddp_reduces:
        notes.append("powersgd compression skipped: it is a DDP comm hook and FSDP2 reduce-scatters sharded "
                     "gradients, which a low-rank all-reduce cannot express")
        return Compression.none
    return compression


def _reduce_every(accum_sync: AccumSync, wrapping: Strategy, ddp_reduces: bool, pipeline: Pipeline | None,
                  notes: list[str]) -> bool:
    """Whether every micro-step reduces gradients, with a note where a request for it runs as
    `last_micro_step`."""
    if accum_sync != AccumSync.per_micro_step:
        return False
    if ddp_reduces:
        notes.append(f"gradients reduced on the last micro-step only, not every one: {wrapping} keeps whole "
                     "gradients between micro-steps either way, so reducing each would only add traffic")
        return False
    if pipeline is not None:
        notes.append(f"gradients reduced after the last micro-batch only, not every one: torch's pipeline stages "
                     f"keep gradient sync off until the last of the {pipeline.microbatches} micro-batches")
        return False
    return True


def _flat_reason(strategy: Strategy, wrapping: Strategy, tp: int, ddp_reduces: bool, compression: Compression) -> str:
    """Why the gradients' all-reduce can only run flat ('' where a hierarchical one can run)."""
    if not ddp_reduces:
        return ("hsdp's mesh already is the hierarchy (shards inside, replicas across) and FSDP2 has no comm hook "
                "for its replica all-reduce" if wrapping == Strategy.hsdp
                else f"{strategy}" + (f" with tp={tp}" if tp > 1 else "")
                + " reduces gradients through FSDP2, which has no comm hook")
    if wrapping == Strategy.zero1:
        return "zero1 reduce-scatters and all-gathers in flat rings"
    if compression == Compression.powersgd:
        return "powersgd compression is its own all-reduce scheme"
    return ""


def on_device(ex: Execution, device: str, precision: Precision | str, requested: Compression | str,
              max_steps: int) -> Execution:
    """`ex` resolved again for the device kind a rank really got (a rank that Ray gave a GPU
    but that has no CUDA runs on CPU with gloo); `ex` itself when the kind is the planned one."""
    if device == ex.device:
        return ex
    again = resolve(ex.strategy, ex.mesh, precision=precision, device=device, recompute=ex.recompute,
                    compression=requested, algorithm=ex.sync_algorithm, bucket_mb=ex.bucket_mb, max_steps=max_steps,
                    pipeline=ex.pipeline, accum_sync=accum_sync_of(ex), cp_attention=ex.cp_attention)
    return replace(again, notes=again.notes + (f"planned for {ex.device} ranks, running on {device}",))
