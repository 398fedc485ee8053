"""What the driver does about a failure or a regrow: one pure decision, no Ray, no printing.

`decide_recovery` looks at the failure, what the driver knows of the world it happened in
(`RecoveryState`) and the job's configuration, and returns one of four frozen decisions, each
with the reason summary.json and the console give for it. The driver carries the decision out
(killing, respawning, restoring: `heal.py` and `driver.py`); where keeping the survivors then
fails midway (a survivor that cannot leave its broken group, a replacement that does not start),
the world restarts with that step's own reason.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import JobConfig
from .failures import Regrow, WorkerFailure


@dataclass(frozen=True)
class KeepSurvivors:
    """Replace only the blamed ranks; every other rank keeps its process and the plan stays."""

    reason: str
    """Why the survivors may stay."""


@dataclass(frozen=True)
class RestartWorld:
    """Release every actor, then probe, plan and place the world afresh (it may have changed)."""

    reason: str
    """Why the survivors cannot stay: the restart record's `recovery.why`."""


@dataclass(frozen=True)
class Replan:
    """More devices came alive: release the world and plan for the larger one from the
    checkpoint just committed. Not a failure: it does not count against train.max_failures."""

    reason: str
    """What grew, as the console and the restart record say it."""


@dataclass(frozen=True)
class GiveUp:
    """No restart is left: the run fails (RunFailed) with the newest whole checkpoint named."""

    reason: str
    """Which ranks failed, why, and that train.max_failures restarts are used up."""


Decision = KeepSurvivors | RestartWorld | Replan | GiveUp
"""What `decide_recovery` returns."""


@dataclass(frozen=True)
class RecoveryState:
    """What the driver knows of the world a failure happened in, gathered before deciding."""

    world_size: int
    """The ranks of the world that failed."""
    training: bool
    """Whether its ranks had started their step loops (a failure in setup has nothing to keep)."""
    recovering: bool
    """Whether the failure came before the first step of a world recovered from an earlier one."""
    failures_so_far: int
    """The failures the run has restarted after already (regrows not counted)."""
    gone_nodes: frozenset[str] = frozenset()
    """The Ray node ids Ray reports dead now."""


def gone_node(failure: WorkerFailure, gone_nodes: frozenset[str]) -> str | None:
    """Why the failure's ranks cannot be replaced where they ran: a node of theirs Ray reports
    gone (it says so seconds after the ranks die, so the answer may change when asked later)."""
    lost = sorted(set(failure.nodes) & gone_nodes)
    return f"node {lost[0][:12]} is gone: its ranks cannot be replaced on their own devices" if lost else None


def decide_recovery(failure: WorkerFailure | Regrow, state: RecoveryState, config: JobConfig) -> Decision:
    """The one answer to what ended an attempt early. A regrow re-plans. A failure past
    train.max_failures gives up. Failing again before a recovered world's first step restarts
    the world (often the lost node Ray had not reported the first time, then named as such).
    Otherwise the survivors stay unless the job turned that off, every rank failed, a blamed
    rank's node is gone, or the ranks had not started training."""
    if isinstance(failure, Regrow):
        return Replan(failure.reason)
    max_failures = config.train.max_failures
    if state.failures_so_far + 1 > max_failures:
        return GiveUp(f"rank(s) {failure.ranks} failed ({failure.reason}) and train.max_failures={max_failures} "
                      f"restarts are used up")
    lost = gone_node(failure, state.gone_nodes)
    if state.recovering:
        return RestartWorld(lost or f"rank(s) {failure.ranks} failed again before the recovered group's first step")
    if not config.elastic.keep_survivors:
        return RestartWorld("elastic.keep_survivors=false")
    if failure.ranks and len(failure.ranks) == state.world_size:
        return RestartWorld("every rank failed")
    if lost:
        return RestartWorld(lost)
    if not state.training:
        return RestartWorld("the failure came before training (its ranks had not started their steps)")
    return KeepSurvivors("the blamed ranks' nodes are alive and the others had started training")
