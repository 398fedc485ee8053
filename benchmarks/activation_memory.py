"""Activation memory: the planner's predicted activation and peak bytes per rank against torch's
own tracker.

    python benchmarks/activation_memory.py [--quick]

For the built-in GPT (priced by counting what its layers keep under fused attention) and the
Llama family (priced by what `workloads.inspect` measured on the meta device), one rank plans a
micro-batch in fp32 on a CPU slot under each recompute mode; the real model, with the runtime's
checkpointing applied, then runs one warm-up iteration (so AdamW's moments exist) and one
tracked forward, backward and optimizer step under
`torch.distributed._tools.mem_tracker.MemTracker` (one iteration per tracker). Gradients are
zeroed in place, not freed, as DDP keeps them in its buckets. Compared: the activations alive at
the end of forward (what backward needs) against the plan's kept activations, and the tracker's
peak (parameters, gradients, optimizer state, activations, temporaries) against the plan's
parameters + gradients + optimizer + activations at their peak (the plan's buffers are
communication buffers, which one process has none of). Goal: within 10%.
Writes benchmarks/results/activation_memory.json.
"""

from __future__ import annotations

import time
from typing import Any

from _common import parse_args, print_table, rel_error, run, write_result

GOAL_ERROR = 0.10
COMMON = ["train.precision=fp32", "checkpoint.enabled=false", "parallel.strategy=ddp", "parallel.tp=1"]
MODELS = ("gpt", "llama")
RECOMPUTE = ("none", "selective", "full")
# (seq, batch, layers): lengths and batches where activations, then model states, dominate.
SHAPES = [(128, 4, 4), (256, 8, 4), (512, 4, 2), (512, 2, 6)]


def model_overrides(label: str, layers: int, width: int = 256) -> list[str]:
    """The built-in GPT or a small member of the Llama family (grouped-query attention), by overrides."""
    if label == "gpt":
        return [f"model.n_layer={layers}", "model.n_head=4", f"model.n_embd={width}", "model.vocab_size=256"]
    return ["model.factory=orchestrator.workloads.llama:build",
            f"model.args={{dim: {width}, n_layers: {layers}, n_heads: 4, n_kv_heads: 2, vocab_size: 256, "
            f"ffn_dim: {width * 11 // 4}}}"]


_SPECS: dict[tuple, Any] = {}


def _measured(overrides: tuple[str, ...], seq: int, measure, cfg) -> Any:
    """The model's spec, measured once per model and sequence length (recompute modes share it)."""
    key = (overrides, seq)
    if key not in _SPECS:
        _SPECS[key] = measure(cfg)
    return _SPECS[key]


def one(label: str, overrides: list[str], seq: int, batch: int, recompute: str = "none") -> dict[str, Any]:
    """Plan one fp32 rank for `overrides` and measure the model it builds under MemTracker."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    from orchestrator.config import load_config
    from orchestrator.control.preflight import measure_model
    from orchestrator.planning import plan_job
    from orchestrator.planning.activations import activation_profile
    from orchestrator.planning.memory import byte_layout
    from orchestrator.planning.model_math import ModelShape
    from orchestrator.runtime.trainer import Trainer
    from orchestrator.topology.model import ClusterTopology, cpu_node
    from orchestrator.workloads.models import apply_recompute, build_model

    cfg = load_config(None, [*overrides, *COMMON, f"model.block_size={seq}", f"train.global_batch_size={batch}",
                             f"train.micro_batch_size={batch}", f"parallel.recompute={recompute}"])
    spec = _measured(tuple(overrides), seq, measure_model, cfg)
    plan = plan_job(cfg, ClusterTopology(nodes=[cpu_node(1)]), spec)
    shape = ModelShape.from_spec(spec) if spec is not None else ModelShape.from_config(cfg.model)
    kept_pred = activation_profile(shape, batch, 1, recompute, byte_layout("fp32", "cpu").activation).kept
    torch.manual_seed(0)
    model = build_model(cfg.model)
    apply_recompute(model, recompute)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, cfg.model.vocab_size if spec is None else spec.vocab, (batch, seq))

    def step(tracker=None) -> float:
        loss = Trainer._loss(model, x, x)
        kept = tracker.get_tracker_snapshot("current")[torch.device("cpu")][_MemRefType.ACT] if tracker else 0
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return kept

    step()
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        kept = step(tracker)
    peak_total = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    m = plan.memory_per_rank
    peak_pred = m.params + m.grads + m.optimizer + m.activations
    return {"model": label, "seq": seq, "batch": batch, "layers": shape.layers, "recompute": recompute,
            "params": plan.model.params,
            "predicted_activations": kept_pred, "measured_activations": kept,
            "activation_error": rel_error(kept_pred, kept),
            "predicted_peak": peak_pred, "measured_peak": peak_total,
            "peak_error": rel_error(peak_pred, peak_total)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__, argv)
    shapes = SHAPES[:1] if args.quick else SHAPES
    t0 = time.perf_counter()
    rows = [one(label, model_overrides(label, layers), s, b, rc)
            for label in MODELS for s, b, layers in shapes for rc in RECOMPUTE]
    worst = max(max(r["activation_error"], r["peak_error"]) for r in rows)
    result = {"rows": rows, "max_error": worst, "goal": {"within": GOAL_ERROR, "met": worst <= GOAL_ERROR},
              "seconds": time.perf_counter() - t0}
    mb = 1e6
    print_table("activation and peak bytes of one fp32 rank: plan against MemTracker",
                ["model", "seq", "batch", "layers", "recompute", "pred act MB", "meas act MB", "act err %",
                 "pred peak MB", "meas peak MB", "peak err %"],
                [[r["model"], r["seq"], r["batch"], r["layers"], r["recompute"], r["predicted_activations"] / mb,
                  r["measured_activations"] / mb, r["activation_error"] * 100, r["predicted_peak"] / mb,
                  r["measured_peak"] / mb, r["peak_error"] * 100] for r in rows],
                caption=f"largest error {worst:.1%} (goal: within {GOAL_ERROR:.0%})")
    print(f"wrote {write_result('activation_memory', result, args)}")
    return 0


if __name__ == "__main__":
    run(main)
