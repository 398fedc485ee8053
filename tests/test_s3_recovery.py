"""Checkpoints on an object store for nodes without a shared disk, end to end against a real S3
server (moto's, on 127.0.0.1) on a 2-node Ray cluster whose nodes keep separate local
directories: a run killed mid-way resumes (`submit --resume s3://...`, on nodes that never saw
it) and ends exactly where the uninterrupted run ends; `export` reads the checkpoint from the
store; a lost node re-plans the survivor, which loads from the store; no checkpoint byte lands
on a local disk and no credential in the run directory."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray
import torch
from ray.cluster_utils import Cluster
from rich.console import Console
from s3_server import ACCESS_KEY, SECRET_KEY, s3_server

from orchestrator.cli import main
from orchestrator.config import load_config
from orchestrator.control.driver import run_job
from orchestrator.record.rundir import RunDir
from orchestrator.runtime import checkpoint, checkpoint_files
from orchestrator.workloads.gpt import GPT, GPTConfig

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "jobs" / "llm.yaml"
# Steps of a few tenths of a second on a loaded host: long enough to kill the run between two
# checkpoints, short enough for three runs.
SMALL = [
    "model.n_layer=2", "model.n_head=2", "model.n_embd=64", "model.block_size=64",
    "train.global_batch_size=8", "train.warmup_steps=2", "train.eval_iters=2", "train.max_steps=24",
    "train.eval_interval=8", "checkpoint.interval=4", "cluster.num_workers=2", "cluster.cpus_per_worker=1",
    "parallel.strategy=ddp", "monitor.progress=false", "monitor.dashboard=false",
]

pytestmark = [pytest.mark.ray, pytest.mark.slow]

s3 = pytest.fixture(scope="module")(s3_server)


def _node_env(tmp: Path, name: str) -> dict[str, str]:
    """A node's own local scratch directory: nothing another node writes is there."""
    local = tmp / name
    local.mkdir()
    return {"TMPDIR": str(local)}


