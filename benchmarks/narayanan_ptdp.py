"""The planner against Narayanan et al. 2021 (Megatron-LM PTD-P), Tables 1 and 2, on DGX A100 clusters.

    python benchmarks/narayanan_ptdp.py [--rows N]

For every row of the paper's weak-scaling table (l, h, a, t, p, GPUs, batch; V=51,200, s=2048)
it plans the model on DGX A100 nodes (8 x A100-80GB on NVSwitch, 200 GB/s per node) twice: with
the paper's own (t, p) forced, and with everything left to `auto`. Then every point of Table 2
(ZeRO-3 without model parallelism against PTD-P at a fixed batch) three times: ZeRO-3 as the
paper ran it, PTD-P at the paper's (t, p), and `auto`. Throughput is the paper's metric: Eq. 3's
FLOPs (with full recomputation, as the paper counts them) over the predicted step time, per
GPU. Writes benchmarks/results/narayanan_ptdp.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from _common import run

from orchestrator.config import load_config
from orchestrator.planning import plan_job
from orchestrator.planning.describe import describe_cluster
from orchestrator.planning.model_math import ModelShape, flops_per_step
from orchestrator.topology.files import load_topology_file
from orchestrator.topology.model import ClusterTopology, Network

ROOT = Path(__file__).resolve().parent.parent
CAPTURE = ROOT / "conf" / "topologies" / "a100-8gpu-nvswitch.txt"
# (billions, heads a, hidden h, layers l, t, p, GPUs, batch, measured TFLOP/s per GPU)
TABLE_1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
# Table 2, the paper's comparison with ZeRO-3 at a fixed global batch: (billions, a, h, l,
# batch, PTD-P's (t, p), [(GPUs, ZeRO-3's micro-batch, ZeRO-3 measured, PTD-P measured)]).
# ZeRO-3 ran without model parallelism, as DeepSpeed's implementation of 2021.
TABLE_2 = [
    (174.6, 96, 12288, 96, 1536, (8, 12), [(384, 4, 144, 153), (768, 2, 88, 149), (1536, 1, 44, 141)]),
    (529.6, 128, 20480, 105, 2240, (8, 35), [(1120, 2, 98, 167), (2240, 1, 48, 159)]),
]
NET = Network(bandwidth_gbps=200.0, latency_us=3.0, source="config")


def cluster(gpus: int) -> ClusterTopology:
    return describe_cluster(load_topology_file(CAPTURE, "A100"), gpus // 8, NET, "A100")


def overrides(row, forced: bool) -> list[str]:
    _, a, h, l, t, p, _, batch, _ = row
    out = [f"model.n_layer={l}", f"model.n_head={a}", f"model.n_embd={h}", "model.vocab_size=51200",
           "model.block_size=2048", f"train.global_batch_size={batch}", "train.precision=bf16", "parallel.pp=auto"]
    # The paper's runs recompute every block (its FLOP counts include the recomputation).
    return out + ([f"parallel.tp={t}", f"parallel.pp={p}", "parallel.recompute=full"] if forced else [])


def tflops_per_gpu(row, step_s: float) -> float:
    _, a, h, l, _, _, gpus, batch, _ = row
    shape = ModelShape(layers=l, hidden=h, heads=a, vocab=51200, seq=2048)
    return flops_per_step(shape, batch, "full") / step_s / gpus / 1e12


def evaluate(row) -> dict:
    topo = cluster(row[6])
    out = {"billions": row[0], "t": row[4], "p": row[5], "gpus": row[6], "batch": row[7], "paper_tflops": row[8]}
    for kind in ("paper", "auto"):
        t0 = time.perf_counter()
        plan = plan_job(load_config(None, overrides(row, kind == "paper")), topo)
        pl = plan.execution.pipeline
        out[kind] = {"strategy": str(plan.strategy), "mesh": plan.mesh.to_dict(), "fits": plan.fits,
                     "micro_batch": plan.micro_batch_size, "recompute": str(plan.recompute),
                     "schedule": None if pl is None else f"{pl.schedule} v={pl.virtual} m={pl.microbatches}",
                     "step_s": round(plan.step_time.total_s, 4),
                     "tflops": round(tflops_per_gpu(row, plan.step_time.total_s), 1),
                     "plan_s": round(time.perf_counter() - t0, 3)}
    return out


def evaluate_zero3(model, gpus: int, micro_batch: int, zero3_tflops: float, ptdp_tflops: float) -> dict:
    """One Table 2 point: ZeRO-3 without model parallelism as the paper ran it (its micro-batch,
    full recomputation), PTD-P at the paper's (t, p), and `auto`, on the same cluster."""
    billions, a, h, l, batch, (t, p), _ = model
    row = (billions, a, h, l, t, p, gpus, batch, ptdp_tflops)
    topo = cluster(gpus)
    forced = {"zero3": ["parallel.strategy=zero3", "parallel.tp=1", "parallel.pp=1",
                        f"train.micro_batch_size={micro_batch}", "parallel.recompute=full"],
              "ptdp": [f"parallel.tp={t}", f"parallel.pp={p}", "parallel.recompute=full"], "auto": []}
    out = {"billions": billions, "gpus": gpus, "batch": batch, "zero3_paper_tflops": zero3_tflops,
           "ptdp_paper_tflops": ptdp_tflops}
    for kind, extra in forced.items():
        plan = plan_job(load_config(None, overrides(row, False) + extra), topo)
        pl = plan.execution.pipeline
        out[kind] = {"strategy": str(plan.strategy), "mesh": plan.mesh.to_dict(), "fits": plan.fits,
                     "schedule": None if pl is None else f"{pl.schedule} v={pl.virtual} m={pl.microbatches}",
                     "tflops": round(tflops_per_gpu(row, plan.step_time.total_s), 1)}
    return out


