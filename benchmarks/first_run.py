"""A newcomer's first runs: the default job, each from a fresh cache, its predictions against what it measured.

Runs `python -m orchestrator submit jobs/llm.yaml` (the README's command, on the embedded private
cluster) `--runs` times in a row, each with a cache directory of its own (so the CPU's compute
rate is measured afresh, as on a fresh clone) and a runs directory of its own. For each run, from
its summary.json and what it printed:

- step time: measured, the plan's prediction, and the prediction re-priced from the compute the
  run measured; their ratios;
- exposed communication: predicted, and measured split into moving bytes and waiting for the
  slowest peer;
- peak memory: predicted and measured, or the reason it is not predicted here;
- every warning the run printed.

Goal (over 5 runs): the re-priced step time within 25% of measured, the predicted communication
within 50% of its measured transfer time, and no warning on a healthy run.

    python benchmarks/first_run.py [--quick] [--runs N]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, parse_args, print_table, run, write_result  # noqa: E402

GOALS = {"repriced_step_within": 0.25, "transfer_within": 0.50, "warnings": 0}


def options(ap) -> None:
    ap.add_argument("--runs", type=int, default=None, help="fresh runs of the default job (default 5; 2 with --quick)")


def one_run(work: Path, index: int) -> dict[str, Any]:
    """The default job once, from a fresh cache: its figures, or why it has none."""
    cache, runs = work / f"cache{index}", work / f"runs{index}"
    env = {**os.environ, "ORCHESTRATOR_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "orchestrator", "submit", "jobs/llm.yaml",
                           f"monitor.runs_dir={runs}", "monitor.progress=false"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    warnings = [line.strip() for line in (done.stdout + done.stderr).splitlines()
                if line.strip().startswith("warning")]
    summaries = sorted(runs.glob("*/summary.json"))
    if done.returncode != 0 or not summaries:
        return {"run": index, "returncode": done.returncode, "error": (done.stderr or done.stdout)[-500:],
                "warnings": warnings}
    s = json.loads(summaries[-1].read_text())
    predicted, measured = s["predicted"], s["measured"]
    step = measured["step_s"]
    transfer = measured.get("exposed_transfer_s")
    memory = None
    if predicted.get("peak_memory_predicted", True):
        peaks = [p - b for p, b in zip(measured["peak_memory_bytes_per_rank"],
                                       measured["baseline_memory_bytes_per_rank"])]
        planned = predicted["peak_memory_bytes_per_rank"]
        memory = max(peaks) / planned if planned else None
    return {
        "run": index, "returncode": 0, "measured_step_s": step, "predicted_step_s": predicted["step_s"],
        "repriced_step_s": predicted.get("step_s_repriced"),
        "repriced_over_measured": predicted["step_s_repriced"] / step if predicted.get("step_s_repriced") else None,
        "predicted_over_measured": predicted["step_s"] / step if predicted["step_s"] else None,
        "predicted_comm_s": predicted["exposed_comm_s"], "measured_exposed_comm_s": measured["exposed_comm_s"],
        "measured_transfer_s": transfer, "measured_straggle_wait_s": measured.get("straggle_wait_s"),
        "comm_over_transfer": predicted["exposed_comm_s"] / transfer if transfer else None,
        "peak_memory_predicted": predicted.get("peak_memory_predicted", True),
        "memory_measured_over_predicted": memory, "memory_source": measured.get("memory_source"),
        "warnings": warnings,
    }


def verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Which goals every run met."""
    ok = [r for r in rows if r["returncode"] == 0]

    def within(key: str, share: float) -> bool:
        return bool(ok) and all(r[key] is not None and abs(r[key] - 1) <= share for r in ok)

    return {
        "runs_finished": f"{len(ok)}/{len(rows)}",
        "repriced_step_within_25pct": within("repriced_over_measured", GOALS["repriced_step_within"]),
        "comm_within_50pct_of_transfer": within("comm_over_transfer", GOALS["transfer_within"]),
        "no_warnings": all(not r["warnings"] for r in rows),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__, argv, options)
    runs = args.runs or (2 if args.quick else 5)
    with tempfile.TemporaryDirectory(prefix="first-run-") as tmp:
        rows = []
        for i in range(runs):
            rows.append(one_run(Path(tmp), i))
            print(json.dumps(rows[-1]), flush=True)
    print_table("the default job's first runs: predicted against measured",
                ["run", "step ms", "plan ms", "re-priced ms", "re-priced/measured", "comm ms", "transfer ms",
                 "wait ms", "comm/transfer", "warnings"],
                [[r["run"], _ms(r.get("measured_step_s")), _ms(r.get("predicted_step_s")),
                  _ms(r.get("repriced_step_s")), r.get("repriced_over_measured"), _ms(r.get("predicted_comm_s")),
                  _ms(r.get("measured_transfer_s")), _ms(r.get("measured_straggle_wait_s")),
                  r.get("comm_over_transfer"), len(r["warnings"])] for r in rows])
    goals = verdict(rows)
    print(goals)
    write_result("first_run", {"runs": rows, "goals": GOALS, "met": goals}, args)
    return 0


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


if __name__ == "__main__":
    run(main)
