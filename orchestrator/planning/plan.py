"""The plan: what the runtime builds (mesh, rank placement, sync) and why.

`flow.plan_job(cfg, topology)` makes one, deterministically: the same job and topology give
the same plan; `explain.py` words it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..choices import Compression, CpAttention, Recompute, Strategy
from ..serialize import from_plain, to_plain
from ..units import format_bytes
from .cluster_view import LeftOut
from .compile import EAGER, CompilePlan
from .memory import MemoryBreakdown
from .mesh import Mesh, RankPlacement
from .resolve import Execution, accum_sync_of
from .sync import SyncPlan


@dataclass(frozen=True)
class ModelSummary:
    """The model as the planner priced it."""

    params: int
    """Distinct parameters."""
    flops_per_step: float
    """Model FLOPs of one optimizer step (MFU's numerator)."""
    peak_tflops_per_rank: float
    """The device peak the compute model used (a measured matmul rate where the probe took one)."""
    name: str = "gpt"
    """The model's factory (`module:callable`) or architecture; `gpt` for the built-in GPT."""
    blocks: int = 0
    """Repeated blocks (the unit of FSDP wrapping and activation checkpointing)."""
    block_class: str = "Block"
    """Class name of the repeated block."""
    tp_plan: bool = True
    """Whether the model declares a tensor-parallel plan (without one the plan keeps tp=1)."""
    datasheet_tflops_per_rank: float = 0.0
    """The device's datasheet peak, which MFU is measured against; 0 where it is
    `peak_tflops_per_rank` itself (a device planned from its table figure, or a CPU slot)."""

    PLAIN_OMIT_AT_DEFAULT: ClassVar[tuple[str, ...]] = ("datasheet_tflops_per_rank",)
    """A plan whose peak is the datasheet's reads as before."""

    @property
    def mfu_peak_tflops_per_rank(self) -> float:
        """What MFU divides by: the datasheet's peak, not a measured rate that would flatter it."""
        return self.datasheet_tflops_per_rank or self.peak_tflops_per_rank

    def to_dict(self) -> dict[str, Any]:
        return to_plain(self)


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
        return to_plain(self)


@dataclass(frozen=True)
class Alternative:
    """A runner-up or a rejected candidate, and why it was not chosen."""

    strategy: Strategy
    mesh: Mesh
    micro_batch_size: int | None = None
    recompute: Recompute | None = None
    compression: Compression | None = None
    # Keyword-only, so that the fields keep the order plan.json lists them in.
    fits: bool = field(kw_only=True)
    reason: str = field(kw_only=True)
    step_time_s: float | None = None
    """Predicted step time; None for a candidate that could not be estimated."""
    memory_per_rank: int | None = None
    cp_attention: CpAttention | None = None
    """How its attention sees the whole sequence (`parallel.cp_attention`), for a candidate with
    cp > 1 that was estimated; None otherwise."""

    # Written only where set, so plans without context parallelism read as before.
    PLAIN_OMIT_AT_DEFAULT: ClassVar[tuple[str, ...]] = ("cp_attention",)

    def to_dict(self) -> dict[str, Any]:
        return to_plain(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Alternative":
        return from_plain(cls, d)


@dataclass(frozen=True)
class Plan:
    """How a job runs on a cluster. The runtime receives this object itself; `to_dict()` is
    the JSON contract of plan.json and `plan --json`. What runs (strategy, mesh,
    recomputation, bucket, all-reduce schedule, compression) has one home, `execution`; the
    plan's own names for them read it."""

    model: ModelSummary
    ranks: tuple[RankPlacement, ...]
    """Where every global rank runs, in rank order."""
    memory_per_rank: MemoryBreakdown
    """Predicted peak bytes of one rank."""
    fits: bool
    """Whether memory_per_rank.total fits the usable memory of every rank."""
    reason: str
    """One line: why this plan (or why it does not fit)."""
    step_time: StepTime
    execution: Execution
    """What really runs (`resolve`): wrapping, precision, sync and compression schedule."""
    micro_batch_size: int
    """Sequences per rank per forward/backward."""
    grad_accum_steps: int
    """Micro-steps per optimizer step."""
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

    @property
    def strategy(self) -> Strategy:
        """`ddp`, `zero1`, `zero2`, `zero3` or `hsdp`."""
        return self.execution.strategy

    @property
    def mesh(self) -> Mesh:
        return self.execution.mesh

    @property
    def recompute(self) -> Recompute:
        return self.execution.recompute

    @property
    def sync(self) -> SyncPlan:
        """How gradients are reduced, read off `execution` (overlap is off on CPU slots, where
        gloo shares the cores with compute)."""
        runs = self.execution
        return SyncPlan(bucket_mb=runs.bucket_mb, algorithm=runs.sync_algorithm, compression=runs.compression,
                        grad_accum_steps=self.grad_accum_steps, overlap=runs.device == "gpu",
                        accum_sync=accum_sync_of(runs))

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
        plain = to_plain(self)
        return {
            "model": plain["model"],
            "strategy": str(self.strategy),
            "mesh": self.mesh.to_dict(),
            "ranks": plain["ranks"],
            "groups": self.groups,
            "memory_per_rank": plain["memory_per_rank"],
            "fits": self.fits,
            "reason": self.reason,
            "step_time": plain["step_time"],
            "sync": self.sync.to_dict(),
            "execution": plain["execution"],
            "alternatives": plain["alternatives"],
            "micro_batch_size": self.micro_batch_size,
            "recompute": str(self.recompute),
            "world_size": self.world_size,
            "explanation": plain["explanation"],
            "left_out": plain["left_out"],
            "compile": plain["compile"],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        """The plan `to_dict` wrote. Its derived keys must agree with the execution they are
        read from (files written before they were derived kept them equal by a check). What a
        file holds beside the plan (a run's plan.json its `trial`, `plan --json --rehearse` its
        `rehearsal`) is not the plan's and is left unread."""
        sync = SyncPlan.from_dict(d["sync"])
        own = {spec.name for spec in dataclasses.fields(cls) if spec.init}
        fields = {k: v for k, v in d.items() if k in own and k not in DERIVED_KEYS}
        plan = from_plain(cls, {**fields, "grad_accum_steps": sync.grad_accum_steps})
        stated = (Strategy(d["strategy"]), Mesh.from_dict(d["mesh"]), Recompute(d["recompute"]), sync)
        if stated != (plan.strategy, plan.mesh, plan.recompute, plan.sync):
            raise ValueError(f"plan.json says {stated[0]} on {stated[1]}, recompute {stated[2]}, sync {stated[3]}; "
                             f"its execution runs {plan.strategy} on {plan.mesh}, recompute {plan.recompute}, "
                             f"sync {plan.sync}")
        return plan


DERIVED_KEYS = ("strategy", "mesh", "groups", "sync", "recompute", "world_size")
"""The keys of plan.json that `Plan` derives from its fields rather than holds."""


def _gb(x: float) -> str:
    return format_bytes(x)

