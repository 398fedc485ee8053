"""Activation memory: the planner's predicted activation and peak bytes per rank against torch's
own tracker.

    python benchmarks/activation_memory.py [--quick]

For the built-in GPT (priced by Korthikanti's formulas) and the Llama family (priced by the
bytes autograd saves per block, measured on the meta device), one rank plans a micro-batch in
fp32 on a CPU slot; the real model then runs one forward and backward under
`torch.distributed._tools.mem_tracker.MemTracker` (one iteration per tracker). Compared:
the activations alive at the end of forward (what backward needs) against the plan's
`activations`, and the tracker's peak (parameters, gradients, activations, temporaries)
against the plan's parameters + gradients + activations. Goal: within 10%.
Writes benchmarks/results/activation_memory.json.
"""

from __future__ import annotations

import time
from typing import Any

from _common import parse_args, print_table, rel_error, write_result

GOAL_ERROR = 0.10
COMMON = ["train.precision=fp32", "checkpoint.enabled=false", "parallel.strategy=ddp", "parallel.tp=1"]
MODELS = {
    "gpt": ["model.n_layer=4", "model.n_head=4", "model.n_embd=256", "model.vocab_size=256"],
    "llama": ["model.factory=orchestrator.workloads.llama:build",
              "model.args={dim: 256, n_layers: 4, n_heads: 4, n_kv_heads: 2, vocab_size: 256, ffn_dim: 704}"],
}


def one(label: str, overrides: list[str], seq: int, batch: int) -> dict[str, Any]:
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    from orchestrator.config import load_config
    from orchestrator.planning import plan_job
    from orchestrator.runtime.driver import measure_model
    from orchestrator.runtime.trainer import Trainer
    from orchestrator.topology.model import ClusterTopology, cpu_node
    from orchestrator.workloads.models import build_model

    cfg = load_config(None, [*overrides, *COMMON, f"model.block_size={seq}", f"train.global_batch_size={batch}",
                             f"train.micro_batch_size={batch}"])
    plan = plan_job(cfg, ClusterTopology(nodes=[cpu_node(1)]), measure_model(cfg))
    torch.manual_seed(0)
    model = build_model(cfg.model)
    x = torch.randint(0, 256, (batch, seq))
    tracker = MemTracker()
    tracker.track_external(model, x)
    with tracker:
        loss = Trainer._loss(model, x, x)
        kept = tracker.get_tracker_snapshot("current")
        loss.backward()
    peak = tracker.get_tracker_snapshot("peak")
    dev = torch.device("cpu")
    acts = kept[dev]["Activation"]
    peak_total = peak[dev]["Total"]
    m = plan.memory_per_rank
    return {"model": label, "seq": seq, "batch": batch, "params": plan.model.params,
            "predicted_activations": m.activations, "measured_activations": acts,
            "activation_error": rel_error(m.activations, acts),
            "predicted_peak": m.params + m.grads + m.activations, "measured_peak": peak_total,
            "peak_error": rel_error(m.params + m.grads + m.activations, peak_total)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__, argv)
    shapes = [(128, 4)] if args.quick else [(128, 4), (256, 8), (512, 4)]
    t0 = time.perf_counter()
    rows = [one(label, ov, s, b) for label, ov in MODELS.items() for s, b in shapes]
    worst = max(max(r["activation_error"], r["peak_error"]) for r in rows)
    result = {"rows": rows, "max_error": worst, "goal": {"within": GOAL_ERROR, "met": worst <= GOAL_ERROR},
              "seconds": time.perf_counter() - t0}
    mb = 1e6
    print_table("activation and peak bytes of one fp32 rank: plan against MemTracker",
                ["model", "seq", "batch", "pred act MB", "meas act MB", "act err %", "pred peak MB", "meas peak MB",
                 "peak err %"],
                [[r["model"], r["seq"], r["batch"], r["predicted_activations"] / mb, r["measured_activations"] / mb,
                  r["activation_error"] * 100, r["predicted_peak"] / mb, r["measured_peak"] / mb,
                  r["peak_error"] * 100] for r in rows],
                caption=f"largest error {worst:.1%} (goal: within {GOAL_ERROR:.0%})")
    print(f"wrote {write_result('activation_memory', result, args)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
