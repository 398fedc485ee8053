"""Which plans a trial runs, and whether one is worth its cost (pure: the driver runs them).

The cost model's step times carry an error of their own (measured in `benchmarks/`: about a
quarter, for compute on this kind of host and for collectives over shaped links). Where other
plans' predictions lie inside that error of the chosen one, the model cannot tell them apart,
and a few real steps of each can: `parallel.trial`. The candidates are always the planner's
choice and the plan a search makes when it sees every link alike (what a topology-blind tool
would run, priced on the real links), then the fastest runners-up inside the band. A trial
is skipped when its steps would cost more than `parallel.trial_budget` of the run's predicted
time (unless a number of candidates was asked for).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

from ..config import JobConfig
from ..errors import PlanError
from ..topology.model import ClusterTopology
from .calibration import UNCALIBRATED, Calibration
from .flow import plan_job
from .model_spec import ModelSpec
from .plan import Alternative, Plan, StepTime

COMPUTE_ERROR = 0.26
"""Relative error of a predicted compute time: the GPT rows' mean absolute error of
benchmarks/step_time.py on a 2-core CPU host (results/step_time.json: 0.26; Llama 0.17)."""
COMMUNICATION_ERROR = 0.26
"""Relative error of a predicted collective over shaped links: the mean error of
benchmarks/cost_model.py --shaped (results/cost_model_shaped.json: 0.26)."""
WARMUP_STEPS = 1
"""Steps of each candidate run and not timed: lazily built buffers, first connections."""
SETUP_S = 3.0
"""Seconds each candidate is assumed to take to form its group and build its model before its
first step, for judging whether a trial fits its budget (the default job's startup breakdown
in summary.json: process group, model build and first step, about 3 s on a 2-core host); the
trial itself stops on what its candidates really took."""
AUTO_CANDIDATES = 3
"""Candidates `parallel.trial=auto` runs at most: the choice, the equal-links plan, one more."""


@dataclass(frozen=True)
class Candidate:
    """One plan a trial runs."""

    label: str
    """`planned` (the model's choice), `equal links` or `runner-up`."""
    plan: Plan
    """The whole plan, priced on the real cluster."""
    why: str
    """Why it is in the trial, in words."""


def error_band(step: StepTime) -> float:
    """The prediction's relative error: each term's share of the step at its own error."""
    if step.total_s <= 0:
        return 0.0
    return ((step.compute_s + step.bubble_s) * COMPUTE_ERROR + step.exposed_comm_s * COMMUNICATION_ERROR) / step.total_s


def within_band(candidate: StepTime, best: StepTime) -> bool:
    """Whether the two predictions overlap inside their error bands: the model cannot say
    which is faster."""
    return candidate.total_s * (1 - error_band(candidate)) <= best.total_s * (1 + error_band(best))


def signature(plan: Plan) -> tuple:
    """What makes two plans run differently (two searches may reach the same plan)."""
    pl = plan.execution.pipeline
    return (str(plan.strategy), plan.mesh, plan.micro_batch_size, str(plan.recompute),
            str(plan.execution.sync_algorithm), str(plan.execution.compression),
            (str(pl.schedule), pl.virtual, pl.microbatches) if pl else None, plan.node_of_rank,
            tuple(r.gpu for r in plan.ranks))


def pinned(cfg: JobConfig, plan: Plan) -> JobConfig:
    """`cfg` with every choice `plan` made fixed, so planning it again on any topology prices
    exactly that plan there."""
    m, ex = plan.mesh, plan.execution
    pl = ex.pipeline
    par = replace(cfg.parallel, strategy=plan.strategy, pp=m.pp, tp=m.tp, dp_shard=m.dp_shard,
                  recompute=plan.recompute, sync=ex.sync_algorithm, compression=ex.compression,
                  accum_sync=plan.sync.accum_sync)
    if pl is not None:
        par = replace(par, pp_schedule=pl.schedule, pp_microbatches=pl.microbatches)
    return replace(cfg, parallel=par, train=replace(cfg.train, micro_batch_size=plan.micro_batch_size))


def _pinned_alternative(cfg: JobConfig, alt: Alternative) -> JobConfig:
    m = alt.mesh
    par = replace(cfg.parallel, strategy=alt.strategy, pp=m.pp, tp=m.tp, dp_shard=m.dp_shard)
    if alt.recompute is not None:
        par = replace(par, recompute=alt.recompute)
    if alt.compression is not None:
        par = replace(par, compression=alt.compression)
    train = cfg.train if alt.micro_batch_size is None else replace(cfg.train, micro_batch_size=alt.micro_batch_size)
    return replace(cfg, parallel=par, train=train)


def equal_links(cfg: JobConfig, topology: ClusterTopology) -> JobConfig | None:
    """`cfg` planning as if the network were as fast as a node's own links (the median of
    them, bandwidth and latency): the view of a tool that treats every link alike. None on one
    node, or nodes of one device each (there is no node's own link to assume)."""
    links = [link for n in topology.nodes for link in n.links]
    if len(topology.nodes) < 2 or not links:
        return None
    bw = statistics.median(link.bandwidth_gbps for link in links)
    lat = statistics.median(link.latency_us for link in links)
    return replace(cfg, cluster=replace(cfg.cluster, inter_node_gbps=bw, inter_node_latency_us=lat))


def candidates(cfg: JobConfig, topology: ClusterTopology, planned: Plan, limit: int, spec: ModelSpec | None = None,
               left_out: tuple = (), calibration: Calibration = UNCALIBRATED) -> list[Candidate]:
    """At most `limit` plans to try, the planner's choice first, then the equal-links plan,
    then the fastest runners-up whose predictions lie inside the model's error band of the
    choice. Every one is the whole plan priced on `topology` (the cluster the run has)."""
    if limit < 2:
        raise ValueError(f"a trial compares at least 2 plans, got a limit of {limit}")
    out = [Candidate("planned", planned, "the planner's choice")]
    seen = {signature(planned)}

    def plan_for(c: JobConfig) -> Plan | None:
        try:
            p = plan_job(c, topology, spec, left_out=left_out, calibration=calibration)
        except PlanError:
            return None
        return p if p.fits and p.world_size == planned.world_size else None

    blind_cfg = equal_links(cfg, topology)
    if blind_cfg is not None:
        blind = plan_for(blind_cfg)
        if blind is not None:
            priced = plan_for(pinned(cfg, blind))
            if priced is not None and signature(priced) not in seen:
                seen.add(signature(priced))
                out.append(Candidate("equal links", priced,
                                     f"what a search that sees every link alike runs ({blind.strategy} on "
                                     f"{blind.mesh}, {blind.execution.sync_algorithm} sync)"))
    for alt in planned.alternatives:
        if len(out) >= limit:
            break
        if not alt.fits or alt.step_time_s is None:
            continue
        p = plan_for(_pinned_alternative(cfg, alt))
        if p is None or signature(p) in seen:
            continue
        if not within_band(p.step_time, planned.step_time):
            break  # runners-up come fastest first: none after this one is inside the band either
        seen.add(signature(p))
        out.append(Candidate("runner-up", p, f"predicted {p.step_time.total_s * 1e3:.0f} ms against the choice's "
                                             f"{planned.step_time.total_s * 1e3:.0f} ms, inside the model's error "
                                             f"band of ±{error_band(planned.step_time):.0%}"))
    return out[:limit]


def trial_limit(cfg: JobConfig, nodes: int) -> tuple[int, str]:
    """How many candidates `parallel.trial` allows on `nodes` nodes (0: no trial), and why not."""
    t = cfg.parallel.trial
    if t == "off":
        return 0, "parallel.trial=off"
    if t == "auto":
        if nodes < 2:
            return 0, "one node: parallel.trial=auto tries plans on multi-node runs only"
        return AUTO_CANDIDATES, ""
    return int(t), ""


def trial_cost_s(cands: list[Candidate], steps: int) -> float:
    """Predicted seconds of the trial: each candidate's set-up and steps."""
    return sum(SETUP_S + (steps + WARMUP_STEPS) * c.plan.step_time.total_s for c in cands)


def budget_s(cfg: JobConfig, planned: Plan) -> float:
    """The most a trial may take: `parallel.trial_budget` of the run's predicted time."""
    return cfg.parallel.trial_budget * cfg.train.max_steps * planned.step_time.total_s


def worth_it(cfg: JobConfig, planned: Plan, cands: list[Candidate]) -> str:
    """Why the trial is skipped ("" when it runs): one candidate only, or (under `auto`) a run
    too short for the trial's steps to stay inside the budget."""
    if len(cands) < 2:
        return ("no other plan lies inside the model's error band of the choice and the equal-links plan is the "
                "same plan")
    if cfg.parallel.trial != "auto":
        return ""
    cost, budget = trial_cost_s(cands, cfg.parallel.trial_steps), budget_s(cfg, planned)
    if cost > budget:
        steps, run_s = cfg.parallel.trial_steps + WARMUP_STEPS, cfg.train.max_steps * planned.step_time.total_s
        return (f"a run of {cfg.train.max_steps} steps (predicted {run_s:.0f} s) is too short: {len(cands)} plans, "
                f"set up and run for {steps} steps, would take about {cost:.0f} s, over "
                f"parallel.trial_budget={cfg.parallel.trial_budget:g} of it ({budget:.0f} s)")
    return ""
