"""What the driver does about a failure or a regrow (`control/recovery.py`), decided from
constructed records alone: every branch of `decide_recovery`, with its reason. (Carried out with
real ranks killed, hung and lost: test_runtime.py and test_recovery.py.)"""

from __future__ import annotations

import dataclasses
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from orchestrator.config import load_config
from orchestrator.control import driver as driver_module
from orchestrator.control.driver import Attempt, Stage
from orchestrator.control.failures import Regrow, WorkerFailure
from orchestrator.control.follow import Failed
from orchestrator.control.recovery import (
    GiveUp,
    KeepSurvivors,
    RecoveryState,
    Replan,
    RestartWorld,
    decide_recovery,
    gone_node,
)
from orchestrator.errors import RunFailed
from orchestrator.record.rundir import RunDir

ROOT = Path(__file__).resolve().parent.parent
ALIVE, GONE = "a" * 56, "b" * 56


def _cfg(*over: str):
    return load_config(ROOT / "jobs" / "llm.yaml", ["train.max_failures=3", *over])


def _failure(ranks, nodes=(ALIVE,)) -> WorkerFailure:
    return WorkerFailure("worker died: gone", list(ranks), list(nodes))


def _state(world=4, training=True, recovering=False, failures_so_far=0, gone=(GONE,)) -> RecoveryState:
    """Ray reports node `b` dead."""
    return RecoveryState(world_size=world, training=training, recovering=recovering, failures_so_far=failures_so_far,
                         gone_nodes=frozenset(gone))


def test_survivors_stay_when_the_dead_ranks_nodes_are_alive():
    decision = decide_recovery(_failure([1]), _state(), _cfg())
    assert isinstance(decision, KeepSurvivors)
    assert decision.reason == "the blamed ranks' nodes are alive and the others had started training"


@pytest.mark.parametrize("failure, state, over, why", [
    (_failure([1], [GONE]), _state(), (), "node bbbbbbbbbbbb is gone"),
    (_failure([0, 1, 2, 3]), _state(), (), "every rank failed"),
    (_failure([1]), _state(training=False), (), "before training"),
    (_failure([1]), _state(), ("elastic.keep_survivors=false",), "elastic.keep_survivors=false"),
])
def test_the_whole_world_restarts_and_says_why(failure, state, over, why):
    decision = decide_recovery(failure, state, _cfg(*over))
    assert isinstance(decision, RestartWorld)
    assert why in decision.reason


def test_a_node_ray_reports_gone_only_later_is_named_as_the_cause():
    """Ray says a node is gone seconds after its ranks die: a recovery that fails again before
    its first step names the node rather than the second failure."""
    assert gone_node(_failure([1], [GONE]), frozenset({GONE})).startswith("node bbbbbbbbbbbb is gone")
    assert gone_node(_failure([1], [ALIVE]), frozenset({GONE})) is None
    assert gone_node(_failure([1], []), frozenset({GONE})) is None
    again = decide_recovery(_failure([1], [GONE]), _state(recovering=True), _cfg())
    assert again == RestartWorld("node bbbbbbbbbbbb is gone: its ranks cannot be replaced on their own devices")
    # Its node alive: the failure itself is the reason, even where the survivors could stay.
    again = decide_recovery(_failure([1]), _state(recovering=True), _cfg())
    assert again == RestartWorld("rank(s) [1] failed again before the recovered group's first step")


def test_failing_again_restarts_the_world_whatever_the_job_says_of_survivors():
    decision = decide_recovery(_failure([1]), _state(recovering=True), _cfg("elastic.keep_survivors=false"))
    assert decision.reason == "rank(s) [1] failed again before the recovered group's first step"


def test_past_max_failures_the_run_gives_up_before_anything_else():
    # The 4th failure of train.max_failures=3: given up, even on a node that is gone.
    decision = decide_recovery(_failure([2], [GONE]), _state(failures_so_far=3), _cfg())
    assert decision == GiveUp("rank(s) [2] failed (worker died: gone) and train.max_failures=3 restarts are used up")
    # The 3rd still restarts.
    assert isinstance(decide_recovery(_failure([2]), _state(failures_so_far=2), _cfg()), KeepSurvivors)
    # train.max_failures=0: the first failure ends the run.
    assert isinstance(decide_recovery(_failure([2]), _state(), _cfg("train.max_failures=0")), GiveUp)


def test_a_regrow_replans_and_counts_no_failure():
    grown = Regrow(before=4, now=6, checkpoint="/ckpt/step_00000010", step=10)
    decision = decide_recovery(grown, _state(failures_so_far=3), _cfg("train.max_failures=0"))
    assert decision == Replan("grow: 6 devices available, the plan was made for 4")
    assert grown.restart_record(12, 10)["grow"] is True and grown.restart_record(12, 10)["steps_lost"] == 2


