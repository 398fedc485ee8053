"""The runtime on a real (embedded) Ray cluster: a run learns and records itself, DDP over 2
workers equals 1 worker, failures are survived exactly, checkpoints are never lost."""

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
import torch
from rich.console import Console

from orchestrator.config import load_config
from orchestrator.connect.cluster import connect
from orchestrator.control.driver import run_job
from orchestrator.errors import CheckpointError
from orchestrator.record.rundir import RunDir
from orchestrator.runtime import checkpoint, checkpoint_files
from orchestrator.workloads.gpt import GPT, GPTConfig

ROOT = Path(__file__).resolve().parent.parent
TINY = [
    "model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=32",
    "train.global_batch_size=8", "train.warmup_steps=2", "train.eval_iters=2",
    "monitor.progress=false", "monitor.dashboard=false",
]

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def cluster():
    with connect(None, num_cpus=4):
        yield


def _run(tmp_path: Path, *overrides: str, resume: str | None = None, console: Console | None = None):
    cfg = load_config(ROOT / "jobs" / "llm.yaml", [*TINY, f"monitor.runs_dir={tmp_path}", *overrides])
    run = RunDir.create(cfg.monitor.runs_dir, cfg.name)
    summary = run_job(cfg, run, console or Console(file=open(os.devnull, "w")), resume_from=resume)
    return run.path, summary, cfg


def _final_weights(run_dir: Path, cfg) -> dict[str, torch.Tensor]:
    model = GPT(GPTConfig(**{f.name: getattr(cfg.model, f.name) for f in dataclasses.fields(GPTConfig)}))
    checkpoint.load_model_weights(checkpoint_files.committed(str(run_dir / "checkpoints"))[-1], model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_two_worker_run_learns_and_records_everything(cluster, tmp_path):
    run_dir, summary, _ = _run(tmp_path, "train.max_steps=30", "train.eval_interval=10", "train.lr=3e-3")
    for name in ("config.yaml", "topology.json", "plan.json", "placement.json", "metrics.jsonl",
                 "summary.json", "loss.svg"):
        assert (run_dir / name).is_file(), name
    placement = json.loads((run_dir / "placement.json").read_text())
    assert [p["rank"] for p in placement] == [0, 1]
    assert len({p["pid"] for p in placement}) == 2  # one process per rank
    assert {p["cpu_slot"] for p in placement} == {0, 1}
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["world_size"] == 2 and [r["rank"] for r in plan["ranks"]] == [0, 1]
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert all(r["tokens_per_s"] > 0 and r["step_s"] > 0 for r in rows)
    assert [r["step"] for r in rows if r["val_loss"] is not None] == [10, 20, 30]
    on_disk = json.loads((run_dir / "summary.json").read_text())
    assert on_disk["steps"] == 30 and on_disk["wall_s"] > 0 and on_disk["tokens_per_s"] > 0
    assert on_disk["final_val_loss"] < 0.8 * on_disk["first_val_loss"]
    # Each rank's own process: its peak resident memory, above what the interpreter and torch
    # held before the model (hundreds of MB), and the plan's per-rank total beside it.
    measured, predicted = on_disk["measured"], on_disk["predicted"]
    assert measured["memory_source"] == "rss"
    assert len(measured["peak_memory_bytes_per_rank"]) == len(measured["baseline_memory_bytes_per_rank"]) == 2
    for peak, base in zip(measured["peak_memory_bytes_per_rank"], measured["baseline_memory_bytes_per_rank"]):
        assert 50 << 20 < base < peak < 8 << 30
    assert predicted["peak_memory_bytes_per_rank"] == plan["memory_per_rank"]["total"] > 0
    # What the loop itself adds per step (metrics, the driver's sink), measured on every rank.
    overhead = measured["orchestration_overhead_s_per_step"]
    assert len(overhead) == 2 and all(o >= 0 for o in overhead)
    assert measured["orchestration_overhead_share"] == pytest.approx(max(overhead) / on_disk["step_s"])
    # 30 steps never pay for a compile: eager, and the record says why.
    assert on_disk["compile"]["enabled"] is False and "blocks run eager" in on_disk["compile"]["reason"]
    assert summary["restarts"] == []
    assert [Path(c).name for c in checkpoint_files.committed(str(run_dir / "checkpoints"))] == ["step_00000030"]


@pytest.mark.slow
def test_ddp_two_workers_equal_one_worker(cluster, tmp_path):
    common = ("train.max_steps=4", "train.eval_interval=4", "parallel.strategy=ddp", "train.micro_batch_size=2")
    one_dir, one, cfg = _run(tmp_path, *common, "cluster.num_workers=1")
    two_dir, two, _ = _run(tmp_path, *common, "cluster.num_workers=2")
    assert one["world_size"] == 1 and two["world_size"] == 2
    assert json.loads((two_dir / "plan.json").read_text())["sync"]["grad_accum_steps"] == 2
    w1, w2 = _final_weights(one_dir, cfg), _final_weights(two_dir, cfg)
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=0, atol=1e-5, msg=k)
    assert two["final_val_loss"] == pytest.approx(one["final_val_loss"], abs=1e-5)
    # The same run with its blocks compiled ends with the same weights, and records its compile.
    comp_dir, comp, _ = _run(tmp_path, *common, "cluster.num_workers=2", "train.compile=true")
    assert json.loads((comp_dir / "plan.json").read_text())["compile"]["enabled"] is True
    wc = _final_weights(comp_dir, cfg)
    for k in w2:
        torch.testing.assert_close(wc[k], w2[k], rtol=0, atol=1e-5, msg=k)
    record = comp["compile"]
    assert record["enabled"] and record["measured_compile_s"] >= 0
    assert [sorted(c) for c in record["cache"]] == [["fxgraph_cache_hit", "fxgraph_cache_miss"]] * 2


