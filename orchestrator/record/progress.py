"""What the user watches during a run: a live bar on a terminal, plain lines elsewhere."""

from __future__ import annotations

import sys
import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class ProgressView:
    """A rich progress bar with step, loss, tokens/s and ETA; on a non-terminal (CI, a log file)
    one plain line per evaluation and at most one every 10 seconds, so logs stay readable."""

    def __init__(self, total_steps: int, console: Console, enabled: bool = True) -> None:
        self.console = console
        self.total = total_steps
        self.live = enabled and console.is_terminal
        self._last_line = 0.0
        self._progress: Progress | None = None
        if self.live:
            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("val {task.fields[val]}"),
                TextColumn("{task.fields[tps]} tok/s"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=console,
            )
            self._task = self._progress.add_task("train", total=total_steps, loss="-", val="-", tps="-")

    def __enter__(self) -> "ProgressView":
        if self._progress:
            self._progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._progress:
            self._progress.stop()

    def update(self, row: dict[str, Any], last_val: float | None) -> None:
        val = f"{last_val:.4f}" if last_val is not None else "-"
        if self._progress:
            self._progress.update(
                self._task, completed=row["step"], loss=f"{row['loss']:.4f}", val=val,
                tps=f"{row['tokens_per_s']:,.0f}",
            )
            return
        now = time.monotonic()
        if row.get("val_loss") is not None or row["step"] == self.total or now - self._last_line >= 10:
            self._last_line = now
            print(
                f"step {row['step']}/{self.total}  loss {row['loss']:.4f}  val {val}  "
                f"{row['tokens_per_s']:,.0f} tok/s  {row['step_s'] * 1000:.0f} ms/step",
                file=sys.stdout, flush=True,
            )
