"""Following a running world from the driver: every rank's step loop is started, and what the
ranks report through the metrics sink is turned into metrics.jsonl, the progress bar and the
straggler report until every rank returns. A rank's future failing is the failure signal; no
step for too long is a hang; more devices alive at a checkpoint is a regrow."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from rich.console import Console
from rich.markup import escape

from ..config import JobConfig
from ..planning import Plan
from ..record.progress import ProgressView
from ..record.report import RANK_TIMES, LiveReport
from ..record.run_state import METRIC_KEYS, RunState, where
from ..record.rundir import RunDir
from ..record.startup_clock import describe as describe_phases
from ..record.straggler import StragglerTracker, describe
from ..runtime.messages import Committed, Evaluated, Message, RankTimes, Stepped
from . import supervise
from .failures import Regrow, WorkerFailure, raise_failure, raise_hang


def follow(cfg: JobConfig, run: RunDir, console: Console, placement, plan: Plan, state: RunState, start: int,
           ckpt_dir: str, devices_at_plan: int = 0,
           devices_now: Callable[[], int] | None = None) -> list[dict[str, Any]]:
    """Run every rank's step loop from `start` and follow it until all return; returns each
    rank's final report. Raises WorkerFailure (a rank died, raised or hung) or Regrow (more
    devices than `devices_at_plan` alive when a checkpoint was just committed)."""
    from ..runtime.worker import MetricsSink

    actors = placement.actors
    # The sink lives beside the driver: a worker node may fail, the driver's own node may not.
    sink = MetricsSink.options(
        num_cpus=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False),
    ).remote()
    refs = [a.train.remote(start, cfg.train.max_steps, sink, ckpt_dir) for a in actors]
    pending = list(refs)
    rank_of = {ref: r for r, ref in enumerate(refs)}
    state.stragglers = StragglerTracker()  # this world's ranks only
    placed = where(plan)
    announced: set[int] = set()
    e = cfg.elastic
    # The first step of compiled blocks compiles them: its predicted cost is allowed on top.
    watchdog = supervise.Watchdog(supervise.hang_timeout_s(plan.run_step_s, e.hang_factor, e.hang_floor_s)
                                  + plan.compile.compile_s)
    heartbeat = supervise.Heartbeat(actors, e.silent_after_s) if e.silent_after_s else None
    report = LiveReport(run, lambda msg: console.print(f"[yellow]warning:[/] {escape(msg)}"))
    t_follow = time.monotonic()
    view = ProgressView(cfg.train.max_steps, console, cfg.monitor.progress)
    try:
        with view:
            while True:
                done, pending = ray.wait(pending, num_returns=1, timeout=0.5)
                if done:  # take whatever else finished with it, so every dead rank is seen at once
                    more, pending = ray.wait(pending, num_returns=len(pending), timeout=0) if pending else ([], [])
                    done += more
                items = ray.get(sink.drain.remote())
                if items:
                    watchdog.progressed()
                saved = [(it.step, it.path) for it in items if isinstance(it, Committed)]
                timed = any(isinstance(it, RankTimes) for it in items)
                stepped = any(isinstance(it, Stepped) for it in items)
                consume(items, state, run, view, cfg.monitor.log_interval)
                if stepped and state.phases is not None:
                    _first_step(state, time.monotonic() - t_follow, console)
                if stepped:
                    report.maybe()
                if timed:
                    slow = [s for s in state.stragglers.report(placed) if s["rank"] not in announced]
                    if slow:
                        announced.update(s["rank"] for s in slow)
                        console.print(f"[yellow]straggler:[/] {escape(describe(slow))}")
                errors = {}
                for ref in done:
                    try:
                        ray.get(ref)
                    except (RayActorError, RayTaskError) as err:
                        errors[rank_of[ref]] = err
                if errors:
                    raise_failure(errors[min(errors)], placement, supervise.dead_from_futures(errors))
                if not pending:
                    break
                # Grow only at a checkpoint boundary: the checkpoint just committed is where the
                # larger world resumes, so (almost) nothing is recomputed.
                if saved and devices_now is not None and (now := devices_now()) > devices_at_plan:
                    raise Regrow(devices_at_plan, now, saved[-1][1], saved[-1][0])
                if watchdog.hung():
                    raise_hang(run, placement, watchdog.timeout_s, state.last_step)
                # A rank that stopped answering stalls the group at its next collective: once no
                # step has finished for as long, it is hung, whatever the step timeout says.
                if (heartbeat is not None and (silent := heartbeat.silent())
                        and watchdog.quiet_s() >= e.silent_after_s):
                    raise_hang(run, placement, e.silent_after_s, state.last_step, silent)
        return ray.get(refs)
    except WorkerFailure as f:
        f.train_refs = refs  # the survivors' steps, which end once they leave the broken group
        raise
    finally:
        _last_items(sink, state, run, view, cfg.monitor.log_interval)
        report.now()  # the state the attempt ended in, whatever ended it; never raises
        ray.kill(sink)


def _last_items(sink, state: RunState, run: RunDir, view: ProgressView, every: int) -> None:
    """Take what the ranks sent after the last drain. A world that failed or is regrown trained
    on until its actors were gone, and the run resumes from the newest checkpoint on disk: the
    rows up to it reached the sink with it (a checkpoint is sent with every row before it), and
    without them metrics.jsonl would skip those steps. Never raises: the attempt's own ending
    is what the caller acts on."""
    try:
        consume(ray.get(sink.drain.remote(), timeout=10), state, run, view, every)
    except Exception:  # noqa: BLE001 - a sink that cannot answer leaves the rows it had
        pass


def _first_step(state: RunState, seconds: float, console: Console) -> None:
    """The first step after a start or restart closes its clock (record/startup_clock.py)."""
    phases, state.phases = state.phases, None
    phases.add("first_step_s", seconds)
    breakdown = phases.finish()
    if phases.record is None:
        state.startup = breakdown
    else:
        console.print(f"[green]recovered[/] in {escape(describe_phases(breakdown))}")


def consume(items: list[Message], state: RunState, run: RunDir, view: ProgressView, every: int) -> None:
    """Take what the ranks reported into the run's state, the progress view and metrics.jsonl
    (every `every`-th step and every step with a validation loss)."""
    rows = []
    for it in items:
        if isinstance(it, Evaluated):
            state.val.append((it.step, it.val_loss))
        elif isinstance(it, Committed):
            state.checkpoints.append(it.path)
        elif isinstance(it, RankTimes):
            state.stragglers.add(it.rank, [tuple(t) for t in it.times])
            # `world`: restarts so far; a restarted world numbers its ranks afresh.
            run.append_jsonl(RANK_TIMES, [{"rank": it.rank, "world": len(state.restarts), "step_s": s,
                                           "exposed_comm_s": c} for s, c in it.times])
        elif isinstance(it, Stepped):
            row = {k: it.row.get(k) for k in METRIC_KEYS}
            state.rows.append(row)
            if row["val_loss"] is not None:
                state.val.append((row["step"], row["val_loss"]))
            view.update(row, state.val[-1][1] if state.val else None)
            if row["step"] % every == 0 or row["val_loss"] is not None:
                rows.append(row)
    run.append_jsonl("metrics.jsonl", rows)