@pytest.mark.slow
def test_pipeline_two_workers_end_at_the_val_loss_of_pp1_and_survive_a_killed_stage(cluster, tmp_path):
    # Two stages (one block each, the embedding on the first, head and loss on the second) run
    # the plan's 4 micro-batches under 1F1B; the same job without a pipeline is ddp on 2 ranks.
    common = ("train.max_steps=12", "train.eval_interval=6", "train.micro_batch_size=2", "cluster.num_workers=2",
              "checkpoint.interval=2")
    pp2 = ("parallel.pp=2", "parallel.pp_schedule=1f1b")
    one_dir, one, cfg = _run(tmp_path / "pp1", *common, "parallel.pp=1", "parallel.strategy=ddp")
    two_dir, two, _ = _run(tmp_path / "pp2", *common, *pp2)
    plan = json.loads((two_dir / "plan.json").read_text())
    assert plan["mesh"]["pp"] == 2 and plan["execution"]["pipeline"]["microbatches"] == 4
    assert two["final_val_loss"] < one["first_val_loss"]
    assert two["final_val_loss"] == pytest.approx(one["final_val_loss"], abs=1e-5)
    # The stages' checkpoint is the whole model: both ends of the tied pair, every block.
    w1, w2 = _final_weights(one_dir, cfg), _final_weights(two_dir, cfg)
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=0, atol=1e-5, msg=k)
    # The last stage's process killed mid-run: the pipeline restarts from its last committed
    # checkpoint and ends exactly where the uninterrupted pipeline did. The driver sees a step
    # up to a second after it ends, and 12 steps of milliseconds can all be over by then: this
    # run evaluates every step and writes its checkpoints synchronously, which changes neither
    # its weights nor its last validation loss, so the kill lands while it still trains.
    done = threading.Event()
    killer = threading.Thread(target=_kill_rank_when, args=(tmp_path / "killed", 1, 3, done), daemon=True)
    killer.start()
    try:
        killed_dir, killed, _ = _run(tmp_path / "killed", *common, *pp2, "train.max_failures=1",
                                     "train.eval_interval=1", "checkpoint.async_save=false")
    finally:
        done.set()
    (restart,) = killed["restarts"]
    assert restart["ranks"] == [1] and restart["resumed_from_step"] % 2 == 0 and restart["resumed_from_step"] >= 2
    # No other rank holds the last stage's state: it comes from the checkpoint, and the record says why.
    assert restart["recovery"]["state_from"] == "checkpoint" and "dp_replicate=1" in restart["recovery"]["why"]
    assert killed["steps"] == 12
    assert killed["final_val_loss"] == pytest.approx(two["final_val_loss"], abs=1e-6)
    w3 = _final_weights(killed_dir, cfg)
    for k in w2:
        torch.testing.assert_close(w3[k], w2[k], rtol=0, atol=1e-6, msg=k)


