"""The trial: a few real steps of each candidate plan on the placed actors, the fastest kept.

The actors placed for the planner's choice stay for the whole trial and the run after it:
every candidate is a plan over the same devices, so each actor only takes the rank that plan
gives its device (`Placement.adopt`), joins a new group, builds the model under the plan,
runs `parallel.trial_steps` steps (after one untimed warm-up) and leaves. A candidate that
fails (out of memory, a collective error, a hang) is dropped with one line saying why; a rank
that died or stayed stuck is replaced in its own bundle. What each measured goes to plan.json's
`trial` and, term by term against the prediction, to calibration.json (`plan --calibration`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from ..config import JobConfig
from ..errors import RunFailed
from ..planning import Plan
from ..planning.calibration import CALIBRATION_FILE, Calibration, term_ratios
from ..planning.compile import EAGER
from ..planning.model_spec import ModelSpec
from ..planning.trial import WARMUP_STEPS, Candidate
from ..record.console_view import ConsoleView
from ..record.rundir import RunDir
from . import supervise
from .job_context import JobContext
from .placement import Placement, cpu_affinity, nccl_settings


@dataclass
class Measured:
    """One candidate's trial."""

    candidate: Candidate
    steps_s: list[float] = field(default_factory=list)
    """Each timed step's seconds, as long as its slowest rank's; none when it failed."""
    steps_exposed_s: list[float | None] = field(default_factory=list)
    """Each timed step's exposed communication (the median over the ranks that measured it)."""
    setup_s: float = 0.0
    """Seconds to form its group and build its model."""
    failed: str | None = None
    """Why it was dropped, in one line."""
    visits: int = 1
    """Times it was set up and timed: 2 when it was a near tie (`near_ties`), timed again."""

    @property
    def step_s(self) -> float | None:
        """Its fastest timed step; None when it failed. Other work on the hosts only ever adds
        time (a cluster still settling after its start, the previous plan's memory going back),
        and it fell on the first plans tried, so a plan's fastest step is what the plan costs."""
        return min(self.steps_s) if self.steps_s else None

    @property
    def exposed_comm_s(self) -> float | None:
        """The exposed communication of its fastest step."""
        if not self.steps_s or len(self.steps_exposed_s) != len(self.steps_s):
            return None
        return self.steps_exposed_s[self.steps_s.index(min(self.steps_s))]

    def ran_step_s(self) -> float:
        """`step_s` of a plan that ran: one that did not fail has timed steps."""
        if not self.steps_s:
            raise ValueError(f"trial plan {self.candidate.label!r} has no timed step: only a plan that ran is compared")
        return min(self.steps_s)

    def spread(self) -> float:
        """How far its slowest timed step lies above its fastest, as a share of the fastest."""
        return max(self.steps_s) / min(self.steps_s) - 1.0 if self.steps_s else 0.0

    def row(self) -> dict[str, Any]:
        p = self.candidate.plan
        st = p.step_time
        pl = p.execution.pipeline
        measured_compute = (self.step_s - self.exposed_comm_s
                            if self.step_s is not None and self.exposed_comm_s is not None else None)
        return {"label": self.candidate.label, "why": self.candidate.why, "strategy": str(p.strategy),
                "mesh": p.mesh.to_dict(), "sync": str(p.execution.sync_algorithm),
                "micro_batch_size": p.micro_batch_size, "recompute": str(p.recompute),
                "pipeline": {"schedule": str(pl.schedule), "microbatches": pl.microbatches} if pl else None,
                "predicted_step_s": st.total_s, "predicted_compute_s": st.compute_s + st.bubble_s,
                "predicted_communication_s": st.exposed_comm_s, "measured_step_s": self.step_s,
                "measured_steps_s": [round(t, 4) for t in self.steps_s],
                "measured_compute_s": measured_compute, "measured_communication_s": self.exposed_comm_s,
                "setup_s": round(self.setup_s, 3), "visits": self.visits, "failed": self.failed}


def _summarise(per_rank: list[list[tuple[float, float | None]]]) -> tuple[list[float], list[float | None]]:
    """Each timed step's seconds and exposed communication: a step is as long as its slowest
    rank, since no rank starts the next before every rank ends this one; its exposed
    communication is the median over the ranks that measured it (None where none did)."""
    timed = [steps[WARMUP_STEPS:] for steps in per_rank]
    steps, exposed = [], []
    for i in range(len(timed[0])):
        steps.append(max(rank[i][0] for rank in timed))
        values = [exposed_s for rank in timed if (exposed_s := rank[i][1]) is not None]
        exposed.append(statistics.median(values) if values else None)
    return steps, exposed


