"""Step-time prediction by model family: the plan's predicted step time against the run's own.

    python benchmarks/step_time.py [--quick] [--steps N]

Each case is a real `python -m orchestrator submit jobs/llm.yaml` on the embedded cluster (2 CPU
workers, gloo): the built-in GPT, priced by its formulas, and the built-in Llama family
(RMSNorm, RoPE, SwiGLU, grouped-query attention), priced from the `ModelSpec` measured on the
meta device (FlopCounterMode FLOPs, parameters, activation bytes). Both are read back from the
run directory: `plan.json`'s predicted step time and `summary.json`'s measured steady step time.
The two families are sized to similar parameter counts, so a model that prices one family's
FLOPs wrongly shows as a gap between the rows. Writes benchmarks/results/step_time.json.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import ROOT, parse_args, print_table, rel_error, run, write_result

JOB = ROOT / "jobs" / "llm.yaml"
LLAMA = ["model.factory=orchestrator.workloads.llama:build", "model.args.dim=128", "model.args.n_layers=4",
         "model.args.n_heads=4", "model.args.n_kv_heads=2", "model.args.vocab_size=256"]
CASES: dict[str, list[str]] = {
    "gpt ddp": ["parallel.strategy=ddp", "parallel.tp=1"],
    "llama ddp": [*LLAMA, "parallel.strategy=ddp", "parallel.tp=1"],
    "gpt zero3": ["parallel.strategy=zero3", "parallel.tp=1"],
    "llama zero3": [*LLAMA, "parallel.strategy=zero3", "parallel.tp=1"],
    "gpt tp=2": ["parallel.strategy=ddp", "parallel.tp=2"],
    "llama tp=2": [*LLAMA, "parallel.strategy=ddp", "parallel.tp=2"],
}
QUICK_CASES = ("gpt ddp", "llama ddp", "llama zero3")
COMMON = ["cluster.num_workers=2", "train.eval_interval=1000", "monitor.progress=false", "monitor.dashboard=false",
          "checkpoint.interval=0"]


def read_run(run_dir: Path) -> dict[str, Any]:
    """Predicted and measured step time, the plan and the parameter count of one run directory."""
    plan = json.loads((run_dir / "plan.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    predicted, measured = plan["step_time"]["total_s"], summary["measured"]["step_s"]
    return {
        "params": plan["model"]["params"], "strategy": plan["strategy"], "mesh": plan["mesh"],
        "micro_batch_size": plan["micro_batch_size"], "predicted_step_s": predicted, "measured_step_s": measured,
        "error": rel_error(predicted, measured),
    }


def run_case(name: str, overrides: list[str], steps: int, tmp: Path) -> dict[str, Any]:
    """One submit of the case; its run directory read back."""
    runs = Path(tempfile.mkdtemp(prefix=name.replace(" ", "-").replace("=", ""), dir=tmp)) / "runs"
    cmd = [sys.executable, "-m", "orchestrator", "submit", str(JOB), *COMMON, *overrides,
           f"train.max_steps={steps}", f"monitor.runs_dir={runs}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
        raise RuntimeError(f"{name}: submit exited with {proc.returncode}:\n" + "\n".join(tail))
    row = read_run(next(runs.iterdir()))
    return {"case": name, "overrides": overrides, "wall_s": time.perf_counter() - t0, **row}


def options(ap) -> None:
    ap.add_argument("--steps", type=int, default=None, help="training steps per run (default 30, 15 with --quick)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__, argv, options)
    steps = args.steps or (15 if args.quick else 30)
    names = QUICK_CASES if args.quick else tuple(CASES)
    with tempfile.TemporaryDirectory(prefix="step-time-") as tmp:
        rows = [run_case(n, CASES[n], steps, Path(tmp)) for n in names]
    print_table(
        f"predicted vs measured step time, 2 CPU workers (gloo), {steps} steps each",
        ["case", "params", "strategy", "micro-batch", "predicted ms", "measured ms", "error %"],
        [[r["case"], r["params"], r["strategy"], r["micro_batch_size"], r["predicted_step_s"] * 1e3,
          r["measured_step_s"] * 1e3, 100 * r["error"]] for r in rows])
    by_family = {f: [abs(r["error"]) for r in rows if r["case"].startswith(f)] for f in ("gpt", "llama")}
    out = write_result("step_time", {
        "steps": steps, "cases": rows,
        "mean_abs_error": {f: sum(v) / len(v) for f, v in by_family.items() if v}}, args)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    run(main)