def _kill_rank_when(run_dir_parent: Path, rank: int, at_step: int, done: threading.Event,
                    seen: list | None = None, sig: int = signal.SIGKILL) -> None:
    """Wait for the run's metrics to reach `at_step`, then kill -9 the rank's process (or send
    it `sig`); the placement it read is appended to `seen`."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not done.is_set():
        runs = sorted(run_dir_parent.glob("llm-*"))
        if runs:
            metrics, placement = runs[-1] / "metrics.jsonl", runs[-1] / "placement.json"
            if metrics.exists() and placement.exists():
                steps = [json.loads(l)["step"] for l in metrics.read_text().splitlines() if l.strip()]
                if steps and max(steps) >= at_step:
                    placed = json.loads(placement.read_text())
                    if seen is not None:
                        seen.append(placed)
                    os.kill(placed[rank]["pid"], sig)
                    return
        time.sleep(0.05)


@pytest.mark.slow
def test_killed_worker_is_replaced_from_the_survivors_memory_and_the_run_ends_exactly_as_without_failure(
        cluster, tmp_path):
    # The kill comes at step 6 of 200 (a step takes milliseconds: the driver may see step 6
    # tens of steps late), with steps after it to show the trajectory is the same. No checkpoint
    # is written before the end: under HSDP (2 replicas of 2 shards) each survivor holds its
    # replica group's state, and the run goes on from where it failed.
    steps = 200
    common = (f"train.max_steps={steps}", "train.eval_interval=50", "checkpoint.interval=0", "parallel.strategy=hsdp",
              "parallel.dp_shard=2", "cluster.num_workers=4")
    ref_dir, ref, cfg = _run(tmp_path / "ref", *common)
    done, seen = threading.Event(), []
    killer = threading.Thread(target=_kill_rank_when, args=(tmp_path / "killed", 1, 6, done, seen), daemon=True)
    killer.start()
    try:
        run_dir, summary, _ = _run(tmp_path / "killed", *common, "train.max_failures=1")
    finally:
        done.set()
    assert len(summary["restarts"]) == 1
    restart = summary["restarts"][0]
    assert restart["ranks"] == [1]
    recovery = restart["recovery"]
    # Only the dead rank was replaced, and any survivor left blocked in its step by the dead
    # one (gloo keeps an FSDP2 group's connections open after it is destroyed): the others'
    # processes trained on, on the same plan, without waiting out elastic.leave_timeout_s.
    assert recovery["kind"] == "kept_survivors"
    stuck = recovery.get("stuck", [])
    assert recovery["replaced"] == sorted([1, *stuck]) and recovery["kept"] == 4 - len(recovery["replaced"])
    after = json.loads((run_dir / "placement.json").read_text())
    assert [a["pid"] == b["pid"] for a, b in zip(after, seen[0])] == [r not in recovery["replaced"] for r in range(4)]
    # The state comes from the survivors' memory where each replica group ([0, 2] and [1, 3])
    # kept one at the newest step. A death inside a step's last collective can leave survivors a
    # step apart (those that got its result went on to the update); a group without the newest
    # step, or whose survivor was stuck, reads the checkpoint (here: none, so step 0) instead.
    assert recovery["state_from"] == "survivors" or (
        recovery["state_from"] == "step 0" and "no survivor of replica group" in recovery["why"]), recovery
    parts = restart["breakdown"]
    for name in ("detection_s", "teardown_s", "actor_start_s", "process_group_s", "model_build_s",
                 "state_restore_s", "first_step_s"):
        assert parts[name] >= 0, name
    assert "probe_s" not in parts and "placement_s" not in parts  # nothing re-probed, re-planned or re-placed
    assert parts["total_s"] >= sum(v for k, v in parts.items() if k.endswith("_s") and k != "total_s") - 0.5
    assert parts["teardown_s"] < cfg.elastic.leave_timeout_s
    assert parts["largest"] in parts
    startup = {"probe_s", "plan_s", "placement_s", "actor_start_s", "model_build_s", "first_step_s"}
    assert startup <= set(summary["startup"])
    if recovery["state_from"] == "survivors":
        # resumed where it failed: no step trained twice, and no checkpoint there to read
        assert 6 <= restart["resumed_from_step"] == restart["failed_at_step"] < steps
        assert restart["steps_lost"] == 0
    assert [p.name for p in (run_dir / "checkpoints").glob("step_*")] == [f"step_{steps:08d}"]
    assert summary["steps"] == steps
    assert summary["final_val_loss"] == pytest.approx(ref["final_val_loss"], abs=1e-6)
    w_ref, w = _final_weights(ref_dir, cfg), _final_weights(run_dir, cfg)
    for k in w_ref:
        torch.testing.assert_close(w[k], w_ref[k], rtol=0, atol=1e-6, msg=k)
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # one line per step, even across the restart
    assert (run_dir / "loss.svg").read_text().count(">restart<") == 1  # the curve marks where it resumed


@pytest.mark.slow
def test_a_stopped_rank_in_a_whole_world_restart_is_killed_at_once(cluster, tmp_path):
    # keep_survivors=false: every actor is released, the stopped one too. Ray's own kill of a
    # stopped process waits 5 s (kill_worker_timeout_milliseconds) before it kills; a rank of
    # its node kills it at once instead.
    done, seen = threading.Event(), []
    stopper = threading.Thread(target=_kill_rank_when, args=(tmp_path, 1, 4, done, seen, signal.SIGSTOP),
                               daemon=True)
    stopper.start()
    try:
        run_dir, summary, _ = _run(tmp_path, "train.max_steps=60", "train.eval_interval=60", "checkpoint.interval=5",
                                   "elastic.keep_survivors=false", "train.max_failures=1")
    finally:
        done.set()
        for placed in seen:  # never leave a stopped process behind
            try:
                os.kill(placed[1]["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
    [restart] = summary["restarts"]
    assert restart["reason"].startswith("hang: rank(s) [1] did not answer") and restart["ranks"] == [1], restart
    assert restart["recovery"]["kind"] == "full_restart"
    assert restart["breakdown"]["teardown_s"] < 4.0, restart["breakdown"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 61))


@pytest.mark.slow
def test_resume_with_another_world_size_or_plan_continues_from_the_saved_step(cluster, tmp_path):
    first_dir, first, cfg = _run(tmp_path, "train.max_steps=6", "train.eval_interval=3", "checkpoint.interval=3",
                                 "cluster.num_workers=2", "parallel.strategy=ddp", "parallel.pp=1",
                                 "train.micro_batch_size=2")
    before = sorted(p.name for p in (first_dir / "checkpoints").iterdir())
    ckpt = checkpoint_files.committed(str(first_dir / "checkpoints"))[0]
    assert ckpt.endswith("step_00000003")
    # Moved to a pipeline (the tied embedding and head on different stages): the run ends where
    # the uninterrupted ddp run ended, and the console says the plan changed.
    said = Console(record=True, file=open(os.devnull, "w"), width=300)
    _, moved, _ = _run(tmp_path, "train.max_steps=6", "train.eval_interval=3", "cluster.num_workers=2",
                       "parallel.pp=2", "parallel.pp_schedule=1f1b", "train.micro_batch_size=2", resume=ckpt,
                       console=said)
    assert moved["final_val_loss"] == pytest.approx(first["final_val_loss"], rel=1e-5)
    assert f"resumed from {ckpt} at step 3, written under ddp on dp_replicate=2 x dp_shard=1 x tp=1 and " \
           "resharded to ddp on pp=2 x dp_replicate=1 x dp_shard=1 x tp=1" in said.export_text()
    last = checkpoint_files.committed(str(first_dir / "checkpoints"))[-1]
    run_dir, summary, _ = _run(tmp_path, "train.max_steps=9", "train.eval_interval=3", "cluster.num_workers=1",
                               resume=last)
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 7 and rows[-1]["step"] == 9
    # resuming a run that already reached train.max_steps is refused before anything starts
    from orchestrator.cli import main

    assert main(["submit", str(ROOT / "jobs" / "llm.yaml"), *TINY, "train.max_steps=6", f"monitor.runs_dir={tmp_path}",
                 "--resume", str(first_dir)]) == 2
    assert summary["resumed_from"] == last and summary["world_size"] == 1
    # the earlier run's directory is only read
    assert sorted(p.name for p in (first_dir / "checkpoints").iterdir()) == before


@pytest.mark.slow
def test_corrupted_latest_checkpoint_is_refused_by_name_and_the_previous_used(cluster, tmp_path):
    run_dir, _, _ = _run(tmp_path, "train.max_steps=4", "train.eval_interval=2", "checkpoint.interval=2")
    ckpts = checkpoint_files.committed(str(run_dir / "checkpoints"))
    assert [Path(c).name for c in ckpts] == ["step_00000002", "step_00000004"]
    shard = sorted(Path(ckpts[-1]).glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{shard.name} is corrupted"):
        checkpoint_files.verify(ckpts[-1])
    from orchestrator.commands.submit import resume_checkpoint

    assert resume_checkpoint(str(run_dir)) == ckpts[0]


_WRITER = r"""
import os, signal, sys, torch, torch.distributed as dist
from orchestrator.runtime import checkpoint
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d", rank=0, world_size=1)
root, kill = sys.argv[1], sys.argv[2] == "kill"
checkpoint.save(root, 1, {"w": torch.ones(1000)}, {}, keep_last=5)
if kill:
    # die after the shards are written, before the commit
    checkpoint.manifest = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
