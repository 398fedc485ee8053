"""What a rank sends the driver while it trains, one small frozen record per kind.

They travel through the driver's metrics sink (a Ray actor) in the order each rank sent them;
the driver tells them apart by type, never by a string key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union


@dataclass(frozen=True)
class Evaluated:
    """The validation loss of the untrained model, before the first step: the curve's baseline."""

    step: int
    """The completed optimizer steps it was taken after (0)."""
    val_loss: float
    """Mean validation loss over `train.eval_batches` batches."""


@dataclass(frozen=True)
class Stepped:
    """One completed optimizer step, as rank 0 saw it."""

    row: dict[str, Any]
    """The step's metrics row (`record.run_state.METRIC_KEYS` and whatever else the rank
    measured); `val_loss` is set on the steps that evaluated."""


@dataclass(frozen=True)
class RankTimes:
    """A batch of one rank's own step timings, for the straggler report."""

    rank: int
    """The rank that timed them."""
    times: tuple[tuple[float, float | None], ...]
    """(step seconds, exposed-communication seconds or None) per step, oldest first."""


@dataclass(frozen=True)
class Committed:
    """A checkpoint was committed (its meta.json written): a resume may start from it."""

    step: int
    """The completed optimizer steps it holds."""
    path: str
    """Its step directory (local path or URL)."""


@dataclass(frozen=True)
class Ended:
    """Rank 0's last message of a step range: nothing it sent is still on its way."""


Message = Union[Evaluated, Stepped, RankTimes, Committed, Ended]
"""Anything a rank sends the driver's sink."""
