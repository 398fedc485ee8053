"""The planner against Narayanan et al. 2021 (Megatron-LM PTD-P), Tables 1 and 2, on DGX A100 clusters.

    python benchmarks/narayanan_ptdp.py [--quick] [--rows N] [--out PATH]

For every row of the paper's weak-scaling table (l, h, a, t, p, GPUs, batch; V=51,200, s=2048)
it plans the model on DGX A100 nodes (8 x A100-80GB on NVSwitch, 200 GB/s per node) twice: with
the paper's own (t, p) forced, and with everything left to `auto`. Then every point of Table 2
(ZeRO-3 without model parallelism against PTD-P at a fixed batch) three times: ZeRO-3 as the
paper ran it, PTD-P at the paper's (t, p), and `auto`. Planning only: every figure but the
paper's is a prediction.

Throughput is the paper's metric, FLOPs per step over the step time, per GPU, with the FLOPs
each plan runs (`model_math.flops_per_step` of the plan's recompute mode): forward, backward
(2x forward) and, under full recomputation, the blocks' forward once more, which is Eq. 3's
count (4x forward in the blocks) and the paper's, since its runs recompute fully. The forced
rows (the paper's (t, p), ZeRO-3 and PTD-P of Table 2) recompute fully, as the paper ran them,
so their column counts as the paper's does; an `auto` plan that does not recompute is charged
3x forward, one that recomputes selectively the attention core once more. `model_tflops` beside
each counts the model's FLOPs alone (3x forward, no recomputation), which ranks plans of one
row by their step time. `--quick` plans the first four rows of Table 1 and skips Table 2.
Writes benchmarks/results/narayanan_ptdp.json (or --out) through `_common.write_result`.
"""

from __future__ import annotations

import time

from _common import ROOT, parse_args, run, write_result

from orchestrator.config import load_config
from orchestrator.planning import plan_job
from orchestrator.planning.describe import describe_cluster
from orchestrator.planning.model_math import ModelShape, flops_per_step
from orchestrator.topology.files import load_topology_file
from orchestrator.topology.model import ClusterTopology, Network

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


def tflops_per_gpu(row, step_s: float, recompute: str) -> float:
    """TFLOP/s per GPU of a plan of `row` whose step takes `step_s`: the FLOPs the plan runs
    under its recompute mode (full: Eq. 3, 4x forward in the blocks; none: 3x forward) over the
    step time. `recompute="none"` gives the model's FLOPs alone."""
    _, a, h, l, _, _, gpus, batch, _ = row
    shape = ModelShape(layers=l, hidden=h, heads=a, vocab=51200, seq=2048)
    return flops_per_step(shape, batch, str(recompute)) / step_s / gpus / 1e12


def throughput(row, plan) -> dict:
    """The plan's step time, its recompute mode and its TFLOP/s per GPU: `tflops` counting the
    FLOPs it runs, `model_tflops` the model's alone."""
    step_s = plan.step_time.total_s
    return {"recompute": str(plan.recompute), "step_s": round(step_s, 4),
            "tflops": round(tflops_per_gpu(row, step_s, plan.recompute), 1),
            "model_tflops": round(tflops_per_gpu(row, step_s, "none"), 1)}


def evaluate(row) -> dict:
    topo = cluster(row[6])
    out = {"billions": row[0], "t": row[4], "p": row[5], "gpus": row[6], "batch": row[7], "paper_tflops": row[8]}
    for kind in ("paper", "auto"):
        t0 = time.perf_counter()
        plan = plan_job(load_config(None, overrides(row, kind == "paper")), topo)
        pl = plan.execution.pipeline
        out[kind] = {"strategy": str(plan.strategy), "mesh": plan.mesh.to_dict(), "fits": plan.fits,
                     "micro_batch": plan.micro_batch_size,
                     "schedule": None if pl is None else f"{pl.schedule} v={pl.virtual} m={pl.microbatches}",
                     **throughput(row, plan), "plan_s": round(time.perf_counter() - t0, 3)}
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
                     "micro_batch": plan.micro_batch_size,
                     "schedule": None if pl is None else f"{pl.schedule} v={pl.virtual} m={pl.microbatches}",
                     **throughput(row, plan)}
    return out


def _mesh(entry: dict) -> str:
    return "x".join(f"{k}{v}" for k, v in entry["mesh"].items() if v > 1) or "1"


def _plan(entry: dict) -> str:
    """strategy, mesh, schedule and recompute mode of a plan, one line."""
    return " ".join(x for x in (entry["strategy"], _mesh(entry), entry["schedule"] or "",
                                f"recompute={entry['recompute']}") if x)


def options(ap) -> None:
    ap.add_argument("--rows", type=int, default=None,
                    help=f"the first N rows of Table 1 only (default all {len(TABLE_1)}, 4 with --quick; "
                         "Table 2 only with all of them)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__, argv, options)
    n_rows = args.rows or (4 if args.quick else len(TABLE_1))
    rows = [evaluate(r) for r in TABLE_1[:n_rows]]
    print(f"{'model':>7} {'t':>2} {'p':>3} {'GPUs':>5} {'paper':>6} {'pred':>6} {'err':>6}  "
          f"{'auto plan':<56} {'auto':>6}")
    worst = 0.0
    for r in rows:
        err = r["paper"]["tflops"] / r["paper_tflops"] - 1
        worst = max(worst, abs(err))
        a = r["auto"]
        print(f"{r['billions']:>6}B {r['t']:>2} {r['p']:>3} {r['gpus']:>5} {r['paper_tflops']:>6} "
              f"{r['paper']['tflops']:>6} {err:>+6.0%}  {_plan(a):<56} {a['tflops']:>6}")
    zero3 = [] if n_rows < len(TABLE_1) else [
        evaluate_zero3(m, gpus, mb, z, pt) for m in TABLE_2 for gpus, mb, z, pt in m[-1]]
    if zero3:
        print("\nTable 2, ZeRO-3 (no model parallelism) against PTD-P at a fixed batch, TFLOP/s per GPU:")
        print(f"{'model':>7} {'GPUs':>5} {'ZeRO-3':>7} {'pred':>6} {'PTD-P':>6} {'pred':>6}  "
              f"{'auto plan':<56} {'auto':>6}")
        for z in zero3:
            a = z["auto"]
            print(f"{z['billions']:>6}B {z['gpus']:>5} {z['zero3_paper_tflops']:>7} {z['zero3']['tflops']:>6} "
                  f"{z['ptdp_paper_tflops']:>6} {z['ptdp']['tflops']:>6}  {_plan(a):<56} {a['tflops']:>6}")
    print("TFLOP/s per GPU: the paper's as published (full recomputation, Eq. 3); predicted ones count the FLOPs "
          "of each plan's own recompute mode (the forced plans recompute fully, as the paper's runs)")
    out = write_result("narayanan_ptdp", {
        "capture": CAPTURE.name, "network_gbps": NET.bandwidth_gbps,
        "flops_counted": {"paper": "as published: Eq. 3, full recomputation (4x forward in the blocks)",
                          "tflops": "the FLOPs each plan runs under its recompute mode: full 4x forward in the "
                                    "blocks (Eq. 3), none 3x, selective 3x plus the attention core",
                          "model_tflops": "the model's FLOPs alone, 3x forward, whatever the plan recomputes"},
        "rows": rows, "zero3_vs_ptdp": zero3,
        "worst_error_at_papers_tp": round(worst, 4)}, args)
    print(f"worst |predicted / measured - 1| at the paper's (t, p): {worst:.0%}; wrote {out}")
    return 0 if worst <= 0.3 else 1


if __name__ == "__main__":
    run(main)
