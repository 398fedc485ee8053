"""A ~0.6B-parameter Llama trained for real on 4 CPU ranks under ZeRO-3: peak memory per rank against the plan.

    python benchmarks/large_model_cpu.py [--quick] [--steps N] [--layers N]

Runs `python -m orchestrator submit jobs/llama-0.6b-cpu.yaml` (617M parameters, 4 plain CPU
ranks, zero3 over dp_shard=4, block 128, global batch 4) as a user would, in a fresh process
with its own Ray cluster, and reads its run directory: the train loss of every step (the run
trains when the last is below the first), and per rank the peak resident memory, the baseline
before the model was built (the interpreter and torch, which the plan does not count) and
the plan's per-rank total, with measured (peak - baseline) / planned. Whole, the model's fp32
weights, gradients and Adam moments take 16 bytes a parameter, ~9.9 GB a rank: four such
ranks exceed a 24 GiB machine, so the run shows that ranks hold only their shards. `--quick`
runs the same job with a small Llama (minutes on 2 cores); `--layers N` keeps the job's shape
with N layers (a model that fits where the whole job does not). The machine's free memory is
sampled while it runs. Refused in one line when the ranks' expected peak does not fit the memory
free now. Writes benchmarks/results/large_model_cpu.json.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, child_env, parse_args, print_table, python, run, write_result  # noqa: E402

JOB = ROOT / "jobs" / "llama-0.6b-cpu.yaml"
QUICK_MODEL = {"dim": 256, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 704}
"""The small Llama of `--quick`: the job's other settings (vocabulary, ranks, strategy) kept."""
ADAM_FP32_BYTES_PER_PARAM = 16
"""fp32 weight, gradient and Adam's two moments: what a rank holding the whole model keeps."""
BASELINE_ALLOWANCE = 1 << 29
"""Per rank, on top of the plan's total, before a run is attempted: the interpreter, torch and
Ray's worker (measured 0.36 GiB on this project's CPU ranks)."""
_SAMPLE_S = 0.5
_TIMEOUT_S = 3600


def options(ap) -> None:
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (the job's 5 by default)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (the job's 20 by default)")


def job_overrides(quick: bool, steps: int | None, runs_dir: Path, layers: int | None = None) -> list[str]:
    """What the benchmark changes of the job: the small model under --quick, the layer and step counts."""
    out = [f"monitor.runs_dir={runs_dir}"]
    if quick:
        out += [f"model.args.{k}={v}" for k, v in QUICK_MODEL.items()]
    if layers:
        out += [f"model.args.n_layers={layers}"]
    if steps:
        out += [f"train.max_steps={steps}", f"train.eval_interval={steps}"]
    return out


def planned(overrides: list[str]) -> dict[str, Any]:
    """The plan `submit` would make for the job on its CPU ranks (its memory does not depend on
    the machine's), with the parameter count the planner measured."""
    from orchestrator.config import load_config
    from orchestrator.control.preflight import measure_model
    from orchestrator.planning import plan_job
    from orchestrator.topology.model import ClusterTopology, cpu_node

    cfg = load_config(JOB, overrides)
    plan = plan_job(cfg, ClusterTopology(nodes=[cpu_node(cfg.cluster.num_workers)]), measure_model(cfg))
    return plan.to_dict()


def refuse_unless_it_fits(plan: dict[str, Any]) -> None:
    """A run that cannot fit the memory free now would only push the machine into swap or the
    OOM killer, taking other work down with it: refused before it starts."""
    import psutil

    from orchestrator.errors import UserError

    extra = BASELINE_ALLOWANCE
    need = plan["world_size"] * (plan["memory_per_rank"]["total"] + extra)
    free = psutil.virtual_memory().available
    if need > free:
        raise UserError(f"the run needs about {need / 2**30:.1f} GiB ({plan['world_size']} ranks x the plan's "
                        f"{plan['memory_per_rank']['total'] / 2**30:.2f} GiB + {extra / 2**30:.2f} GiB) but "
                        f"{free / 2**30:.1f} GiB is free; free memory, or use --layers or --quick")


