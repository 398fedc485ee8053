"""Memory model: the planner's per-rank model-state bytes against what each rank holds.

    python benchmarks/memory_model.py [--quick] [--world N]

For the built-in GPT and a small member of the Llama family (grouped-query attention, untied
embeddings, its own tensor-parallel plan; planned from its measured `ModelSpec`), and for every
strategy (ddp, zero1, zero2, zero3, hsdp, and tensor parallelism under FSDP), the planner
plans the job on N CPU slots with that strategy forced; N gloo processes then build the model
from that very plan with the runtime's Trainer, run an optimizer step and one more
forward/backward (so weights, gradients and Adam state all exist), and count the storages
each rank holds (`Parallelized.state_bytes`). The plan's params + grads + optimizer is set
against the largest rank's count. Goal: within 5%.
Writes benchmarks/results/memory_model.json.
"""

from __future__ import annotations

import gc
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import parse_args, print_table, rel_error, run, write_result

GOAL_ERROR = 0.05
STATES = ("params", "grads", "optimizer")
QUICK_MODEL = ["model.n_layer=2", "model.n_head=4", "model.n_embd=128", "model.block_size=64",
               "train.global_batch_size=8"]
FULL_MODEL = ["model.n_layer=6", "model.n_head=8", "model.n_embd=384", "model.block_size=128",
              "train.global_batch_size=16"]
LLAMA = "model.factory=orchestrator.workloads.llama:build"
QUICK_LLAMA = [LLAMA, "model.args={dim: 128, n_layers: 2, n_heads: 4, n_kv_heads: 2, vocab_size: 256, ffn_dim: 352}",
               "model.block_size=64", "train.global_batch_size=8"]
FULL_LLAMA = [LLAMA, "model.args={dim: 384, n_layers: 6, n_heads: 8, n_kv_heads: 4, vocab_size: 256, ffn_dim: 1024}",
              "model.block_size=128", "train.global_batch_size=16"]
COMMON = ["train.precision=fp32", "train.eval_iters=1", "checkpoint.enabled=false"]


def cases(world: int) -> list[tuple[str, list[str]]]:
    """(label, forced parallel settings) for every strategy the runtime builds on `world` ranks."""
    if world < 4 or world % 2:
        raise ValueError(f"hsdp and tensor parallelism under FSDP need an even world of at least 4 ranks, got {world}")
    return [
        ("ddp", ["parallel.strategy=ddp", "parallel.tp=1"]),
        ("zero1", ["parallel.strategy=zero1", "parallel.tp=1"]),
        ("zero2", ["parallel.strategy=zero2", "parallel.tp=1"]),
        ("zero3", ["parallel.strategy=zero3", "parallel.tp=1"]),
        ("hsdp", ["parallel.strategy=hsdp", "parallel.tp=1", f"parallel.dp_shard={world // 2}"]),
        ("tp+fsdp", ["parallel.strategy=zero3", "parallel.tp=2"]),
    ]


def plans(world: int, model: list[str]) -> list[dict[str, Any]]:
    """The planner's plan for each case on `world` CPU slots (pure Python, no processes)."""
    from orchestrator.config import load_config
    from orchestrator.control.preflight import measure_model
    from orchestrator.planning import job_context, plan_job
    from orchestrator.planning.cost import held_grad_bytes
    from orchestrator.planning.memory import runtime_states
    from orchestrator.topology.model import ClusterTopology, cpu_node

    topo = ClusterTopology(nodes=[cpu_node(world)])
    spec = measure_model(load_config(None, [*model, *COMMON]))  # None for the built-in GPT
    out = []
    for label, forced in cases(world):
        overrides = [*model, *COMMON, *forced]
        cfg = load_config(None, overrides)
        plan = plan_job(cfg, topo, spec)
        # The states the planner counts a rank holding (the plan's breakdown is its peak,
        # where FSDP2's gradients may not all exist yet).
        ctx, ex = job_context(cfg, topo, spec), plan.execution
        st = runtime_states(str(plan.strategy), ctx.shape, plan.mesh.tp, ex.shard_group, ctx.layout,
                            held_grad_bytes=held_grad_bytes(ex, ctx.layout, plan.sync.grad_accum_steps))
        states = {"params": st.params, "grads": st.grads, "optimizer": st.optimizer}
        out.append({"label": label, "overrides": overrides, "plan": plan.to_dict(), "states": states})
    return out


