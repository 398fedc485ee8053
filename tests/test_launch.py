"""A launch without Ray (`torchrun -m orchestrator.runtime.launch`): torchrun's processes plan
the job for this node and run the step loop a worker actor runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=32", "train.global_batch_size=8",
        "train.warmup_steps=2", "train.eval_iters=2", "train.max_steps=6", "train.eval_interval=3",
        "parallel.strategy=ddp", "train.micro_batch_size=2"]


def _launch(nproc: int, *overrides: str) -> tuple[list[dict], subprocess.CompletedProcess]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={nproc}", "-m", "orchestrator.runtime.launch",
                           str(ROOT / "jobs" / "llm.yaml"), *TINY, *overrides],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return lines, done


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("launch") / "checkpoints"
    lines, done = _launch(2, f"checkpoint.path={root}", "checkpoint.interval=3")
    assert done.returncode == 0, done.stderr[-3000:]
    return lines, root


@pytest.mark.slow
def test_two_torchrun_ranks_plan_train_evaluate_and_checkpoint_through_the_shared_loop(two_ranks):
    lines, root = two_ranks
    assert lines[0]["step"] == 0 and set(lines[0]) == {"step", "val_loss"}  # the untrained model's baseline
    rows = [line for line in lines if "loss" in line]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in rows if r["val_loss"] is not None] == [3, 6]
    assert rows[-1]["loss"] < rows[0]["loss"] and rows[-1]["val_loss"] < lines[0]["val_loss"]
    assert all(r["step_s"] > 0 and r["exposed_comm_s"] is not None for r in rows)  # DDP: calibrated
    # The background write of step 3 commits after step 4's row; the last one in its own step.
    commits = [line for line in lines if "committed_step" in line]
    assert [c["committed_step"] for c in commits] == [3, 6]
    assert lines.index(commits[0]) > lines.index(next(r for r in rows if r["step"] == 4))
    assert sorted(p.name for p in root.iterdir() if (p / "meta.json").is_file()) == ["step_00000003",
                                                                                      "step_00000006"]
    end = lines[-1]["end"]
    assert end["strategy"] == "ddp" and end["mesh"]["dp_replicate"] == 2
    assert end["last_val_loss"] == rows[-1]["val_loss"]


@pytest.mark.slow
def test_two_ranks_train_as_one_does_with_the_same_global_batch(two_ranks):
    lines, _ = two_ranks
    one, done = _launch(1, "checkpoint.enabled=false")
    assert done.returncode == 0, done.stderr[-3000:]
    two_rows, one_rows = ([line for line in got if "loss" in line] for got in (lines, one))
    assert [r["loss"] for r in two_rows] == pytest.approx([r["loss"] for r in one_rows], abs=1e-5)
    assert one[0]["val_loss"] == pytest.approx(lines[0]["val_loss"], abs=1e-5)


@pytest.mark.slow
@pytest.mark.ray
def test_the_launch_trains_as_a_submitted_run_of_the_same_plan_does(two_ranks, tmp_path):
    """The same loop under torchrun and under Ray's worker actors: the same losses, step by step."""
    from rich.console import Console

    from orchestrator.config import load_config
    from orchestrator.connect.cluster import connect
    from orchestrator.control.driver import run_job
    from orchestrator.record.rundir import RunDir

    lines, _ = two_ranks
    cfg = load_config(ROOT / "jobs" / "llm.yaml", [*TINY, "cluster.num_workers=2", "checkpoint.enabled=false",
                                                   "monitor.progress=false", "monitor.dashboard=false",
                                                   f"monitor.runs_dir={tmp_path}"])
    run = RunDir.create(cfg.monitor.runs_dir, cfg.name)
    with connect(None, num_cpus=4):
        summary = run_job(cfg, run, Console(file=open(os.devnull, "w")))
    submitted = [json.loads(line) for line in (run.path / "metrics.jsonl").read_text().splitlines()]
    launched = [line for line in lines if "loss" in line]
    assert [r["loss"] for r in launched] == pytest.approx([r["loss"] for r in submitted], abs=1e-5)
    assert lines[0]["val_loss"] == pytest.approx(summary["first_val_loss"], abs=1e-5)
    assert launched[-1]["val_loss"] == pytest.approx(summary["final_val_loss"], abs=1e-5)


def test_outside_torchrun_the_launch_says_how_to_start_it():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    done = subprocess.run([sys.executable, "-m", "orchestrator.runtime.launch", "jobs/llm.yaml"], cwd=ROOT,
                          env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: start this under torchrun (it sets RANK, WORLD_SIZE and the rendezvous): "
        "torchrun --nproc-per-node N -m orchestrator.runtime.launch JOB.yaml"]


@pytest.mark.slow  # ~4 s: two torchrun ranks
def test_a_bad_key_is_one_line_from_rank_0_and_the_launch_fails():
    _, done = _launch(2, "train.max_steps=0")
    assert done.returncode != 0
    said = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(said) == 1 and "train.max_steps" in said[0], done.stderr[-2000:]


class _Store:
    """torchrun's store as the launch uses it: set by one rank, read (after it) by every rank."""

    def __init__(self) -> None:
        self.kept: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.kept[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.kept[key]


def test_rank_0s_plan_reaches_every_rank_through_the_store_before_any_group_forms(monkeypatch):
    from orchestrator.config import load_config
    from orchestrator.errors import UserError
    from orchestrator.runtime import launch

    cfg = load_config(ROOT / "jobs" / "llm.yaml", TINY)
    planned = []
    monkeypatch.setattr(launch, "plan_here", lambda c, world: planned.append(world) or _tiny_plan(c, world))
    store = _Store()
    first = launch.agreed_plan(cfg, 0, 2, store)
    other = launch.agreed_plan(cfg, 1, 2, store)
    assert planned == [2] and other == first and other.world_size == 2  # planned once, by rank 0
    assert launch.rank_device(other, 1).type == "cpu"

    def refuse(c, world):
        raise UserError("the plan does not fit: 9 GB per rank")

    monkeypatch.setattr(launch, "plan_here", refuse)
    refused = _Store()
    with pytest.raises(UserError, match="^the plan does not fit: 9 GB per rank$"):
        launch.agreed_plan(cfg, 0, 2, refused)
    with pytest.raises(UserError, match="^the plan does not fit: 9 GB per rank$"):
        launch.agreed_plan(cfg, 1, 2, refused)


def test_a_gpu_plan_in_a_process_without_cuda_is_one_line(monkeypatch):
    import torch

    from orchestrator.config import load_config
    from orchestrator.errors import UserError
    from orchestrator.runtime import launch

    plan = _tiny_plan(load_config(ROOT / "jobs" / "llm.yaml", TINY), 2, gpu=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="^rank 1: the plan is for GPUs but this process has no CUDA device"):
        launch.rank_device(plan, 1)


def _tiny_plan(cfg, world: int, gpu: bool = False):
    from orchestrator.planning import plan_job
    from orchestrator.planning.describe import describe_cluster
    from orchestrator.topology.files import load_topology_file
    from orchestrator.topology.model import ClusterTopology, Network, cpu_node

    if gpu:
        node = load_topology_file(ROOT / "tests" / "fixtures" / "topology" / "topo_4gpu_pcie_pxb_pix_nccl667.txt")
        node.devices = node.devices[:world]
        return plan_job(cfg, describe_cluster(node, 1, Network(25.0, 10.0), "A100"))
    return plan_job(cfg, ClusterTopology(nodes=[cpu_node(world)]))
