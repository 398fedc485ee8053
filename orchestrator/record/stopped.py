"""summary.json of a run stopped by a signal (SIGTERM, Ctrl-C), from what the run directory holds.

The driver's cleanup has already released the actors and the placement group when this runs;
every committed checkpoint stays where it is, and the summary names them, so the run can be
continued with `submit --resume RUN_DIR`.
"""

from __future__ import annotations

import json
from typing import Any

from ..config import JobConfig
from .rundir import RunDir


def _rows(run: RunDir) -> list[dict[str, Any]]:
    path = run.path / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # the last line may be cut by the stop
            break
    return rows


def stopped_summary(cfg: JobConfig, run: RunDir, signal_name: str, wall_s: float,
                    resumed_from: str | None = None) -> dict[str, Any]:
    """The outcome of a stopped run: how far it got and which whole checkpoints it left."""
    from ..runtime import checkpoint_files

    rows = _rows(run)
    vals = [r["val_loss"] for r in rows if r.get("val_loss") is not None]
    ckpt_dir = cfg.checkpoint.path or str(run.checkpoints)
    try:
        checkpoints = checkpoint_files.committed(ckpt_dir)
    except Exception:  # storage unreachable: the summary still says the run stopped
        checkpoints = []
    # A committed checkpoint proves its step finished even when the signal came before the
    # driver wrote that step's metrics line.
    saved = [s for s in map(checkpoint_files.step_of, checkpoints) if s is not None]
    summary = {
        "job": cfg.name,
        "stopped": True,
        "signal": signal_name,
        "steps": max([rows[-1]["step"] if rows else 0, *saved]),
        "max_steps": cfg.train.max_steps,
        "final_train_loss": rows[-1]["loss"] if rows else None,
        "final_val_loss": vals[-1] if vals else None,
        "wall_s": wall_s,
        "checkpoints": checkpoints,
    }
    if resumed_from:
        summary["resumed_from"] = resumed_from
    return summary
