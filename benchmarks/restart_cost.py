"""Restart cost: wall time of a run where kill -9 takes out one of 8 ranks, over the same run
uninterrupted, on 2 fake-GPU nodes (4 GPUs each, wired as the 4-GPU PCIe capture) beside a
GPU-less head; plus how long the driver took from the kill to the restart record.

    python benchmarks/restart_cost.py [--quick] [--steps N]
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
from _common import ROOT, parse_args, print_table, write_result  # noqa: E402

CAPTURE = ROOT / "tests" / "fixtures" / "topology" / "topo_4gpu_pcie_pxb_pix_nccl667.txt"
TINY = ["model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.block_size=32", "train.global_batch_size=16",
        "train.warmup_steps=1", "train.eval_iters=1", "cluster.gpu=A100", "cluster.cpus_per_worker=0.25",
        "parallel.strategy=ddp", "parallel.tp=1", "monitor.progress=false", "monitor.dashboard=false"]


def _run(runs: Path, steps: int, kill_at: int | None) -> dict:
    from rich.console import Console

    from orchestrator.config import load_config
    from orchestrator.rundir import RunDir
    from orchestrator.runtime.driver import run_job

    cfg = load_config(ROOT / "jobs" / "llm.yaml", [*TINY, f"monitor.runs_dir={runs}", f"train.max_steps={steps}",
                                                   f"train.eval_interval={steps}", "checkpoint.interval=5",
                                                   "train.max_failures=1"])
    run = RunDir.create(cfg.monitor.runs_dir, cfg.name)
    killed: dict = {}

    def killer():
        while "t" not in killed:
            m = run.path / "metrics.jsonl"
            rows = m.read_text().splitlines() if m.exists() else []
            if rows and json.loads(rows[-1])["step"] >= kill_at:
                place = json.loads((run.path / "placement.json").read_text())
                killed["t"] = time.time()
                os.kill(place[3]["pid"], signal.SIGKILL)
            time.sleep(0.05)

    if kill_at:
        threading.Thread(target=killer, daemon=True).start()
    t0 = time.monotonic()
    summary = run_job(cfg, run, Console(file=open(os.devnull, "w")))
    wall = time.monotonic() - t0
    out = {"wall_s": wall, "restarts": summary["restarts"]}
    if kill_at and summary["restarts"]:
        r = summary["restarts"][0]
        detected = time.mktime(time.strptime(r["detected_at"][:19], "%Y-%m-%dT%H:%M:%S"))
        out["detect_s"] = max(0.0, detected - killed["t"])
        out["blamed"] = r["ranks"]
    return out


def main(argv=None) -> None:
    args = parse_args(__doc__, argv, lambda ap: ap.add_argument("--steps", type=int, default=40))
    import ray
    from ray.cluster_utils import Cluster

    steps = 20 if args.quick else args.steps
    env = {"ORCHESTRATOR_TOPOLOGY_FILE": str(CAPTURE)}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 0})
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=2, num_gpus=4, env_vars=env)
        ray.init(address=cluster.address)
        cluster.wait_for_nodes()
        with tempfile.TemporaryDirectory() as tmp:
            base = _run(Path(tmp) / "a", steps, None)
            hit = _run(Path(tmp) / "b", steps, steps // 2)
    finally:
        ray.shutdown()
        cluster.shutdown()
    extra = hit["wall_s"] - base["wall_s"]
    rows = [("uninterrupted", f"{base['wall_s']:.1f} s", "-", "-"),
            ("kill -9 of rank 3", f"{hit['wall_s']:.1f} s", f"{extra:+.1f} s", str(hit.get("blamed")))]
    print_table(f"restart cost, 8 ranks on 2 fake-GPU nodes, {steps} steps", ["run", "wall", "over uninterrupted",
                                                                             "blamed ranks"], rows,
                caption=f"kill to detection: {hit.get('detect_s', float('nan')):.1f} s (1 s resolution)")
    write_result("restart_cost", {"steps": steps, "uninterrupted_s": base["wall_s"], "killed_s": hit["wall_s"],
                                  "restart_cost_s": extra, "detect_s": hit.get("detect_s"),
                                  "blamed": hit.get("blamed")}, args)


if __name__ == "__main__":
    main()
