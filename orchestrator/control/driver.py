"""The driver of one job: probe, plan, place, run, record.

It runs wherever `submit` runs (the user's shell, or a Ray job on the head node), holds no
training state itself, and writes everything to the run directory as it goes. `JobDriver` owns
the job's state; an attempt moves through named stages (`Stage`), each handler doing one
stage's work and returning the next, until the run is done:

    probe -> plan -> place -> trial (once per run) -> start -> follow -> done
                                                        ^        |
                                   recover: keep survivors ------+  (a failure)
    probe <- recover: restart the world ---------------------------+
    probe <- regrow: re-plan for the larger world -----------------+  (more devices)

What to do about a failure or a regrow is decided in `recovery.decide_recovery`, a pure function;
the handlers here carry its decision out (with `heal.py`), and every line the user sees is
worded by `record/console_view.py`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, NoReturn

import ray
from ray.exceptions import RayActorError, RayTaskError
from rich.console import Console

from ..config import JobConfig, to_yaml
from ..errors import PlanError, RunFailed
from ..planning import Plan, plan_job
from ..planning.calibration import UNCALIBRATED
from ..planning.calibration import load as load_calibration
from ..planning.cluster_view import LeftOut, plannable
from ..planning.mesh import Mesh
from ..planning.model_spec import ModelSpec
from ..planning.trial import pinned
from ..record.checkpoint_scan import latest_whole_checkpoint
from ..record.console_view import ConsoleView
from ..record.monitoring import announce
from ..record.progress import ProgressView
from ..record.report import write_report
from ..record.run_state import RunState
from ..record.rundir import RunDir
from ..record.startup_clock import Phases
from ..record.summary import notes, print_summary, save_compile_gain, summarize, write_loss_curve
from ..record.trackers import Trackers
from ..runtime import checkpoint_files
from ..runtime.messages import Stepped
from ..runtime.metrics import record_restarts
from ..runtime.peer_state import PeerRestore
from ..topology.model import ClusterTopology
from . import heal, supervise, trial
from .elastic import devices_now, limit_world, plan_keeping_batch, uses_gpus
from .failures import Regrow, WorkerFailure
from .follow import Failed, Finished, Outcome, consume, follow
from .job_context import JobContext
from .placement import EarlyStart, Placement, claim, cpu_affinity, nccl_settings, place, start_early
from .preflight import check_context_parallel, compile_checked, measure_model
from .recovery import GiveUp, KeepSurvivors, RecoveryState, RestartWorld, decide_recovery


class Stage(Enum):
    """Where an attempt is."""

    PROBE = "probe"
    """Start the workers early and probe every node's interconnect (topology.json)."""
    PLAN = "plan"
    """Plan the world that keeps the global batch (plan.json)."""
    PLACE = "place"
    """One worker actor per rank on its planned device (placement.json)."""
    TRIAL = "trial"
    """Once per run: time the candidate plans on the placed actors, keep the fastest."""
    START = "start"
    """Every rank joins the process group, builds its model part and loads its state."""
    FOLLOW = "follow"
    """Run the step loops and follow them until the world ends."""
    RECOVER = "recover"
    """A world failed: keep its survivors, restart it, or give up, as decided."""
    REGROW = "regrow"
    """More devices came alive: release the world and re-plan."""
    DONE = "done"
    """Every rank finished: the run's record is written."""


@dataclass
class Attempt:
    """What the current attempt (one probe -> plan -> place pass, and the worlds started on its
    placement) has built so far."""

    early: EarlyStart | None = None
    """The workers started before the plan, to probe from and to claim when the plan fits them."""
    topology: ClusterTopology | None = None
    """What the probe found."""
    plannable: ClusterTopology | None = None
    """The part of it the plan may use (GPU-less nodes left out, cut to elastic.max_workers)."""
    left_out: tuple[LeftOut, ...] = ()
    """The nodes left out of `plannable`, and why."""
    use_gpu: bool = False
    """Whether the ranks run on GPUs."""
    plan: Plan | None = None
    """The plan the attempt trains."""
    placement: Placement | None = None
    """Its actors, one per rank."""
    setups: list[dict[str, Any]] = field(default_factory=list)
    """Each rank's setup report of the world started last."""
    ended: Outcome | None = None
    """How the world started last ended (its setup failing is a `Failed` too)."""

    def require_plannable(self) -> ClusterTopology:
        """`plannable`, which every stage after PROBE has."""
        assert self.plannable is not None, "the stages after PROBE plan on what the probe found"
        return self.plannable

    def require_plan(self) -> Plan:
        """`plan`, which every stage after PLAN has."""
        assert self.plan is not None, "the stages after PLAN run the plan it chose"
        return self.plan

    def require_placement(self) -> Placement:
        """`placement`, which every stage after PLACE has (a recovery and a regrow included)."""
        assert self.placement is not None, "the stages after PLACE run on the actors it placed"
        return self.placement


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
    return JobDriver(cfg, run, console, resume_from, model_fn, spec, ray_start_s, measure_s).run(dashboard_url)