checkpoint.save(root, 2, {"w": torch.full((1000,), 2.0)}, {}, keep_last=5)
"""


@pytest.mark.slow
def test_kill_during_checkpoint_write_leaves_the_previous_one_loadable(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, "-c", _WRITER % port, str(tmp_path), "kill"], capture_output=True,
                          timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert [Path(c).name for c in checkpoint_files.committed(str(tmp_path))] == ["step_00000001"]
    assert (tmp_path / ".step_00000002.partial").is_dir()  # the torn write is there, and ignored
    meta = checkpoint_files.verify(str(tmp_path / "step_00000001"))
    assert meta["step"] == 1
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.zeros(1000)}
    dcp.load(state, checkpoint_id=str(tmp_path / "step_00000001"), no_dist=True)
    assert torch.equal(state["w"], torch.ones(1000))


@pytest.mark.slow
def test_submit_cli_end_to_end(tmp_path):
    """The README's command, shortened: trains, prints the run directory, exits 0."""
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator", "submit", "jobs/llm.yaml", *TINY, "train.max_steps=6",
         "train.eval_interval=3", f"monitor.runs_dir={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "run directory:" in proc.stdout
    (run_dir,) = tmp_path.glob("llm-*")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 6
    # The start-up breakdown begins where the user's wait does: with Ray's own start.
    startup = summary["startup"]
    assert next(iter(startup)) == "ray_start_s"
    assert "measure_s" not in startup  # the built-in GPT is priced from its config, not measured
    assert 0 < startup["ray_start_s"] < startup["total_s"]
    assert startup["total_s"] >= sum(v for k, v in startup.items() if k.endswith("_s") and k != "total_s") - 0.5


