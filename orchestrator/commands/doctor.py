"""`doctor`: check every node of a cluster (or captures of them) before a long job.

Without `--from` it runs the per-node check on every alive Ray node (joining `--address`, or a
private local cluster when none is given) and measures the links; with `--from FILE` it runs the
wiring checks on captures. It prints one verdict per node (ok / warn / fail, each reason in one
line), writes the whole report to `--out` (doctor.json), and exits 1 when a node fails.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from ..errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--from", dest="from_file", metavar="FILE", action="append",
                        help="check the wiring of a capture instead of a live cluster (topology JSON, NCCL topology "
                             "XML or `nvidia-smi topo -m` text); give it once per capture")
    parser.add_argument("--gpu", dest="gpu_name", metavar="NAME",
                        help="GPU model for captures that do not name it, as NVML names it")
    parser.add_argument("--address", default=None,
                        help="Ray cluster to check: `auto` or host:port (default: a private local cluster)")
    parser.add_argument("--out", default="doctor.json", metavar="FILE",
                        help="where to write the report (default: doctor.json)")
    parser.add_argument("--full", action="store_true",
                        help="larger matrices and messages: slower, closer to a training step's sizes")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(soft_wrap=True)
    out = Path(args.out)
    if not out.parent.is_dir():
        raise UserError(f"--out {args.out}: no such directory {out.parent}")
    t0 = time.perf_counter()
    if args.from_file:
        if args.address or args.full:
            raise UserError("--address and --full check a live cluster; they do not apply to --from FILE")
        from ..control.doctor import check_captures

        figures: dict[str, Any] = {}
        reports = check_captures(args.from_file, args.gpu_name)
    else:
        from ..connect.cluster import connect
        from ..control.doctor import check_cluster

        with connect(args.address, name="--address"), console.status("checking nodes") as status:
            reports, figures = check_cluster(quick=not args.full, progress=status.update)
    report = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "seconds": round(time.perf_counter() - t0, 1),
              "nodes": [r.to_dict() for r in reports], **figures}
    _write(out, report)
    colour = {"ok": "green", "warn": "yellow", "fail": "red"}
    for r in reports:
        console.print(f"[{colour[r.verdict]}]{r.verdict:4}[/] {r.name}", highlight=False)
        for reason in r.to_dict()["reasons"]:
            console.print(f"     {reason}", markup=False, highlight=False)
        if r.details.get("note"):
            console.print(f"     {r.details['note']}", markup=False, highlight=False)
    if "network" in figures:
        console.print(f"network: all-reduce {figures['network']['all_reduce_bus_gbps']:.2f} GB/s per node, "
                      f"{figures['network']['latency_us']:.0f} us", highlight=False)
    console.print(f"report: {out}", markup=False, highlight=False)
    return 1 if any(r.verdict == "fail" for r in reports) else 0


def _write(path: Path, report: dict) -> None:
    """Write atomically: an earlier report at `path` is replaced whole or not at all."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(report, f, indent=2, default=str)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
