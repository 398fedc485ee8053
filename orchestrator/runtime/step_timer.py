"""What a rank measures beside its steps, never inside them: the compute-only baseline that
exposed communication is read against, what compiling the blocks gains (timed passes at the
start, and the named steps of COMPILE_GAIN_STEPS that train with the blocks eager), and the
per-step figures derived from them (exposed communication, MFU).

The Trainer's step is always the production step; the loop asks this timer, by step number,
whether a step is one of the gain's eager ones (`gain_stance`), so no step changes what it runs
without the loop saying so, and summary.json lists those steps.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
import torch.distributed as dist

from .trainer import StepResult, Trainer

CALIBRATION_BUDGET_S = 0.1
"""Seconds of timed passes the compute-only baseline (`StepTimer.calibrate`) takes after its
warm-up before it stops: a GPU's millisecond passes are all timed, a pass this long or longer
only once, so the baseline costs a start or restart at most about two passes."""
COMPILE_PASSES = 3
"""Passes a start with compiled blocks times each way (compiled, eager) to measure the gain:
one of each alone is within the host's spread of a few percent."""
COMPILE_GAIN_STEPS = range(2, 10)
"""The optimizer steps (counted from 0) a compiled run times to measure what compiling gains a
whole step: the even ones train with the blocks eager, each beside the compiled step after it,
so the host's drift hits both kinds. Fixed step numbers, so a run that restarts inside them
trains each of them as the uninterrupted run did."""


