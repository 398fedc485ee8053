"""The trial on a fake-GPU cluster (a GPU-less head, two nodes of two GPUs wired as the real
PCIe capture's first two, a slow network): the candidates run on the actors placed for the
planner's choice, re-ranked per plan; the fastest measured one trains, exactly as it would
have without a trial; plan.json and calibration.json say what each measured; a candidate that
cannot run is dropped with one line, and a trial where every candidate fails stops the run."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster
from rich.console import Console

from orchestrator.config import load_config
from orchestrator.control import trial as trial_module
from orchestrator.control.driver import run_job
from orchestrator.control.placement import claim, place, start_early
from orchestrator.control.trial import run_trial
from orchestrator.errors import RunFailed
from orchestrator.planning import plan_job
from orchestrator.planning.calibration import load
from orchestrator.planning.cluster_view import plannable
from orchestrator.planning.trial import Candidate
from orchestrator.record.console_view import ConsoleView
from orchestrator.record.rundir import RunDir
from orchestrator.topology.cluster_probe import probe_cluster
from orchestrator.topology.files import load_topology_file
from orchestrator.topology.model import ClusterTopology

ROOT = Path(__file__).resolve().parent.parent
CAPTURE = ROOT / "tests" / "fixtures" / "topology" / "topo_4gpu_pcie_pxb_pix_nccl667.txt"
TINY = [
    "model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=32",
    "train.global_batch_size=8", "train.warmup_steps=1", "train.eval_iters=1", "train.eval_interval=6",
    "train.max_steps=6", "cluster.gpu=A100", "cluster.cpus_per_worker=0.25", "parallel.tp=1",
    # A slow network: what the equal-links plan ignores.
    "cluster.inter_node_gbps=0.01", "checkpoint.enabled=false",
    "monitor.progress=false", "monitor.dashboard=false",
]

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    two = ClusterTopology(nodes=[load_topology_file(CAPTURE, "A100")]).limit(2).nodes[0]
    capture = tmp_path_factory.mktemp("trial") / "two_gpus.json"
    capture.write_text(json.dumps(two.to_dict()))
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    try:
        for _ in range(2):
            c.add_node(num_cpus=2, num_gpus=2, env_vars={"ORCHESTRATOR_TOPOLOGY_FILE": str(capture)})
        ray.init(address=c.address)
        c.wait_for_nodes()
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def _run(runs: Path, overrides: list[str]) -> tuple[dict, Path]:
    cfg = load_config(ROOT / "jobs" / "llm.yaml", [*TINY, f"monitor.runs_dir={runs}", *overrides])
    run = RunDir.create(cfg.monitor.runs_dir, cfg.name)
    return run_job(cfg, run, Console(file=open(os.devnull, "w"))), run.path


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_the_fastest_measured_plan_trains_as_it_would_without_a_trial(cluster, tmp_path):
    summary, run = _run(tmp_path / "runs", ["parallel.trial=3", "monitor.log_interval=1"])
    plan = json.loads((run / "plan.json").read_text())
    trial = plan["trial"]
    labels = [c["label"] for c in trial["candidates"]]
    assert labels[:2] == ["planned", "equal links"] and len(labels) >= 2
    assert all(c["failed"] is None and c["measured_step_s"] > 0 and c["predicted_step_s"] > 0
               for c in trial["candidates"])
    # Each plan's figure is its fastest timed step; the fastest figure wins.
    assert all(len(c["measured_steps_s"]) == trial["timed_steps"] * c["visits"] and c["visits"] in (1, 2)
               and c["measured_step_s"] == pytest.approx(min(c["measured_steps_s"]), abs=1e-4)
               for c in trial["candidates"])
    best = trial["candidates"][trial["winner"]]
    assert best["measured_step_s"] == min(c["measured_step_s"] for c in trial["candidates"])
    # What trains is the plan the trial kept, laid out as that plan says.
    assert (plan["strategy"], plan["mesh"], plan["sync"]["algorithm"]) == (best["strategy"], best["mesh"],
                                                                            best["sync"])
    assert trial["overruled"] == (best["label"] != "planned")
    assert any(line.startswith("trial: the measured steps overruled") for line in plan["explanation"]) \
        == trial["overruled"]
    placed = json.loads((run / "placement.json").read_text())
    assert [p["node_id"] for p in placed] == [r["node"] for r in plan["ranks"]]
    assert [p["rank"] for p in placed] == list(range(len(placed)))
    assert summary["startup"]["trial_s"] > 0
    # The trial's steps leave no trace: the same plan without a trial trains the same losses.
    pin = [f"parallel.strategy={best['strategy']}", f"parallel.dp_shard={best['mesh']['dp_shard']}",
           f"parallel.pp={best['mesh']['pp']}", f"parallel.sync={best['sync']}",
           f"train.micro_batch_size={best['micro_batch_size']}", f"parallel.recompute={best['recompute']}"]
    # ... priced with what the trial measured (parallel.calibration), which changes no choice pinned.
    _, again = _run(tmp_path / "again", ["parallel.trial=off", "monitor.log_interval=1", *pin,
                                         f"parallel.calibration={run}"])
    again_plan = json.loads((again / "plan.json").read_text())
    assert again_plan["trial"]["skipped"] == "parallel.trial=off"
    assert any(line.startswith(f"priced with the measured calibration of {run}") for line in again_plan["explanation"])
    assert _losses(run) == _losses(again)
    # What it measured prices the next plan.
    cal = load(str(run))
    ratios = json.loads((run / "calibration.json").read_text())["ratios"]
    assert ratios and all(getattr(cal, term) == value for term, value in ratios.items())
    assert cal.communication != 1.0  # DDP's buckets measure their exposed communication
    cfg = load_config(ROOT / "jobs" / "llm.yaml", TINY)
    topo = ClusterTopology.from_json((run / "topology.json").read_text())
    base, calibrated = plan_job(cfg, topo), plan_job(cfg, topo, calibration=cal)
    assert calibrated.step_time.compute_s == pytest.approx(base.step_time.compute_s * cal.compute, rel=1e-6) \
        or calibrated.strategy != base.strategy or calibrated.mesh != base.mesh
    assert any("measured calibration" in line for line in calibrated.explanation)


def test_a_candidate_that_cannot_run_is_dropped_and_all_failing_stops_the_run(cluster, tmp_path, monkeypatch):
    cfg = load_config(ROOT / "jobs" / "llm.yaml", [*TINY, "parallel.strategy=ddp"])
    topology = probe_cluster(num_cpu_slots=2)
    view, _ = plannable(topology)
    plan = plan_job(cfg, view)
    # A plan whose micro-batches do not cover the global batch: every rank refuses it at set-up.
    broken = replace(plan, micro_batch_size=plan.micro_batch_size + 1)
    placement = place(plan, job="trial-test", use_gpu=True, cpus_per_worker=0.25, threads_per_worker=1,
                      timeout_s=60)
    console = Console(record=True, width=200)
    view = ConsoleView(console)
    try:
        out = run_trial(cfg, [Candidate("planned", broken, "broken"), Candidate("runner-up", plan, "fine")],
                        placement, topology, view, True, None, None)
        assert out[0].failed.startswith("RuntimeError: plan does not cover the global batch")
        assert out[1].failed is None and out[1].step_s > 0
        text = console.export_text()
        assert "dropped planned (ddp on" in text and "plan does not cover the global batch" in text
        with pytest.raises(RunFailed, match="every trial plan failed; the first, ddp on .*: RuntimeError: plan does"):
            run_trial(cfg, [Candidate("planned", broken, "broken")] * 2, placement, topology, view, True, None,
                      None)
        # Near ties are set up and timed once more, in reverse order, their steps added to their first.
        monkeypatch.setattr(trial_module, "near_ties", lambda measured: [m for m in measured if not m.failed])
        out = run_trial(cfg, [Candidate("planned", plan, "a"), Candidate("runner-up", plan, "b")], placement, topology,
                        view, True, None, None)
        assert [(m.visits, len(m.steps_s), m.failed) for m in out] == [(2, 2 * cfg.parallel.trial_steps, None)] * 2
        assert all(m.step_s == min(m.steps_s) and m.row()["visits"] == 2 for m in out)
        assert "2 plans lie within their own step-to-step spread of the fastest; timing them again" in \
            console.export_text()
    finally:
        placement.release()


def test_workers_started_before_the_plan_are_taken_by_a_plan_over_their_devices(cluster):
    # The driver starts a worker on every GPU while it probes and plans: a plan over exactly
    # those GPUs keeps them, each actor taking the rank the plan puts on its device.
    cfg = load_config(ROOT / "jobs" / "llm.yaml", [*TINY, "parallel.strategy=ddp"])
    kw = dict(job="early-test", num_workers=2, cpus_per_worker=0.25, threads_per_worker=1)
    assert start_early(max_workers=3, **kw) is None  # elastic.max_workers=3 of 4 GPUs: not foreseeable
    early = start_early(max_workers=0, **kw)
    assert early is not None and early.use_gpu and sorted(early.slots_per_node.values()) == [2, 2]
    started = {a._actor_id.hex() for a in early.placement.actors}
    view, _ = plannable(probe_cluster(num_cpu_slots=2))
    plan = plan_job(cfg, view)
    placement = claim(early, plan, True, 60)
    try:
        assert placement is not None
        assert {r["actor_id"] for r in placement.reports} == started
        for want, got, actor in zip(plan.ranks, placement.reports, placement.actors):
            assert (got["node_id"], got["gpu"], got["rank"]) == (want.node, want.gpu, want.rank)
            assert actor._actor_id.hex() == got["actor_id"]
        assert set(placement.timings) == {"placement_s", "actor_start_s"}
    finally:
        placement.release()
    # Ray gave each node's bundles its GPUs 0 and 1: a plan naming others is placed afresh.
    early = start_early(max_workers=0, **kw)
    elsewhere = replace(plan, ranks=tuple(replace(r, gpu=r.gpu + 2) for r in plan.ranks))
    assert claim(early, elsewhere, True, 60) is None
    # A plan over two of the four GPUs: the early workers go, and their GPUs with them.
    early = start_early(max_workers=0, **kw)
    smaller = plan_job(cfg, view.limit(2))
    assert claim(early, smaller, True, 60) is None
    placement = place(smaller, job="early-test", use_gpu=True, cpus_per_worker=0.25, threads_per_worker=1,
                      timeout_s=60)
    try:
        assert [(r["node_id"], r["gpu"]) for r in placement.reports] == [(r.node, r.gpu) for r in smaller.ranks]
    finally:
        placement.release()
