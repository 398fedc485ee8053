"""The step loop (`runtime/loop.py`), the validator and the step timer, on stand-in trainers:
what the loop sends in which order, when it evaluates, and which steps time the compile gain."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from orchestrator.runtime import step_timer
from orchestrator.runtime.loop import TIMES_BATCH, run_steps
from orchestrator.runtime.messages import Evaluated, RankTimes, Stepped
from orchestrator.runtime.step_timer import COMPILE_GAIN_STEPS, StepTimer
from orchestrator.runtime.trainer import StepResult
from orchestrator.runtime.validator import Validator


class _Trainer:
    """Steps that take 0.1 s, 0.02 s of it the update, and lose 0.01 of loss each."""

    def __init__(self, rank: int = 0, max_steps: int = 12, compiled: bool = False, measured: bool = False) -> None:
        self.rank = rank
        self.cfg = SimpleNamespace(train=SimpleNamespace(max_steps=max_steps))
        self.plan = SimpleNamespace(compile=SimpleNamespace(measured=measured), world_size=2,
                                    model=SimpleNamespace(flops_per_step=4e9, mfu_peak_tflops_per_rank=20.0))
        self.compiled = compiled
        self.accum = 2
        self.device = torch.device("cpu")
        self.trained: list[int] = []

    def train_step(self, step: int) -> StepResult:
        self.trained.append(step)
        return StepResult(step=step, loss=5.0 - 0.01 * step, lr=1e-3, step_s=0.1, tokens_per_s=100.0,
                          grad_norm=1.0, optimizer_s=0.02)


class _Sink:
    def __init__(self) -> None:
        self.sent: list = []
        self.urgent: list = []
        self.ended = 0

    def add(self, item, urgent: bool = False) -> None:
        self.sent.append(item)
        self.urgent.append(urgent)

    def flush(self) -> None:
        pass

    def end(self) -> None:
        self.ended += 1


def _validator(max_steps: int = 12, interval: int = 5) -> Validator:
    losses = iter([4.0 - 0.1 * i for i in range(100)])
    return Validator(lambda: next(losses), interval, max_steps)


def test_the_loop_sends_the_baseline_every_row_and_timings_in_batches_and_evaluates_on_its_cadence():
    trainer, sink, seen = _Trainer(), _Sink(), []
    timer = StepTimer(trainer)
    timer.compute_micro_s = 0.03
    end = run_steps(trainer, range(0, 12), timer, _validator(), sink,
                    on_step=lambda row: seen.append((row["step"], row["val_loss"])))
    assert trainer.trained == list(range(12))
    assert sink.sent[0] == Evaluated(step=0, val_loss=4.0) and sink.urgent[0]
    rows = [m.row for m in sink.sent if isinstance(m, Stepped)]
    assert [r["step"] for r in rows] == list(range(1, 13))
    # Every 5 completed steps, and after the last.
    assert [(r["step"], r["val_loss"]) for r in rows if r["val_loss"] is not None] == [(5, 3.9), (10, 3.8), (12, 3.7)]
    # A row is whole (and kept) before its evaluation.
    assert seen == [(s, None) for s in range(1, 13)]
    # 0.1 s step - 0.02 s update - 2 micro-steps x 0.03 s compute; MFU: 2e9 FLOPs in 0.1 s of 20 TFLOP/s.
    assert rows[0]["exposed_comm_s"] == pytest.approx(0.02) and rows[0]["mfu"] == pytest.approx(1e-3)
    assert set(rows[0]) == {"step", "loss", "lr", "step_s", "tokens_per_s", "grad_norm", "exposed_comm_s",
                            "val_loss", "time", "mfu", "memory_bytes"}
    assert all(isinstance(r["memory_bytes"], int) and r["memory_bytes"] > 0 for r in rows)  # rank 0's, each step
    times = [m for m in sink.sent if isinstance(m, RankTimes)]
    assert [len(t.times) for t in times] == [TIMES_BATCH, 12 - TIMES_BATCH] and times[0].rank == 0
    assert times[0].times[0] == (0.1, pytest.approx(0.02))
    # The first step's row at once (it closes the driver's start clock), then evaluated ones.
    urgent_rows = [m.row["step"] for m, u in zip(sink.sent, sink.urgent) if isinstance(m, Stepped) and u]
    assert urgent_rows == [1, 5, 10, 12]
    assert sink.ended == 1 and end.last_val_loss == pytest.approx(3.7) and end.overhead_s_per_step >= 0


def test_a_resumed_range_takes_no_baseline_and_a_rank_other_than_0_sends_only_its_timings():
    trainer, sink = _Trainer(rank=1, max_steps=7), _Sink()
    end = run_steps(trainer, range(4, 7), StepTimer(trainer), _validator(max_steps=7), sink)
    assert trainer.trained == [4, 5, 6]
    # The last step sends what is left of a batch.
    assert sink.sent == [RankTimes(rank=1, times=((0.1, None),) * 3)] and sink.ended == 0
    assert end.last_val_loss == pytest.approx(3.9)  # after steps 5 and 7
    with pytest.raises(ValueError, match="consecutive steps"):
        run_steps(trainer, range(0, 6, 2), StepTimer(trainer), _validator(), sink)


def test_the_validator_evaluates_every_interval_and_after_the_last_step():
    v = _validator(max_steps=7, interval=3)
    assert [s for s in range(1, 8) if v.due(s)] == [3, 6, 7]
    assert v.baseline(2) is None and v.last is None
    assert v.baseline(0) == 4.0 and v.validate() == pytest.approx(3.9) and v.last == pytest.approx(3.9)
    with pytest.raises(ValueError, match="at least 1; got 0"):
        Validator(lambda: 0.0, 0, 7)


def test_a_compiled_run_names_its_gain_steps_and_the_loop_trains_the_eager_ones_under_that_stance(monkeypatch):
    stances: list[tuple[int, str]] = []
    trainer = _Trainer(max_steps=COMPILE_GAIN_STEPS.stop, compiled=True)
    real_step = trainer.train_step
    now = [None]

    def step(s: int) -> StepResult:
        now[0] = s
        return real_step(s)

    def stance(name: str = "default", **_):
        stances.append((now[0], name))
        return contextlib.nullcontext()

    trainer.train_step = step
    monkeypatch.setattr(torch.compiler, "set_stance", stance)
    timer = StepTimer(trainer)
    assert timer.gain_steps == range(2, 10)
    assert [timer.gain_mode(s) for s in range(11)] == [None, None] + ["eager", "compiled"] * 4 + [None]
    # The stance is entered before the step runs: `now` still names the step before.
    run_steps(trainer, range(0, COMPILE_GAIN_STEPS.stop), timer, _validator(max_steps=10), _Sink())
    assert [s + 1 for s, name in stances if name == "force_eager"] == [2, 4, 6, 8]
    assert timer.compile_steps == {"eager_s": [0.1] * 4, "compiled_s": [0.1] * 4}
    assert timer.gain_steps_trained == {"eager": [3, 5, 7, 9], "compiled": [4, 6, 8, 10]}


@pytest.mark.parametrize("kwargs", [{"max_steps": 9, "compiled": True}, {"max_steps": 20},
                                    {"max_steps": 20, "compiled": True, "measured": True}])
def test_no_step_times_the_gain_where_it_is_not_timed(kwargs):
    """Eager blocks, a run shorter than the gain steps, or a plan priced from a measured gain."""
    timer = StepTimer(_Trainer(**kwargs))
    assert timer.gain_steps == range(0) and all(timer.gain_mode(s) is None for s in range(20))
    assert isinstance(timer.gain_stance(4), contextlib.nullcontext)


def test_exposed_communication_is_what_compute_and_the_update_leave_and_never_negative():
    trainer = _Trainer()
    timer = StepTimer(trainer)
    result = trainer.train_step(0)
    assert timer.exposed_comm_s(result) is None  # no compute-only baseline: nothing to read against
    timer.compute_micro_s = 0.06
    assert timer.exposed_comm_s(result) == 0.0  # 0.1 - 0.02 - 2 x 0.06 < 0
    trainer.plan.model.mfu_peak_tflops_per_rank = 0.0
    assert StepTimer(trainer).mfu(result) is None
    assert step_timer.CALIBRATION_BUDGET_S > 0 and step_timer.COMPILE_PASSES >= 1
