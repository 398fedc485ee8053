"""The driver of one job: probe, plan, place, run, record.

It runs wherever `submit` runs (the user's shell, or a Ray job on the head node), holds no
training state itself, and writes everything to the run directory as it goes. `run_job` is
the whole story: attempts until one finishes, each attempt the same named steps
(`_probe`, `_plan`, `_place`, `_start`, `follow`), a failure or a regrow answered by resuming
from the newest whole checkpoint, and the record of the run at the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError
from rich.console import Console
from rich.markup import escape

from ..config import JobConfig, to_yaml
from ..errors import PlanError, RunFailed
from ..planning import Plan, plan_job
from ..planning.calibration import UNCALIBRATED
from ..planning.calibration import load as load_calibration
from ..planning.cluster_view import plannable
from ..planning.mesh import Mesh
from ..planning.model_spec import ModelSpec
from ..planning.trial import pinned
from ..record.checkpoint_scan import latest_whole_checkpoint
from ..record.monitoring import announce
from ..record.progress import ProgressView
from ..record.report import write_report
from ..record.rundir import RunDir
from ..record.startup_clock import Phases
from ..record.summary import notes, print_summary, save_compile_gain, summarize, write_loss_curve
from ..runtime import checkpoint_files
from ..runtime.messages import Stepped
from ..runtime.metrics import record_restarts
from ..runtime.peer_state import PeerRestore
from ..topology.model import ClusterTopology
from . import heal, trial
from .elastic import devices_now, limit_world, plan_keeping_batch, uses_gpus
from .failures import Regrow, WorkerFailure, raise_failure
from .follow import RunState, consume, follow
from .placement import EarlyStart, Placement, claim, cpu_affinity, nccl_settings, place, start_early
from .preflight import compile_checked, measure_model


def run_job(
    cfg: JobConfig,
    run: RunDir,
    console: Console,
    dashboard_url: str | None = None,
    resume_from: str | None = None,
    model_fn: Callable[..., Any] | None = None,
    spec: ModelSpec | None = None,
    ray_start_s: float | None = None,
    measure_s: float = 0.0,
) -> dict[str, Any]:
    """Run the job on the connected Ray cluster, restarting after failures up to
    `train.max_failures` times; returns the summary written to summary.json. `model_fn` builds
    the model instead of `model.factory` (the Python API); `spec` is its measurement
    (`measure_model`), made here when not given. `ray_start_s`: the seconds the caller took to
    start (or reach) Ray just before, the start-up breakdown's first part; `measure_s`: how much
    longer measuring the model (`start_measuring`, alongside Ray's start) took, its second."""
    t_start = time.monotonic()
    calibration = load_calibration(cfg.parallel.calibration) if cfg.parallel.calibration else UNCALIBRATED
    phases = Phases(time.time() - (ray_start_s or 0.0) - measure_s)
    if ray_start_s is not None:
        phases.add("ray_start_s", ray_start_s)
    if measure_s:
        phases.add("measure_s", measure_s)
    state = RunState(model_fn=model_fn, spec=spec if spec is not None else measure_model(cfg, model_fn),
                     phases=phases, calibration=calibration)
    run.write_text("config.yaml", to_yaml(cfg))
    record_restarts(cfg.name, 0)  # a healthy run's dashboard reads 0, not "no data"
    announce(console, dashboard_url)
    ckpt_dir = cfg.checkpoint.path or str(run.checkpoints)
    resume = resume_from

    def on_failure(f: WorkerFailure, peers: PeerRestore | None = None) -> str | PeerRestore | None:
        return _after_failure(f, cfg, console, state, ckpt_dir, run, resume_from, peers)

    while True:
        try:
            plan, setups, finals, reports = _attempt(cfg, run, console, state, ckpt_dir, resume, on_failure)
            break
        except PlanError:
            if state.restarts:  # the world shrank below what the job can run on: the summary says so too
                run.write_json("summary.json", {"job": cfg.name, "failed": True, "restarts": state.restarts})
                write_report(run)
            raise
        except Regrow as g:
            resume = _after_regrow(g, console, state, ckpt_dir, run)
            state.phases = Phases(time.time(), state.restarts[-1])
        except WorkerFailure as f:
            resume = on_failure(f)
            _full_restart_clock(state, f)

    summary = summarize(cfg, plan, state, setups, finals, time.monotonic() - t_start, reports)
    if resume_from:
        summary["resumed_from"] = resume_from
    run.write_json("summary.json", summary)
    gain_line = save_compile_gain(run, plan, summary["compile"])
    write_report(run)
    write_loss_curve(run, cfg, plan, state)
    print_summary(console, summary, run)
    if gain_line:
        console.print(gain_line, markup=False)
    return summary


def _attempt(cfg: JobConfig, run: RunDir, console: Console, state: RunState, ckpt_dir: str,
             resume: str | PeerRestore | None,
             on_failure: Callable[..., str | PeerRestore | None]):
    """One probe -> plan -> place -> train pass. A failure the survivors can outlive (heal.py)
    is recovered inside it, on the same plan and placement; any other raises WorkerFailure
    once every actor is released."""
    t = time.monotonic()
    # The workers start (processes, imports, devices) while the cluster is probed and planned.
    early = start_early(job=cfg.name, num_workers=cfg.cluster.num_workers, max_workers=cfg.elastic.max_workers,
                        cpus_per_worker=cfg.cluster.cpus_per_worker, threads_per_worker=_threads(cfg),
                        measure=cfg.cluster.measure)
    try:
        topology = _probe(cfg, run, console, early.probers() if early is not None else None)
        # GPU-less nodes (a CPU head) run no rank of a GPU plan: the one rule, in `plannable`.
        view, left_out = plannable(topology)
        use_gpu = uses_gpus(view)
        view = limit_world(cfg, view)
        devices_at_plan = view.num_devices
        t_plan = time.monotonic()
        plan = _plan(cfg, view, run, console, left_out, state, use_gpu)
    except BaseException:
        if early is not None:
            early.placement.release(fence=False)
        raise
    _phase(state, "probe_s", t_plan - t)
    _phase(state, "plan_s", time.monotonic() - t_plan)
    placement = _place(cfg, plan, console, use_gpu, early)
    for name, seconds in placement.timings.items():
        _phase(state, name, seconds)
    try:
        run.write_json("placement.json", placement.reports)
        if state.trial is None:  # once per run: a restart trains what the trial chose
            plan = trial.conduct(cfg, view, topology, plan, placement, run, console, state, use_gpu, left_out)
            run.write_json("placement.json", placement.reports)
        while True:
            try:
                setups = _start(cfg, plan, topology, run, console, placement, state, resume, use_gpu)
                if state.phases is not None:
                    state.phases.add_setups(setups)
                grow = (lambda: devices_now(cfg)) if use_gpu else None
                finals = follow(cfg, run, console, placement, plan, state, setups[0]["start_step"], ckpt_dir,
                                devices_at_plan, grow)
                break
            except WorkerFailure as f:
                f.handled_unix_s = time.time()
                resume = _keep_survivors(cfg, plan, placement, f, run, console, state, on_failure)
        ray.get([a.shutdown.remote() for a in placement.actors])
    except WorkerFailure as f:
        t = time.monotonic()
        heal.kill_silent(placement, f)
        placement.release()
        f.teardown_s = time.monotonic() - t
        raise
    finally:
        placement.release()  # a second release finds nothing left to free
    return plan, setups, finals, placement.reports


def _phase(state: RunState, name: str, seconds: float) -> None:
    if state.phases is not None:
        state.phases.add(name, seconds)


def _keep_survivors(cfg: JobConfig, plan: Plan, placement: Placement, f: WorkerFailure, run: RunDir,
                    console: Console, state: RunState,
                    on_failure: Callable[..., str | PeerRestore | None]) -> str | PeerRestore | None:
    """Recover from `f` keeping every healthy rank (heal.py): returns where the same plan
    resumes (the survivors' memory, a checkpoint, or None: step 0), with the dead ranks' actors
    replaced. Re-raises `f` (its `fallback` says why) when the whole world must restart instead."""
    t = time.monotonic()
    # A restart's clock still open: this failure came before the recovered world's first step.
    again = state.phases is not None and state.phases.record is not None
    # Failing again is often the lost node Ray had not yet reported the first time: said as such.
    why = ((heal.gone_node(f) or f"rank(s) {f.ranks} failed again before the recovered group's first step") if again
           else heal.precheck(placement, f, cfg.elastic.keep_survivors))
    replace, stuck, why = ([], [], why) if why else heal.leave(placement, f, cfg.elastic.leave_timeout_s)
    if why:
        f.fallback = why
        raise f
    teardown_s = time.monotonic() - t
    try:
        actor_start_s = placement.respawn(replace, cfg.cluster.placement_timeout_s)
    except Exception as e:  # noqa: BLE001 - whatever stops them, the whole world restarts instead
        f.fallback = f"a replacement rank did not start ({type(e).__name__}: {str(e)[:160]})"
        raise f from e
    peers, rows, why_checkpoint = heal.from_memory(placement, replace, plan.mesh, state.last_step,
                                                   cfg.train.max_steps, cfg.elastic.leave_timeout_s)
    if rows:  # the steps rank 0 had not sent when it failed: the survivors made the same rows
        consume([Stepped(row=row) for row in rows], state, run,
                ProgressView(cfg.train.max_steps, console, enabled=False), cfg.monitor.log_interval)
    resume = on_failure(f, peers)
    world = len(placement.actors)
    record = state.restarts[-1]
    record["recovery"] = {"kind": "kept_survivors", "replaced": replace, "kept": world - len(replace),
                          **({"stuck": stuck} if stuck else {}),
                          "state_from": "survivors" if peers else "checkpoint" if resume else "step 0",
                          **({"why": why_checkpoint} if why_checkpoint else {})}
    state.phases = Phases(f.detected_unix_s, record)
    state.phases.add("detection_s", f.handled_unix_s - f.detected_unix_s)
    state.phases.add("teardown_s", teardown_s)
    state.phases.add("actor_start_s", actor_start_s)
    console.print(f"[green]{escape(heal.describe_kept(world, replace))}[/]: the same plan resumes")
    return resume


def _full_restart_clock(state: RunState, f: WorkerFailure) -> None:
    """The restart record of a whole-world restart: why the survivors could not stay, and the
    clock of its parts (the rest are added as the new attempt goes)."""
    record = state.restarts[-1]
    record["recovery"] = {"kind": "full_restart", "why": f.fallback or "the ranks had not started training"}
    state.phases = Phases(f.detected_unix_s, record)
    state.phases.add("detection_s", (f.handled_unix_s or time.time()) - f.detected_unix_s)
    state.phases.add("teardown_s", f.teardown_s)


def _probe(cfg: JobConfig, run: RunDir, console: Console, on: dict | None = None) -> ClusterTopology:
    """Every node's interconnect, written to topology.json; the warnings a user must act on
    (NICs a node declares but lacks) are repeated on the console. `on`: a worker already
    started on a node, to probe it in (`EarlyStart.probers`)."""
    from ..topology.cluster_probe import HOLDS_NO_WORKER, RAY_GPUS_UNSEEN, probe_cluster
    from ..topology.local import MISSING_NIC_WARNING

    with console.status("probing the cluster topology" + (" and timing its links" if cfg.cluster.measure else "")):
        topology = probe_cluster(measure=cfg.cluster.measure, num_cpu_slots=cfg.cluster.num_workers, on=on,
                                 cpus_per_worker=cfg.cluster.cpus_per_worker)
    run.write_text("topology.json", topology.to_json())
    for warning in dict.fromkeys(w for n in topology.nodes for w in n.warnings if MISSING_NIC_WARNING in w):
        console.print(f"[yellow]warning:[/] {escape(warning)}")
    # What runs where Ray's resources promise otherwise: one line per node.
    for n in topology.nodes:
        for w in n.warnings:
            if RAY_GPUS_UNSEEN in w or HOLDS_NO_WORKER in w:
                console.print(f"note: node {(n.node_id or '')[:12]} ({n.hostname}): {w}", markup=False)
    return topology


def _plan(cfg: JobConfig, view: ClusterTopology, run: RunDir, console: Console, left_out, state: RunState,
          use_gpu: bool) -> Plan:
    """The plan that keeps the global batch on the part of `view` it uses (`elastic`), written
    to plan.json, even when refused: it then says why. After a trial, a world of the same size
    runs the plan the trial kept."""
    spec = state.spec
    kept = state.trial_plan
    plan = None
    if kept is not None and view.num_devices == kept.world_size:
        try:
            plan, _, note = plan_keeping_batch(pinned(cfg, kept), view, spec, left_out, state.calibration)
            note = f"trial: the run keeps the plan its trial measured fastest ({kept.strategy} on {kept.mesh})"
        except PlanError:
            plan = None  # the same size, another world: planned afresh below
    try:
        if plan is None:
            plan, _, note = plan_keeping_batch(cfg, view, spec, left_out, state.calibration)
    except PlanError:
        try:
            run.write_json("plan.json", plan_job(cfg, view, spec, left_out=left_out,
                                                 calibration=state.calibration).to_dict())
        except PlanError:
            pass
        raise
    if plan.compile.enabled and spec is not None and not spec.compile_checked:
        # Only now is the block worth tracing: planned again with what the trace found.
        state.spec = compile_checked(cfg, spec, state.model_fn)
        return _plan(cfg, view, run, console, left_out, state, use_gpu)
    if note:
        plan = replace(plan, explanation=tuple(plan.explanation) + (note,))
    run.write_json("plan.json", trial.plan_record(plan, state.trial))
    for x in plan.left_out:
        console.print(f"left out: {escape(str(x))}")
    if note:
        console.print(f"[yellow]note:[/] {escape(note)}")
    if spec is not None and spec.graph_break and plan.compile.requested == "auto":
        console.print(f"[yellow]warning:[/] {escape(plan.compile.reason)}")
    console.print(
        f"plan: [bold]{plan.strategy}[/] on {plan.world_size} {'GPUs' if use_gpu else 'CPU workers'} "
        f"({plan.mesh}), micro-batch {plan.micro_batch_size} x {plan.sync.grad_accum_steps} accumulation steps"
        + (", blocks compiled" if plan.compile.enabled else "")
    )
    return plan


def _place(cfg: JobConfig, plan: Plan, console: Console, use_gpu: bool, early: EarlyStart | None = None) -> Placement:
    """One worker actor per rank in a placement group, each on its planned node and device:
    the workers started early where the plan runs on exactly their devices."""
    with console.status(f"placing {plan.world_size} workers"):
        claimed = claim(early, plan, use_gpu, cfg.cluster.placement_timeout_s) if early is not None else None
        return claimed or place(
            plan, job=cfg.name, use_gpu=use_gpu, cpus_per_worker=cfg.cluster.cpus_per_worker,
            threads_per_worker=_threads(cfg), timeout_s=cfg.cluster.placement_timeout_s,
        )


def _threads(cfg: JobConfig) -> int:
    return max(1, int(cfg.cluster.cpus_per_worker))


def _start(cfg: JobConfig, plan: Plan, topology: ClusterTopology, run: RunDir, console: Console,
           placement: Placement, state: RunState, resume: str | PeerRestore | None,
           use_gpu: bool) -> list[dict[str, Any]]:
    """Every rank joins the process group, builds its part of the model and loads `resume`;
    what each set up for itself (the GPUs it exposes to NCCL, the CPUs it runs on, its NCCL
    environment) is added to placement.json. Returns each rank's setup report."""
    affinity = cpu_affinity(plan, topology)
    nccl = nccl_settings(plan, topology)
    actors = placement.actors
    try:
        master = ray.get(actors[0].rendezvous_address.remote())
        with console.status("starting the process group and building the model"):
            setups = ray.get([
                a.setup.remote(cfg, plan, master, resume, affinity[r] if use_gpu else None, nccl[r], state.model_fn,
                               rank=r)
                for r, a in enumerate(actors)
            ])
    except (RayActorError, RayTaskError) as e:
        raise_failure(e, placement)
    for report, setup in zip(placement.reports, setups):
        report.update(visible_gpus=setup["visible_gpus"], cpus=setup["cpus"], backend=setup["backend"],
                      nccl_env=setup["nccl_env"])
    run.write_json("placement.json", placement.reports)
    for note in notes(setups):
        console.print(f"[yellow]note:[/] {escape(note)}")
    if isinstance(resume, PeerRestore):
        console.print(f"restored step {setups[0]['start_step']} from {resume}: no checkpoint read", markup=False)
    elif resume:
        console.print(f"resumed from {resume} at step {setups[0]['start_step']}{_plan_change(resume, plan)}",
                      markup=False)
    return setups


def _plan_change(resume: str, plan: Plan) -> str:
    """How the plan that wrote the checkpoint `resume` differs from `plan`, said after the resume
    line ("" when it is the same): a checkpoint loads under any plan, and a user should see that
    one changed."""
    meta = checkpoint_files.read_meta(resume)
    if "mesh" not in meta or "strategy" not in meta:
        return ""
    was = f"{meta['strategy']} on {Mesh.from_dict(meta['mesh'])}"
    now = f"{plan.strategy} on {plan.mesh}"
    return "" if was == now else f", written under {was} and resharded to {now}"


def _after_regrow(g: Regrow, console: Console, state: RunState, ckpt_dir: str, run: RunDir) -> str:
    """Where a grown world resumes. The old world trained on until its actors were gone and may
    have committed a newer checkpoint than the one that set off the regrow: the newest whole one
    (re-training from the older would then find its step already committed)."""
    found = latest_whole_checkpoint(ckpt_dir, console)
    resume, step = found if found and found[1] > g.step else (g.checkpoint, g.step)
    state.restarts.append(g.restart_record(state.last_step, step))
    console.print(f"[green]{escape(g.reason)}:[/] re-planning from step {step}")
    state.rewind(step, run)
    return resume


def _after_failure(f: WorkerFailure, cfg: JobConfig, console: Console, state: RunState, ckpt_dir: str, run: RunDir,
                   resume_from: str | None, peers: PeerRestore | None = None) -> str | PeerRestore | None:
    """Where the run resumes after a failure (`peers`, the survivors' memory, where given; else
    the newest whole checkpoint, else the one it was resumed from, else step 0), or RunFailed
    once train.max_failures restarts are used up."""
    if peers is not None:
        found = (peers, peers.step)
    else:
        found = latest_whole_checkpoint(ckpt_dir, console)
        if found is None and resume_from:
            found = (resume_from, int(checkpoint_files.verify(resume_from)["step"]))
    resume, resume_step = found if found else (None, 0)
    state.restarts.append(f.restart_record(state.last_step, resume_step))
    record_restarts(cfg.name, len(state.restarts))
    failures = sum(1 for r in state.restarts if not r.get("grow"))
    if failures > cfg.train.max_failures:
        run.write_json("summary.json", {"job": cfg.name, "failed": True, "restarts": state.restarts})
        write_report(run)
        raise RunFailed(
            f"rank(s) {f.ranks} failed ({f.reason}) and train.max_failures={cfg.train.max_failures} "
            f"restarts are used up; the last whole checkpoint is "
            f"{(latest_whole_checkpoint(ckpt_dir, console) or ['none'])[0] if peers else resume or 'none'}"
        ) from f
    console.print(
        f"[red]failure:[/] {escape(f.reason)} (ranks {f.ranks}); restart {failures}/"
        f"{cfg.train.max_failures} from " + (f"step {resume_step} ({escape(str(resume))})" if resume else
                                            "step 0: no checkpoint was written yet")
    )
    state.rewind(resume_step, run)
    return resume