@pytest.fixture(scope="module")
def two_nodes(s3, tmp_path_factory):
    # The head holds no worker: the two ranks run one on each node. The nodes start after the
    # S3 server's environment is set, so their workers read the endpoint and credentials as a
    # cloud node reads its own.
    tmp = tmp_path_factory.mktemp("nodes")
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0,
        # Fast failure detection, so a removed node is declared dead in seconds.
        "_system_config": {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                           "health_check_failure_threshold": 3},
    })
    try:
        cluster.nodes_by_name = {name: cluster.add_node(num_cpus=1, env_vars=_node_env(tmp, name))
                                 for name in ("a", "b")}
        ray.init(address=cluster.address)
        cluster.wait_for_nodes()
        cluster.tmp = tmp
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def _weights(ckpt: str, cfg) -> dict[str, torch.Tensor]:
    model = GPT(GPTConfig(**{f.name: getattr(cfg.model, f.name) for f in dataclasses.fields(GPTConfig)}))
    checkpoint.load_model_weights(ckpt, model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _only_run(runs: Path) -> Path:
    [run] = sorted(runs.glob("llm-*"))
    return run


def _kill_between_checkpoints(cluster: Cluster, runs: Path, prefix: str) -> str:
    """`submit` in a process of its own on the cluster, SIGKILLed once its first checkpoint is
    committed on the store and before its last; returns what it printed."""
    driver = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "submit", str(JOB), *SMALL, f"monitor.runs_dir={runs}",
         f"checkpoint.path={prefix}", f"cluster.address={cluster.address}"],
        cwd=ROOT, env=os.environ.copy(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    while not checkpoint_files.committed(prefix):
        assert driver.poll() is None, driver.stdout.read().decode(errors="replace")[-3000:]
        assert time.monotonic() < deadline, "no checkpoint committed within 300 s"
        time.sleep(0.1)
    os.killpg(driver.pid, signal.SIGKILL)
    driver.wait()
    return driver.stdout.read().decode(errors="replace")


def test_a_run_killed_on_nodes_without_a_shared_disk_resumes_from_s3_where_the_uninterrupted_run_ends(
        two_nodes, s3, tmp_path, capsys):
    # the uninterrupted run, its checkpoints on the store
    cfg = load_config(JOB, [*SMALL, f"monitor.runs_dir={tmp_path / 'whole'}", f"checkpoint.path={s3.url('whole')}"])
    run = RunDir.create(cfg.monitor.runs_dir, cfg.name)
    whole = run_job(cfg, run, Console(file=open(os.devnull, "w")))
    assert whole["steps"] == 24
    plan = json.loads((run.path / "plan.json").read_text())
    assert len({r["node"] for r in plan["ranks"]}) == 2  # one rank on each node
    assert whole["checkpoints"][-1] == f"{s3.url('whole')}/step_00000024"

    # the same run, killed between two of its checkpoints
    printed = _kill_between_checkpoints(two_nodes, tmp_path / "killed", s3.url("killed"))
    left = checkpoint_files.committed(s3.url("killed"))
    assert left and not left[-1].endswith("step_00000024"), left
    # its nodes go, and two that never saw the run take their place
    for name, node in list(two_nodes.nodes_by_name.items()):
        two_nodes.remove_node(node, allow_graceful=False)
        two_nodes.nodes_by_name[name] = two_nodes.add_node(num_cpus=1, env_vars=_node_env(two_nodes.tmp, f"{name}2"))
    two_nodes.wait_for_nodes()

    capsys.readouterr()
    assert main(["submit", str(JOB), *SMALL, f"monitor.runs_dir={tmp_path / 'resumed'}",
                 f"checkpoint.path={s3.url('resumed')}", "--resume", s3.url("killed")]) == 0
    said = capsys.readouterr()
    printed += said.out + said.err
    resumed_dir = _only_run(tmp_path / "resumed")
    resumed = json.loads((resumed_dir / "summary.json").read_text())
    assert resumed["resumed_from"] == left[-1] and resumed["steps"] == 24
    rows = [json.loads(line) for line in (resumed_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == checkpoint_files.step_of(left[-1]) + 1 and rows[-1]["step"] == 24
    # exactly where the uninterrupted run ended
    assert resumed["final_val_loss"] == pytest.approx(whole["final_val_loss"], abs=1e-6)
    ended = _weights(resumed["checkpoints"][-1], cfg)
    for name, want in _weights(whole["checkpoints"][-1], cfg).items():
        torch.testing.assert_close(ended[name], want, rtol=0, atol=1e-6, msg=name)

    # export reads the checkpoint from the store
    out = tmp_path / "export"
    assert main(["export", str(resumed_dir), "--out", str(out)]) == 0
    from orchestrator.control.export import load_exported

    exported = load_exported(out).state_dict()
    for name, want in ended.items():
        assert torch.equal(exported[name], want), name

    # no checkpoint on any local disk, no credential in any file a run wrote
    local = [p for p in tmp_path.rglob("*") if p.name.endswith(".distcp") or p.name.startswith("step_")]
    local += [p for p in two_nodes.tmp.rglob("*") if p.name.endswith(".distcp") or p.name.startswith("step_")]
    assert local == []
    assert ACCESS_KEY not in printed and SECRET_KEY not in printed
    for run_dir in (run.path, _only_run(tmp_path / "killed"), resumed_dir):
        assert not (run_dir / "checkpoints").exists()
        for f in (p for p in run_dir.rglob("*") if p.is_file()):
            text = f.read_bytes()
            assert ACCESS_KEY.encode() not in text and SECRET_KEY.encode() not in text, f


def test_a_lost_node_re_plans_the_survivor_which_loads_from_s3(two_nodes, s3, tmp_path):
    prefix = s3.url("lost")
    cfg = load_config(JOB, [*SMALL, f"monitor.runs_dir={tmp_path}", f"checkpoint.path={prefix}",
                            "train.max_failures=2"])
    run = RunDir.create(cfg.monitor.runs_dir, cfg.name)
    result: dict = {}

    def train():
        try:
            result["summary"] = run_job(cfg, run, Console(file=open(os.devnull, "w")))
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            result["error"] = e

    # The run goes in a thread: Ray's Cluster.remove_node and add_node belong to the main thread.
    t = threading.Thread(target=train, daemon=True)
    t.start()
    deadline = time.monotonic() + 300
    while not checkpoint_files.committed(prefix) and "error" not in result and "summary" not in result:
        assert time.monotonic() < deadline, "no checkpoint committed within 300 s"
        time.sleep(0.1)
    lost = two_nodes.nodes_by_name.pop("b")
    two_nodes.remove_node(lost, allow_graceful=False)
    t.join(timeout=400)
    if "error" in result:
        raise result["error"]
    summary = result["summary"]
    [restart] = summary["restarts"]
    assert restart["nodes"] == [lost.node_id] and restart["recovery"]["kind"] == "full_restart", restart
    # the survivor, alone on the other node, went on from a checkpoint the store holds
    assert summary["world_size"] == 1 and summary["steps"] == 24
    plan = json.loads((run.path / "plan.json").read_text())
    assert {r["node"] for r in plan["ranks"]} == {two_nodes.nodes_by_name["a"].node_id}
    resumed_at = restart["resumed_from_step"]
    assert resumed_at >= 4 and resumed_at % 4 == 0, restart
    rows = [json.loads(line) for line in (run.path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 25))
    assert summary["checkpoints"][-1] == f"{prefix}/step_00000024"
    assert checkpoint_files.verify(summary["checkpoints"][-1])["world_size"] == 1
    assert not (run.path / "checkpoints").exists()
