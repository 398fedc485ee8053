"""`submit JOB [key=value ...]`: run a training job on the embedded cluster or a Ray cluster."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", help="job file, e.g. jobs/llm.yaml")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. train.max_steps=100")
    p.add_argument(
        "--address", metavar="URL",
        help="submit to a Ray cluster's Jobs API (e.g. http://HEAD:8265) and return; "
             "the driver then runs on the cluster (see `status`, `logs`, `stop`)",
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
    from ..runtime.driver import latest_whole_checkpoint

    root = Path(run_dir)
    if not root.is_dir():
        raise CheckpointError(f"--resume {run_dir}: no such run directory")
    for candidate in (root / "checkpoints", root):
        found = latest_whole_checkpoint(str(candidate), Console(stderr=True))
        if found:
            return found[0]
    raise CheckpointError(f"--resume {run_dir}: no whole checkpoint under {root / 'checkpoints'}")


def _stop_on_sigterm() -> None:
    """`stop` (and schedulers) end the driver with SIGTERM: turn it into KeyboardInterrupt so
    the driver's cleanup runs (actors and placement group released, run directory closed)."""
    import signal

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def run(args: argparse.Namespace) -> int:
    if args.address:
        from ..remote import submit_remote

        if args.resume:
            from ..errors import ConfigError

            raise ConfigError("--resume reads a local run directory; with --address, resume on the cluster instead")
        job_id = submit_remote(args.address, args.job, args.overrides)
        print(f"submitted {job_id} to {args.address}")
        print(f"follow it with: python -m orchestrator logs {job_id} --follow --address {args.address}")
        return 0

    from ..config import load_config

    _stop_on_sigterm()
    cfg = load_config(args.job, args.overrides)
    submit_job(cfg, args.resume)
    return 0


def submit_job(cfg, resume_dir: str | None = None, model_fn=None) -> dict:
    """Measure the model, connect, create the run directory and run the driver: the one path of
    the `submit` command and of `orchestrator.submit` in Python. Returns the run's summary."""
    from rich.console import Console

    from ..cluster import connect
    from ..model_source import inside_ray_job, model_modules
    from ..rundir import RunDir
    from ..runtime.driver import measure_model, run_job

    resume = resume_checkpoint(resume_dir) if resume_dir else None
    if resume:
        from ..errors import ConfigError
        from ..runtime.checkpoint import read_meta

        step = int(read_meta(resume)["step"])
        if step >= cfg.train.max_steps:
            raise ConfigError(
                f"key 'train.max_steps': the checkpoint {resume} is already at step {step}; "
                f"set train.max_steps above {step} to train on"
            )
    # soft_wrap: a log file or CI keeps long lines (paths) whole instead of folding at 80 columns
    console = Console(soft_wrap=True)
    need_cpus = cfg.cluster.num_workers * cfg.cluster.cpus_per_worker
    # A model that breaks the contract fails here, in one line, before any cluster or run directory.
    spec = measure_model(cfg, model_fn)
    # The user's model module travels with the job (a Jobs API entrypoint's own env carries it already).
    modules = [] if inside_ray_job() else model_modules(cfg.model, model_fn)
    runtime_env = {"py_modules": modules} if modules else None
    with connect(cfg.cluster.address, num_cpus=need_cpus, dashboard=cfg.monitor.dashboard,
                 runtime_env=runtime_env) as dashboard_url:
        # Created once a cluster is there: a failed connect leaves no empty run directory behind.
        run_dir = RunDir.create(cfg.monitor.runs_dir, cfg.name)
        console.print(f"run directory: {run_dir.path}", markup=False)
        return run_job(cfg, run_dir, console, dashboard_url, resume_from=resume, model_fn=model_fn, spec=spec)