_PIN = r"""
import os, sys
from orchestrator.runtime.worker import _bind_cpus
before = sorted(os.sched_getaffinity(0))
notes = _bind_cpus(sys.argv[1], 3)
print(before, sorted(os.sched_getaffinity(0)), notes)
"""


@pytest.mark.slow
def test_worker_pins_to_the_cpus_near_its_gpu_and_never_widens(tmp_path):
    from orchestrator.topology.model import parse_cpu_list

    assert parse_cpu_list("0-2,8,10-11") == {0, 1, 2, 8, 10, 11}
    with pytest.raises(ValueError):
        parse_cpu_list("5-3")
    first = min(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", _PIN, f"{first},100000-100003"], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == f"{sorted(os.sched_getaffinity(0))} {[first]} []"
    out = subprocess.run([sys.executable, "-c", _PIN, "100000-100003"], capture_output=True, text=True,
                         check=True).stdout
    before = sorted(os.sched_getaffinity(0))
    assert out.startswith(f"{before} {before} ['rank 3: none of the CPUs near its GPU (100000-100003)")


@pytest.mark.slow
def test_fp16_trains_with_loss_scaling_and_is_refused_where_it_cannot(cluster, tmp_path):
    from orchestrator.errors import PlanError

    _, summary, _ = _run(tmp_path, "train.precision=fp16", "train.max_steps=6", "train.eval_interval=3")
    assert summary["strategy"] == "ddp"  # the planner keeps fp16 where loss scaling runs
    assert summary["final_val_loss"] < summary["first_val_loss"]
    with pytest.raises(PlanError, match="train.precision=fp16 needs loss scaling"):
        _run(tmp_path, "train.precision=fp16", "parallel.strategy=zero2", "train.max_steps=2")


@pytest.mark.slow
def test_elastic_max_workers_caps_the_world(cluster, tmp_path):
    from orchestrator.topology.model import ClusterTopology, cpu_node

    two = ClusterTopology(nodes=[cpu_node(4, node_id="a"), cpu_node(4, node_id="b")])
    capped = two.limit(6)
    assert [n.num_devices for n in capped.nodes] == [4, 2]
    assert [len(n.links) for n in capped.nodes] == [6, 1]  # every kept pair keeps its link
    capped.nodes[1].check()
    _, summary, _ = _run(tmp_path, "cluster.num_workers=2", "elastic.max_workers=1", "train.max_steps=2",
                         "train.eval_interval=2")
    assert summary["world_size"] == 1


def test_the_private_clusters_workers_run_at_normal_priority(cluster):
    """Ray starts workers at niceness 15; in our own cluster the workers are the training, and a
    step that yields to every Ray daemon on a busy host stalls every rank at the next collective."""
    import ray

    @ray.remote(num_cpus=1)
    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, 0)

    assert ray.get(niceness.remote()) == 0


