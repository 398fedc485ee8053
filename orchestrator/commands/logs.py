"""`logs JOB_ID [--follow] --address URL`: the driver output of a job on a Ray cluster."""

from __future__ import annotations

import argparse
import sys

from ..connect.remote import default_address, job_logs, job_status


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("job_id", help="the job id that `submit --address` printed")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")
    p.add_argument("--address", default=None,
                   help="Ray dashboard URL (default: $RAY_ADDRESS, else http://127.0.0.1:8265)")


def run(args: argparse.Namespace) -> int:
    address = args.address or default_address()
    for chunk in job_logs(address, args.job_id, follow=args.follow):
        sys.stdout.write(chunk)
        sys.stdout.flush()
    if not args.follow:
        return 0
    # Following ends with the job: exit like it did, so scripts can chain on `logs --follow`.
    job = job_status(address, args.job_id)[0]
    if job.status != "SUCCEEDED":
        print(f"job {args.job_id} {job.status.lower()}" + (f": {job.message}" if job.message else ""), file=sys.stderr)
        return 1
    return 0