def _one_line(err: BaseException) -> str:
    """The last line of a rank's traceback: what it raised."""
    lines = [ln for ln in str(err).strip().splitlines() if ln.strip()]
    return (lines[-1].strip() if lines else type(err).__name__)[:200]


def _all(refs: list, timeout_s: float) -> list:
    """Every rank's answer; once any fails, the first failure, but only after every rank has
    answered or `timeout_s` passed: a rank still setting up must not be told to leave midway."""
    ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    for ref in ready:
        ray.get(ref)  # raises the rank's own error
    if pending:
        raise GetTimeoutError(f"{len(pending)} rank(s) did not answer within {timeout_s:.0f} s")
    return ray.get(refs)


def _reset(placement: Placement, refs: list, timeout_s: float, respawn_timeout_s: float) -> None:
    """After a failed candidate, every rank out of its group: those stuck or dead replaced in
    their own bundles, the rest told to leave (a rank whose setup failed is still in one)."""
    _, stuck = ray.wait(refs, num_returns=len(refs), timeout=0) if refs else ([], [])
    for r, ref in enumerate(refs):
        if ref in stuck:  # blocked in a collective: NCCL's wait ends only by abort
            placement.actors[r].abort_collectives.remote()
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    dead = {r for r, ref in enumerate(refs) if ref not in ready}
    for r, ref in enumerate(refs):
        if ref in ready:
            try:
                ray.get(ref)
            except RayActorError:
                dead.add(r)
            except RayTaskError:
                pass
    left = {placement.actors[r].leave.remote(): r for r in range(len(placement.actors)) if r not in dead}
    ready, late = ray.wait(list(left), num_returns=len(left), timeout=timeout_s) if left else ([], [])
    dead |= {left[ref] for ref in late}
    for ref in ready:
        try:
            ray.get(ref)
        except (RayActorError, RayTaskError):
            dead.add(left[ref])
    placement.respawn(sorted(dead), respawn_timeout_s)


def _measure(cfg: JobConfig, c: Candidate, placement: Placement, topology, use_gpu: bool, model_fn) -> Measured:
    # Eager: compiling speeds every candidate's blocks alike, and would cost each its compile.
    plan = replace(c.plan, compile=EAGER)
    placement.adopt(plan)
    affinity, nccl = cpu_affinity(plan, topology), nccl_settings(plan, topology)
    actors = placement.actors
    steps = cfg.parallel.trial_steps + WARMUP_STEPS
    e = cfg.elastic
    # The run's hang rule, applied to the candidate's steps together (no evaluation or checkpoint
    # among them for the floor to cover).
    timeout = supervise.hang_timeout_s(steps * plan.step_time.total_s, e.hang_factor, e.hang_floor_s)
    m = Measured(c)
    t0 = time.monotonic()
    refs: list = []
    try:
        master = ray.get(actors[0].rendezvous_address.remote())
        refs = [a.setup.remote(cfg, plan, master, None, affinity[r] if use_gpu else None, nccl[r], model_fn, rank=r)
                for r, a in enumerate(actors)]
        _all(refs, cfg.cluster.placement_timeout_s)
        m.setup_s = time.monotonic() - t0
        refs = [a.trial.remote(steps) for a in actors]
        m.steps_s, m.steps_exposed_s = _summarise(_all(refs, timeout))
    except (RayActorError, RayTaskError, GetTimeoutError) as err:
        if (mistake := supervise.user_error_of(err)) is not None:
            raise mistake from None
        m.failed = (f"no step within {timeout:.0f} s" if isinstance(err, GetTimeoutError) else _one_line(err))
        _reset(placement, refs, e.leave_timeout_s, cfg.cluster.placement_timeout_s)
    return m


