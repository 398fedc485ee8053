"""The driver of one job: probe, plan, place, run, record.

It runs wherever `submit` runs (the user's shell, or a Ray job on the head node), holds no
training state itself, and writes everything to the run directory as it goes.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..config import JobConfig, to_yaml
from ..errors import CheckpointError, ConfigError, PlanError, RunFailed
from ..planning import Plan, plan_job
from ..planning.cluster_view import plannable
from ..planning.model_spec import ModelSpec
from ..rundir import RunDir
from . import supervise
from .curve import loss_svg
from .metrics import record_restart
from .progress import ProgressView
from .straggler import StragglerTracker, describe


@dataclass
class RunState:
    """What the driver has seen of the run so far (across restarts)."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    """One metrics row per completed step, as written to metrics.jsonl."""
    stragglers: StragglerTracker = field(default_factory=StragglerTracker)
    """Every rank's own step and exposed-communication times (the current world's ranks)."""
    val: list[tuple[int, float]] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)
    restarts: list[dict[str, Any]] = field(default_factory=list)
    model_fn: Callable[..., Any] | None = None
    """The model factory the Python API passed (shipped to the workers by pickling); None: `model.factory`."""
    spec: ModelSpec | None = None
    """The measured model the planner prices; None for the built-in GPT (its formulas)."""

    @property
    def last_step(self) -> int:
        return self.rows[-1]["step"] if self.rows else 0

    def rewind(self, step: int) -> None:
        """Forget what happened after `step`: a resumed run recomputes those steps."""
        self.rows = [r for r in self.rows if r["step"] <= step]
        self.val = [v for v in self.val if v[0] <= step]


class WorkerFailure(Exception):
    """A worker actor died or a rank raised while training."""

    def __init__(self, reason: str, ranks: list[int], nodes: list[str], detected_unix_s: float | None = None,
                 stacks: str | None = None) -> None:
        super().__init__(reason)
        self.reason, self.ranks, self.nodes = reason, ranks, nodes
        self.detected_unix_s = detected_unix_s or time.time()
        """When the driver saw the failure (before asking who is to blame)."""
        self.detected_at = _now(self.detected_unix_s)
        self.stacks = stacks
        """The run-directory folder with every rank's stacks (a hang), else None."""


class Regrow(Exception):
    """More devices are alive than the running plan was made for: re-plan from the checkpoint
    just committed (not a failure: it does not count against train.max_failures)."""

    def __init__(self, before: int, now: int, checkpoint: str, step: int) -> None:
        super().__init__(f"grow: {now} devices available, the plan was made for {before}")
        self.reason, self.checkpoint, self.step = str(self), checkpoint, step


def _now(t: float | None = None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t))


def _use_gpu(topology) -> bool:
    kinds = {d.kind for n in topology.nodes for d in n.devices}
    return kinds == {"gpu"} and ray.cluster_resources().get("GPU", 0) >= 1


def measure_model(cfg: JobConfig, model_fn: Callable[..., Any] | None = None) -> ModelSpec | None:
    """The model's spec, measured on the meta device; None for the built-in GPT. ConfigError
    (one line naming the key) for a model that breaks the contract."""
    from ..workloads.inspect import is_builtin_gpt, model_spec

    if is_builtin_gpt(cfg.model, model_fn):
        return None
    spec = model_spec(cfg.model, model_fn)
    if isinstance(cfg.parallel.pp, int) and cfg.parallel.pp > 1:
        _check_pipeline_contract(cfg, model_fn)
    return spec


def _check_pipeline_contract(cfg: JobConfig, model_fn: Callable[..., Any] | None) -> None:
    """A forced pipeline needs a model that names its ends: refused here, in one line, before
    any worker starts."""
    import torch

    from ..workloads.models import build_model
    from .pipeline import pipeline_parts

    with torch.device("meta"):
        model = build_model(cfg.model, model_fn)
    try:
        pipeline_parts(model)
    except PlanError as e:
        raise ConfigError(f"key 'parallel.pp': {e}") from None