def submit(overrides: list[str], log: Path) -> tuple[Path, int]:
    """Run the job to its end; its run directory and the least memory the machine had free."""
    import psutil

    runs_dir = Path(overrides[0].split("=", 1)[1])
    least_free = psutil.virtual_memory().available
    cmd = [python(), "-m", "orchestrator", "submit", str(JOB), *overrides]
    t0 = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=out, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            least_free = min(least_free, psutil.virtual_memory().available)
            if time.monotonic() - t0 > _TIMEOUT_S:
                proc.kill()
                raise RuntimeError(f"submit ran past {_TIMEOUT_S} s; see {log}")
            time.sleep(_SAMPLE_S)
    if proc.returncode != 0:
        tail = log.read_text().strip().splitlines()[-20:]
        raise RuntimeError(f"submit exited with {proc.returncode}:\n" + "\n".join(tail))
    return next(runs_dir.iterdir()), least_free


def figures(run_dir: Path) -> dict[str, Any]:
    """What the run directory says: the loss per step, and per rank the measured peak and
    baseline beside the plan's total."""
    summary = json.loads((run_dir / "summary.json").read_text())
    plan = json.loads((run_dir / "plan.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    losses = [r["loss"] for r in rows]
    measured, total = summary["measured"], summary["predicted"]["peak_memory_bytes_per_rank"]
    ranks = []
    for rank, (peak, base) in enumerate(zip(measured["peak_memory_bytes_per_rank"],
                                            measured["baseline_memory_bytes_per_rank"])):
        ranks.append({"rank": rank, "peak_bytes": peak, "baseline_bytes": base, "above_baseline_bytes": peak - base,
                      "plan_total_bytes": total, "ratio": (peak - base) / total,
                      "model_state_bytes": sum(measured["model_state_bytes_per_rank"][rank].values())})
    return {
        "params": summary["num_params"],
        "strategy": summary["strategy"],
        "mesh": summary["mesh"],
        "memory_source": measured["memory_source"],
        "plan_memory_per_rank": plan["memory_per_rank"],
        "loss": {"train": losses, "first_val": summary["first_val_loss"], "final_val": summary["final_val_loss"],
                 "trains": bool(losses) and losses[-1] < losses[0]},
        "ranks": ranks,
        "whole_model_state_bytes_per_rank": summary["num_params"] * ADAM_FP32_BYTES_PER_PARAM,
        "step_s": summary["step_s"],
        "wall_s": summary["wall_s"],
        "notes": summary["notes"],
        "warnings": summary["warnings"],
    }


def main(argv: list[str] | None = None) -> int:
    import psutil

    args = parse_args(__doc__, argv, options)
    with tempfile.TemporaryDirectory(prefix="large_model_cpu-") as tmp:
        overrides = job_overrides(args.quick, args.steps, Path(tmp) / "runs", args.layers)
        plan = planned(overrides)
        refuse_unless_it_fits(plan)
        print(f"  {plan['model']['params'] / 1e6:,.0f}M parameters, {plan['strategy']} on {plan['world_size']} "
              f"CPU ranks, plan {plan['memory_per_rank']['total'] / 2**30:.2f} GiB per rank", file=sys.stderr)
        run_dir, least_free = submit(overrides, Path(tmp) / "submit.log")
        found = figures(run_dir)
    total = psutil.virtual_memory().total
    found["machine_memory_bytes"] = total
    found["least_free_memory_bytes"] = least_free
    found["whole_model_fits_every_rank"] = found["whole_model_state_bytes_per_rank"] * len(found["ranks"]) <= total
    result = {"job": str(JOB.relative_to(ROOT)), "overrides": overrides[1:], "steps": len(found["loss"]["train"]),
              "layers": plan["model"]["blocks"], **found}
    gib = 2**30
    print_table(
        f"{found['params'] / 1e6:,.0f}M-parameter Llama, {found['strategy']} on {len(found['ranks'])} CPU ranks, "
        f"{result['steps']} steps",
        ["rank", "baseline GiB", "peak GiB", "peak - baseline GiB", "plan total GiB", "measured / plan"],
        [[r["rank"], r["baseline_bytes"] / gib, r["peak_bytes"] / gib, r["above_baseline_bytes"] / gib,
          r["plan_total_bytes"] / gib, r["ratio"]] for r in found["ranks"]],
        caption=f"train loss {found['loss']['train'][0]:.3f} -> {found['loss']['train'][-1]:.3f}; whole-model fp32 "
                f"Adam state {found['whole_model_state_bytes_per_rank'] / gib:.1f} GiB a rank; least free "
                f"{least_free / gib:.1f} of {total / gib:.1f} GiB",
    )
    for w in found["warnings"]:
        print(f"warning: {w}", file=sys.stderr)
    out = write_result("large_model_cpu", result, args)
    print(f"wrote {out}")
    return 0 if found["loss"]["trains"] else 1


if __name__ == "__main__":
    run(main)
