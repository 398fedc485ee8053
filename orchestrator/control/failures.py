"""What ends an attempt early, and the record of each restart in summary.json.

A failure names only the ranks that are dead or silent (`supervise`): survivors stuck in a
collective behind a dead peer are not failed. A regrow is no failure: more devices came
alive, so the driver re-plans from the checkpoint just committed.
"""

from __future__ import annotations

import time
from typing import Any

from ..record.rundir import RunDir
from . import supervise


def now(t: float | None = None) -> str:
    """A local timestamp as summary.json writes them."""
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t))


def _steps(failed_at_step: int, resumed_from_step: int) -> dict[str, int]:
    """Where a restart left off and resumed, and the steps it trains again."""
    return {"failed_at_step": failed_at_step, "resumed_from_step": resumed_from_step,
            "steps_lost": max(0, failed_at_step - resumed_from_step)}


class WorkerFailure(Exception):
    """A worker actor died or a rank raised while training."""

    def __init__(self, reason: str, ranks: list[int], nodes: list[str], detected_unix_s: float | None = None,
                 stacks: str | None = None, silent: list[int] | None = None) -> None:
        super().__init__(reason)
        self.reason, self.ranks, self.nodes = reason, ranks, nodes
        self.silent = silent or []
        """The blamed ranks that are alive but did not answer (stopped, frozen), not gone."""
        self.detected_unix_s = detected_unix_s or time.time()
        """When the driver saw the failure (before asking who is to blame)."""
        self.detected_at = now(self.detected_unix_s)
        self.stacks = stacks
        """The run-directory folder with every rank's stacks (a hang), else None."""
        # What recovery learns about the failure as it goes (driver.py, heal.py):
        self.train_refs: list | None = None
        """Every rank's step-loop future, when it failed while training: survivors' end as they leave."""
        self.handled_unix_s: float | None = None
        """When the driver began to recover (detection is the time from `detected_unix_s`)."""
        self.fallback: str | None = None
        """Why the survivors could not stay, when the whole world restarts."""
        self.teardown_s = 0.0
        """Seconds spent releasing every actor for a whole-world restart."""

    def restart_record(self, failed_at_step: int, resumed_from_step: int) -> dict[str, Any]:
        """The summary's record of the restart this failure causes."""
        return {
            "time": now(),
            "detected_at": self.detected_at,
            "detected_unix_s": self.detected_unix_s,
            "reason": self.reason,
            "ranks": self.ranks,
            "nodes": self.nodes,
            **({"stacks": self.stacks} if self.stacks else {}),
            **_steps(failed_at_step, resumed_from_step),
        }


class Regrow(Exception):
    """More devices are alive than the running plan was made for: re-plan from the checkpoint
    just committed (not a failure: it does not count against train.max_failures)."""

    def __init__(self, before: int, now: int, checkpoint: str, step: int) -> None:
        super().__init__(f"grow: {now} devices available, the plan was made for {before}")
        self.reason, self.checkpoint, self.step = str(self), checkpoint, step

    def restart_record(self, failed_at_step: int, resumed_from_step: int) -> dict[str, Any]:
        return {"time": now(), "reason": self.reason, "ranks": [], "nodes": [], "grow": True,
                **_steps(failed_at_step, resumed_from_step)}


def _nodes_of(placement, ranks: list[int]) -> list[str]:
    return sorted({placement.reports[r]["node_id"] for r in ranks}) if placement.reports else []


def raise_failure(err: Exception, placement, known_dead: dict[int, Exception] | None = None) -> None:
    """Turn a rank's error into a WorkerFailure naming only the ranks whose actors are dead
    (or no longer answer): survivors stuck in a collective behind them are not failed.
    `known_dead`: ranks whose own futures said they died, with what they said."""
    detected = time.time()
    node_of = [r["node_id"] for r in placement.reports] if placement.reports else None
    who = supervise.blame(placement.actors, known_dead, node_of)
    dead = who.ranks
    kind = "worker died" if dead else "rank raised"
    lines = str(err).strip().splitlines()
    detail = next((ln for ln in reversed(lines) if ln.strip()), type(err).__name__)[:200]
    raise WorkerFailure(f"{kind}: {detail}", dead, _nodes_of(placement, dead), detected,
                        silent=who.silent) from err


def raise_hang(run: RunDir, placement, timeout_s: float, step: int, silent: list[int] | None = None) -> None:
    """No step finished for `timeout_s`, or (`silent`) these ranks' control threads have not
    answered for `timeout_s` while no step finished: save every rank's stacks, blame the
    silent ones."""
    detected = time.time()
    folder = f"stacks/restart_{step:08d}_{time.strftime('%H%M%S')}"
    # The ranks already known silent are not waited for again: the others answer at once.
    who = supervise.save_stacks(placement.actors, run.path / folder, supervise.PING_TIMEOUT_S, silent or [])
    what = (f"rank(s) {silent} did not answer for {timeout_s:g} s and no step finished after step {step}" if silent
            else f"no step finished within {timeout_s:.0f} s after step {step}")
    raise WorkerFailure(f"hang: {what}; stacks in {folder}", who.ranks, _nodes_of(placement, who.ranks), detected,
                        folder, who.silent)
