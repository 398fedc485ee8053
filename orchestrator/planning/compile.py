"""Whether the run compiles its blocks with `torch.compile`, priced against the run's length.

Compilation is per block class, as torchtitan does it: every repeated block is compiled in
place, and blocks of one class share one compiled graph, so the cost is paid once per class
(forward and backward), not per layer. What it buys is a faster block: the embeddings, head,
loss, optimizer and every collective run as before. `auto` compiles when the seconds saved
over the run's steps are at least twice the seconds compiling takes (`AUTO_MARGIN`): priced from
the device's table, or from what a compiled run of the same model measured on this cluster (a
calibration).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..errors import PlanError
from ..serialize import from_plain, to_plain
from .calibration import CompileGain

COMPILE_SPEEDUP = {"gpu": 6667 / 5762, "cpu": 1.0}
"""A block's eager time over its compiled time. gpu: torchtitan's Llama 3 8B on 8 H100s
(FSDP2, bf16, per-block compile), 5,762 -> 6,667 tokens/s per GPU; measured on the whole step,
so it understates the blocks' own gain. cpu: priced at no gain, because what compiling gains
there depends on the block more than any one figure can say. The blocks' matmuls are MKL's
either way, and compiling fuses only what lies between them. The default job's GPT block
gained 1.03x alone and 1.02x in the runtime's whole step (benchmarks/compile_gain.py), and
0.94x-1.01x across whole `submit` launches. The built-in Llama's (RMSNorm, SwiGLU, rotary)
gained 1.10x under zero3 (benchmarks/runtime_overhead.py). With no gain priced, `auto` never
spends a compile on a CPU run that would not pay for it; `train.compile=true` takes the gain
where a user knows it is there, and measures it: a later plan of the same model prices `auto`
with that run's figures instead (`parallel.calibration`, `calibration.CompileGain`)."""

COMPILE_S = {"gpu": 13.1, "cpu": 13.1}
"""Seconds to compile one block class's forward and backward from a cold cache (a warm cache on
the same node: 2.3 s). cpu: the default job's GPT block with inductor's C++ backend
(benchmarks/compile_gain.py, results/compile.json). gpu: not measured yet (the GPU check
measures it where a GPU is lent); the CPU figure stands in."""

AUTO_MARGIN = 2.0
"""`auto` compiles only when the run saves this many times what compiling costs. The gain a few
timed passes measure spreads around what the steps then gain: the built-in Llama under zero3
measured its blocks 1.07x-1.11x faster compiled in three launches whose steps then ran
1.04x-1.09x faster, and 1.04x-1.05x in two whose steps ran 1.08x-1.11x faster
(benchmarks/runtime_overhead.py), so a run priced to just pay could end behind eager. At twice
the cost, a saving overstated by half still pays."""

CHOICES = ("auto", "true", "false")


