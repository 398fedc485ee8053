"""The named choices a job makes, declared once.

The config validates them (OmegaConf matches a YAML value to a member's name), the planner
searches over them and the runtime applies them. `auto` is a config value only: it leaves the
choice to the planner, and no plan ever holds it. Members are `str`s, so they compare equal
to, print as and serialise to their plain names.
"""

from __future__ import annotations

from enum import Enum
from typing import TypeVar

Member = TypeVar("Member", bound="Choice")


class Choice(str, Enum):
    """A str-valued enum that prints as its value (`ddp`, not `Strategy.ddp`)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @classmethod
    def _missing_(cls, value: object) -> "Choice | None":
        # By name too, so an alias such as Strategy("fsdp") means what parallel.strategy=fsdp does.
        return cls.__members__.get(value) if isinstance(value, str) else None

    @classmethod
    def concrete(cls: type[Member]) -> tuple[Member, ...]:
        """Every member a plan may hold (all but `auto`), in declaration order."""
        return tuple(m for m in cls if m.value != "auto")

    @classmethod
    def names(cls) -> str:
        """The allowed config values, for messages."""
        return ", ".join(cls.__members__)


class Strategy(Choice):
    """How model states are replicated or sharded over the data-parallel ranks."""

    auto = "auto"
    ddp = "ddp"
    zero1 = "zero1"
    zero2 = "zero2"
    zero3 = "zero3"
    fsdp = "zero3"  # an alias: FSDP's full sharding is ZeRO-3
    hsdp = "hsdp"


class Precision(Choice):
    """`auto` is bf16 autocast on GPU and fp32 on CPU."""

    auto = "auto"
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


class Recompute(Choice):
    """Activation recomputation: none, the attention of every block, or whole blocks."""

    auto = "auto"
    none = "none"
    selective = "selective"
    full = "full"


class PipelineSchedule(Choice):
    """How a pipeline orders its micro-batches' forward and backward passes
    (torch.distributed.pipelining's schedules)."""

    auto = "auto"
    gpipe = "gpipe"
    one_f_one_b = "1f1b"
    interleaved_1f1b = "interleaved_1f1b"
    zero_bubble = "zero_bubble"


class Compression(Choice):
    """Gradient compression on the wire."""

    auto = "auto"
    none = "none"
    fp16 = "fp16"
    bf16 = "bf16"
    powersgd = "powersgd"


class SyncAlgorithm(Choice):
    """The data-parallel all-reduce: one ring or tree through every rank, or intra-node
    reduce-scatter, inter-node all-reduce, intra-node all-gather."""

    auto = "auto"
    flat = "flat"
    hierarchical = "hierarchical"


class AccumSync(Choice):
    """When FSDP2 reduces gradients under gradient accumulation: `per_micro_step`
    reduce-scatters after every micro-step's backward and keeps only sharded gradients;
    `last_micro_step` keeps every unsharded gradient until the last micro-step and reduces
    once. DDP, ZeRO-1 and pipelines always run `last_micro_step`."""

    auto = "auto"
    per_micro_step = "per_micro_step"
    last_micro_step = "last_micro_step"


class CpAttention(Choice):
    """How attention sees the whole sequence under context parallelism (cp > 1):
    `allgather_kv` all-gathers K and V over the cp group (any head count; what it moves grows
    with cp); `ulysses` trades sequence for heads with all-to-alls (DeepSpeed-Ulysses: what it
    moves stays (cp-1)/cp of a rank's q, k, v and output at any cp), where the rank's attention
    heads divide by cp."""

    auto = "auto"
    allgather_kv = "allgather_kv"
    ulysses = "ulysses"
