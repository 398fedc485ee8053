"""Restart cost on fake-GPU Ray clusters with a GPU-less head.

1. One `kill -9` half-way through a run of 4, 8 and 16 ranks (nodes of 4 fake GPUs wired as
   the 4-GPU PCIe capture), each against the same run uninterrupted, twice: keeping the
   survivors (the default: only the dead rank's actor is replaced) and with
   `elastic.keep_survivors=false` (every actor torn down, re-probed, re-planned, re-placed).
   Per run: the extra wall time over the uninterrupted run, the ranks blamed, the time from
   the kill to its detection, where the state came from (the survivors' memory under DDP, or
   a checkpoint) and the steps trained again, and the restart record's breakdown (detection,
   teardown, probe, plan, placement, actor start, process group, model build, state restore,
   first step). Then rank 1 stopped (SIGSTOP) half-way: a hang, found by the heartbeat
   (`elastic.silent_after_s`), its extra wall time counted the same way.
   Goal: keeping the survivors, <= 10 s at 8 ranks and flat in the rank count.
2. 3 nodes of 2 GPUs with global batch 18: one node removed half-way (its 2 ranks die, and the 4
   survivors do not divide 18); the world sizes before and after, the global batch every plan
   covers, and whether every step finished.

    python benchmarks/restart_cost.py [--quick] [--steps N] [--ranks 4 8 16]
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, parse_args, print_table, run, write_result  # noqa: E402

CAPTURE = ROOT / "tests" / "fixtures" / "topology" / "topo_4gpu_pcie_pxb_pix_nccl667.txt"
TINY = ["model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.block_size=32", "train.warmup_steps=1",
        "train.eval_iters=1", "cluster.gpu=A100", "cluster.cpus_per_worker=0.25", "parallel.strategy=ddp",
        "parallel.tp=1", "monitor.progress=false", "monitor.dashboard=false"]


def _last_step(run: Path) -> int:
    m = run / "metrics.jsonl"
    rows = m.read_text().splitlines() if m.exists() else []
    return json.loads(rows[-1])["step"] if rows else 0


def _run(runs: Path, steps: int, batch: int, chaos=None, extra: tuple[str, ...] = ()) -> dict:
    """One run_job; `chaos(run_dir)` runs beside it and returns what it did."""
    from rich.console import Console

    from orchestrator.config import load_config
    from orchestrator.control.driver import run_job
    from orchestrator.record.rundir import RunDir

    cfg = load_config(ROOT / "jobs" / "llm.yaml", [*TINY, f"monitor.runs_dir={runs}", f"train.max_steps={steps}",
                                                   f"train.global_batch_size={batch}", f"train.eval_interval={steps}",
                                                   "checkpoint.interval=5", "train.max_failures=1", *extra])
    run = RunDir.create(cfg.monitor.runs_dir, cfg.name)
    did: dict = {}
    if chaos:
        threading.Thread(target=lambda: did.update(chaos(run.path)), daemon=True).start()
    t0 = time.monotonic()
    summary = run_job(cfg, run, Console(file=open(os.devnull, "w")))
    rows = [json.loads(line) for line in (run.path / "metrics.jsonl").read_text().splitlines()]
    return {"wall_s": time.monotonic() - t0, "summary": summary, "did": did, "steps": [r["step"] for r in rows],
            "plan": json.loads((run.path / "plan.json").read_text())}


def _strike_rank(rank: int, at: int, sig: int = signal.SIGKILL):
    """At step `at`, send `sig` to rank `rank`: SIGKILL a death, SIGSTOP a hang."""
    def chaos(run: Path) -> dict:
        while _last_step(run) < at:
            time.sleep(0.05)
        place = json.loads((run / "placement.json").read_text())
        t = time.time()
        os.kill(place[rank]["pid"], sig)
        return {"struck_at": t, "rank": rank, "pid": place[rank]["pid"]}
    return chaos


def _remove_node(cluster, node, at: int):
    def chaos(run: Path) -> dict:
        while _last_step(run) < at:
            time.sleep(0.05)
        plan = json.loads((run / "plan.json").read_text())
        cluster.remove_node(node, allow_graceful=False)
        return {"world_before": plan["world_size"]}
    return chaos


def _cluster(nodes: int, gpus: int, env: dict):
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "num_gpus": 0,
        "_system_config": {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                           "health_check_failure_threshold": 3}})
    workers = [cluster.add_node(num_cpus=2, num_gpus=gpus, env_vars=env) for _ in range(nodes)]
    ray.init(address=cluster.address)
    cluster.wait_for_nodes()
    return cluster, workers


def _batch(plan: dict) -> int:
    m = plan["mesh"]
    return plan["micro_batch_size"] * plan["sync"]["grad_accum_steps"] * m["dp_replicate"] * m["dp_shard"]


def options(ap) -> None:
    ap.add_argument("--steps", type=int, default=40, help="training steps per run (quick: 20)")
    ap.add_argument("--ranks", type=int, nargs="+", default=None,
                    help="world sizes of the kill runs, multiples of 4 (default 4 8 16; quick: 4 8)")


def _killed(base: dict, hit: dict) -> dict:
    if not hit["summary"].get("restarts"):
        raise SystemExit("the run ended before its kill landed (the driver sees steps up to half a second late): "
                         "give it more --steps")
    r = hit["summary"]["restarts"][0]
    return {"wall_s": hit["wall_s"], "restart_cost_s": hit["wall_s"] - base["wall_s"],
            "detect_s": r["detected_unix_s"] - hit["did"]["struck_at"], "blamed_ranks": r["ranks"],
            "steps_lost": r["steps_lost"], "recovery": r.get("recovery"), "breakdown": r.get("breakdown"),
            "every_step_finished": hit["steps"] == base["steps"]}


def _kill_runs(tmp: Path, ranks: int, steps: int) -> dict:
    """Uninterrupted, then rank `ranks - 1` killed keeping the survivors, then killed with a
    whole-world restart, then rank 1 stopped (a hang), on one cluster of `ranks / 4` nodes."""
    import ray

    cluster, _ = _cluster(ranks // 4, 4, {"ORCHESTRATOR_TOPOLOGY_FILE": str(CAPTURE)})
    hang: dict = {}
    try:
        base = _run(tmp / f"{ranks}-a", steps, 32)
        kept = _run(tmp / f"{ranks}-b", steps, 32, _strike_rank(ranks - 1, steps // 2))
        full = _run(tmp / f"{ranks}-c", steps, 32, _strike_rank(ranks - 1, steps // 2),
                    ("elastic.keep_survivors=false",))
        hang = _run(tmp / f"{ranks}-d", steps, 32, _strike_rank(1, steps // 2, signal.SIGSTOP))
    finally:
        if hang.get("did"):  # never leave a stopped process behind (recovery kills it; this makes sure)
            try:
                os.kill(hang["did"]["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
        ray.shutdown()
        cluster.shutdown()
    return {"ranks": ranks, "uninterrupted_s": base["wall_s"], "keep_survivors": _killed(base, kept),
            "full_restart": _killed(base, full), "hang": _killed(base, hang)}


def _parts(breakdown: dict | None) -> str:
    if not breakdown:
        return "-"
    return ", ".join(f"{k[:-2].replace('_', ' ')} {v:.1f}" for k, v in breakdown.items()
                     if k.endswith("_s") and k != "total_s")


def main(argv=None) -> None:
    args = parse_args(__doc__, argv, options)
    import ray

    from orchestrator.topology.files import load_topology_file
    from orchestrator.topology.model import ClusterTopology

    steps = 20 if args.quick else args.steps
    sizes = args.ranks or ([4, 8] if args.quick else [4, 8, 16])
    if any(n % 4 for n in sizes):
        raise SystemExit(f"--ranks: each must be a multiple of 4 (nodes of 4 GPUs), got {sizes}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        kills = [_kill_runs(tmp, n, steps) for n in sizes]
        two = ClusterTopology(nodes=[load_topology_file(CAPTURE, "A100")]).limit(2).nodes[0]
        (tmp / "two.json").write_text(json.dumps(two.to_dict()))
        cluster, workers = _cluster(3, 2, {"ORCHESTRATOR_TOPOLOGY_FILE": str(tmp / "two.json")})
        try:
            lost = _run(tmp / "c", steps, 18, _remove_node(cluster, workers[-1], steps // 2))
        finally:
            ray.shutdown()
            cluster.shutdown()

    lr = lost["summary"]["restarts"][0]
    node = {"world_before": lost["did"]["world_before"], "world_after": lost["plan"]["world_size"],
            "global_batch_after": _batch(lost["plan"]),
            "every_step_finished": lost["steps"] == list(range(1, steps + 1)),
            "blamed_ranks": lr["ranks"], "wall_s": lost["wall_s"], "recovery": lr.get("recovery")}
    rows = []
    for k in kills:
        for mode in ("keep_survivors", "full_restart", "hang"):
            m = k[mode]
            state = (m["recovery"] or {}).get("state_from", "checkpoint")
            rows.append((k["ranks"], mode.replace("_", " "), f"{k['uninterrupted_s']:.1f} s",
                         f"{m['restart_cost_s']:+.1f} s", str(m["blamed_ranks"]), f"{m['detect_s']:.2f} s",
                         state, m["steps_lost"],
                         f"{m['breakdown']['total_s']:.1f} s" if m["breakdown"] else "-", _parts(m["breakdown"])))
    print_table(f"kill -9 of the last rank half-way (hang: SIGSTOP of rank 1), nodes of 4 fake GPUs, {steps} steps",
                ["ranks", "recovery", "uninterrupted", "extra wall", "blamed", "strike to detection",
                 "state from", "steps lost", "restart to first step", "parts (s)"], rows)
    print_table(f"one of 3 nodes lost, global batch 18, {steps} steps",
                ["world before", "world after", "global batch after", "every step finished", "blamed ranks"],
                [(node["world_before"], node["world_after"], node["global_batch_after"],
                  str(node["every_step_finished"]), str(node["blamed_ranks"]))])
    write_result("restart_cost", {"steps": steps, "kill": kills, "lose_one_of_3_nodes": node}, args)


if __name__ == "__main__":
    run(main)