@dataclass(frozen=True)
class CompilePlan:
    """Whether the blocks run compiled, and why."""

    enabled: bool
    """The runtime compiles every repeated block (`Module.compile`, fullgraph)."""
    requested: str
    """`train.compile`: auto, true or false."""
    compile_s: float
    """Predicted seconds of compilation (cold cache; a warm one takes a fraction of it)."""
    saving_s_per_step: float
    """Predicted seconds each optimizer step saves compiled (0 where nothing compiles)."""
    steps: int
    """Optimizer steps the saving is counted over (the run's max_steps)."""
    reason: str
    """One line: why the blocks run compiled or eager."""
    block_share: float = 1.0
    """The share of a step's compute in the repeated blocks: what compiling speeds up (from a
    whole pass timed both ways, the blocks' own speedup follows)."""
    measured: bool = False
    """Priced from a gain this model's compiled run measured (a calibration): the runtime then
    compiles without timing the gain again, which would cost the run a dozen passes."""
    block_compute_s: float = 0.0
    """The predicted seconds per step the blocks take eager on one rank: what a saving a run
    measures is a speedup of (`calibration.speedup_from_saving`), so that a later plan of the
    same step prices that very saving back."""

    def to_dict(self) -> dict[str, Any]:
        return to_plain(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CompilePlan":
        return from_plain(cls, d)


EAGER = CompilePlan(enabled=False, requested="false", compile_s=0.0, saving_s_per_step=0.0, steps=0,
                    reason="blocks run eager: train.compile=false")


def block_saving_s(block_compute_s: float, speedup: float) -> float:
    """Seconds a step saves when blocks that take `block_compute_s` eager run `speedup` times
    faster compiled (negative where compiled ran slower)."""
    return block_compute_s * (1.0 - 1.0 / speedup)


def decide(requested: str, device: str, block_compute_s: float, steps: int,
           graph_break: str | None = None, measured: CompileGain | None = None, source: str = "") -> CompilePlan:
    """Compile or not. `block_compute_s`: the predicted seconds per optimizer step the blocks'
    forward and backward take on one rank (recomputation included); `graph_break`: where the
    block first breaks the graph: a block that does not compile as one graph runs eager under
    `auto`, and is refused (PlanError naming the key) under `true`. `measured`: what compiling
    this model's blocks bought on this cluster (a calibration from the run in `source`), priced
    instead of the device's table figures."""
    if requested not in CHOICES:
        raise ValueError(f"train.compile must be one of {', '.join(CHOICES)}, got {requested!r}")
    if device not in COMPILE_SPEEDUP:
        raise ValueError(f"device kind must be one of {', '.join(COMPILE_SPEEDUP)}, got {device!r}")
    if requested == "false":
        return EAGER
    # One block class (the repeated block list): one graph, one compile.
    speedup, cost = (measured.speedup, measured.compile_s) if measured else (COMPILE_SPEEDUP[device], COMPILE_S[device])
    per_step = block_saving_s(block_compute_s, speedup)
    saved = per_step * steps
    where = f" (blocks {speedup:.2f}x as fast compiled, measured in {source or 'a calibration'})" if measured else ""
    if per_step > 0:
        priced = (f"compiling costs about {cost:.1f} s once and saves {per_step * 1e3:.2f} ms per step, "
                  f"{saved:.0f} s over {steps} steps{where}")
    elif measured:
        priced = (f"compiled blocks ran {speedup:.2f}x as fast as eager in {source or 'a calibration'}: "
                  f"compiling saves nothing")
    else:
        priced = f"compiling costs about {cost:.1f} s once and saves nothing measurable on {device} ranks"
    if graph_break is not None and requested == "true":
        raise PlanError(f"key 'train.compile': true, but the block does not compile as one graph ({graph_break}); "
                        f"use train.compile=auto or false, or make the block traceable")
    if graph_break is not None:
        return CompilePlan(enabled=False, requested=requested, compile_s=0.0, saving_s_per_step=0.0, steps=steps,
                           reason=f"blocks run eager: the block does not compile as one graph ({graph_break})")
    if requested == "true":
        return CompilePlan(enabled=True, requested=requested, compile_s=cost, saving_s_per_step=per_step,
                           steps=steps, reason=f"blocks compiled, as train.compile=true asks: {priced}",
                           measured=measured is not None)
    enabled = saved >= AUTO_MARGIN * cost
    verdict = "blocks compiled" if enabled else "blocks run eager"
    longer = (f"; it compiles where a run saves {AUTO_MARGIN:g}x what compiling costs, "
              f"{math.ceil(AUTO_MARGIN * cost / per_step)} steps or more" if per_step > 0 and not enabled else "")
    return CompilePlan(enabled=enabled, requested=requested, compile_s=cost if enabled else 0.0,
                       saving_s_per_step=per_step if enabled else 0.0, steps=steps,
                       reason=f"{verdict}: {priced}{longer}", measured=enabled and measured is not None)
