"""What stays the same for the whole of one job, whatever attempt it is on."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import JobConfig
from ..record.console_view import ConsoleView
from ..record.rundir import RunDir
from ..record.trackers import Trackers


@dataclass(frozen=True)
class JobContext:
    """The job's configuration and where its record and output go."""

    config: JobConfig
    """The job as configured."""
    run: RunDir
    """Its run directory."""
    view: ConsoleView
    """Its console."""
    checkpoint_root: str
    """Where its checkpoints go: `checkpoint.path`, else the run directory's checkpoints/."""
    trackers: Trackers
    """The experiment trackers it is logged to (`monitor.trackers`; none by default)."""