def test_the_private_cluster_polls_its_local_connections_every_tenth_of_a_second(cluster):
    """Ray's raylet retries its connection to the object store it has just started after 1 s,
    which made every other start of the cluster 1 s slower; the private cluster retries after
    0.1 s, as often as makes Ray's own 10 s of patience, and its processes see it."""
    import ray

    @ray.remote(num_cpus=0)
    def poll() -> tuple[int, int]:
        from ray._raylet import Config

        return Config.raylet_client_connect_timeout_milliseconds(), Config.raylet_client_num_connect_attempts()

    timeout_ms, attempts = ray.get(poll.remote())
    assert timeout_ms == 100 and timeout_ms * attempts == 10_000


def test_a_rank_started_below_normal_priority_restores_it_or_says_why():
    import subprocess
    import sys

    code = ("import os; from orchestrator.runtime.worker import _normal_priority; "
            "print(repr(_normal_priority())); print(os.getpriority(os.PRIO_PROCESS, 0))")
    out = subprocess.run(["nice", "-n", "15", sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout.splitlines()
    if os.geteuid() == 0:  # root may lower its niceness
        assert out == ["None", "0"]
    else:
        assert "runs at niceness 15" in out[0] and "RAY_worker_niceness=0" in out[0] and out[1] == "15"
