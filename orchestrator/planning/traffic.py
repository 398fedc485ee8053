"""The collectives one rank of a plan issues in a step, as the cost model understands them.

Read off the same quantities `cost.estimate` prices (parameters per rank, the wire bytes per
gradient, FSDP2's units, DDP's buckets, the pipeline's micro-batches and chunk boundaries,
tensor parallelism's all-reduces per block), so that a rehearsal that finds other collectives
has found a gap in the planner, not in this module.

Bytes follow one convention: the largest buffer of each call as the rank hands it to torch
(all_gather: the output; reduce_scatter: the input; all_reduce, broadcast, send, recv: the
tensor). Axes are the mesh's names; `dp` is the flattened dp_replicate x dp_shard group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..choices import Strategy
from ..serialize import to_plain
from .cost import JobContext, ties_head, tp_all_reduces_per_micro_batch
from .memory import params_per_tp_rank
from .model_math import root_params
from .pipeline import stage_share
from .plan import Plan
from .sync import MB, wire_bytes_per_grad


@dataclass(frozen=True)
class Traffic:
    """Collectives of one kind on one axis that a rank issues in one optimizer step."""

    op: str
    """all_reduce, all_gather, reduce_scatter, send or recv."""
    axis: str
    """The mesh axis of the group (pp, dp_replicate, dp_shard, tp), or `dp`."""
    count: int
    """Calls per step."""
    bytes: int
    """Bytes per step, by the module's convention."""

    def to_dict(self) -> dict:
        return to_plain(self)


def dp_axis(plan: Plan) -> str:
    """The name of the group of all data-parallel ranks (the runtime's `_dp_mesh`)."""
    m = plan.mesh
    if m.dp_shard == 1:
        return "dp_replicate"
    return "dp_shard" if m.dp_replicate == 1 else "dp"


def stage_of(plan: Plan, rank: int) -> int:
    return rank // (plan.world_size // plan.mesh.pp)


def predicted_traffic(ctx: JobContext, plan: Plan, rank: int = 0) -> tuple[Traffic, ...]:
    """What the cost model has global `rank` send in one step of `plan`, by (op, axis)."""
    shape, lay, ex = ctx.shape, ctx.layout, plan.execution
    mesh, pl = plan.mesh, ex.pipeline
    tp = mesh.tp
    accum = plan.sync.grad_accum_steps
    stage = stage_of(plan, rank)
    share = stage_share(shape, pl, stage) if pl else None
    p_whole = params_per_tp_rank(shape, tp)
    per_block = (p_whole - root_params(shape)) / shape.layers
    p_rank = share.blocks * per_block + share.root if share else p_whole
    blocks = share.blocks if share else shape.layers
    act = plan.micro_batch_size * shape.seq * shape.hidden * lay.activation
    out: dict[tuple[str, str], list[float]] = {}

    def add(op: str, axis: str, count: float, nbytes: float) -> None:
        if count <= 0:
            return
        entry = out.setdefault((op, axis), [0, 0.0])
        entry[0] += count
        entry[1] += nbytes

    if tp > 1:
        calls = accum * blocks * tp_all_reduces_per_micro_batch(shape, plan.recompute)
        add("all_reduce", "tp", calls, calls * act)
    if pl:
        # Each micro-batch crosses every chunk boundary: forward its activation, backward its
        # gradient, each a send on one side and a receive on the other.
        last = pl.chunks - 1
        for c in pl.chunks_of(stage):
            if c < last:
                add("send", "pp", pl.microbatches, pl.microbatches * act)  # activation forward
                add("recv", "pp", pl.microbatches, pl.microbatches * act)  # its gradient back
            if c > 0:
                add("recv", "pp", pl.microbatches, pl.microbatches * act)
                add("send", "pp", pl.microbatches, pl.microbatches * act)
        if ties_head(shape) and stage in (0, pl.stages - 1) and pl.stages > 1:
            tied = shape.vocab * shape.hidden * lay.grads / ex.shard_group
            add("send", "pp", 1, tied)
            add("recv", "pp", 1, tied)

    grad_wire = wire_bytes_per_grad(ex.compression, lay.grads, ctx.powersgd_ratio,
                                    ex.compression_warmup_steps / ctx.max_steps if ctx.max_steps else 0.0)
    grad_bytes = p_rank * grad_wire
    syncs = accum if getattr(ex, "reduce_every_micro_step", False) else 1
    if ex.ddp_reduces:
        axis = dp_axis(plan)
        if mesh.dp > 1:
            buckets = max(1, math.ceil(grad_bytes / (plan.sync.bucket_mb * MB)))
            add("all_reduce", axis, syncs * buckets, syncs * grad_bytes)
            if ex.wrapping == Strategy.zero1:
                # ZeroRedundancyOptimizer: each rank broadcasts its partition, one bucket.
                add("broadcast", axis, mesh.dp, p_rank * lay.weights)
    else:
        axis = "dp_shard" if ex.fsdp_replicates else dp_axis(plan)
        units = blocks + 1  # FSDP2 unit per block, and the root's own parameters
        if ex.shard_group > 1:
            gather = p_rank * lay.compute
            gathers = 1 if not ex.reshard_after_forward else 2 * accum
            add("all_gather", axis, gathers * units, gathers * gather)
            add("reduce_scatter", axis, syncs * units, syncs * grad_bytes)
        if ex.fsdp_replicates and mesh.dp_replicate > 1:
            add("all_reduce", "dp_replicate", syncs * units, syncs * grad_bytes / ex.shard_group)
    return tuple(Traffic(op, axis, int(n), int(round(b))) for (op, axis), (n, b) in sorted(out.items()))

