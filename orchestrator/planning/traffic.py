"""The collectives one rank of a plan issues in a step, as the cost model understands them.

Read off the same quantities `cost.estimate` prices (parameters per rank, the wire bytes per
gradient, FSDP2's units, DDP's buckets, the pipeline's micro-batches and chunk boundaries,
tensor parallelism's all-reduces per block), so that a rehearsal that finds other collectives
has found a gap in the planner, not in this module.

Bytes follow one convention: the largest buffer of each call as the rank hands it to torch
(all_gather: the output; reduce_scatter: the input; all_reduce, broadcast, send, recv: the
tensor; all_to_all: the rows the rank sends, at balance). Axes are the mesh's names; `dp` is
the flattened dp_replicate x dp_shard group, `dp_shard_cp` the FSDP group context parallelism
joins, `ep` and `efsdp` the expert mesh's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..choices import CpAttention, Strategy
from ..serialize import to_plain
from .activations import kv_heads_and_width, routed_rows, ulysses_tensor_bytes
from .cost import JobContext, ties_head, tp_all_reduces_per_micro_batch
from .memory import moe_blocks_of, params_per_tp_rank
from .model_math import root_params, routed_params_per_block
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


class _Tally:
    """Calls and bytes per (op, axis), summed as the step issues them."""

    def __init__(self) -> None:
        self.totals: dict[tuple[str, str], list[float]] = {}

    def add(self, op: str, axis: str, count: float, nbytes: float) -> None:
        if count <= 0:
            return
        entry = self.totals.setdefault((op, axis), [0, 0.0])
        entry[0] += count
        entry[1] += nbytes

    def traffic(self) -> tuple[Traffic, ...]:
        return tuple(Traffic(op, axis, int(count), int(round(nbytes)))
                     for (op, axis), (count, nbytes) in sorted(self.totals.items()))


def predicted_traffic(ctx: JobContext, plan: Plan, rank: int = 0) -> tuple[Traffic, ...]:
    """What the cost model has global `rank` send in one step of `plan`, by (op, axis)."""
    shape, pipeline = ctx.shape, plan.execution.pipeline
    stage = stage_of(plan, rank)
    share = stage_share(shape, pipeline, stage) if pipeline else None
    whole = params_per_tp_rank(shape, plan.mesh.tp)
    per_block = (whole - root_params(shape)) / shape.layers
    params_per_rank = share.blocks * per_block + share.root if share else whole
    blocks = share.blocks if share else shape.layers
    tally = _Tally()
    _model_parallel_traffic(tally, ctx, plan, stage, blocks)
    _gradient_traffic(tally, ctx, plan, params_per_rank, blocks)
    _context_and_expert_traffic(tally, ctx, plan, blocks, moe_blocks_of(shape, share))
    return tally.traffic()


def _context_and_expert_traffic(tally: _Tally, ctx: JobContext, plan: Plan, blocks: int, moe_blocks: float) -> None:
    """The K/V all-gathers and their gradients' reduce-scatters of context parallelism (one of
    each per attention layer and micro-batch, the gather again where attention is recomputed),
    or its Ulysses all-to-alls (q, k, v and the output, forward and backward, the forward
    four again where attention is recomputed),
    the expert all-to-alls (dispatch and combine, forward, backward and again under full
    recomputation) and the experts' own FSDP2 gathers and reduce-scatters over efsdp."""
    shape, mesh, accum = ctx.shape, plan.mesh, plan.sync.grad_accum_steps
    if mesh.cp > 1 and plan.execution.cp_attention == CpAttention.ulysses:
        q, kv = ulysses_tensor_bytes(shape, plan.micro_batch_size, mesh.tp, mesh.cp, ctx.layout.activation)
        passes = accum * blocks * (2 if str(plan.recompute) == "none" else 3)
        tally.add("all_to_all", "cp", 4 * passes, passes * (2 * q + 2 * kv))
    elif mesh.cp > 1:
        kv, width = kv_heads_and_width(shape)
        gathered = 2 * plan.micro_batch_size * shape.seq * kv * width * ctx.layout.activation
        # K and V are gathered, and their gradients reduce-scattered, one call each.
        gathers = accum * blocks * (1 if str(plan.recompute) == "none" else 2)
        tally.add("all_gather", "cp", 2 * gathers, gathers * gathered)
        tally.add("reduce_scatter", "cp", 2 * accum * blocks, accum * blocks * gathered)
    if not moe_blocks:
        return
    if mesh.ep > 1:
        sent = routed_rows(shape, plan.micro_batch_size, mesh.cp, mesh.tp) * shape.hidden * ctx.layout.activation
        calls = accum * moe_blocks * (6 if str(plan.recompute) == "full" else 4)
        tally.add("all_to_all", "ep", calls, calls * sent)
    runs = plan.execution
    if mesh.efsdp > 1 and not runs.ddp_reduces:
        local = routed_params_per_block(shape) / mesh.ep
        expert_gathers = moe_blocks * (2 * accum if runs.reshard_after_forward else 1)
        expert_syncs = moe_blocks * (accum if runs.reduce_every_micro_step else 1)
        grad_wire = wire_bytes_per_grad(runs.compression, ctx.layout.grads, ctx.powersgd_ratio, 0.0)
        tally.add("all_gather", "efsdp", expert_gathers, expert_gathers * local * ctx.layout.compute)
        tally.add("reduce_scatter", "efsdp", expert_syncs, expert_syncs * local * grad_wire)