def run_trial(cfg: JobConfig, cands: list[Candidate], placement: Placement, topology, view: ConsoleView,
              use_gpu: bool, model_fn, budget_s: float | None) -> list[Measured]:
    """Measure every candidate in turn, then the near ties (`near_ties`) once more in reverse
    order (the placement ends laid out for the last one tried). Under `budget_s`
    (parallel.trial=auto) the trial stops before a candidate, and skips the second timing,
    that would take it past the budget, judged by what the candidates so far cost. RunFailed
    (exit 1) when every candidate failed: the first one's line."""
    out: list[Measured] = []
    spent = 0.0
    for i, c in enumerate(cands):
        if budget_s is not None and out and spent + spent / len(out) > budget_s:
            view.trial_stopped(len(out), len(cands), budget_s)
            break
        t = time.monotonic()
        with view.status(f"trial {i + 1}/{len(cands)}: {c.label}: {c.plan.strategy} on {c.plan.mesh}"):
            m = _measure(cfg, c, placement, topology, use_gpu, model_fn)
        spent += time.monotonic() - t
        if m.failed:
            view.trial_dropped(c.label, c.plan, m.failed)
        out.append(m)
    ok = [m for m in out if m.failed is None]
    if not ok:
        first = out[0]
        raise RunFailed(f"every trial plan failed; the first, {first.candidate.plan.strategy} on "
                        f"{first.candidate.plan.mesh}: {first.failed}")
    ties = near_ties(out)
    if len(ties) > 1:
        again = spent / len(out) * len(ties)
        passes_budget = budget_s is not None and spent + again > budget_s
        view.trial_ties(len(ties), again, budget_s if passes_budget else None)
        if not passes_budget:
            _retime(cfg, ties[::-1], placement, topology, view, use_gpu, model_fn)
            if all(m.failed for m in out):
                raise RunFailed(f"every trial plan failed; the last, {ties[0].candidate.plan.strategy} on "
                                f"{ties[0].candidate.plan.mesh}: {ties[0].failed}")
    return out


def near_ties(measured: list[Measured]) -> list[Measured]:
    """The plans the trial's steps cannot tell from the fastest, in the order they were tried:
    those whose fastest step lies within the widest step-to-step spread any plan showed (a
    settling cluster slows the first plans tried by as much). Empty when the fastest is clear."""
    ok = [m for m in measured if m.failed is None]
    if len(ok) < 2:
        return []
    best = min(m.ran_step_s() for m in ok)
    spread = max(m.spread() for m in ok)
    ties = [m for m in ok if m.ran_step_s() <= best * (1.0 + spread)]
    return ties if len(ties) > 1 else []


def _retime(cfg: JobConfig, ties: list[Measured], placement: Placement, topology, view: ConsoleView,
            use_gpu: bool, model_fn) -> None:
    """Each near tie's steps once more, added to its first ones: the order reversed, so the plan
    tried first, on the least settled cluster, is now tried last. A plan that fails this time is
    dropped: it cannot be relied on to run."""
    for i, m in enumerate(ties):
        c = m.candidate
        with view.status(f"trial, again {i + 1}/{len(ties)}: {c.label}: {c.plan.strategy} on {c.plan.mesh}"):
            again = _measure(cfg, c, placement, topology, use_gpu, model_fn)
        m.setup_s += again.setup_s
        if again.failed:
            m.failed = f"failed when timed again: {again.failed}"
            view.trial_dropped(c.label, c.plan, m.failed)
            continue
        m.visits += 1
        m.steps_s += again.steps_s
        m.steps_exposed_s += again.steps_exposed_s


def winner(measured: list[Measured]) -> Measured:
    return min((m for m in measured if m.failed is None), key=lambda m: m.ran_step_s())


def record(measured: list[Measured], best: Measured, cost_s: float, budget_s: float | None,
           steps: int) -> dict[str, Any]:
    """plan.json's `trial` section."""
    return {"candidates": [m.row() for m in measured], "winner": measured.index(best),
            "overruled": best.candidate.label != "planned", "timed_steps": steps, "cost_s": round(cost_s, 3),
            "budget_s": None if budget_s is None else round(budget_s, 3)}


def skipped(why: str, cands: list[Candidate]) -> dict[str, Any]:
    """plan.json's `trial` section when no trial ran."""
    return {"skipped": why, "candidates": [Measured(c).row() for c in cands]}


