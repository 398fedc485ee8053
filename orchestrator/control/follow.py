"""Following a running world from the driver: every rank's step loop is started, and what the
ranks report through the metrics sink is turned into metrics.jsonl, the progress bar and the
straggler report until the world ends. How it ended is returned, never raised: every rank
returned (`Finished`); a rank's future failed, or no step came for too long, a hang (`Failed`);
more devices were alive at a checkpoint (`Regrow`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..planning import Plan
from ..record.console_view import ConsoleView
from ..record.progress import ProgressView
from ..record.report import RANK_TIMES, LiveReport
from ..record.run_state import COLLAPSING_IMBALANCE, EXPERT_LOAD_KEYS, METRIC_KEYS, RunState, where
from ..record.rundir import RunDir
from ..record.startup_clock import Phases
from ..record.straggler import StragglerTracker
from ..runtime.messages import Committed, Evaluated, Message, RankTimes, Stepped
from . import supervise
from .failures import Regrow, WorkerFailure
from .job_context import JobContext


@dataclass(frozen=True)
class Finished:
    """Every rank returned from its step loop."""

    finals: list[dict[str, Any]]
    """Each rank's final report, by rank."""


@dataclass(frozen=True)
class Failed:
    """A world that failed: in setup, or while training."""

    failure: WorkerFailure
    """Who failed and how."""
    train_refs: list | None = None
    """Every rank's step-loop future when it failed while training (the survivors' end as they
    leave the broken group); None when it failed before its ranks started their steps."""
    before_first_step: bool = True
    """Whether the world had not finished a step yet (its start-up clock still open)."""


Outcome = Finished | Failed | Regrow
"""How following a world ended."""


def follow(job: JobContext, placement, plan: Plan, state: RunState, clock: Phases | None, start: int,
           devices_at_plan: int = 0, devices_now: Callable[[], int] | None = None) -> Outcome:
    """Run every rank's step loop from `start` and follow it until the world ends: every rank
    returned, a rank died, raised or hung, or more devices than `devices_at_plan` were alive
    when a checkpoint was just committed. `clock`: the start or restart's clock, which the first
    step closes (the run's `startup`, or the restart record's breakdown)."""
    from ..runtime.worker import MetricsSink

    cfg, run, view = job.config, job.run, job.view
    actors = placement.actors
    # The sink lives beside the driver: a worker node may fail, the driver's own node may not.
    sink_class: Any = MetricsSink  # @ray.remote made it an actor class, which its own type does not say
    sink = sink_class.options(
        num_cpus=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False),
    ).remote()
    refs = [a.train.remote(start, cfg.train.max_steps, sink, job.checkpoint_root) for a in actors]
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
    report = LiveReport(run, view.warning)
    t_follow = time.monotonic()
    progress = ProgressView(cfg.train.max_steps, view.console, cfg.monitor.progress)
    try:
        with progress:
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
                consume(items, state, run, progress, cfg.monitor.log_interval)
                job.trackers.log(state)
                if stepped and clock is not None:
                    _first_step(clock, time.monotonic() - t_follow, state, view)
                    clock = None
                if stepped:
                    report.maybe()
                if timed:
                    slow = [s for s in state.stragglers.report(placed) if s["rank"] not in announced]
                    if slow:
                        announced.update(s["rank"] for s in slow)
                        view.stragglers(slow)
                errors = {}
                for ref in done:
                    try:
                        ray.get(ref)
                    except (RayActorError, RayTaskError) as err:
                        errors[rank_of[ref]] = err
                if errors:
                    dead = supervise.dead_from_futures(errors)
                    return Failed(supervise.failure_from_error(errors[min(errors)], placement, dead), refs,
                                  clock is not None)
                if not pending:
                    break
                # Grow only at a checkpoint boundary: the checkpoint just committed is where the
                # larger world resumes, so (almost) nothing is recomputed.
                if saved and devices_now is not None and (now := devices_now()) > devices_at_plan:
                    return Regrow(devices_at_plan, now, saved[-1][1], saved[-1][0])
                if watchdog.hung():
                    return Failed(supervise.hang_failure(run, placement, watchdog.timeout_s, state.last_step), refs,
                                  clock is not None)
                # A rank that stopped answering stalls the group at its next collective: once no
                # step has finished for as long, it is hung, whatever the step timeout says.
                if (heartbeat is not None and (silent := heartbeat.silent())
                        and watchdog.quiet_s() >= e.silent_after_s):
                    hung = supervise.hang_failure(run, placement, e.silent_after_s, state.last_step, silent)
                    return Failed(hung, refs, clock is not None)
        return Finished(ray.get(refs))
    finally:
        _last_items(sink, state, run, progress, cfg.monitor.log_interval)
        job.trackers.log(state)
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


def _first_step(clock: Phases, seconds: float, state: RunState, view: ConsoleView) -> None:
    """The first step after a start or restart closes its clock (record/startup_clock.py)."""
    clock.add("first_step_s", seconds)
    breakdown = clock.finish()
    if clock.record is None:
        state.startup = breakdown
    else:
        view.recovered(breakdown)


def _name_collapsing_router(row: dict[str, Any], previous: dict[str, Any] | None, view: ProgressView) -> None:
    """A warning the step an MoE layer's imbalance first reaches COLLAPSING_IMBALANCE (again
    after it fell below): the layer, its busiest expert and the figure."""
    def worst(r: dict[str, Any] | None) -> float:
        return max(r.get("expert_imbalance") or [0.0]) if r else 0.0

    if worst(row) < COLLAPSING_IMBALANCE or worst(previous) >= COLLAPSING_IMBALANCE:
        return
    layer = max(range(len(row["expert_imbalance"])), key=lambda i: row["expert_imbalance"][i])
    tokens = row["expert_tokens"][layer]
    busiest = max(range(len(tokens)), key=lambda e: tokens[e])
    view.console.print(f"[yellow]warning:[/] step {row['step']}: the router of MoE layer {layer} is collapsing: "
                       f"expert {busiest} got {tokens[busiest]} of {sum(tokens)} routed tokens, "
                       f"{row['expert_imbalance'][layer]:.1f}x the mean (max/mean imbalance)", markup=True)


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
            state.stragglers.add(it.rank, list(it.times))
            # `world`: restarts so far; a restarted world numbers its ranks afresh.
            run.append_jsonl(RANK_TIMES, [{"rank": it.rank, "world": len(state.restarts), "step_s": s,
                                           "exposed_comm_s": c} for s, c in it.times])
        elif isinstance(it, Stepped):
            row: dict[str, Any] = {k: it.row.get(k) for k in METRIC_KEYS}
            row.update({k: it.row[k] for k in EXPERT_LOAD_KEYS if k in it.row})
            _name_collapsing_router(row, state.rows[-1] if state.rows else None, view)
            state.rows.append(row)
            if row["val_loss"] is not None:
                state.val.append((row["step"], row["val_loss"]))
            view.update(row, state.val[-1][1] if state.val else None)
            if row["step"] % every == 0 or row["val_loss"] is not None:
                rows.append(row)
    run.append_jsonl("metrics.jsonl", rows)
