"""`status [JOB_ID] --address URL`: the jobs of a Ray cluster, or one job in detail."""

from __future__ import annotations

import argparse
import time

from ..connect.remote import RemoteJob, default_address, job_status, run_directory


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("job_id", nargs="?", help="a job id that `submit --address` printed; all jobs when omitted")
    p.add_argument("--address", default=None,
                   help="Ray dashboard URL (default: $RAY_ADDRESS, else http://127.0.0.1:8265)")


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def _duration(job: RemoteJob) -> str:
    if not job.start_time:
        return "-"
    secs = int((job.end_time or time.time()) - job.start_time)
    return f"{secs // 3600}:{secs % 3600 // 60:02d}:{secs % 60:02d}"


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    address = args.address or default_address()
    jobs = job_status(address, args.job_id)
    console = Console()
    if args.job_id is not None:
        job = jobs[0]
        for key, value in (("job", job.job_id), ("status", job.status), ("started", _when(job.start_time)),
                           ("ended", _when(job.end_time)), ("duration", _duration(job)),
                           ("entrypoint", job.entrypoint), ("message", job.message or "-"),
                           ("run dir", run_directory(address, job.job_id) or "- (not created yet)")):
            console.print(f"{key:<11}{value}", highlight=False, soft_wrap=True)
        return 0
    if not jobs:
        console.print(f"no jobs on the Ray cluster at {address}")
        return 0
    table = Table(title=f"jobs on {address}", title_justify="left")
    for col in ("job", "status", "started", "duration", "message"):
        table.add_column(col, overflow="fold")
    for job in jobs:
        message = job.message.splitlines()[0] if job.message else ""
        table.add_row(job.job_id, job.status, _when(job.start_time), _duration(job), message)
    console.print(table)
    return 0
