"""Rehearsal: the planner's per-rank peak memory and collective bytes against a rehearsed step.

    python benchmarks/rehearsal.py [--quick] [--only LABEL]

For GPT and Llama models from about 1B to 70B parameters (the built-in families, and Hugging
Face `transformers` models from the configs in benchmarks/hf_configs) and ddp, zero1, zero2, zero3, hsdp,
tensor-parallel and pipeline plans at 8 to 512 ranks of DGX H100 nodes (`conf/cluster/dgx-h100`,
described, not probed), the planner plans the job with the strategy forced; `plan --rehearse`'s
machinery then runs one training step of the plan's rank 0 (and of the last stage's first rank
under a pipeline) in this process, on fake tensors and torch's fake process group, at the
plan's real world size. Set side by side: the predicted and the rehearsed peak bytes of each
rank, and every collective's bytes per step. Goal: memory within 10%, bytes within 5%.
`--quick` runs small models of the same shapes (seconds each).
Writes benchmarks/results/rehearsal.json.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from _common import RESULTS, ROOT, parse_args, print_table, run, write_result

MEMORY_GOAL = 0.10
BYTES_GOAL = 0.05
LLAMA = "orchestrator.workloads.llama:build"
# DGX H100 nodes; the model's shape is overridden.
JOBS = {"llama": str(ROOT / "jobs" / "llama3-8b-dgx-h100.yaml"), "gpt": str(ROOT / "jobs" / "gpt-7b-dgx-h100.yaml")}


def _llama(args: str, seq: int, batch: int) -> list[str]:
    return [f"model.factory={LLAMA}", f"model.args={{{args}}}", f"model.block_size={seq}",
            f"train.global_batch_size={batch}"]


def _gpt(layers: int, heads: int, width: int, seq: int, batch: int) -> list[str]:
    return [f"model.n_layer={layers}",
            f"model.n_head={heads}", f"model.n_embd={width}", "model.vocab_size=50304", f"model.block_size={seq}",
            f"train.global_batch_size={batch}"]


QUICK_LLAMA = _llama("dim: 512, n_layers: 4, n_heads: 8, n_kv_heads: 2, vocab_size: 32000, ffn_dim: 1536", 512, 64)
QUICK_GPT = _gpt(4, 8, 512, 512, 64)
LLAMA_1B = _llama("dim: 2048, n_layers: 16, n_heads: 32, n_kv_heads: 8, vocab_size: 128256, ffn_dim: 8192", 4096, 512)
LLAMA_8B = _llama("preset: llama3-8b", 8192, 256)
LLAMA_70B = _llama("preset: llama3-70b", 8192, 256)
GPT_1B = _gpt(24, 16, 2048, 2048, 512)
HF_CONFIGS = Path(__file__).resolve().parent / "hf_configs"


def _hf(name: str, seq: int, batch: int) -> list[str]:
    return [f"model.hf_config={HF_CONFIGS / name}.json", f"model.block_size={seq}", f"train.global_batch_size={batch}"]


QUICK_HF = _hf("llama-small", 512, 64)
GPT_7B = _gpt(32, 32, 4096, 2048, 512)


def cases(quick: bool) -> list[tuple[str, list[str], int, list[str]]]:
    """(label, model overrides, nodes of 8 GPUs, forced parallel settings)."""
    if quick:
        return [
            ("llama-s zero3 16", QUICK_LLAMA, 2, ["parallel.strategy=zero3", "parallel.tp=1", "parallel.pp=1"]),
            ("llama-s hsdp 32", QUICK_LLAMA, 4, ["parallel.strategy=hsdp", "parallel.dp_shard=8", "parallel.tp=1",
                                                  "parallel.pp=1"]),
            ("llama-s tp2 32", QUICK_LLAMA, 4, ["parallel.strategy=zero3", "parallel.tp=2", "parallel.pp=1"]),
            ("gpt-s ddp 8", QUICK_GPT, 1, ["parallel.strategy=ddp", "parallel.tp=1", "parallel.pp=1"]),
            ("gpt-s zero2 16", QUICK_GPT, 2, ["parallel.strategy=zero2", "parallel.tp=1", "parallel.pp=1"]),
            ("llama-s pp2 32", QUICK_LLAMA, 4, ["parallel.strategy=zero2", "parallel.tp=1", "parallel.pp=2"]),
            ("gpt-s zero1 8", QUICK_GPT, 1, ["parallel.strategy=zero1", "parallel.tp=1", "parallel.pp=1"]),
            ("hf-small zero3 16", QUICK_HF, 2, ["parallel.strategy=zero3", "parallel.tp=1", "parallel.pp=1"]),
        ]
    return [
        ("gpt-1.3b ddp 8", GPT_1B, 1, ["parallel.strategy=ddp", "parallel.tp=1", "parallel.pp=1"]),
        ("gpt-1.3b zero1 16", GPT_1B, 2, ["parallel.strategy=zero1", "parallel.tp=1", "parallel.pp=1"]),
        ("gpt-6.7b zero2 64", GPT_7B, 8, ["parallel.strategy=zero2", "parallel.tp=1", "parallel.pp=1"]),
        ("llama-1b zero3 32", LLAMA_1B, 4, ["parallel.strategy=zero3", "parallel.tp=1", "parallel.pp=1"]),
        ("llama3-8b hsdp 128", LLAMA_8B, 16, ["parallel.strategy=hsdp", "parallel.dp_shard=8", "parallel.tp=1",
                                              "parallel.pp=1"]),
        ("llama3-8b zero3 512", LLAMA_8B, 64, ["parallel.strategy=zero3", "parallel.tp=2", "parallel.pp=1"]),
        ("llama3-70b zero3 64", LLAMA_70B, 8, ["parallel.strategy=zero3", "parallel.tp=1", "parallel.pp=1"]),
        ("llama3-70b tp8 256", LLAMA_70B, 32, ["parallel.strategy=zero3", "parallel.tp=8", "parallel.pp=1"]),
        ("llama3-70b pp4 tp8 128", LLAMA_70B, 16, ["parallel.strategy=zero3", "parallel.tp=8", "parallel.pp=4"]),
        ("hf llama-2-13b zero3 64", _hf("llama-2-13b", 4096, 512), 8,
         ["parallel.strategy=zero3", "parallel.tp=1", "parallel.pp=1"]),
        ("hf mistral-7b hsdp 256", _hf("mistral-7b", 4096, 512), 32,
         ["parallel.strategy=hsdp", "parallel.dp_shard=16", "parallel.tp=1", "parallel.pp=1"]),
        ("hf llama-3.2-3b tp2 128", _hf("llama-3.2-3b", 4096, 512), 16,
         ["parallel.strategy=zero3", "parallel.tp=2", "parallel.pp=1"]),
        ("hf llama-2-13b full tp4 256", _hf("llama-2-13b", 4096, 512), 32,
         ["parallel.strategy=zero3", "parallel.tp=4", "parallel.pp=1", "parallel.recompute=full"]),
        ("hf llama-2-13b pp2 tp8 512", _hf("llama-2-13b", 4096, 512), 64,
         ["parallel.strategy=zero2", "parallel.tp=8", "parallel.pp=2"]),
    ]


def one_case(label: str, model: list[str], nodes: int, forced: list[str]) -> dict[str, Any]:
    """Plan the case, rehearse it, and compare (the `plan --rehearse --json` report)."""
    from orchestrator.commands.plan import described_topology
    from orchestrator.commands.rehearsal_view import rehearsal_report
    from orchestrator.config import load_config
    from orchestrator.planning import plan_job
    from orchestrator.workloads.inspect import model_spec
    from orchestrator.workloads.source import is_builtin_gpt

    overrides = [*model, *forced]
    job = JOBS["llama" if any(o.startswith(("model.factory=", "model.hf_config=")) for o in model) else "gpt"]
    cfg = load_config(job, overrides)
    topo = described_topology(cfg, cfg.cluster.topology_file, nodes, job)
    spec = None if is_builtin_gpt(cfg.model) else model_spec(cfg.model)
    plan = plan_job(cfg, topo, spec=spec)
    t0 = time.perf_counter()
    try:
        report = rehearsal_report(cfg, plan, topo, spec)
        error = None
    except Exception as e:  # noqa: BLE001 - a case that cannot be rehearsed is a finding, kept with its reason
        report, error = {"ranks": [], "collectives": [], "differences": []}, f"{type(e).__name__}: {e}"
    memory = [abs(r["predicted_peak_bytes"] / r["peak_bytes"] - 1) for r in report["ranks"] if r["peak_bytes"]]
    big = [c for c in report["collectives"] if max(c["bytes"], c["predicted_bytes"]) >= 2**20]
    # An operation only one side has (ZeRO-1's broadcasts against the planner's all-gather) has
    # no ratio: it is listed, and the goal is missed.
    by_bytes = [abs(c["predicted_bytes"] / c["bytes"] - 1) for c in big if c["bytes"] and c["predicted_bytes"]]
    unmatched = [f"rank {c['rank']}: {c['op']} on {c['axis']}" for c in big
                 if not (c["bytes"] and c["predicted_bytes"])]
    return {"label": label, "job": str(Path(job).relative_to(ROOT)), "overrides": overrides, "nodes": nodes,
            "world": plan.world_size, "strategy": str(plan.strategy), "mesh": plan.mesh.to_dict(),
            "micro_batch": plan.micro_batch_size, "recompute": str(plan.recompute),
            "accum": plan.sync.grad_accum_steps, "params": plan.model.params, "rehearsal": report, "error": error,
            "seconds": round(time.perf_counter() - t0, 1), "memory_error": max(memory) if memory else None,
            "bytes_error": max(by_bytes) if by_bytes else None, "unmatched_ops": unmatched}


def options(ap) -> None:
    ap.add_argument("--only", metavar="LABEL",
                    help="run only the cases whose label contains LABEL; they replace their rows in the saved "
                         "sweep of the same kind (quick or full), which keeps its other cases")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__, argv, options)
    t0 = time.perf_counter()
    rows = []
    for label, model, nodes, forced in cases(args.quick):
        if args.only and args.only not in label:
            continue
        rows.append(one_case(label, model, nodes, forced))
        r = rows[-1]
        print(f"{label}: {r['seconds']} s" + (f" ({r['error']})" if r["error"] else ""), flush=True)
    rerun = [r["label"] for r in rows] if args.only else []
    rows = _merged(rows, args) if args.only else rows
    gb = 1e9
    table = []
    for r in rows:
        for rank in r["rehearsal"]["ranks"]:
            mine = [c for c in r["rehearsal"]["collectives"] if c["rank"] == rank["rank"]]
            table.append([r["label"], "x".join(str(v) for v in r["mesh"].values()), rank["rank"],
                          rank["predicted_peak_bytes"] / gb, rank["peak_bytes"] / gb,
                          100 * (rank["predicted_peak_bytes"] / rank["peak_bytes"] - 1),
                          sum(c["predicted_bytes"] for c in mine) / gb, sum(c["bytes"] for c in mine) / gb,
                          100 * (r["bytes_error"] or 0.0), rank["seconds"]])
        if r["error"]:
            table.append([r["label"], "x".join(str(v) for v in r["mesh"].values()), "-", None, None, None, None,
                          None, None, r["seconds"]])
    mem_worst = max((r["memory_error"] for r in rows if r["memory_error"] is not None), default=None)
    bytes_worst = max((r["bytes_error"] for r in rows if r["bytes_error"] is not None), default=None)
    failed = [r["label"] for r in rows if r["error"]]
    unmatched = [f"{r['label']}: {op}" for r in rows for op in r["unmatched_ops"]]
    print_table("predicted vs rehearsed, per rank and step",
                ["case", "mesh (pp x rep x shard x tp)", "rank", "pred peak GB", "rehearsed GB", "mem error %",
                 "pred coll GB", "rehearsed coll GB", "worst op bytes error %", "s"], table,
                caption=f"worst memory error {_pct(mem_worst)} (goal {MEMORY_GOAL:.0%}), worst collective bytes "
                        f"error {_pct(bytes_worst)} (goal {BYTES_GOAL:.0%})"
                        + (f"; operations on one side only: {len(unmatched)}" if unmatched else "")
                + (f"; not rehearsed: {', '.join(failed)}" if failed else ""))
    out = write_result("rehearsal", {
        "cases": rows, "max_memory_error": mem_worst, "max_bytes_error": bytes_worst, "unmatched_ops": unmatched,
        "not_rehearsed": failed, "rerun": rerun,
        "goal": {"memory_within": MEMORY_GOAL, "bytes_within": BYTES_GOAL,
                 "met": not failed and not unmatched and mem_worst is not None and mem_worst <= MEMORY_GOAL
                 and (bytes_worst or 0.0) <= BYTES_GOAL},
        "seconds": round(time.perf_counter() - t0, 1)}, args)
    print(f"wrote {out}")
    return 0


def _merged(rows: list[dict], args) -> list[dict]:
    """The saved sweep's cases with `rows` in place of those of the same label, in the sweep's
    order, read from the file it writes (`--out` or the default): a change that only some cases
    see is measured without rerunning the rest. A sweep of the other kind (quick or full) is
    replaced, not merged into."""
    saved = args.out or RESULTS / "rehearsal.json"
    try:
        old = json.loads(saved.read_text())
    except (OSError, ValueError):
        return rows
    if bool(old.get("quick")) != bool(args.quick):
        return rows
    new = {r["label"]: r for r in rows}
    merged = [new.pop(c["label"], c) for c in old.get("cases", [])]
    return merged + list(new.values())


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


if __name__ == "__main__":
    run(main)