class StepTimer:
    """One rank's measurements around its Trainer's steps."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        plan = trainer.plan
        self.compute_micro_s: float | None = None
        """Seconds of one micro-step's forward and backward without gradient sync (`calibrate`);
        None before it, under a pipeline, and where FSDP2 holds only sharded gradients."""
        self.compile_times: dict[str, float] | None = None
        """Compiled blocks only: what compiling took, the compute-only pass compiled, and eager
        where the gain was timed (`calibrate`)."""
        # A gain priced from a measurement is not timed again: a dozen passes would cost the run.
        self.times_gain = trainer.compiled and not plan.compile.measured
        """Whether this start times what compiling gains (compiled blocks, no measured gain priced)."""
        stepped = self.times_gain and trainer.cfg.train.max_steps >= COMPILE_GAIN_STEPS.stop
        self.gain_steps = COMPILE_GAIN_STEPS if stepped else range(0)
        """The optimizer steps (from 0) that time the gain, every other one eager; empty where the
        gain is not timed by steps (eager, a measured gain priced, a run shorter than those steps)."""
        self.compile_steps: dict[str, list[float]] = {"eager_s": [], "compiled_s": []}
        """The seconds of the `gain_steps` this rank trained, by how its blocks ran."""
        self.gain_steps_trained: dict[str, list[int]] = {"eager": [], "compiled": []}
        """Which of the `gain_steps` this rank trained each way, as completed-step numbers (the
        `step` of their metrics rows)."""
        self._flops_per_rank_step = plan.model.flops_per_step / plan.world_size
        # MFU against the datasheet's peak, as MFU is quoted everywhere; the planner may have
        # priced with a measured rate, which is lower and would flatter it.
        self._peak_flops = plan.model.mfu_peak_tflops_per_rank * 1e12

    def gain_mode(self, step: int) -> str | None:
        """How step `step` (from 0) runs its blocks to time the compile gain: `eager`, `compiled`,
        or None for a production step that times nothing."""
        if step not in self.gain_steps:
            return None
        return "eager" if (step - self.gain_steps.start) % 2 == 0 else "compiled"

    def gain_stance(self, step: int) -> contextlib.AbstractContextManager[Any]:
        """The blocks' stance for step `step`: eager inside for the gain's eager steps, else as planned."""
        if self.gain_mode(step) == "eager":
            return torch.compiler.set_stance("force_eager")
        return contextlib.nullcontext()

    def record(self, result: StepResult) -> None:
        """Keep a gain step's time under the mode it ran in (`gain_mode`); other steps keep nothing."""
        mode = self.gain_mode(result.step)
        if mode is not None:
            self.compile_steps[f"{mode}_s"].append(result.step_s)
            self.gain_steps_trained[mode].append(result.step + 1)

    def exposed_comm_s(self, result: StepResult) -> float | None:
        """Step time not explained by compute: step - optimizer - micro-steps x compute-only time
        (None without the baseline)."""
        if self.compute_micro_s is None:
            return None
        return max(0.0, result.step_s - result.optimizer_s - self.trainer.accum * self.compute_micro_s)

    def mfu(self, result: StepResult) -> float | None:
        """The share of the device's datasheet peak FLOP/s this rank's step achieved; None without a peak."""
        if not self._peak_flops:
            return None
        return self._flops_per_rank_step / result.step_s / self._peak_flops

    def calibrate(self, repeats: int = 3) -> float | None:
        """Seconds of one micro-step's forward and backward with gradient sync off: the
        compute-only baseline that exposed communication is measured against: the fastest of up
        to `repeats` timed passes after a warm-up, as many as fit CALIBRATION_BUDGET_S (at least
        one). The loss is scaled by zero, so the backward passes cost what real ones do and
        leave only zero gradients behind: FSDP2 keeps what a backward without sync accumulates in its own
        unsharded buffers, out of the optimizer's reach, and adds it to the next synced step's
        gradient. (Sharded strategies still all-gather parameters inside it, so their figure
        counts gradient communication only.) None under a pipeline, whose stages cannot run a
        micro-batch apart from the schedule, and where FSDP2 is planned to hold only sharded
        gradients (`holds_unsharded_grads`): a backward without sync would hold the whole
        model's unsharded gradients at once, memory the plan does not have. Compiled blocks
        are also timed eager (`compile_times`), on passes that sync where no pass may skip it.
        Run on the loaded weights (`Trainer.start` first): a trainer built `resuming` holds
        uninitialised memory until then."""
        tr = self.trainer
        if tr.pipelined:
            return None
        x, y = tr.data.train_batch(0, tr.cfg.train.global_batch_size, tr.dp_rank, tr.dp_world)
        x, y = x[: tr.micro].to(tr.device), y[: tr.micro].to(tr.device)
        tr.par.model.train()
        if not self.holds_unsharded_grads():
            if self.times_gain:
                self.compile_times = self._compile_gain(x, y, True, self._timed_pass(x, y, sync=True))
                tr.par.zero_grad()
            return None
        # The warm-up pays for allocation (and compiling), which the first step then does not.
        warm_up = self._timed_pass(x, y)
        times = [self._timed_pass(x, y)]
        # Every start and restart waits for these passes, so they stop at CALIBRATION_BUDGET_S.
        # Sharded passes gather parameters, so every rank must run as many: the count follows
        # the slowest rank's first pass.
        slowest = torch.tensor([times[0]], dtype=torch.float64, device=tr.device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        more = max(0, min(repeats, int(CALIBRATION_BUDGET_S // max(slowest.item(), 1e-9))) - 1)
        times += [self._timed_pass(x, y) for _ in range(more)]
        # The fastest is the figure: other work on the host only ever adds to a pass.
        self.compute_micro_s = min(times)
        if self.times_gain:
            self.compile_times = self._compile_gain(x, y, False, warm_up)
        elif tr.compiled:
            self.compile_times = {"compiled_s": self.compute_micro_s,
                                  "compile_s": max(0.0, warm_up - self.compute_micro_s)}
        tr.par.zero_grad()
        return self.compute_micro_s

    def holds_unsharded_grads(self) -> bool:
        """Whether the plan already holds whole (unsharded) gradients between backward passes:
        DDP and ZeRO-1 always; FSDP2 when it accumulates them until the last micro-step."""
        ex = self.trainer.execution
        return ex.ddp_reduces or (self.trainer.accum > 1 and not ex.reduce_every_micro_step)

    def _timed_pass(self, x: torch.Tensor, y: torch.Tensor, sync: bool = False) -> float:
        """Seconds of one forward and backward of the loss scaled by zero (zero gradients)."""
        tr = self.trainer
        tr.sync_device()
        t0 = time.perf_counter()
        with contextlib.nullcontext() if sync else tr.par.no_sync():
            with tr._autocast():
                loss = tr._loss(tr.par.model, x, y) * 0.0
            loss.backward()
        tr.sync_device()
        return time.perf_counter() - t0

    def _compile_gain(self, x: torch.Tensor, y: torch.Tensor, sync: bool, warm_up: float) -> dict[str, float]:
        """What compiling bought, for a later plan's `auto` (calibration.py), and what it cost:
        COMPILE_PASSES passes with the blocks compiled and as many eager, alternating so the
        host's drift hits both, the fastest of each; `warm_up`, the pass that compiled them,
        over the fastest compiled one is the compile."""
        with torch.compiler.set_stance("force_eager"):
            self._timed_pass(x, y, sync)  # the eager path's own first use
        compiled, eager = [], []
        for _ in range(COMPILE_PASSES):
            compiled.append(self._timed_pass(x, y, sync))
            with torch.compiler.set_stance("force_eager"):
                eager.append(self._timed_pass(x, y, sync))
        fastest = min(compiled)
        return {"compiled_s": fastest, "eager_s": min(eager), "compile_s": max(0.0, warm_up - fastest)}
