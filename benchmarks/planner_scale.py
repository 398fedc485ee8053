"""How long the full `auto` plan search takes as a cluster of 8 x H100 nodes grows.

    python benchmarks/planner_scale.py [--quick] [--out PATH]

Prints a table and writes benchmarks/results/planner_scale.json (or --out) through
`_common.write_result`; `--quick` plans 1, 64 and 1,024 nodes once each, the full run 1, 8, 64,
256 and 1,024 nodes, the fastest of three plannings each. The planner must stay under
one second at 1,024 nodes: identical nodes are laid out once, and beyond a node the search
enumerates divisors of the world, never permutations of ranks.
"""

from __future__ import annotations

import time

from _common import ROOT, parse_args, run, write_result

from orchestrator.config import load_config
from orchestrator.errors import PlanError
from orchestrator.planning import plan_job
from orchestrator.planning.describe import describe_cluster
from orchestrator.topology.files import load_topology_file
from orchestrator.topology.model import ClusterTopology, Network

CAPTURE = ROOT / "conf" / "topologies" / "h100-8gpu-nvswitch.txt"
# A Llama-3-70B-sized decoder; 16,384 sequences of 4,096 tokens a step.
MODEL = ["model.n_layer=80", "model.n_head=64", "model.n_embd=8192", "model.vocab_size=128256",
         "model.block_size=4096", "train.global_batch_size=16384"]


def cluster(nodes: int) -> ClusterTopology:
    node = load_topology_file(CAPTURE, "H100")
    return describe_cluster(node, nodes, Network(bandwidth_gbps=400.0, latency_us=3.0, source="config"), "H100")


def measure(nodes: int, repeats: int) -> dict:
    """The fastest of `repeats` full searches. A cluster the model fits at no plan is timed to
    the planner's answer, the one line saying so (a search as long as any other)."""
    cfg = load_config(None, MODEL)
    topo = cluster(nodes)
    best, plan, refused = float("inf"), None, None
    for _ in range(repeats):
        t0 = time.perf_counter()
        try:
            plan = plan_job(cfg, topo)
        except PlanError as e:
            refused = str(e)
        best = min(best, time.perf_counter() - t0)
    if plan is None:
        return {"nodes": nodes, "gpus": topo.num_devices, "seconds": round(best, 4), "strategy": None,
                "mesh": None, "fits": False, "step_time_s": None, "refused": refused}
    return {"nodes": nodes, "gpus": plan.world_size, "seconds": round(best, 4), "strategy": str(plan.strategy),
            "mesh": plan.mesh.to_dict(), "fits": plan.fits, "step_time_s": round(plan.step_time.total_s, 4)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__, argv)
    sizes = [1, 64, 1024] if args.quick else [1, 8, 64, 256, 1024]
    rows = [measure(n, 1 if args.quick else 3) for n in sizes]
    print(f"{'nodes':>6} {'gpus':>6} {'plan s':>8}  {'strategy':<8} {'mesh (pp x rep x shard x tp)':<27} "
          f"{'step s':>8}  fits")
    for r in rows:
        if r["mesh"] is None:
            print(f"{r['nodes']:>6} {r['gpus']:>6} {r['seconds']:>8.3f}  fits at no plan")
            continue
        mesh = "x".join(str(v) for v in r["mesh"].values())
        print(f"{r['nodes']:>6} {r['gpus']:>6} {r['seconds']:>8.3f}  {r['strategy']:<8} {mesh:<27} "
              f"{r['step_time_s']:>8.3f}  {r['fits']}")
    out = write_result("planner_scale", {"capture": CAPTURE.name, "model": MODEL, "rows": rows,
                                         "repeats": 1 if args.quick else 3}, args)
    print(f"wrote {out}")
    return 0 if rows[-1]["seconds"] < 1.0 else 1


if __name__ == "__main__":
    run(main)