def _mesh(entry: dict) -> str:
    return "x".join(f"{k}{v}" for k, v in entry["mesh"].items() if v > 1) or "1"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=len(TABLE_1), help="the first N rows only")
    args = ap.parse_args(argv)
    rows = [evaluate(r) for r in TABLE_1[:args.rows]]
    print(f"{'model':>7} {'t':>2} {'p':>3} {'GPUs':>5} {'paper':>6} {'pred':>6} {'err':>6}  "
          f"{'auto plan':<44} {'auto':>6}")
    worst = 0.0
    for r in rows:
        err = r["paper"]["tflops"] / r["paper_tflops"] - 1
        worst = max(worst, abs(err))
        a = r["auto"]
        mesh = _mesh(a)
        print(f"{r['billions']:>6}B {r['t']:>2} {r['p']:>3} {r['gpus']:>5} {r['paper_tflops']:>6} "
              f"{r['paper']['tflops']:>6} {err:>+6.0%}  {a['strategy'] + ' ' + mesh + ' ' + (a['schedule'] or ''):<44} "
              f"{a['tflops']:>6}")
    zero3 = [] if args.rows < len(TABLE_1) else [
        evaluate_zero3(m, gpus, mb, z, pt) for m in TABLE_2 for gpus, mb, z, pt in m[-1]]
    if zero3:
        print("\nTable 2, ZeRO-3 (no model parallelism) against PTD-P at a fixed batch, TFLOP/s per GPU:")
        print(f"{'model':>7} {'GPUs':>5} {'ZeRO-3':>7} {'pred':>6} {'PTD-P':>6} {'pred':>6}  "
              f"{'auto plan':<44} {'auto':>6}")
        for z in zero3:
            a = z["auto"]
            print(f"{z['billions']:>6}B {z['gpus']:>5} {z['zero3_paper_tflops']:>7} {z['zero3']['tflops']:>6} "
                  f"{z['ptdp_paper_tflops']:>6} {z['ptdp']['tflops']:>6}  "
                  f"{a['strategy'] + ' ' + _mesh(a) + ' ' + (a['schedule'] or ''):<44} {a['tflops']:>6}")
    out = ROOT / "benchmarks" / "results" / "narayanan_ptdp.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"capture": CAPTURE.name, "network_gbps": NET.bandwidth_gbps, "rows": rows, "zero3_vs_ptdp": zero3}
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"worst |predicted / measured - 1| at the paper's (t, p): {worst:.0%}; wrote {out.relative_to(ROOT)}")
    return 0 if worst <= 0.3 else 1


if __name__ == "__main__":
    run(main)
