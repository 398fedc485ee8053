"""When a rank evaluates: the untrained model once before the first step (the curve's
baseline), then every `train.eval_interval` completed steps and after the last."""

from __future__ import annotations

from collections.abc import Callable


class Validator:
    """The evaluation cadence of one run, over the trainer's `evaluate`."""

    def __init__(self, evaluate: Callable[[], float], interval: int, max_steps: int) -> None:
        if interval < 1:
            raise ValueError(f"the evaluation interval is a number of steps, at least 1; got {interval}")
        if max_steps < 1:
            raise ValueError(f"a run trains at least one step; got max_steps {max_steps}")
        self._evaluate = evaluate
        self.interval = interval
        """Completed steps between two evaluations."""
        self.max_steps = max_steps
        """The run's last step, which always evaluates."""
        self.last: float | None = None
        """The newest validation loss this validator took; None before the first."""

    def baseline(self, start: int) -> float | None:
        """The untrained model's loss where the range starts at step 0; None for a resumed range
        (its baseline was taken by the run it continues)."""
        return self.validate() if start == 0 else None

    def due(self, completed: int) -> bool:
        """Whether the step that made `completed` steps is followed by an evaluation."""
        return completed % self.interval == 0 or completed == self.max_steps

    def validate(self) -> float:
        """Evaluate now; the mean validation loss."""
        self.last = self._evaluate()
        return self.last