def test_failures_and_decisions_are_frozen_records():
    failure = _failure([1])
    with pytest.raises(dataclasses.FrozenInstanceError):
        failure.reason = "changed"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        RestartWorld("why").reason = "other"  # type: ignore[misc]
    record = failure.restart_record(failed_at_step=9, resumed_from_step=6)
    assert record["ranks"] == [1] and record["steps_lost"] == 3 and record["detected_at"] == failure.detected_at
    assert not isinstance(failure, BaseException)  # returned from follow, never raised


def test_the_decision_needs_neither_ray_nor_a_console():
    code = ("import sys; import orchestrator.control.recovery; "
            "print(sorted(m for m in ('ray', 'rich', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


# --- the driver carrying the decisions out, on a stand-in placement --------------------------------

class _Placement:
    """A placed world of `world` ranks on node `b`, which counts its releases."""

    def __init__(self, world: int) -> None:
        self.actors = [object()] * world
        self.reports = [{"node_id": GONE, "pid": 100 + r} for r in range(world)]
        self.released = 0

    def release(self, *args, **kwargs) -> None:
        self.released += 1


@pytest.fixture
def driver(tmp_path, monkeypatch):
    """A JobDriver on a stand-in world: Ray reports node `b` dead, and no metric is exported."""
    monkeypatch.setattr(driver_module.ray, "nodes", lambda: [{"NodeID": GONE, "Alive": False}])
    monkeypatch.setattr(driver_module, "record_restarts", lambda job, restarts: None)

    def make(*over: str):
        console = Console(record=True, width=300, file=io.StringIO())
        return driver_module.JobDriver(_cfg(*over), RunDir(tmp_path), console), console

    return make


def test_a_world_whose_node_is_gone_is_released_and_probed_again_with_the_reason_recorded(driver):
    job, console = driver()
    placement = _Placement(4)
    failure = WorkerFailure("worker died: gone", [1], [GONE], detected_unix_s=1000.0)
    job.attempt, job.clock = Attempt(placement=placement, ended=Failed(failure, [object()] * 4, False)), None
    assert job._recover() is Stage.PROBE
    assert placement.released == 1 and job.attempt.placement is None  # the next attempt starts afresh
    record = job.record.restarts[-1]
    assert record["recovery"] == {"kind": "full_restart",
                                  "why": "node bbbbbbbbbbbb is gone: its ranks cannot be replaced on their own devices"}
    assert record["ranks"] == [1] and record["resumed_from_step"] == 0 and job.resume is None
    assert job.clock.record is record and set(job.clock.parts) == {"detection_s", "teardown_s"}
    assert job.clock.parts["detection_s"] > 0  # from the failure's detection to the start of recovery
    assert "failure: worker died: gone (ranks [1]); restart 1/3 from step 0: no checkpoint was written yet" in \
        console.export_text()


def test_a_run_out_of_restarts_records_its_failure_and_names_the_last_checkpoint(driver):
    job, _ = driver("train.max_failures=0")
    placement = _Placement(2)
    failure = WorkerFailure("rank raised: boom", [0], [ALIVE])
    job.attempt = Attempt(placement=placement, ended=Failed(failure, [object()] * 2, False))
    with pytest.raises(RunFailed, match=r"rank\(s\) \[0\] failed \(rank raised: boom\) and train.max_failures=0 "
                                        r"restarts are used up; the last whole checkpoint is none"):
        job._recover()
    assert placement.released == 1
    summary = json.loads((job.job.run.path / "summary.json").read_text())
    assert summary["failed"] is True and [r["reason"] for r in summary["restarts"]] == ["rank raised: boom"]


def test_a_grown_world_resumes_from_the_checkpoint_that_set_off_the_regrow(driver):

    job, console = driver()
    placement = _Placement(4)
    job.record.rows = [{"step": s, "loss": 1.0} for s in range(1, 13)]
    job.attempt = Attempt(placement=placement, ended=Regrow(before=4, now=6, checkpoint="/ckpt/step_10", step=10))
    assert job._regrow() is Stage.PROBE
    assert placement.released == 1 and job.resume == "/ckpt/step_10" and job.record.last_step == 10
    record = job.record.restarts[-1]
    assert record["grow"] is True and record["failed_at_step"] == 12 and record["steps_lost"] == 2
    assert job.clock.record is record
    assert "grow: 6 devices available, the plan was made for 4: re-planning from step 10" in console.export_text()
