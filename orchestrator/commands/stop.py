"""`stop JOB_ID --address URL`: end a job on a Ray cluster and wait until it has ended."""

from __future__ import annotations

import argparse

from ..connect.remote import TERMINAL, default_address, stop_job


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("job_id", help="the job id that `submit --address` printed")
    p.add_argument("--wait", type=float, default=30.0, metavar="SECONDS",
                   help="how long to wait for the job to end (default 30)")
    p.add_argument("--address", default=None,
                   help="Ray dashboard URL (default: $RAY_ADDRESS, else http://127.0.0.1:8265)")


def run(args: argparse.Namespace) -> int:
    status = stop_job(args.address or default_address(), args.job_id, wait_s=args.wait)
    if status not in TERMINAL:
        print(f"job {args.job_id}: asked to stop, still {status} after {args.wait:g}s")
        return 1
    print(f"job {args.job_id}: {status}")
    return 0