def _model_parallel_traffic(tally: _Tally, ctx: JobContext, plan: Plan, stage: int, blocks: int) -> None:
    """The tensor-parallel all-reduces and the pipeline's point-to-point sends of `stage`."""
    shape, pipeline = ctx.shape, plan.execution.pipeline
    activation = plan.micro_batch_size * shape.seq * shape.hidden * ctx.layout.activation
    if plan.mesh.tp > 1:
        calls = plan.sync.grad_accum_steps * blocks * tp_all_reduces_per_micro_batch(shape, plan.recompute)
        tally.add("all_reduce", "tp", calls, calls * activation)
    if not pipeline:
        return
    # Each micro-batch crosses every chunk boundary: forward its activation, backward its
    # gradient, each a send on one side and a receive on the other.
    last, microbatches = pipeline.chunks - 1, pipeline.microbatches
    for chunk in pipeline.chunks_of(stage):
        if chunk < last:
            tally.add("send", "pp", microbatches, microbatches * activation)  # activation forward
            tally.add("recv", "pp", microbatches, microbatches * activation)  # its gradient back
        if chunk > 0:
            tally.add("recv", "pp", microbatches, microbatches * activation)
            tally.add("send", "pp", microbatches, microbatches * activation)
    if ties_head(shape) and stage in (0, pipeline.stages - 1) and pipeline.stages > 1:
        tied = shape.vocab * shape.hidden * ctx.layout.grads / plan.execution.shard_group
        tally.add("send", "pp", 1, tied)
        tally.add("recv", "pp", 1, tied)


def _gradient_traffic(tally: _Tally, ctx: JobContext, plan: Plan, params_per_rank: float, blocks: int) -> None:
    """The data-parallel gradient sync: DDP's bucketed all-reduce (and ZeRO-1's broadcasts), or
    FSDP2's per-unit gathers and reduce-scatters (and HSDP's replica all-reduce)."""
    runs, mesh, layout = plan.execution, plan.mesh, ctx.layout
    accum = plan.sync.grad_accum_steps
    grad_wire = wire_bytes_per_grad(runs.compression, layout.grads, ctx.powersgd_ratio,
                                    runs.compression_warmup_steps / ctx.max_steps if ctx.max_steps else 0.0)
    grad_bytes = params_per_rank * grad_wire
    syncs = accum if getattr(runs, "reduce_every_micro_step", False) else 1
    if runs.ddp_reduces:
        axis = dp_axis(plan)
        if mesh.dp > 1:
            buckets = max(1, math.ceil(grad_bytes / (plan.sync.bucket_mb * MB)))
            tally.add("all_reduce", axis, syncs * buckets, syncs * grad_bytes)
            if runs.wrapping == Strategy.zero1:
                # ZeroRedundancyOptimizer: each rank broadcasts its partition, one bucket.
                tally.add("broadcast", axis, mesh.dp, params_per_rank * layout.weights)
        return
    axis = "dp_shard" if runs.fsdp_replicates else dp_axis(plan)
    if mesh.cp > 1:
        # FSDP shards over dp_shard x cp (torchtitan's flattened name), over cp alone without dp_shard.
        axis = "dp_shard_cp" if mesh.dp_shard > 1 else "cp"
    units = blocks + 1  # FSDP2 unit per block, and the root's own parameters
    if runs.shard_group > 1:
        gather = params_per_rank * layout.compute
        gathers = 1 if not runs.reshard_after_forward else 2 * accum
        tally.add("all_gather", axis, gathers * units, gathers * gather)
        tally.add("reduce_scatter", axis, syncs * units, syncs * grad_bytes)
    if runs.fsdp_replicates and mesh.dp_replicate > 1:
        tally.add("all_reduce", "dp_replicate", syncs * units, syncs * grad_bytes / runs.shard_group)

