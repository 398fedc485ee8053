"""The step loop of one rank, free of Ray: train a step range and, one call each, let the step
timer, the validator, the checkpointer and the metrics see every step. The worker actor runs
it (`Worker.train`), so do a launch without Ray (`launch.py`) and the runtime benchmark."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from .checkpointer import Checkpointer
from .messages import Evaluated, RankTimes, Stepped
from .metrics import process_memory_bytes
from .outbox import Sink
from .step_timer import StepTimer
from .trainer import StepResult, Trainer
from .validator import Validator

TIMES_BATCH = 10
"""Steps of per-rank timings sent to the driver at once (one small message per rank per batch)."""


class StepMetrics(Protocol):
    """Where each step's row is exported (`metrics.TrainMetrics`)."""

    def record_step(self, result: dict[str, Any]) -> None: ...

    def flush(self) -> None: ...


@dataclass(frozen=True)
class LoopEnd:
    """What a finished step range leaves behind for the rank's final answer."""

    last_val_loss: float | None
    """The newest validation loss the range took (None where it took none)."""
    overhead_s_per_step: float
    """The loop's own work per step, reporting rather than training (summary.json's
    `orchestration_overhead_s_per_step`)."""


def step_row(result: StepResult, timer: StepTimer, completed: int) -> dict[str, Any]:
    """The metrics row of one step (metrics.jsonl's keys, `record.run_state.METRIC_KEYS`):
    counted in completed steps, `val_loss` None until the step's evaluation sets it."""
    row = {"step": completed, "loss": result.loss, "lr": result.lr, "step_s": result.step_s,
           "tokens_per_s": result.tokens_per_s, "grad_norm": result.grad_norm,
           "exposed_comm_s": timer.exposed_comm_s(result), "val_loss": None, "time": time.time()}
    mfu = timer.mfu(result)
    if mfu is not None:
        row["mfu"] = mfu
    if result.expert_load is not None:
        row.update(result.expert_load)
    return row


def run_steps(trainer: Trainer, steps: range, timer: StepTimer, validator: Validator, sink: Sink, *,
              checkpointer: Checkpointer | None = None, metrics: StepMetrics | None = None,
              on_step: Callable[[dict[str, Any]], None] | None = None) -> LoopEnd:
    """Train optimizer steps `steps` (counted from 0, consecutive). Rank 0 sends the baseline
    evaluation, every step's row and every commit to `sink`; every rank sends its own timings
    in batches of TIMES_BATCH. `on_step` sees each row once its step is whole (applied and
    reported), before the step's evaluation: a step that loses a peer then costs only its
    validation loss."""
    if steps.step != 1:
        raise ValueError(f"the loop trains consecutive steps; got {steps}")
    reports = trainer.rank == 0
    last_step = trainer.cfg.train.max_steps
    baseline = validator.baseline(steps.start)
    if baseline is not None and reports:
        sink.add(Evaluated(step=0, val_loss=baseline), urgent=True)
    times: list[tuple[float, float | None]] = []  # this rank's own timings, for the straggler report
    overhead_s = 0.0
    for step in steps:
        # Named, not hidden: a step of the timer's gain steps runs its blocks as the timer says
        # (summary.json lists those steps); every other step runs as the plan does.
        with timer.gain_stance(step):
            result = trainer.train_step(step)
        timer.record(result)
        completed = step + 1  # metrics count completed optimizer steps
        evaluated = validator.due(completed)
        t_report = time.perf_counter()
        row = step_row(result, timer, completed)
        if reports:
            # The memory the run's record and trackers show per step: a host counter on a GPU,
            # one /proc read on CPU, after the step's end, so nothing waits on it.
            row["memory_bytes"] = process_memory_bytes(trainer.device)
        if on_step is not None:
            on_step(row)
        if evaluated:
            overhead_s += time.perf_counter() - t_report
            row["val_loss"] = validator.validate()
            t_report = time.perf_counter()
        if metrics is not None:
            metrics.record_step(row)
        if reports:
            # The first step at once: it closes the driver's clock of this start or restart.
            sink.add(Stepped(row=dict(row)), urgent=evaluated or step == steps.start)
        times.append((result.step_s, row["exposed_comm_s"]))
        if len(times) >= TIMES_BATCH or completed == last_step:
            # Already a batch: sent now, or the other ranks' timings (their only items) would
            # wait a batch more for the straggler report.
            sink.add(RankTimes(rank=trainer.rank, times=tuple(times)), urgent=True)
            times = []
        overhead_s += time.perf_counter() - t_report
        if checkpointer is not None:
            checkpointer.after_step(completed)
    if checkpointer is not None:
        checkpointer.close()
    sink.flush()
    if metrics is not None:
        metrics.flush()  # the last steps' values now, not at the exporter's next tick
    if reports:
        sink.end()
    return LoopEnd(last_val_loss=validator.last, overhead_s_per_step=overhead_s / max(1, len(steps)))
