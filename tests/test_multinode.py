"""Two Ray nodes with 4 fake GPUs each, wired as the real 4-GPU PCIe capture (GPUs 0-1 under
one PCIe switch, 2-3 under another, SYS between): the planner's layout reaches the actors, and
losing a node mid-run re-plans onto the survivor."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster
from rich.console import Console

from orchestrator.config import load_config
from orchestrator.rundir import RunDir
from orchestrator.runtime.driver import run_job

ROOT = Path(__file__).resolve().parent.parent
CAPTURE = ROOT / "tests" / "fixtures" / "topology" / "topo_4gpu_pcie_pxb_pix_nccl667.txt"
TINY = [
    "model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.block_size=32",
    "train.global_batch_size=8", "train.warmup_steps=1", "train.eval_iters=1",
    "cluster.gpu=A100", "cluster.cpus_per_worker=0.25",
    "monitor.progress=false", "monitor.dashboard=false",
]

pytestmark = pytest.mark.ray


def _cluster() -> Cluster:
    # Fast failure detection, so a removed node is declared dead in seconds, not half a minute.
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2, "num_gpus": 4, "env_vars": {"ORCHESTRATOR_TOPOLOGY_FILE": str(CAPTURE)},
            "_system_config": {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                               "health_check_failure_threshold": 3},
        },
    )
    worker = cluster.add_node(num_cpus=2, num_gpus=4, env_vars={"ORCHESTRATOR_TOPOLOGY_FILE": str(CAPTURE)})
    ray.init(address=cluster.address)
    cluster.wait_for_nodes()
    cluster.worker = worker  # the node a test may remove
    return cluster


@pytest.fixture
def two_nodes():
    cluster = _cluster()
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def _run(tmp_path: Path, *overrides: str):
    cfg = load_config(ROOT / "jobs" / "llm.yaml", [*TINY, f"monitor.runs_dir={tmp_path}", *overrides])
    run = RunDir.create(cfg.monitor.runs_dir, cfg.name)
    return run.path, run_job(cfg, run, Console(file=open(os.devnull, "w")))


def test_tp_pairs_land_under_one_pcie_switch_and_hsdp_shards_stay_in_a_node(two_nodes, tmp_path):
    run_dir, summary = _run(tmp_path, "parallel.tp=2", "parallel.strategy=hsdp", "train.max_steps=2",
                            "train.eval_interval=2", "checkpoint.enabled=false")
    assert summary["steps"] == 2 and summary["world_size"] == 8
    plan = json.loads((run_dir / "plan.json").read_text())
    placement = json.loads((run_dir / "placement.json").read_text())
    where = {p["rank"]: (p["node_id"], p["gpu"]) for p in placement}
    assert len({node for node, _ in where.values()}) == 2
    for group in plan["groups"]["tp"]:
        nodes = {where[r][0] for r in group}
        gpus = {where[r][1] for r in group}
        assert len(nodes) == 1 and gpus in ({0, 1}, {2, 3}), (group, nodes, gpus)
    for group in plan["groups"]["dp_shard"]:
        assert len({where[r][0] for r in group}) == 1
    # the actors themselves reported these devices: Ray's choice of GPU matched the plan's
    assert all(p["gpu_ids"] == [p["gpu"]] for p in placement)
    # each worker exposes all of the job's GPUs on its node (NCCL needs its peers), in PCI order
    assert all(p["visible_gpus"] == "0,1,2,3" for p in placement)


def test_losing_a_node_replans_onto_the_survivor_and_finishes(two_nodes, tmp_path):
    removed = threading.Event()

    def remove_when_running():
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            runs = sorted(tmp_path.glob("llm-*"))
            metrics = runs[-1] / "metrics.jsonl" if runs else None
            if metrics and metrics.exists() and len(metrics.read_text().splitlines()) >= 6:
                two_nodes.remove_node(two_nodes.worker, allow_graceful=False)
                removed.set()
                return
            time.sleep(0.1)

    t = threading.Thread(target=remove_when_running, daemon=True)
    t.start()
    run_dir, summary = _run(tmp_path, "parallel.strategy=ddp", "train.max_steps=60", "train.eval_interval=30",
                            "checkpoint.interval=3", "train.max_failures=2")
    assert removed.is_set()
    assert summary["steps"] == 60
    assert len(summary["restarts"]) >= 1
    assert summary["world_size"] == 4  # the re-plan used what was left
    head = ray.get_runtime_context().get_node_id()
    placement = json.loads((run_dir / "placement.json").read_text())
    assert {p["node_id"] for p in placement} == {head}
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 61))