def _plan(cfg: JobConfig, topology, run: RunDir, left_out=(), spec: ModelSpec | None = None):
    """The plan that keeps the global batch on the part of `topology` it uses (`elastic`), and
    that part; plan.json is written even when refused: it says why."""
    from .elastic import plan_keeping_batch

    try:
        plan, used, note = plan_keeping_batch(cfg, topology, spec, left_out)
    except PlanError:
        try:
            run.write_json("plan.json", plan_job(cfg, topology, spec, left_out=left_out).to_dict())
        except PlanError:
            pass
        raise
    if note:
        plan = replace(plan, explanation=tuple(plan.explanation) + (note,))
    run.write_json("plan.json", plan.to_dict())
    return plan, used, note


def _steady_mean(values: list[float]) -> float:
    """Mean over the steps after the first few (which include warm-up and allocation)."""
    tail = values[min(len(values) // 5, 10):] or values
    return sum(tail) / len(tail) if tail else float("nan")


def latest_whole_checkpoint(root: str, console: Console) -> tuple[str, int] | None:
    """The newest checkpoint under `root` that verifies (hashed in parallel across the nodes);
    damaged ones are named and skipped."""
    from . import checkpoint
    from .verify import verify_parallel

    for path in reversed(checkpoint.committed(root)):
        try:
            meta = verify_parallel(path)
        except CheckpointError as e:
            console.print(f"[yellow]warning:[/] {escape(str(e))}; trying the previous checkpoint")
            continue
        return path, int(meta["step"])
    return None


def run_job(
    cfg: JobConfig,
    run: RunDir,
    console: Console,
    dashboard_url: str | None = None,
    resume_from: str | None = None,
    model_fn: Callable[..., Any] | None = None,
    spec: ModelSpec | None = None,
) -> dict[str, Any]:
    """Run the job on the connected Ray cluster, restarting after failures up to
    `train.max_failures` times; returns the summary written to summary.json. `model_fn` builds
    the model instead of `model.factory` (the Python API); `spec` is its measurement
    (`measure_model`), made here when not given."""
    t_start = time.monotonic()
    state = RunState(model_fn=model_fn, spec=spec if spec is not None else measure_model(cfg, model_fn))
    run.write_text("config.yaml", to_yaml(cfg))
    if dashboard_url:
        console.print(f"Ray dashboard: http://{dashboard_url}")
    ckpt_dir = cfg.checkpoint.path or str(run.checkpoints)
    resume = resume_from
    while True:
        try:
            plan, setups, finals, reports = _attempt(cfg, run, console, state, ckpt_dir, resume)
            break
        except PlanError:
            if state.restarts:  # the world shrank below what the job can run on: the summary says so too
                run.write_json("summary.json", {"job": cfg.name, "failed": True, "restarts": state.restarts})
            raise
        except Regrow as g:
            # The old world trained on until its actors were gone and may have committed a newer
            # checkpoint than the one that set off the regrow: resume from the newest whole one
            # (re-training from the older would then find its step already committed).
            found = latest_whole_checkpoint(ckpt_dir, console)
            resume, step = found if found and found[1] > g.step else (g.checkpoint, g.step)
            state.restarts.append({"time": _now(), "reason": g.reason, "ranks": [], "nodes": [], "grow": True,
                                   "failed_at_step": state.last_step, "resumed_from_step": step,
                                   "steps_lost": max(0, state.last_step - step)})
            console.print(f"[green]{escape(g.reason)}:[/] re-planning from step {step}")
            state.rewind(step)
            run.write_text("metrics.jsonl", "".join(json.dumps(r) + "\n" for r in state.rows))
        except WorkerFailure as f:
            found = latest_whole_checkpoint(ckpt_dir, console)
            if found is None and resume_from:
                from . import checkpoint

                found = (resume_from, int(checkpoint.verify(resume_from)["step"]))
            resume, resume_step = found if found else (None, 0)
            restart = {
                "time": _now(),
                "detected_at": f.detected_at,
                "detected_unix_s": f.detected_unix_s,
                "reason": f.reason,
                "ranks": f.ranks,
                "nodes": f.nodes,
                **({"stacks": f.stacks} if f.stacks else {}),
                "failed_at_step": state.last_step,
                "resumed_from_step": resume_step,
                "steps_lost": max(0, state.last_step - resume_step),
            }
            state.restarts.append(restart)
            record_restart(cfg.name)
            failures = sum(1 for r in state.restarts if not r.get("grow"))
            if failures > cfg.train.max_failures:
                run.write_json("summary.json", {"job": cfg.name, "failed": True, "restarts": state.restarts})
                raise RunFailed(
                    f"rank(s) {f.ranks} failed ({f.reason}) and train.max_failures={cfg.train.max_failures} "
                    f"restarts are used up; the last whole checkpoint is {resume or 'none'}"
                ) from f
            console.print(
                f"[red]failure:[/] {escape(f.reason)} (ranks {f.ranks}); restart {failures}/"
                f"{cfg.train.max_failures} from " + (f"step {resume_step} ({escape(resume)})" if resume else
                                                    "step 0: no checkpoint was written yet")
            )
            state.rewind(resume_step)
            run.write_text("metrics.jsonl", "".join(json.dumps(r) + "\n" for r in state.rows))

    wall = time.monotonic() - t_start
    summary = _summary(cfg, plan, state, setups, finals, wall, reports)
    if resume_from:
        summary["resumed_from"] = resume_from
    run.write_json("summary.json", summary)
    train = [(r["step"], r["loss"]) for r in state.rows]
    run.write_text("loss.svg", loss_svg(train, state.val, f"{cfg.name}: {plan.strategy} on {plan.world_size} workers",
                                        [r["resumed_from_step"] for r in state.restarts]))
    _print_summary(console, summary, run)
    return summary


def _attempt(cfg: JobConfig, run: RunDir, console: Console, state: RunState, ckpt_dir: str, resume: str | None):
    """One probe -> plan -> place -> train pass; raises WorkerFailure when a rank dies."""
    from ..placement import place
    from ..topology.cluster_probe import probe_cluster

    with console.status("probing the cluster topology" + (" and timing its links" if cfg.cluster.measure else "")):
        topology = probe_cluster(measure=cfg.cluster.measure, num_cpu_slots=cfg.cluster.num_workers)
    run.write_text("topology.json", topology.to_json())
    for warning in dict.fromkeys(w for n in topology.nodes for w in n.warnings if _shown(w)):
        console.print(f"[yellow]warning:[/] {escape(warning)}")
    # GPU-less nodes (a CPU head) run no rank of a GPU plan: the one rule, in `plannable`.
    view, left_out = plannable(topology)
    use_gpu = _use_gpu(view)
    view = _elastic(cfg, view)
    devices_at_plan = view.num_devices
    plan, view, note = _plan(cfg, view, run, left_out, state.spec)
    for x in plan.left_out:
        console.print(f"left out: {escape(str(x))}")
    if note:
        console.print(f"[yellow]note:[/] {escape(note)}")
    console.print(
        f"plan: [bold]{plan.strategy}[/] on {plan.world_size} {'GPUs' if use_gpu else 'CPU workers'} "
        f"({plan.mesh}), micro-batch {plan.micro_batch_size} x {plan.sync.grad_accum_steps} accumulation steps"
    )
    with console.status(f"placing {plan.world_size} workers"):
        placement = place(
            plan, job=cfg.name, use_gpu=use_gpu, cpus_per_worker=cfg.cluster.cpus_per_worker,
            threads_per_worker=max(1, int(cfg.cluster.cpus_per_worker)),
            timeout_s=cfg.cluster.placement_timeout_s,
        )
    affinity = _cpu_affinity(plan, topology)
    nccl = _nccl(plan, topology)
    try:
        run.write_json("placement.json", placement.reports)
        actors = placement.actors
        try:
            master = ray.get(actors[0].rendezvous_address.remote())
            with console.status("starting the process group and building the model"):
                setups = ray.get([
                    a.setup.remote(cfg, plan, master, resume, affinity[r] if use_gpu else None, nccl[r],
                                   state.model_fn)
                    for r, a in enumerate(actors)
                ])
        except (RayActorError, RayTaskError) as e:
            _raise_failure(e, placement)
        for report, setup in zip(placement.reports, setups):
            # What each rank set up for itself: the GPUs it exposes to NCCL, the CPUs it runs on.
            report.update(visible_gpus=setup["visible_gpus"], cpus=setup["cpus"], backend=setup["backend"],
                          nccl_env=setup["nccl_env"])
        run.write_json("placement.json", placement.reports)
        for note in _notes(setups):
            console.print(f"[yellow]note:[/] {escape(note)}")
        start = setups[0]["start_step"]
        if resume:
            console.print(f"resumed from {escape(resume)} at step {start}")
        grow = (lambda: _devices_now(cfg)) if use_gpu else None
        finals = _train(cfg, run, console, placement, plan, state, start, ckpt_dir, devices_at_plan, grow)
        ray.get([a.shutdown.remote() for a in actors])
    finally:
        placement.release()
    return plan, setups, finals, placement.reports


def _devices_now(cfg: JobConfig) -> int:
    """GPUs on the cluster's alive nodes now, up to elastic.max_workers."""
    gpus = int(sum(n.get("Resources", {}).get("GPU", 0) for n in ray.nodes() if n.get("Alive")))
    return min(gpus, cfg.elastic.max_workers) if cfg.elastic.max_workers else gpus


def _shown(warning: str) -> bool:
    """Probe warnings the driver repeats: those about NICs a node declares but lacks."""
    from ..topology.local import MISSING_NIC_WARNING

    return MISSING_NIC_WARNING in warning


def _notes(setups: list[dict[str, Any]]) -> list[str]:
    """Every rank's notes, each said once, in rank order."""
    return list(dict.fromkeys(n for s in setups for n in s["notes"]))


def _cpu_affinity(plan: Plan, topology) -> list[str | None]:
    """Each rank's CPU list near its device, as the probe found it (None when unknown)."""
    by_node = {n.node_id: {d.index: d.cpu_affinity for d in n.devices} for n in topology.nodes}
    return [by_node.get(r.node, {}).get(r.gpu) for r in plan.ranks]


def _nccl(plan: Plan, topology) -> list:
    """Each rank's NCCL settings, decided per node from its probed topology (`nccl_env`)."""
    from .nccl_env import nccl_setup

    multi = len(set(plan.node_of_rank)) > 1
    by_node = {n.node_id: nccl_setup(n, multi) for n in topology.nodes if n.node_id in set(plan.node_of_rank)}
    return [by_node.get(r.node) for r in plan.ranks]


def _elastic(cfg: JobConfig, topology):
    """The part of the cluster this job may use: at most elastic.max_workers devices (whole
    nodes first, then the lowest device indices of the next node), at least min_workers."""
    devices = topology.num_devices
    if devices < cfg.elastic.min_workers:
        raise PlanError(
            f"the cluster has {devices} devices, fewer than elastic.min_workers={cfg.elastic.min_workers}"
        )
    if not cfg.elastic.max_workers or devices <= cfg.elastic.max_workers:
        return topology
    return topology.limit(cfg.elastic.max_workers)


def _raise_failure(err: Exception, placement, known_dead: list[int] = ()) -> None:
    """Turn a rank's error into a WorkerFailure naming only the ranks whose actors are dead
    (or no longer answer): survivors stuck in a collective behind them are not failed."""
    detected = time.time()
    node_of = [r["node_id"] for r in placement.reports] if placement.reports else None
    who = supervise.blame(placement.actors, known_dead, node_of)
    dead = who.ranks
    nodes = _nodes_of(placement, dead)
    kind = "worker died" if dead else "rank raised"
    first = str(err).strip().splitlines()
    detail = next((ln for ln in reversed(first) if ln.strip()), type(err).__name__)[:200]
    raise WorkerFailure(f"{kind}: {detail}", dead, nodes, detected) from err


def _where(plan: Plan) -> dict[int, dict[str, Any]]:
    """Each rank's placement in the plan (node, device, NIC), for the straggler report."""
    return {r.rank: r.to_dict() for r in plan.ranks}


def _nodes_of(placement, ranks: list[int]) -> list[str]:
    return sorted({placement.reports[r]["node_id"] for r in ranks}) if placement.reports else []


def _raise_hang(run: RunDir, placement, timeout_s: float, step: int) -> None:
    """No step finished for `timeout_s`: save every rank's stacks, blame the silent ones."""
    detected = time.time()
    folder = f"stacks/restart_{step:08d}_{time.strftime('%H%M%S')}"
    who = supervise.save_stacks(placement.actors, run.path / folder)
    raise WorkerFailure(f"hang: no step finished within {timeout_s:.0f} s after step {step}; stacks in {folder}",
                        who.ranks, _nodes_of(placement, who.ranks), detected, folder)


def _train(cfg: JobConfig, run: RunDir, console: Console, placement, plan: Plan, state: RunState, start: int,
           ckpt_dir: str, devices_at_plan: int = 0, devices_now=None) -> list[dict[str, Any]]:
    """Run every rank's step loop and follow it through the metrics sink until all return:
    a rank's future failing is the failure signal, no step for too long is a hang."""
    from .worker import MetricsSink

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
    where = _where(plan)
    announced: set[int] = set()
    e = cfg.elastic
    watchdog = supervise.Watchdog(supervise.hang_timeout_s(plan.step_time.total_s, e.hang_factor, e.hang_floor_s))
    try:
        with ProgressView(cfg.train.max_steps, console, cfg.monitor.progress) as view:
            while True:
                done, pending = ray.wait(pending, num_returns=1, timeout=0.5)
                if done:  # take whatever else finished with it, so every dead rank is seen at once
                    more, pending = ray.wait(pending, num_returns=len(pending), timeout=0) if pending else ([], [])
                    done += more
                items = ray.get(sink.drain.remote())
                if items:
                    watchdog.progressed()
                saved = [(it["step"], it["path"]) for it in items if it["kind"] == "checkpoint"]
                timed = any(it["kind"] == "times" for it in items)
                _consume(items, state, run, view, cfg.monitor.log_interval)
                if timed:
                    slow = [s for s in state.stragglers.report(where) if s["rank"] not in announced]
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
                    first = errors[min(errors)]
                    _raise_failure(first, placement, supervise.dead_from_futures(errors))
                if not pending:
                    break
                # Grow only at a checkpoint boundary: the checkpoint just committed is where the
                # larger world resumes, so (almost) nothing is recomputed.
                if saved and devices_now is not None and (now := devices_now()) > devices_at_plan:
                    raise Regrow(devices_at_plan, now, saved[-1][1], saved[-1][0])
                if watchdog.hung():
                    _raise_hang(run, placement, watchdog.timeout_s, state.last_step)
        return ray.get(refs)
    finally:
        ray.kill(sink)


def _consume(items: list[dict[str, Any]], state: RunState, run: RunDir, view: ProgressView, every: int) -> None:
    rows = []
    for it in items:
        kind = it.pop("kind")
        if kind == "end":
            continue
        if kind == "eval":
            state.val.append((it["step"], it["val_loss"]))
        elif kind == "checkpoint":
            state.checkpoints.append(it["path"])
        elif kind == "times":
            state.stragglers.add(it["rank"], [tuple(t) for t in it["times"]])
        elif kind == "step":
            row = {k: it.get(k) for k in ("step", "time", "loss", "lr", "tokens_per_s", "step_s", "exposed_comm_s",
                                          "grad_norm", "mfu", "val_loss")}
            state.rows.append(row)
            if row["val_loss"] is not None:
                state.val.append((row["step"], row["val_loss"]))
            view.update(row, state.val[-1][1] if state.val else None)
            if row["step"] % every == 0 or row["val_loss"] is not None:
                rows.append(row)
    run.append_jsonl("metrics.jsonl", rows)


def _summary(cfg, plan: Plan, state: RunState, setups, finals, wall: float, reports) -> dict[str, Any]:
    first_val = state.val[0][1] if state.val else None
    final_val = state.val[-1][1] if state.val else None
    measured_step = _steady_mean([r["step_s"] for r in state.rows])
    predicted = plan.step_time.total_s
    measured_mem = [f["state_bytes"] for f in finals]
    warnings = []
    if predicted and math.isfinite(measured_step) and not (0.5 <= measured_step / predicted <= 2.0):
        warnings.append(f"measured step time {measured_step:.3g}s differs from the plan's {predicted:.3g}s "
                        "by more than 2x")
    m = plan.memory_per_rank
    model_state_pred = m.params + m.grads + m.optimizer
    model_state_meas = max((sum(m.values()) for m in measured_mem), default=0)
    if model_state_pred and model_state_meas and not (0.5 <= model_state_meas / model_state_pred <= 2.0):
        warnings.append(f"measured model-state bytes {model_state_meas:,} differ from the plan's "
                        f"{model_state_pred:,} by more than 2x")
    return {
        "job": cfg.name,
        "strategy": str(plan.strategy),
        "world_size": plan.world_size,
        "mesh": plan.mesh.to_dict(),
        "num_params": setups[0]["num_params"],
        "backend": setups[0]["backend"],
        "steps": state.last_step,
        "first_val_loss": first_val,
        "final_val_loss": final_val,
        "val_loss_drop": (1 - final_val / first_val) if first_val and final_val is not None else None,
        "final_train_loss": state.rows[-1]["loss"] if state.rows else None,
        "tokens_per_s": _steady_mean([r["tokens_per_s"] for r in state.rows]),
        "step_s": measured_step,
        "wall_s": wall,
        "checkpoints": state.checkpoints,
        "predicted": {"step_s": predicted, "exposed_comm_s": plan.step_time.exposed_comm_s,
                      "model_state_bytes_per_rank": model_state_pred},
        "measured": {"step_s": measured_step, "exposed_comm_s": _steady_mean(
                         [r["exposed_comm_s"] for r in state.rows if r.get("exposed_comm_s") is not None]),
                     "model_state_bytes_per_rank": measured_mem},
        "notes": _notes(setups),
        "warnings": warnings,
        "nodes": sorted({r["node_id"] for r in reports}),
        "restarts": state.restarts,
        "stragglers": state.stragglers.report(_where(plan)),
    }


def _print_summary(console: Console, s: dict[str, Any], run: RunDir) -> None:
    t = Table(title=f"{s['job']}: {s['strategy']} on {s['world_size']} workers", show_header=False)
    t.add_column(style="bold")
    t.add_column(justify="right")
    fmt = lambda v, f: "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, f)  # noqa: E731
    t.add_row("parameters", fmt(s["num_params"], ","))
    t.add_row("steps", str(s["steps"]))
    t.add_row("val loss first -> last", f"{fmt(s['first_val_loss'], '.4f')} -> {fmt(s['final_val_loss'], '.4f')}")
    t.add_row("val loss drop", fmt(s["val_loss_drop"], ".1%"))
    t.add_row("tokens/s (steady)", fmt(s["tokens_per_s"], ",.0f"))
    t.add_row("step time (steady)", f"{fmt(s['step_s'] * 1000 if s['step_s'] else None, '.1f')} ms")
    if s["predicted"]["step_s"]:
        t.add_row("step time predicted", f"{s['predicted']['step_s'] * 1000:.1f} ms")
    exposed = s["measured"]["exposed_comm_s"]
    predicted_exposed = s["predicted"]["exposed_comm_s"]
    t.add_row("exposed communication", f"{fmt(exposed * 1000 if exposed == exposed else None, '.1f')} ms"
              + (f" (predicted {predicted_exposed * 1000:.1f} ms)" if predicted_exposed else ""))
    t.add_row("wall time", f"{s['wall_s']:.1f} s")
    t.add_row("last checkpoint", s["checkpoints"][-1] if s["checkpoints"] else "-")
    console.print(t)
    for w in s["warnings"]:
        console.print(f"[yellow]warning:[/] {escape(w)}")
    console.print(f"run directory: {run.path}  (loss curve: {run.path / 'loss.svg'})", markup=False)