class JobDriver:
    """One job from its start to its summary, across every attempt and recovery."""

    def __init__(self, cfg: JobConfig, run: RunDir, console: Console, resume_from: str | None = None,
                 model_fn: Callable[..., Any] | None = None, spec: ModelSpec | None = None,
                 ray_start_s: float | None = None, measure_s: float = 0.0) -> None:
        self.started = time.monotonic()
        """When the driver began (the summary's wall time counts from it)."""
        view = ConsoleView(console)
        self.job = JobContext(cfg, run, view, cfg.checkpoint.path or str(run.checkpoints),
                              Trackers(cfg, run, view.note))
        """What stays the same for the whole job."""
        self.resume_from = resume_from
        """The checkpoint (or run) the user resumed the job from; None for a fresh run."""
        self.calibration = load_calibration(cfg.parallel.calibration) if cfg.parallel.calibration else UNCALIBRATED
        """What every plan of the run is priced with (`parallel.calibration`)."""
        self.clock: Phases | None = Phases(time.time() - (ray_start_s or 0.0) - measure_s)
        """The clock of the start or restart whose first step has not come yet."""
        if ray_start_s is not None:
            self.clock.add("ray_start_s", ray_start_s)
        if measure_s:
            self.clock.add("measure_s", measure_s)
        self.model_fn = model_fn
        """The model factory the Python API passed (shipped to the workers by pickling); None: `model.factory`."""
        self.spec = spec if spec is not None else measure_model(cfg, model_fn)
        """The measured model the planner prices; None for the built-in GPT (its formulas)."""
        self.record = RunState()
        """What the run's record (summary, report, curve) is written from."""
        self.trial_section: dict[str, Any] | None = None
        """plan.json's `trial` section, once the run's trial ran or was skipped (once per run)."""
        self.trial_plan: Plan | None = None
        """The plan the trial kept; a restart on the same world size trains it again."""
        self.resume: str | PeerRestore | None = resume_from
        """Where the next world's state comes from: a checkpoint, the survivors' memory, or None (step 0)."""
        self.attempt = Attempt()
        """What the current attempt has built."""
        self.finals: list[dict[str, Any]] = []
        """Each rank's final report, once the run is done."""

    @property
    def view(self) -> ConsoleView:
        return self.job.view

    def run(self, dashboard_url: str | None = None) -> dict[str, Any]:
        """Every attempt until one finishes, then the run's record; returns the summary."""
        cfg, run = self.job.config, self.job.run
        run.write_text("config.yaml", to_yaml(cfg))
        record_restarts(cfg.name, 0)  # a healthy run's dashboard reads 0, not "no data"
        announce(self.view.console, dashboard_url)
        handlers: dict[Stage, Callable[[], Stage]] = {
            Stage.PROBE: self._probe, Stage.PLAN: self._plan, Stage.PLACE: self._place, Stage.TRIAL: self._trial,
            Stage.START: self._start, Stage.FOLLOW: self._follow, Stage.RECOVER: self._recover,
            Stage.REGROW: self._regrow,
        }
        stage = Stage.PROBE
        try:
            while stage is not Stage.DONE:
                stage = handlers[stage]()
        except PlanError:
            if self.record.restarts:  # the world shrank below what the job can run on: the summary says so too
                self._write_failed()
            raise
        finally:
            self._release()  # whatever ended the attempt; a second release finds nothing left to free
            if stage is not Stage.DONE:
                self.job.trackers.close()
        return self._finish()

    # --- the stages -------------------------------------------------------------------------

    def _probe(self) -> Stage:
        """Every node's interconnect, while the workers start (processes, imports, devices)."""
        cfg, attempt = self.job.config, self.attempt
        t = time.monotonic()
        attempt.early = start_early(job=cfg.name, num_workers=cfg.cluster.num_workers,
                                    max_workers=cfg.elastic.max_workers, cpus_per_worker=cfg.cluster.cpus_per_worker,
                                    threads_per_worker=_threads(cfg), measure=cfg.cluster.measure)
        attempt.topology = self._probe_cluster(attempt.early.probers() if attempt.early is not None else None)
        # GPU-less nodes (a CPU head) run no rank of a GPU plan: the one rule, in `plannable`.
        view, attempt.left_out = plannable(attempt.topology)
        attempt.use_gpu = uses_gpus(view)
        attempt.plannable = limit_world(cfg, view)
        self._phase("probe_s", time.monotonic() - t)
        return Stage.PLAN

    def _plan(self) -> Stage:
        attempt = self.attempt
        t = time.monotonic()
        attempt.plan = self._choose_plan(attempt.require_plannable(), attempt.left_out, attempt.use_gpu)
        self._phase("plan_s", time.monotonic() - t)
        return Stage.PLACE

    def _place(self) -> Stage:
        """One worker actor per rank in a placement group, each on its planned node and device:
        the workers started early where the plan runs on exactly their devices."""
        cfg, attempt = self.job.config, self.attempt
        plan = attempt.require_plan()
        with self.view.status(f"placing {plan.world_size} workers") as waiting:
            claimed = (claim(attempt.early, plan, attempt.use_gpu, cfg.cluster.placement_timeout_s, waiting)
                       if attempt.early is not None else None)
            attempt.placement = claimed or place(
                plan, job=cfg.name, use_gpu=attempt.use_gpu, cpus_per_worker=cfg.cluster.cpus_per_worker,
                threads_per_worker=_threads(cfg), timeout_s=cfg.cluster.placement_timeout_s, on_wait=waiting,
            )
        placement = attempt.placement
        for name, seconds in placement.timings.items():
            self._phase(name, seconds)
        self.job.run.write_json("placement.json", placement.reports)
        return Stage.TRIAL if self.trial_section is None else Stage.START  # a restart trains what the trial chose

    def _trial(self) -> Stage:
        attempt = self.attempt
        placement = attempt.require_placement()
        result = trial.conduct(self.job, attempt.plannable, attempt.topology, attempt.require_plan(), placement,
                               self.spec, self.model_fn, self.calibration, attempt.use_gpu, attempt.left_out)
        attempt.plan, self.trial_section = result.plan, result.section
        if result.kept is not None:
            self.trial_plan = result.kept
        if result.cost_s is not None:
            self._phase("trial_s", result.cost_s)
        self.job.run.write_json("placement.json", placement.reports)
        return Stage.START

    def _start(self) -> Stage:
        """Every rank joins the process group, builds its part of the model and loads the
        driver's `resume`; what each set up for itself (the GPUs it exposes to NCCL, the CPUs
        it runs on, its NCCL environment) is added to placement.json."""
        cfg, run, attempt = self.job.config, self.job.run, self.attempt
        plan, placement = attempt.require_plan(), attempt.require_placement()
        affinity = cpu_affinity(plan, attempt.topology)
        nccl = nccl_settings(plan, attempt.topology)
        actors = placement.actors
        try:
            master = ray.get(actors[0].rendezvous_address.remote())
            with self.view.status("starting the process group and building the model"):
                setups = ray.get([
                    a.setup.remote(cfg, plan, master, self.resume, affinity[r] if attempt.use_gpu else None, nccl[r],
                                   self.model_fn, rank=r)
                    for r, a in enumerate(actors)
                ])
        except (RayActorError, RayTaskError) as e:
            if (mistake := supervise.user_error_of(e)) is not None:
                raise mistake from None
            attempt.ended = Failed(supervise.failure_from_error(e, placement))
            return Stage.RECOVER
        for report, setup in zip(placement.reports, setups):
            report.update(visible_gpus=setup["visible_gpus"], cpus=setup["cpus"], backend=setup["backend"],
                          nccl_env=setup["nccl_env"])
        run.write_json("placement.json", placement.reports)
        for note in notes(setups):
            self.view.note(note)
        if isinstance(self.resume, PeerRestore):
            self.view.restored_from_peers(setups[0]["start_step"], self.resume)
        elif self.resume:
            self.view.resumed(self.resume, setups[0]["start_step"], _plan_change(self.resume, plan))
        attempt.setups = setups
        if self.clock is not None:
            self.clock.add_setups(setups)
        return Stage.FOLLOW

    def _follow(self) -> Stage:
        cfg, attempt = self.job.config, self.attempt
        grow = (lambda: devices_now(cfg)) if attempt.use_gpu else None
        placement = attempt.require_placement()
        ended = follow(self.job, placement, attempt.require_plan(), self.record, self.clock,
                       attempt.setups[0]["start_step"], attempt.require_plannable().num_devices, grow)
        attempt.ended = ended
        if not (isinstance(ended, Failed) and ended.before_first_step):
            self.clock = None  # the world's first step closed it
        if isinstance(ended, Finished):
            self.finals = ended.finals
            ray.get([a.shutdown.remote() for a in placement.actors])
            placement.release()
            return Stage.DONE
        return Stage.RECOVER if isinstance(ended, Failed) else Stage.REGROW

    def _recover(self) -> Stage:
        """Carry out what `decide_recovery` says about the failed world: keep its survivors on
        the same plan (back to start), else release it and probe again, or give up."""
        attempt = self.attempt
        failed = attempt.ended
        assert isinstance(failed, Failed), f"recovery follows a failed world, not {type(failed).__name__}"
        handled_unix_s = time.time()
        t = time.monotonic()
        decision = decide_recovery(failed.failure, self._recovery_state(failed), self.job.config)
        if isinstance(decision, KeepSurvivors):
            restart = self._keep_survivors(failed, handled_unix_s, t)
            if restart is None:
                return Stage.START
            decision = restart
        t = time.monotonic()
        placement = attempt.require_placement()
        heal.kill_silent(placement, failed.failure)
        placement.release()
        teardown_s = time.monotonic() - t
        if isinstance(decision, GiveUp):
            self._give_up(decision, failed.failure)
        assert isinstance(decision, RestartWorld), f"a failure restarts the world, not {decision}"
        self.resume = self._resume_after(failed.failure)
        record = self.record.restarts[-1]
        record["recovery"] = {"kind": "full_restart", "why": decision.reason}
        self.clock = Phases(failed.failure.detected_unix_s, record)
        self.clock.add("detection_s", handled_unix_s - failed.failure.detected_unix_s)
        self.clock.add("teardown_s", teardown_s)
        self.attempt = Attempt()
        return Stage.PROBE

    def _regrow(self) -> Stage:
        """Release the world and re-plan for the larger one. The old world trained on until its
        actors were gone and may have committed a newer checkpoint than the one that set off
        the regrow: it resumes from the newest whole one (re-training from the older would then
        find its step already committed)."""
        grown = self.attempt.ended
        assert isinstance(grown, Regrow), f"a regrow follows a grown world, not {type(grown).__name__}"
        decision = decide_recovery(grown, self._recovery_state(None), self.job.config)
        self.attempt.require_placement().release()
        found = latest_whole_checkpoint(self.job.checkpoint_root, self.view.console)
        self.resume, step = found if found and found[1] > grown.step else (grown.checkpoint, grown.step)
        self.record.restarts.append(grown.restart_record(self.record.last_step, step))
        self.view.regrow(decision.reason, step)
        self.record.rewind(step, self.job.run)
        self.clock = Phases(time.time(), self.record.restarts[-1])
        self.attempt = Attempt()
        return Stage.PROBE

    # --- carrying out a recovery ------------------------------------------------------------

    def _recovery_state(self, failed: Failed | None) -> RecoveryState:
        """What `decide_recovery` is told about the world that ended."""
        placement = self.attempt.require_placement()
        return RecoveryState(
            world_size=len(placement.actors),
            training=failed is not None and failed.train_refs is not None,
            # A restart's clock still open: this failure came before the recovered world's first step.
            recovering=self.clock is not None and self.clock.record is not None,
            failures_so_far=sum(1 for r in self.record.restarts if not r.get("grow")),
            gone_nodes=frozenset(n["NodeID"] for n in ray.nodes() if not n.get("Alive")),
        )

    def _keep_survivors(self, failed: Failed, handled_unix_s: float, t: float) -> RestartWorld | None:
        """Recover keeping every healthy rank (heal.py): the dead ranks' actors replaced, and the
        driver's `resume` set to where the same plan resumes (the survivors' memory, a
        checkpoint, or None: step 0). None once done; the restart of the whole world, with
        why, where the survivors could not stay after all. `t`: when recovery began."""
        cfg, attempt, f = self.job.config, self.attempt, failed.failure
        placement, train_refs = attempt.require_placement(), failed.train_refs
        assert train_refs is not None, "survivors are kept only where the ranks had started training"
        replaced, stuck, why = heal.leave(placement, f, train_refs, cfg.elastic.leave_timeout_s)
        if why:
            return RestartWorld(why)
        teardown_s = time.monotonic() - t
        try:
            actor_start_s = placement.respawn(replaced, cfg.cluster.placement_timeout_s)
        except Exception as e:  # noqa: BLE001 - whatever stops them, the whole world restarts instead
            return RestartWorld(f"a replacement rank did not start ({type(e).__name__}: {str(e)[:160]})")
        peers, rows, why_checkpoint = heal.from_memory(placement, replaced, attempt.require_plan().mesh,
                                                       self.record.last_step, cfg.train.max_steps,
                                                       cfg.elastic.leave_timeout_s)
        if rows:  # the steps rank 0 had not sent when it failed: the survivors made the same rows
            consume([Stepped(row=row) for row in rows], self.record, self.job.run,
                    ProgressView(cfg.train.max_steps, self.view.console, enabled=False), cfg.monitor.log_interval)
        self.resume = self._resume_after(f, peers)
        world = len(placement.actors)
        record = self.record.restarts[-1]
        record["recovery"] = {"kind": "kept_survivors", "replaced": replaced, "kept": world - len(replaced),
                              **({"stuck": stuck} if stuck else {}),
                              "state_from": "survivors" if peers else "checkpoint" if self.resume else "step 0",
                              **({"why": why_checkpoint} if why_checkpoint else {})}
        self.clock = Phases(f.detected_unix_s, record)
        self.clock.add("detection_s", handled_unix_s - f.detected_unix_s)
        self.clock.add("teardown_s", teardown_s)
        self.clock.add("actor_start_s", actor_start_s)
        self.view.kept_survivors(world, replaced)
        return None

    def _resume_point(self, peers: PeerRestore | None) -> tuple[str | PeerRestore | None, int]:
        """Where the run resumes and at which step: `peers` (the survivors' memory) where given;
        else the newest whole checkpoint, else the one the run was resumed from, else step 0."""
        if peers is not None:
            return peers, peers.step
        found = latest_whole_checkpoint(self.job.checkpoint_root, self.view.console)
        if found is None and self.resume_from:
            found = (self.resume_from, int(checkpoint_files.verify(self.resume_from)["step"]))
        return found if found else (None, 0)

    def _count_restart(self, f: WorkerFailure, resume_step: int) -> None:
        self.record.restarts.append(f.restart_record(self.record.last_step, resume_step))
        record_restarts(self.job.config.name, len(self.record.restarts))

    def _resume_after(self, f: WorkerFailure, peers: PeerRestore | None = None) -> str | PeerRestore | None:
        """The restart after `f` recorded and said; returns where the run resumes."""
        cfg = self.job.config
        resume, resume_step = self._resume_point(peers)
        self._count_restart(f, resume_step)
        failures = sum(1 for r in self.record.restarts if not r.get("grow"))
        self.view.failure(f.reason, f.ranks, failures, cfg.train.max_failures, resume, resume_step)
        self.record.rewind(resume_step, self.job.run)
        return resume

    def _give_up(self, decision: GiveUp, f: WorkerFailure) -> NoReturn:
        """The failed run's record, then RunFailed naming the newest whole checkpoint."""
        resume, resume_step = self._resume_point(None)
        self._count_restart(f, resume_step)
        self._write_failed()
        raise RunFailed(f"{decision.reason}; the last whole checkpoint is {resume or 'none'}")

    def _write_failed(self) -> None:
        run = self.job.run
        run.write_json("summary.json", {"job": self.job.config.name, "failed": True, "restarts": self.record.restarts})
        write_report(run)

    def _release(self) -> None:
        """Every actor of the current attempt killed and its placement group freed."""
        attempt = self.attempt
        if attempt.placement is not None:
            attempt.placement.release()
        elif attempt.early is not None:
            attempt.early.placement.release(fence=False)

    # --- the pieces -------------------------------------------------------------------------

    def _phase(self, name: str, seconds: float) -> None:
        if self.clock is not None:
            self.clock.add(name, seconds)

    def _probe_cluster(self, on: dict | None = None) -> ClusterTopology:
        """Every node's interconnect, written to topology.json; the warnings a user must act on
        (NICs a node declares but lacks) are repeated on the console. `on`: a worker already
        started on a node, to probe it in (`EarlyStart.probers`)."""
        from ..topology.cluster_probe import HOLDS_NO_WORKER, RAY_GPUS_UNSEEN, probe_cluster
        from ..topology.local import MISSING_NIC_WARNING

        cfg = self.job.config
        with self.view.status("probing the cluster topology" + (" and timing its links" if cfg.cluster.measure
                                                                else "")):
            topology = probe_cluster(measure=cfg.cluster.measure, num_cpu_slots=cfg.cluster.num_workers, on=on,
                                     cpus_per_worker=cfg.cluster.cpus_per_worker)
        self.job.run.write_text("topology.json", topology.to_json())
        for warning in dict.fromkeys(w for n in topology.nodes for w in n.warnings if MISSING_NIC_WARNING in w):
            self.view.warning(warning)
        # What runs where Ray's resources promise otherwise: one line per node.
        for n in topology.nodes:
            for w in n.warnings:
                if RAY_GPUS_UNSEEN in w or HOLDS_NO_WORKER in w:
                    self.view.note(f"node {(n.node_id or '')[:12]} ({n.hostname}): {w}")
        return topology

    def _choose_plan(self, view: ClusterTopology, left_out: tuple[LeftOut, ...], use_gpu: bool) -> Plan:
        """The plan that keeps the global batch on the part of `view` it uses (`elastic`), written
        to plan.json, even when refused: it then says why. After a trial, a world of the same
        size runs the plan the trial kept."""
        cfg, run, spec, kept = self.job.config, self.job.run, self.spec, self.trial_plan
        plan = None
        if kept is not None and view.num_devices == kept.world_size:
            try:
                plan, _, note = plan_keeping_batch(pinned(cfg, kept), view, spec, left_out, self.calibration)
                note = f"trial: the run keeps the plan its trial measured fastest ({kept.strategy} on {kept.mesh})"
            except PlanError:
                plan = None  # the same size, another world: planned afresh below
        try:
            if plan is None:
                plan, _, note = plan_keeping_batch(cfg, view, spec, left_out, self.calibration)
        except PlanError:
            try:
                run.write_json("plan.json", plan_job(cfg, view, spec, left_out=left_out,
                                                     calibration=self.calibration).to_dict())
            except PlanError:
                pass
            raise
        if plan.compile.enabled and spec is not None and not spec.compile_checked:
            # Only now is the block worth tracing: planned again with what the trace found.
            self.spec = compile_checked(cfg, spec, self.model_fn)
            return self._choose_plan(view, left_out, use_gpu)
        check_context_parallel(cfg, plan.mesh.cp, self.model_fn)
        if note:
            plan = replace(plan, explanation=tuple(plan.explanation) + (note,))
        run.write_json("plan.json", trial.plan_record(plan, self.trial_section))
        graph_break = spec is not None and spec.graph_break and plan.compile.requested == "auto"
        self.view.planned(plan, note, plan.compile.reason if graph_break else None, use_gpu)
        return plan

    def _finish(self) -> dict[str, Any]:
        """The run's record: summary.json, report.html, loss.svg and the console's summary."""
        cfg, run, attempt = self.job.config, self.job.run, self.attempt
        plan = attempt.require_plan()
        summary = summarize(cfg, plan, self.record, attempt.setups, self.finals, time.monotonic() - self.started,
                            attempt.require_placement().reports)
        if self.resume_from:
            summary["resumed_from"] = self.resume_from
        run.write_json("summary.json", summary)
        gain_line = save_compile_gain(run, plan, summary["compile"])
        write_report(run)
        write_loss_curve(run, cfg, plan, self.record)
        self.job.trackers.finish(summary)
        print_summary(self.view.console, summary, run)
        if gain_line:
            self.view.line(gain_line)
        return summary


def _threads(cfg: JobConfig) -> int:
    return max(1, int(cfg.cluster.cpus_per_worker))


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
