"""Plan against rehearsal: what the planner predicts for a rehearsed rank, and where they differ.

Pure: the rehearsal's measurements arrive as plain numbers (`runtime/rehearse.py` takes them),
the predictions come from the memory model and `traffic`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..serialize import to_plain
from .cost import JobContext, held_grad_bytes
from .memory import GPU_WORKSPACE_BYTES, rank_memory
from .pipeline import stage_share
from .plan import Plan
from .sync import MB
from .traffic import Traffic, stage_of

MEMORY_TOLERANCE = 0.10
"""Relative difference of peak memory above which plan and rehearsal are said to differ."""
BYTES_TOLERANCE = 0.10
"""Relative difference of a collective's bytes per step above which they are said to differ."""
NEGLIGIBLE_BYTES = 1 * MB
"""Collectives under this many bytes a step on both sides (a gradient norm, the loss) are
shown but never called a difference: the planner does not price scalars."""


def predicted_peak_bytes(ctx: JobContext, plan: Plan, rank: int) -> int:
    """The memory model's peak for `rank`'s stage, less the GPU workspace allowance (NCCL and
    cuBLAS buffers outside torch's allocator, which no rehearsal sees)."""
    ex, pl = plan.execution, plan.execution.pipeline
    wrapping = ex.wrapping if pl else plan.strategy
    bucket = plan.sync.bucket_mb * MB if ex.ddp_reduces else 0.0
    held = held_grad_bytes(ex, ctx.layout, plan.sync.grad_accum_steps)
    stage = stage_of(plan, rank)
    mesh = plan.mesh
    m = rank_memory(wrapping, ctx.shape, mesh.tp, ex.shard_group, plan.micro_batch_size, plan.recompute,
                    ctx.layout, bucket, ctx.on_gpu, share=stage_share(ctx.shape, pl, stage) if pl else None,
                    held_grad_bytes=held, micro_steps=pl.microbatches if pl else plan.sync.grad_accum_steps,
                    cp=mesh.cp, ep=mesh.ep, efsdp=mesh.efsdp, cp_attention=ex.cp_attention)
    return m.total - (GPU_WORKSPACE_BYTES if ctx.on_gpu else 0)


@dataclass(frozen=True)
class CollectiveRow:
    """One (op, axis) of a rank's step: rehearsed and predicted."""

    op: str
    axis: str
    count: int
    """Calls the rehearsed rank issued (0: predicted only)."""
    bytes: int
    predicted_count: int
    """Calls the planner expects (0: rehearsed only)."""
    predicted_bytes: int

    @property
    def differs(self) -> bool:
        if max(self.bytes, self.predicted_bytes) < NEGLIGIBLE_BYTES:
            return False
        return relative_gap(self.bytes, self.predicted_bytes) > BYTES_TOLERANCE

    def to_dict(self) -> dict:
        return to_plain(self)


def relative_gap(measured: float, predicted: float) -> float:
    """|predicted - measured| / measured (inf when only one of them is zero)."""
    if measured == predicted:
        return 0.0
    return abs(predicted - measured) / measured if measured else float("inf")


def collective_rows(measured: list[tuple[str, str, int, int]], predicted: tuple[Traffic, ...]) -> list[CollectiveRow]:
    """Rehearsed (op, axis, count, bytes) beside the prediction, one row per (op, axis) of either."""
    got = {(op, axis): (n, b) for op, axis, n, b in measured}
    want = {(t.op, t.axis): (t.count, t.bytes) for t in predicted}
    return [CollectiveRow(op, axis, *got.get((op, axis), (0, 0)), *want.get((op, axis), (0, 0)))
            for op, axis in sorted(set(got) | set(want))]
