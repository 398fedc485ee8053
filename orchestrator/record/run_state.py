"""What the driver has seen of a run so far, across restarts: the metrics rows, validation
losses, checkpoints, restarts and start-up breakdown the summary and report are written from.
(What the driver needs to go on, the model, the trial's plan, the open start-up clock, is the
driver's own: `control/driver.py`.)"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..planning import Plan
from .rundir import RunDir
from .straggler import StragglerTracker

METRIC_KEYS = ("step", "time", "loss", "lr", "tokens_per_s", "step_s", "exposed_comm_s", "grad_norm", "mfu",
               "val_loss", "memory_bytes")
"""The fields of one metrics.jsonl row (`memory_bytes`: rank 0's, as `runtime.metrics.process_memory_bytes`
reads it at the step's end)."""
EXPERT_LOAD_KEYS = ("expert_tokens", "expert_imbalance")
"""A Mixture-of-Experts run's further fields: tokens per expert per MoE layer in the step, and
per layer the most an expert got over the mean (`runtime/expert_parallel.expert_load`)."""
COLLAPSING_IMBALANCE = 4.0
"""An MoE layer whose busiest expert gets this many times the mean load is named as a
collapsing router (at 4 of top-2 routing over 8 experts, one expert takes half the choices)."""


@dataclass
class RunState:
    """What the driver has seen of the run so far (across restarts)."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    """One metrics row per completed step, as written to metrics.jsonl."""
    stragglers: StragglerTracker = field(default_factory=StragglerTracker)
    """Every rank's own step and exposed-communication times (the current world's ranks)."""
    val: list[tuple[int, float]] = field(default_factory=list)
    """(step, validation loss) for every evaluation, the untrained model's first."""
    checkpoints: list[str] = field(default_factory=list)
    """Every checkpoint a rank reported committed, oldest first."""
    restarts: list[dict[str, Any]] = field(default_factory=list)
    """summary.json's record of each restart and regrow, in order."""
    startup: dict[str, Any] | None = None
    """Where the seconds to the run's first step went (`Phases.finish`)."""

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