def overruled_line(best: Measured, planned: Measured) -> str:
    """The explanation's line when the trial chose another plan than the model did."""
    b, p = best.candidate.plan, planned.candidate.plan
    was = (f"{p.strategy} on {p.mesh} measured {planned.step_s:.3f} s" if planned.step_s is not None
           else f"{p.strategy} on {p.mesh} failed ({planned.failed})")
    return (f"trial: the measured steps overruled the cost model: {b.strategy} on {b.mesh} "
            f"({best.candidate.label}, {b.execution.sync_algorithm} sync) ran {best.step_s:.3f} s per step "
            f"(predicted {b.step_time.total_s:.3f} s) where the model's choice, {was} (predicted "
            f"{p.step_time.total_s:.3f} s)")


def write_calibration(run: RunDir, measured: list[Measured]) -> dict[str, float]:
    """calibration.json: measured / predicted per term kind, for `plan --calibration RUN`."""
    rows = [m.row() for m in measured if m.failed is None]
    ratios = term_ratios(rows)
    run.write_json(CALIBRATION_FILE, {"ratios": ratios, "candidates": rows,
                                      "note": "measured / predicted, the median over the trial's plans"})
    return ratios


def table_rows(measured: list[Measured], best: Measured) -> list[tuple[str, ...]]:
    """The console's trial table: each candidate's plan, prediction and fastest measured step."""
    rows: list[tuple[str, ...]] = []
    for m in measured:
        p = m.candidate.plan
        rows.append((m.candidate.label, str(p.strategy), str(p.mesh), str(p.execution.sync_algorithm),
                     f"{p.step_time.total_s:.3f}", "failed" if m.failed else f"{m.step_s:.3f}",
                     "kept" if m is best else ""))
    return rows


@dataclass(frozen=True)
class TrialResult:
    """What the run's trial (or its skipping) leaves the driver."""

    plan: Plan
    """The plan the run trains with; the placement is laid out for it."""
    section: dict[str, Any]
    """plan.json's `trial` section (a skipped trial says why)."""
    kept: Plan | None = None
    """The plan the trial measured fastest, which a restart on the same world size trains
    again; None when no trial ran."""
    cost_s: float | None = None
    """Seconds the trial took; None when none ran."""


def conduct(job: JobContext, plannable, topology, plan: Plan, placement: Placement, spec: ModelSpec | None,
            model_fn, calibration: Calibration, use_gpu: bool, left_out: tuple = ()) -> TrialResult:
    """The trial of one run, when `parallel.trial` asks for one and it is worth its cost, over
    the plannable part `plannable` of `topology`: the plan the run trains with (the placement laid
    out for it), and the trial's record, also written to plan.json."""
    from ..planning.trial import budget_s, candidates, trial_limit, worth_it

    cfg, run, view = job.config, job.run, job.view
    limit, why = trial_limit(cfg, len(plannable.nodes))
    if not limit:
        section = skipped(why, [])
        run.write_json("plan.json", plan_record(plan, section))
        return TrialResult(plan, section)
    with view.status("choosing the plans to try"):
        cands = candidates(cfg, plannable, plan, limit, spec, left_out, calibration)
    why = worth_it(cfg, plan, cands)
    if why:
        section = skipped(why, cands)
        run.write_json("plan.json", plan_record(plan, section))
        view.trial_skipped(why)
        return TrialResult(plan, section)
    budget = budget_s(cfg, plan) if cfg.parallel.trial == "auto" else None
    view.trial_begins(len(cands), cfg.parallel.trial_steps, budget)
    t = time.monotonic()
    measured = run_trial(cfg, cands, placement, topology, view, use_gpu, model_fn, budget)
    cost = time.monotonic() - t
    best = winner(measured)
    view.trial_table(table_rows(measured, best))
    ratios = write_calibration(run, measured)
    chosen = best.candidate.plan
    if best.candidate.label != "planned":
        line = overruled_line(best, measured[0])
        chosen = replace(chosen, explanation=tuple(chosen.explanation) + (line,))
        view.trial_overruled(line)
    placement.adopt(chosen)
    section = {**record(measured, best, cost, budget, cfg.parallel.trial_steps), "calibration": ratios}
    run.write_json("plan.json", plan_record(chosen, section))
    view.trial_took(cost, CALIBRATION_FILE, run.path)
    return TrialResult(chosen, section, chosen, cost)


def plan_record(plan, trial: dict[str, Any] | None) -> dict[str, Any]:
    """plan.json: the plan, and its run's `trial` section once there is one."""
    return {**plan.to_dict(), **({"trial": trial} if trial else {})}