def _rank(rank: int, world: int, port: int, cases_: list[dict[str, Any]], out: str) -> None:
    import torch
    import torch.distributed as dist

    from orchestrator.config import load_config
    from orchestrator.planning import Plan
    from orchestrator.runtime.trainer import Trainer, init_process_group

    torch.set_num_threads(1)
    init_process_group(rank, world, "127.0.0.1", port, "gloo")
    measured = []
    for case in cases_:
        cfg = load_config(None, case["overrides"])
        # The plan crosses into the rank as its plan.json contract and is read back from it.
        tr = Trainer(cfg, Plan.from_dict(case["plan"]), torch.device("cpu"))
        tr.train_step(0)  # creates the optimizer state
        # One more forward/backward after the step so gradients are held as they are at peak.
        x, y = tr.data.train_batch(1, cfg.train.global_batch_size, tr.dp_rank, tr.dp_world)
        Trainer._loss(tr.par.model, x[: tr.micro], y[: tr.micro]).backward()
        states = tr.par.state_bytes()
        every = [None] * world
        dist.all_gather_object(every, {"rank": rank, **states, "notes": list(tr.par.notes)})
        measured.append(every)
        del tr
        gc.collect()
        dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps(measured))
    dist.destroy_process_group()


def measure(world: int, planned: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Per case, every rank's {params, grads, optimizer} bytes."""
    import torch.multiprocessing as mp
    from _common import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "memory.json")
        mp.spawn(_rank, args=(world, free_port(), planned, out), nprocs=world)
        return json.loads(Path(out).read_text())


def compare(planned: list[dict[str, Any]], measured: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Predicted beside the largest rank's measured bytes, per case and per state."""
    rows = []
    for case, ranks in zip(planned, measured):
        plan = case["plan"]
        pred = {k: int(case["states"][k]) for k in STATES}
        peak = max(ranks, key=lambda r: sum(r[k] for k in STATES))
        meas = {k: int(peak[k]) for k in STATES}
        pred_total, meas_total = sum(pred.values()), sum(meas.values())
        rows.append({
            "strategy": case["label"], "planned_strategy": plan["strategy"], "mesh": plan["mesh"],
            "predicted": {**pred, "total": pred_total}, "measured": {**meas, "total": meas_total},
            "measured_per_rank": [sum(r[k] for k in STATES) for r in ranks],
            "error": rel_error(pred_total, meas_total),
            "state_errors": {k: (rel_error(pred[k], meas[k]) if meas[k] else None) for k in STATES},
            "notes": peak["notes"],
        })
    worst = max(r["error"] for r in rows)
    return {"rows": rows, "max_error": worst,
            "goal": {"within": GOAL_ERROR, "met": worst <= GOAL_ERROR,
                     "missed_by": [r["strategy"] for r in rows if r["error"] > GOAL_ERROR]}}


def options(ap) -> None:
    ap.add_argument("--world", type=int, default=4, help="gloo processes (an even number, at least 4)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__, argv, options)
    models = {"gpt": QUICK_MODEL if args.quick else FULL_MODEL, "llama": QUICK_LLAMA if args.quick else FULL_LLAMA}
    t0 = time.perf_counter()
    results = {label: one_model(label, model, args.world) for label, model in models.items()}
    worst = max(r["max_error"] for r in results.values())
    out = write_result("memory_model", {
        "world": args.world, "backend": "gloo", "models": results, "max_error": worst,
        "goal": {"within": GOAL_ERROR, "met": worst <= GOAL_ERROR}, "seconds": time.perf_counter() - t0}, args)
    print(f"wrote {out}")
    return 0


def one_model(label: str, model: list[str], world: int) -> dict[str, Any]:
    """Plan, measure and compare every strategy for one model; print its table."""
    planned = plans(world, model)
    result = compare(planned, measure(world, planned))
    params = planned[0]["plan"]["model"]["params"]
    result.update(model=model, params=params)
    mb = 1e6
    print_table(
        f"{label}: model-state bytes per rank, {params / 1e6:.2f}M parameters on {world} gloo ranks (largest rank)",
        ["strategy", "mesh (pp x rep x shard x tp)", "pred params MB", "meas params MB", "pred grads MB",
         "meas grads MB", "pred optim MB", "meas optim MB", "pred total MB", "meas total MB", "error %"],
        [[r["strategy"], "x".join(str(v) for v in r["mesh"].values()),
          r["predicted"]["params"] / mb, r["measured"]["params"] / mb, r["predicted"]["grads"] / mb,
          r["measured"]["grads"] / mb, r["predicted"]["optimizer"] / mb, r["measured"]["optimizer"] / mb,
          r["predicted"]["total"] / mb, r["measured"]["total"] / mb, r["error"] * 100] for r in result["rows"]],
        caption=f"largest error {result['max_error']:.2%} (goal: within {GOAL_ERROR:.0%})",
    )
    return result


if __name__ == "__main__":
    run(main)
