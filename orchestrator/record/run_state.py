"""What the driver has seen of a run so far, across restarts: the metrics rows, validation
losses, checkpoints and restarts the summary and report are written from."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..planning import Plan
from ..planning.calibration import UNCALIBRATED, Calibration
from ..planning.model_spec import ModelSpec
from .rundir import RunDir
from .startup_clock import Phases
from .straggler import StragglerTracker

METRIC_KEYS = ("step", "time", "loss", "lr", "tokens_per_s", "step_s", "exposed_comm_s", "grad_norm", "mfu",
               "val_loss")
"""The fields of one metrics.jsonl row."""


@dataclass
class RunState:
    """What the driver has seen of the run so far (across restarts)."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    """One metrics row per completed step, as written to metrics.jsonl."""
    stragglers: StragglerTracker = field(default_factory=StragglerTracker)
    """Every rank's own step and exposed-communication times (the current world's ranks)."""
    val: list[tuple[int, float]] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)
    restarts: list[dict[str, Any]] = field(default_factory=list)
    model_fn: Callable[..., Any] | None = None
    """The model factory the Python API passed (shipped to the workers by pickling); None: `model.factory`."""
    spec: ModelSpec | None = None
    """The measured model the planner prices; None for the built-in GPT (its formulas)."""
    phases: Phases | None = None
    """The clock of the start or restart whose first step has not come yet."""
    startup: dict[str, Any] | None = None
    """Where the seconds to the run's first step went (`Phases.finish`)."""
    trial: dict[str, Any] | None = None
    """plan.json's `trial` section, once the run's trial ran or was skipped (once per run)."""
    trial_plan: Plan | None = None
    """The plan the trial kept; a restart on the same world size trains it again."""
    calibration: Calibration = UNCALIBRATED
    """What every plan of the run is priced with (`parallel.calibration`)."""

    @property
    def last_step(self) -> int:
        return self.rows[-1]["step"] if self.rows else 0

    def rewind(self, step: int, run: RunDir) -> None:
        """Forget what happened after `step` (a resumed run recomputes those steps), in memory
        and in metrics.jsonl. rank_times.jsonl is kept: it records how fast each rank ran, not
        what a step computed, and the steps trained twice were timed twice."""
        self.rows = [r for r in self.rows if r["step"] <= step]
        self.val = [v for v in self.val if v[0] <= step]
        run.write_text("metrics.jsonl", "".join(json.dumps(r) + "\n" for r in self.rows))


def where(plan: Plan) -> dict[int, dict[str, Any]]:
    """Each rank's placement in the plan (node, device, NIC), for the straggler report."""
    return {r.rank: r.to_dict() for r in plan.ranks}
