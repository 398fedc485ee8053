"""Where the seconds to a first step go: at the run's start and after each restart.

One `Phases` clock is open at a time. The driver adds each part as it ends (Ray's start, or the
connection to a running cluster; what measuring the model took beyond it; probe, plan,
placement, actor start, process group, model build, state restore; after a failure also
detection and teardown), and the first step after it closes the clock: summary.json's
`startup`, or the restart record's `breakdown`, with the total and the largest part.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

PART_NAMES = {
    "detection_s": "detection", "teardown_s": "teardown", "ray_start_s": "Ray start",
    "measure_s": "model measurement", "probe_s": "probe",
    "plan_s": "plan",
    "placement_s": "placement", "actor_start_s": "actor start", "trial_s": "trial",
    "process_group_s": "process group",
    "model_build_s": "model build", "state_restore_s": "state restore", "first_step_s": "first step",
}
"""Each part's key and how the console names it, in the order they happen."""


@dataclass
class Phases:
    """The clock of one start or restart."""

    started: float
    """Unix time it began: the driver's start, or when a failure was detected."""
    record: dict[str, Any] | None = None
    """The restart record it fills in; None for the run's start."""
    parts: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, seconds: float) -> None:
        if name not in PART_NAMES:
            raise ValueError(f"unknown phase {name!r}; expected one of {', '.join(PART_NAMES)}")
        self.parts[name] = self.parts.get(name, 0.0) + max(0.0, seconds)

    def add_setups(self, setups: list[dict[str, Any]]) -> None:
        """The ranks' own timings of `setup`, from the rank whose setup took longest: the others
        waited for it. One rank's parts, not each part's slowest rank: a rank that waits in the
        process group for a new one still importing would count that one wait twice."""
        names = ("process_group_s", "model_build_s", "state_restore_s")
        timed = [s["timings"] for s in setups if s.get("timings")]
        if timed:
            slowest = max(timed, key=lambda t: sum(t[n] for n in names))
            for name in names:
                self.add(name, slowest[name])

    def finish(self) -> dict[str, Any]:
        """The breakdown: every part in seconds, `total_s` (from `started` to now, so time no
        part accounts for is in the total too) and the `largest` part's key."""
        out: dict[str, Any] = {k: round(self.parts[k], 3) for k in PART_NAMES if k in self.parts}
        out["total_s"] = round(time.time() - self.started, 3)
        out["largest"] = max(self.parts, key=lambda k: self.parts[k]) if self.parts else None
        if self.record is not None:
            self.record["breakdown"] = out
        return out


def describe(breakdown: dict[str, Any]) -> str:
    """`12.3 s (largest part: actor start 6.1 s)` for the console."""
    largest = breakdown.get("largest")
    part = f" (largest part: {PART_NAMES[largest]} {breakdown[largest]:.1f} s)" if largest else ""
    return f"{breakdown['total_s']:.1f} s{part}"
