"""What ends an attempt early, and the record of each restart in summary.json.

Both are frozen records, made once and never changed: what recovery learns about a failure
afterwards (the decision, how long the teardown took) is carried beside it, not written into it.
A failure names only the ranks that are dead or silent (`supervise` makes them): survivors stuck
in a collective behind a dead peer are not failed. A regrow is no failure: more devices came alive,
so the driver re-plans from the checkpoint just committed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


def now(t: float | None = None) -> str:
    """A local timestamp as summary.json writes them."""
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t))


def _steps(failed_at_step: int, resumed_from_step: int) -> dict[str, int]:
    """Where a restart left off and resumed, and the steps it trains again."""
    return {"failed_at_step": failed_at_step, "resumed_from_step": resumed_from_step,
            "steps_lost": max(0, failed_at_step - resumed_from_step)}


@dataclass(frozen=True)
class WorkerFailure:
    """A worker actor died, a rank raised, or the group hung."""

    reason: str
    """One line: what happened ("worker died: ...", "rank raised: ...", "hang: ...")."""
    ranks: list[int]
    """The blamed ranks: dead or silent, never a survivor stuck behind them."""
    nodes: list[str]
    """The Ray node ids of the blamed ranks."""
    detected_unix_s: float = field(default_factory=time.time)
    """When the driver saw the failure (before asking who is to blame)."""
    stacks: str | None = None
    """The run-directory folder with every rank's stacks (a hang), else None."""
    silent: list[int] = field(default_factory=list)
    """The blamed ranks that are alive but did not answer (stopped, frozen), not gone."""

    @property
    def detected_at(self) -> str:
        """`detected_unix_s` as summary.json writes times."""
        return now(self.detected_unix_s)

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


@dataclass(frozen=True)
class Regrow:
    """More devices are alive than the running plan was made for: re-plan from the checkpoint
    just committed (not a failure: it does not count against train.max_failures)."""

    before: int
    """The devices the running plan was made for."""
    now: int
    """The devices alive when the checkpoint was committed."""
    checkpoint: str
    """The checkpoint just committed, where the larger world resumes."""
    step: int
    """The step that checkpoint holds."""

    @property
    def reason(self) -> str:
        """What grew, in one line (the console's and the restart record's)."""
        return f"grow: {self.now} devices available, the plan was made for {self.before}"

    def restart_record(self, failed_at_step: int, resumed_from_step: int) -> dict[str, Any]:
        return {"time": now(), "reason": self.reason, "ranks": [], "nodes": [], "grow": True,
                **_steps(failed_at_step, resumed_from_step)}
