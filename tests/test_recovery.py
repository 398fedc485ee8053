"""Recovery on a fake-GPU Ray cluster with a GPU-less head and three 2-GPU nodes, in one run:
kill -9 of one rank blames only that rank; SIGSTOP of another is detected as a hang, every
rank's stacks are saved and the group restarts; losing a node with a global batch the survivors
do not divide re-plans them into a pipeline that loads the checkpoint written without one, every
step still covering the whole batch; the node back, the world grows to a plan without a pipeline
again, loading the pipeline's checkpoint."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster
from rich.console import Console

from orchestrator.config import load_config
from orchestrator.control.driver import run_job
from orchestrator.record.checkpoint_scan import latest_whole_checkpoint
from orchestrator.record.rundir import RunDir
from orchestrator.topology.files import load_topology_file
from orchestrator.topology.model import ClusterTopology

ROOT = Path(__file__).resolve().parent.parent
CAPTURE = ROOT / "tests" / "fixtures" / "topology" / "topo_4gpu_pcie_pxb_pix_nccl667.txt"
TINY = [
    "model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=32",
    "train.global_batch_size=18", "train.warmup_steps=1", "train.eval_iters=1",
    "cluster.gpu=A100", "cluster.cpus_per_worker=0.25", "parallel.strategy=ddp", "parallel.tp=1",
    "monitor.progress=false", "monitor.dashboard=false",
]

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture
def gpu_less_head(tmp_path):
    # A 2-GPU node: the first two GPUs of the 4-GPU capture (one PCIe switch).
    two = ClusterTopology(nodes=[load_topology_file(CAPTURE, "A100")]).limit(2).nodes[0]
    capture = tmp_path / "two_gpus.json"
    capture.write_text(json.dumps(two.to_dict()))
    env = {"ORCHESTRATOR_TOPOLOGY_FILE": str(capture)}
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "num_gpus": 0,
        # Fast failure detection, so a removed node is declared dead in seconds.
        "_system_config": {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                           "health_check_failure_threshold": 3},
    })
    try:
        workers = [cluster.add_node(num_cpus=2, num_gpus=2, env_vars=env) for _ in range(3)]
        ray.init(address=cluster.address)
        cluster.wait_for_nodes()
        cluster.workers, cluster.env = workers, env
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def _last_step(run: Path) -> int:
    m = run / "metrics.jsonl"
    lines = m.read_text().splitlines() if m.exists() else []
    return json.loads(lines[-1])["step"] if lines else 0


def _stepped_since_placed(run: Path) -> bool:
    """Whether the world placement.json now describes has finished a step: a row newer than the
    file, which the driver writes once every rank is set up. (A recovery from the survivors'
    memory resumes at the step the run had reached, so the step count alone cannot say so.)"""
    m, p = run / "metrics.jsonl", run / "placement.json"
    if not m.exists() or not p.exists():
        return False
    lines = m.read_text().splitlines()
    return bool(lines) and json.loads(lines[-1])["time"] > p.stat().st_mtime


def _placement(run: Path) -> list[dict]:
    p = run / "placement.json"
    try:
        rows = json.loads(p.read_text()) if p.exists() else []
    except json.JSONDecodeError:
        return []
    return rows if rows and all("backend" in r for r in rows) else []  # written again after setup


def test_kill_blames_one_rank_a_stopped_rank_is_a_hang_and_a_lost_node_keeps_the_batch(gpu_less_head, tmp_path):
    runs = tmp_path / "runs"
    events: dict = {}
    stopped: list[int] = []
    result: dict = {}

    def wait_for(pred, timeout=400):  # generous: a loaded 2-core host places actors slowly
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and "summary" not in result and "error" not in result:
            found = sorted(runs.glob("llm-*"))
            if found and pred(found[-1]):
                return found[-1]
            time.sleep(0.1)
        raise TimeoutError(f"waiting for the run; so far {events}, run: {result}")

    cfg = load_config(ROOT / "jobs" / "llm.yaml", [
        *TINY, f"monitor.runs_dir={runs}", "train.max_steps=120", "train.eval_interval=30",
        "checkpoint.interval=2", "train.max_failures=3", "elastic.max_workers=6",
    ])
    run = RunDir.create(cfg.monitor.runs_dir, cfg.name)

    def train():
        try:
            result["summary"] = run_job(cfg, run, Console(file=open(os.devnull, "w")))
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            result["error"] = e

    # The run goes in a thread: Ray's Cluster.add_node installs a signal handler, which only
    # the main thread may do.
    t = threading.Thread(target=train, daemon=True)
    t.start()
    try:
        r = wait_for(lambda r: _last_step(r) >= 4 and len(_placement(r)) == 6)
        first = _placement(r)
        events["killed"] = first[1]
        os.kill(first[1]["pid"], signal.SIGKILL)
        r = wait_for(lambda r: (p := _placement(r)) and p[1]["pid"] != first[1]["pid"] and _last_step(r) >= 10
                     and _stepped_since_placed(r))
        second = _placement(r)
        events["stopped"] = second[2]
        stopped.append(second[2]["pid"])
        os.kill(second[2]["pid"], signal.SIGSTOP)
        events["stopped_at"] = time.time()
        r = wait_for(lambda r: (p := _placement(r)) and p[2]["pid"] != second[2]["pid"] and _last_step(r) >= 16
                     and _stepped_since_placed(r))
        node = gpu_less_head.workers[-1]
        events["removed"] = node.node_id
        events["removed_ranks"] = [p["rank"] for p in _placement(r) if p["node_id"] == node.node_id]
        gpu_less_head.remove_node(node, allow_graceful=False)
        r = wait_for(lambda r: len(_placement(r)) == 4)
        events["shrunk_plan"] = json.loads((r / "plan.json").read_text())
        gpu_less_head.add_node(num_cpus=2, num_gpus=2, env_vars=gpu_less_head.env)
        t.join(timeout=600)
    finally:
        for pid in stopped:  # never leave a stopped process behind, whatever happened
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if "error" in result:
        raise result["error"]
    summary = result["summary"]
    kill, hang, lost, grow = summary["restarts"]

    # kill -9: only that rank and its node are blamed, and detection did not wait on the others
    assert kill["ranks"] == [1] and kill["nodes"] == [events["killed"]["node_id"]], kill
    assert "died" in kill["reason"]
    # every survivor holds the whole DDP state: the run goes on from where it failed, no step lost
    assert kill["recovery"] == {"kind": "kept_survivors", "replaced": [1], "kept": 5, "state_from": "survivors"}, kill
    assert kill["steps_lost"] == 0 and kill["resumed_from_step"] == kill["failed_at_step"], kill

    # SIGSTOP: a hang; the stopped rank is the one that did not answer, every rank has a stack file.
    # Found by the heartbeat, not the step timeout (its default floor, 300 s, is left as is).
    assert hang["reason"].startswith("hang: rank(s) [2] did not answer for 5 s") and hang["ranks"] == [2], hang
    assert hang["detected_unix_s"] - events["stopped_at"] < 60, hang
    assert hang["nodes"] == [events["stopped"]["node_id"]]
    stacks = sorted((run.path / hang["stacks"]).glob("rank_*.txt"))
    assert len(stacks) == 6
    assert "no answer" in stacks[2].read_text()
    assert "train" in stacks[0].read_text()  # a live rank's stack shows where it waits
    # the hung rank is killed and replaced; the others stay
    assert hang["recovery"] == {"kind": "kept_survivors", "replaced": [2], "kept": 5, "state_from": "survivors"}, hang

    # a node lost: 4 survivors do not divide 18 as data-parallel ranks, so they run as a pipeline
    # of 2 stages x 2 data-parallel ranks with the whole batch per step, from the checkpoint the
    # 6 ranks wrote without a pipeline (its tied embedding and head split between the stages)
    assert lost["reason"].startswith("worker died") and lost["ranks"] == events["removed_ranks"], lost
    assert lost["nodes"] == [events["removed"]]
    # a lost node changes the world: its ranks cannot start on it again, so everything re-plans
    assert lost["recovery"]["kind"] == "full_restart" and "is gone" in lost["recovery"]["why"], lost
    plan = events["shrunk_plan"]
    assert plan["world_size"] == 4 and plan["mesh"]["pp"] == 2
    dp = plan["mesh"]["dp_replicate"] * plan["mesh"]["dp_shard"]
    assert plan["micro_batch_size"] * plan["sync"]["grad_accum_steps"] * dp == 18
    head = ray.get_runtime_context().get_node_id()
    assert head not in {r["node"] for r in plan["ranks"]}  # the GPU-less head is left out of the plan
    assert head in {x["node"] for x in plan["left_out"]}  # and named

    # a node back: at the next checkpoint the world grows to all 6 GPUs again, not as a failure,
    # without a pipeline, from the pipeline's checkpoint
    assert grow["reason"].startswith("grow") and grow["ranks"] == [] and grow["steps_lost"] <= 4, grow
    assert summary["world_size"] == 6
    assert json.loads((run.path / "plan.json").read_text())["mesh"]["pp"] == 1
    rows = [json.loads(line) for line in (run.path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 121))
    assert summary["steps"] == 120

    # the latest checkpoint damaged after the fact: the nodes' parallel check refuses it by name
    ckpts = sorted((run.path / "checkpoints").glob("step_*"))
    shard = next(ckpts[-1].glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[0] ^= 0xFF
    shard.write_bytes(bytes(data))
    console = Console(record=True, file=open(os.devnull, "w"))
    assert latest_whole_checkpoint(str(run.path / "checkpoints"), console)[0] == str(ckpts[-2])
    assert f"{shard.name} is corrupted" in console.export_text()
