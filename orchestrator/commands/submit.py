"""`submit JOB [key=value ...]`: run a training job on the embedded cluster or a Ray cluster."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", help="job file, e.g. jobs/llm.yaml")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. train.max_steps=100")
    p.add_argument(
        "--address", metavar="URL",
        help="submit to a Ray cluster's Jobs API (e.g. http://HEAD:8265) and return; "
             "the driver then runs on the cluster (see `status`, `logs`, `stop`)",
    )
    p.add_argument(
        "--verbose", action="store_true",
        help="show every line the workers print, live (they are always in RUN_DIR/logs/rank-N.log); "
             "without it the console shows worker errors and the first of each distinct warning",
    )
    p.add_argument(
        "--rehearse", action="store_true",
        help="plan the job, rehearse one training step of the plan here (as `plan --rehearse` does) and stop "
             "before any worker starts",
    )
    p.add_argument(
        "--resume", metavar="RUN_DIR",
        help="continue from the latest whole checkpoint of an earlier run (its directory is only read)",
    )


def resume_checkpoint(run_dir: str) -> str:
    """The latest whole checkpoint of a run directory (or of a checkpoints directory)."""
    from pathlib import Path

    from rich.console import Console

    from ..errors import CheckpointError
    from ..record.checkpoint_scan import latest_whole_checkpoint

    if "://" in run_dir:  # an object store: no directories to test, only objects under a prefix
        root = run_dir.rstrip("/")
    elif not Path(run_dir).is_dir():
        raise CheckpointError(f"--resume {run_dir}: no such run directory")
    else:
        root = str(Path(run_dir))
    for candidate in (f"{root}/checkpoints", root):
        found = latest_whole_checkpoint(candidate, Console(stderr=True))
        if found:
            return found[0]
    raise CheckpointError(f"--resume {run_dir}: no whole checkpoint under {root}/checkpoints or {root}")


def run(args: argparse.Namespace) -> int:
    if args.rehearse:
        return _rehearse_only(args)
    if args.address:
        from ..connect.remote import submit_remote

        if args.resume:
            from ..errors import ConfigError

            raise ConfigError("--resume reads a local run directory; with --address, resume on the cluster instead")
        job_id, cfg = submit_remote(args.address, args.job, args.overrides, verbose=args.verbose)
        print(f"submitted {job_id} to {args.address}")
        if "://" not in cfg.monitor.runs_dir and not Path(cfg.monitor.runs_dir).expanduser().is_absolute():
            print(f"its run directory will be under ~/{cfg.monitor.runs_dir} on the head node "
                  f"(`status {job_id}` names it)")
        print(f"follow it with: python -m orchestrator logs {job_id} --follow --address {args.address}")
        return 0

    from ..config import load_config
    from ..connect.job_driver import run_from_snapshot
    from ..control.signals import stop_on_sigterm

    # A driver that `submit --address` started goes on from its own copy of the shipped files.
    run_from_snapshot(sys.argv[1:])
    stop_on_sigterm()
    cfg = load_config(args.job, args.overrides)
    submit_job(cfg, args.resume, job=args.job, verbose=args.verbose)
    return 0


def _rehearse_only(args: argparse.Namespace) -> int:
    """`submit --rehearse`: the plan and its rehearsal, exactly as `plan JOB --rehearse` shows them."""
    from ..errors import ConfigError
    from . import plan

    if args.address or args.resume:
        raise ConfigError("--rehearse runs the plan's step in this process and stops before training; "
                          "drop --address and --resume")
    plan_args = argparse.Namespace(job=args.job, overrides=list(args.overrides), topology=None, nodes=None, gpu=None,
                                   json=False, svg=None, rehearse=True)
    code = plan.run(plan_args)
    print("stopped before training (--rehearse)")
    return code


def submit_job(cfg, resume_dir: str | None = None, model_fn=None, job: str | None = None,
               verbose: bool = False) -> dict:
    """Measure the model, connect, create the run directory and run the driver: the one path of
    the `submit` command and of `orchestrator.submit` in Python. Returns the run's summary.
    `job` names the job file in the hint a stopped run prints; `verbose` shows every worker line."""
    from rich.console import Console

    from ..connect.cluster import connect
    from ..connect.remote import RUN_DIR_LINE, RUN_NAME_ENV
    from ..control.preflight import start_measuring
    from ..control.signals import stop_on_sigterm
    from ..control.store_probe import check_job_stores
    from ..record.rundir import RunDir, anchored
    from ..record.worker_logs import WorkerLogs
    from ..workloads.source import inside_ray_job, model_modules

    cfg.monitor.runs_dir = anchored(cfg.monitor.runs_dir)
    cfg.checkpoint.path = anchored(cfg.checkpoint.path)
    check_job_stores(cfg)  # a missing bucket, refused credentials or an unreachable endpoint: one line, now
    resume = resume_checkpoint(resume_dir) if resume_dir else None
    if resume:
        from ..errors import ConfigError
        from ..runtime.checkpoint_files import read_meta

        step = int(read_meta(resume)["step"])
        if step >= cfg.train.max_steps:
            raise ConfigError(
                f"key 'train.max_steps': the checkpoint {resume} is already at step {step}; "
                f"set train.max_steps above {step} to train on"
            )
    # soft_wrap: a log file or CI keeps long lines (paths) whole instead of folding at 80 columns
    console = Console(soft_wrap=True)
    if cfg.checkpoint.export:
        from ..control.export import check_exportable

        check_exportable(cfg.model)  # refused before training, not after it
    need_cpus = cfg.cluster.num_workers * cfg.cluster.cpus_per_worker
    if cfg.parallel.calibration:
        from ..planning.calibration import load as load_calibration

        load_calibration(cfg.parallel.calibration)  # a bad one is refused before anything starts
    # Measured while Ray starts; a model that breaks the contract still fails in one line, and
    # leaves neither a cluster nor a run directory behind.
    measuring = start_measuring(cfg, model_fn)
    # The user's model module travels with the job (a Jobs API entrypoint's own env carries it already).
    modules = [] if inside_ray_job() else model_modules(cfg.model, model_fn)
    runtime_env = {"py_modules": modules} if modules else None
    # Named before Ray starts so the dashboard's Jobs page can name it; removed again (it is
    # still empty) when no cluster is there, so a failed connect leaves nothing behind.
    runs_existed = Path(cfg.monitor.runs_dir).exists()
    run_dir = RunDir.create(cfg.monitor.runs_dir, cfg.name, exact=os.environ.get(RUN_NAME_ENV))
    with ExitStack() as cluster:
        t_ray = time.monotonic()
        try:
            dashboard_url = cluster.enter_context(connect(
                cfg.cluster.address, num_cpus=need_cpus, dashboard=cfg.monitor.dashboard, runtime_env=runtime_env,
                metadata={"job_name": cfg.name, "run_dir": str(run_dir.path)}))
            t_measured = time.monotonic()
            spec = measuring.result()
        except BaseException:
            run_dir.path.rmdir()
            if not runs_existed:
                with contextlib.suppress(OSError):  # another submit's run may be in it by now
                    run_dir.path.parent.rmdir()
            raise
        # What start-up waited for: the connection, then what measuring the model took longer
        # (nothing for the built-in GPT, which is priced from its config: spec None).
        ray_start_s = t_measured - t_ray
        measure_s = time.monotonic() - t_measured if spec is not None else 0.0
        stop_on_sigterm()  # again: ray.init replaced it with Ray's own
        console.print(f"{RUN_DIR_LINE}{run_dir.path}", markup=False)
        with WorkerLogs(run_dir, console, verbose=verbose):
            summary = _run_until_stopped(cfg, job, run_dir, console, dashboard_url, resume, model_fn, spec,
                                         ray_start_s=ray_start_s, measure_s=measure_s)
    if cfg.checkpoint.export:
        from ..control.export import export_run

        with console.status("exporting the final weights"):
            out = export_run(run_dir.path, run_dir.path / "export")
        console.print(f"exported the final weights to {out}", markup=False)
    return summary


def _run_until_stopped(cfg, job: str | None, run_dir, console, dashboard_url: str | None, resume: str | None,
                       model_fn=None, spec=None, ray_start_s: float | None = None, measure_s: float = 0.0) -> dict:
    """The run; stopped by SIGTERM or Ctrl-C, it is recorded as stopped before the exit (the
    driver has released its actors and placement group by then)."""
    from ..control.driver import run_job
    from ..control.signals import signal_name
    from ..record.report import write_report
    from ..record.stopped import stopped_summary

    t0 = time.monotonic()
    try:
        return run_job(cfg, run_dir, console, dashboard_url, resume_from=resume, model_fn=model_fn, spec=spec,
                       ray_start_s=ray_start_s, measure_s=measure_s)
    except KeyboardInterrupt as e:
        name = signal_name(e)
        summary = stopped_summary(cfg, run_dir, name, time.monotonic() - t0, resume)
        run_dir.write_json("summary.json", summary)
        write_report(run_dir)
        said = f"stopped by {name} at step {summary['steps']}/{cfg.train.max_steps}; "
        if summary["checkpoints"]:
            said += f"last checkpoint {summary['checkpoints'][-1]}; continue with "
            said += f"`python -m orchestrator submit {job or 'JOB'} --resume {run_dir.path}`"
        else:
            said += "no checkpoint was committed yet"
        console.print(said, markup=False)
        raise
