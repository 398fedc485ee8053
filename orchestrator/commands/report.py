"""`report RUN_DIR`: rebuild the run's report.html, one self-contained page (plan and why,
topology, rank layout, loss, per-rank step time, predicted against measured, restarts,
checkpoints), from the run directory's files alone (see orchestrator/record/report.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (runs/<name>-<time>)")


def run(args: argparse.Namespace) -> int:
    from ..record.report import REPORT, RUN_MARKERS, build_report, is_run_dir
    from ..record.rundir import RunDir

    path = Path(args.run_dir)
    if not path.is_dir():
        raise UserError(f"{path}: no such directory; expected a run directory (runs/<name>-<time>) made by `submit`")
    if not is_run_dir(path):
        raise UserError(f"{path} is not a run directory: expected {', '.join(RUN_MARKERS[:-1])} or "
                        f"{RUN_MARKERS[-1]} in it (made by `submit`)")
    # Unlike the driver's write_report, a failure to write is the answer here, not a side issue.
    out = RunDir(path).write_text(REPORT, build_report(path))
    print(out)
    return 0
