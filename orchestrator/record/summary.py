"""The run's outcome: summary.json (the plan's predictions beside what was measured), the loss
curve, and the table the console ends with."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..config import JobConfig
from ..planning import Plan
from ..planning.calibration import CALIBRATION_FILE, CompileGain, block_speedup, speedup_from_saving, with_compile_gain
from .curve import loss_svg
from .run_state import RunState, where
from .rundir import RunDir

AGREEMENT = (0.5, 2.0)
"""Measured over predicted outside this range is warned about in the summary."""

PEAK_MEMORY_TOLERANCE = 0.3
"""A rank's measured peak above its baseline further than this fraction from the plan's
per-rank total is warned about in the summary..."""
PEAK_MEMORY_SLACK_BYTES = 256 << 20
"""...when it is also this far from it: a small model's run moves its process's memory (the
allocator's kept pages, the libraries' first-use buffers) by more than its whole plan."""


def steady_mean(values: list[float]) -> float:
    """Mean over the steps after the first few (which include warm-up and allocation)."""
    tail = values[min(len(values) // 5, 10):] or values
    return sum(tail) / len(tail) if tail else float("nan")


def notes(setups: list[dict[str, Any]]) -> list[str]:
    """Every rank's notes, each said once, in rank order."""
    return list(dict.fromkeys(n for s in setups for n in s["notes"]))


def peak_memory_warning(plan_total: int, finals: list[dict[str, Any]]) -> str | None:
    """One line when the rank that grew most (its peak less its baseline) is further than
    PEAK_MEMORY_TOLERANCE and PEAK_MEMORY_SLACK_BYTES from the plan's per-rank total, else None."""
    grown = [f["memory"]["peak_bytes"] - f["memory"]["baseline_bytes"] for f in finals]
    if not plan_total or not grown:
        return None
    rank = max(range(len(grown)), key=grown.__getitem__)
    off = abs(grown[rank] - plan_total)
    if off <= PEAK_MEMORY_TOLERANCE * plan_total or off <= PEAK_MEMORY_SLACK_BYTES:
        return None
    return (f"measured peak memory of rank {rank}, {grown[rank]:,} bytes above its baseline, differs from the "
            f"plan's {plan_total:,} per rank by more than {PEAK_MEMORY_TOLERANCE:.0%}")


def repriced_step_s(plan: Plan, setups: list[dict[str, Any]]) -> float | None:
    """The plan's step time re-priced from the compute the ranks measured before their first
    step (each rank's compute-only micro-step, `StepTimer.calibrate`): the plan's compute (and
    the pipeline bubble, which is made of it) scaled to the slowest rank's measured compute,
    its communication as planned. None where no rank measured it (a pipeline; FSDP2 holding only
    sharded gradients). It tells a compute rate that was wrong on this host from a cost model
    that was wrong."""
    measured = [s["compute_micro_s"] for s in setups if s.get("compute_micro_s")]
    st = plan.step_time
    if not measured or not st.compute_s:
        return None
    scale = plan.sync.grad_accum_steps * max(measured) / st.compute_s
    return (st.compute_s + st.bubble_s) * scale + st.exposed_comm_s - plan.compile.saving_s_per_step


def exposed_split(samples: dict[int, list[tuple[float, float | None]]]) -> tuple[float, float] | None:
    """The steady exposed communication split into moving bytes and waiting for the slowest
    peer: at each step the rank that waited least (the last to arrive) waited for no one, so its
    exposed time is the transfer; what any other rank exposed beyond it was waiting. The means
    over the steady steps of (transfer, wait per rank); None without two ranks' timings."""
    ranks = [[e for _, e in times] for times in samples.values()]
    if len(ranks) < 2:
        return None
    transfer, wait = [], []
    for step in zip(*ranks):  # the i-th time of every rank is the world's i-th step
        if any(e is None for e in step):
            continue
        least = min(step)
        transfer.append(least)
        wait.append(sum(e - least for e in step) / len(step))
    if not transfer:
        return None
    return steady_mean(transfer), steady_mean(wait)


def compile_record(plan: Plan, rows: list[dict[str, Any]], finals: list[dict[str, Any]],
                   setups: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """What compiling the blocks cost and bought against the plan's figures. Where the ranks
    timed their compute-only pass compiled and eager (`StepTimer.calibrate`): the slowest
    rank's compile, the pass's speedup and the blocks' own (`block_speedup`), the medians over
    the ranks. Otherwise (a pipeline; FSDP2 holding only sharded gradients under a plan priced
    from a measured gain, which is not timed again) the cost is the first step's time over the
    steady step's (the first step compiles). Where the ranks also trained steps both ways
    (`StepTimer.compile_steps`, a run of COMPILE_GAIN_STEPS or more): the whole step's speedup
    (the fastest step of each kind, the median over the ranks), and the blocks' speedup is the
    one that saves what the steps saved (`speedup_from_saving`): what a step gains, collectives
    and optimizer included, is what `auto` prices, and the passes are its fallback; `gain_steps`
    names those steps (metrics rows' `step`), eager and compiled, so no row's time is read as a
    production step's unknowingly. And each rank's inductor cache hits and misses (a restart on
    the same node hits, misses 0)."""
    c = plan.compile
    out: dict[str, Any] = {"enabled": c.enabled, "requested": c.requested, "reason": c.reason,
                           "predicted_compile_s": c.compile_s, "predicted_saving_s_per_step": c.saving_s_per_step}
    if not c.enabled:
        return out
    timed = [s["compile_times"] for s in setups if s.get("compile_times")]
    if timed:
        out["measured_compile_s"] = max(t["compile_s"] for t in timed)
        if all("eager_s" in t for t in timed):  # the gain was timed (not where the plan priced a measured one)
            eager = statistics.median(t["eager_s"] for t in timed)
            compiled = statistics.median(t["compiled_s"] for t in timed)
            out["measured_pass_speedup"] = eager / compiled
            out["measured_speedup"] = block_speedup(eager, compiled, c.block_share)
            out["measured_speedup_from"] = "passes"
    elif len(rows) > 1:
        out["measured_compile_s"] = max(0.0, rows[0]["step_s"] - steady_mean([r["step_s"] for r in rows]))
    stepped = [f["compile_steps"] for f in finals if f.get("compile_steps")]
    if stepped:
        eager = statistics.median(min(t["eager_s"]) for t in stepped)
        compiled = statistics.median(min(t["compiled_s"]) for t in stepped)
        out["measured_step_speedup"] = eager / compiled
        named = [f["compile_gain_steps"] for f in finals if f.get("compile_gain_steps")]
        if named:  # every rank trains the same steps each way
            out["gain_steps"] = named[0]
        out["measured_saving_s_per_step"] = eager - compiled
        if c.block_compute_s > 0:
            out["measured_speedup"] = speedup_from_saving(c.block_compute_s, eager - compiled)
            out["measured_speedup_from"] = "steps"
    if len(rows) > 1:
        out["cache"] = [f.get("compile_cache") for f in finals]
    return out


def compile_gain(plan: Plan, record: dict[str, Any]) -> CompileGain | None:
    """The compile figure a later plan of this model can price `auto` with (calibration.json),
    where this run measured one."""
    if "measured_speedup" not in record or "measured_compile_s" not in record:
        return None
    m = plan.model
    return CompileGain(model=m.name, block_class=m.block_class, params=m.params,
                       speedup=round(record["measured_speedup"], 4), compile_s=round(record["measured_compile_s"], 3))


def save_compile_gain(run: RunDir, plan: Plan, record: dict[str, Any]) -> str | None:
    """Add this run's compile figure (`compile_gain`) to its calibration.json, a trial's ratios
    kept; the console's line about it, or None where the run measured none."""
    gain = compile_gain(plan, record)
    if gain is None:
        return None
    path = run.path / CALIBRATION_FILE
    existing = json.loads(path.read_text()) if path.is_file() else None
    run.write_json(CALIBRATION_FILE, with_compile_gain(existing, gain))
    if record.get("measured_speedup_from") == "steps":
        steps = (f"steps ran {record['measured_step_speedup']:.2f}x as fast with the blocks compiled "
                 f"({record['measured_saving_s_per_step'] * 1e3:.1f} ms saved a step)")
    else:
        steps = f"the blocks ran {gain.speedup:.2f}x as fast compiled"
    return (f"compile: {steps} and compiling took {gain.compile_s:.1f} s; "
            f"parallel.calibration={run.path} prices train.compile=auto with it")


def overhead_share(finals: list[dict[str, Any]], step_s: float) -> float | None:
    """The largest rank's reporting time per step over the step's time: what share of the
    run's wall time the orchestrator's loop adds (None for answers that predate the figure)."""
    per_rank = [f["overhead_s_per_step"] for f in finals if f.get("overhead_s_per_step") is not None]
    if not per_rank or not step_s or not math.isfinite(step_s):
        return None
    return max(per_rank) / step_s


def summarize(cfg: JobConfig, plan: Plan, state: RunState, setups, finals, wall: float, reports) -> dict[str, Any]:
    """summary.json of a finished run."""
    lo, hi = AGREEMENT
    first_val = state.val[0][1] if state.val else None
    final_val = state.val[-1][1] if state.val else None
    measured_step = steady_mean([r["step_s"] for r in state.rows])
    predicted = plan.run_step_s
    repriced = repriced_step_s(plan, setups)
    split = exposed_split(state.stragglers.samples)
    measured_mem = [f["state_bytes"] for f in finals]
    warnings = []
    # Against the figure re-priced from measured compute where there is one: a host whose compute
    # rate was misjudged is said by the two step figures side by side, not warned about.
    judged, judged_as = (repriced, "the plan's re-priced from measured compute") if repriced else (predicted,
                                                                                                   "the plan's")
    if judged and math.isfinite(measured_step) and not (lo <= measured_step / judged <= hi):
        warnings.append(f"measured step time {measured_step:.3g}s differs from {judged_as} {judged:.3g}s "
                        "by more than 2x")
    m = plan.memory_per_rank
    model_state_pred = m.params + m.grads + m.optimizer
    model_state_meas = max((sum(m.values()) for m in measured_mem), default=0)
    if model_state_pred and model_state_meas and not (lo <= model_state_meas / model_state_pred <= hi):
        warnings.append(f"measured model-state bytes {model_state_meas:,} differ from the plan's "
                        f"{model_state_pred:,} by more than 2x")
    # A CPU rank's peak is its resident memory (the interpreter, its libraries and the
    # allocator's kept pages), which the plan, a count of torch's own allocations, does not predict.
    memory_source = finals[0]["memory"]["source"] if finals else None
    peak_warning = peak_memory_warning(m.total, finals) if memory_source != "rss" else None
    if peak_warning:
        warnings.append(peak_warning)
    return {
        "job": cfg.name,
        "strategy": str(plan.strategy),
        "world_size": plan.world_size,
        "mesh": plan.mesh.to_dict(),
        "num_params": setups[0]["num_params"],
        "backend": setups[0]["backend"],
        "steps": state.last_step,
        "first_val_loss": first_val,
        "final_val_loss": final_val,
        "val_loss_drop": (1 - final_val / first_val) if first_val and final_val is not None else None,
        "final_train_loss": state.rows[-1]["loss"] if state.rows else None,
        "tokens_per_s": steady_mean([r["tokens_per_s"] for r in state.rows]),
        "step_s": measured_step,
        "wall_s": wall,
        "checkpoints": state.checkpoints,
        "predicted": {"step_s": predicted, "step_s_repriced": repriced, "exposed_comm_s": plan.step_time.exposed_comm_s,
                      # The planner prices equal ranks: none waits for another.
                      "straggle_wait_s": 0.0,
                      "model_state_bytes_per_rank": model_state_pred, "peak_memory_bytes_per_rank": m.total,
                      "peak_memory_predicted": memory_source != "rss"},
        "measured": {"step_s": measured_step, "exposed_comm_s": steady_mean(
                         [r["exposed_comm_s"] for r in state.rows if r.get("exposed_comm_s") is not None]),
                     "exposed_transfer_s": split[0] if split else None,
                     "straggle_wait_s": split[1] if split else None,
                     "model_state_bytes_per_rank": measured_mem,
                     "peak_memory_bytes_per_rank": [f["memory"]["peak_bytes"] for f in finals],
                     "baseline_memory_bytes_per_rank": [f["memory"]["baseline_bytes"] for f in finals],
                     "peak_reserved_bytes_per_rank": [f["memory"]["peak_reserved_bytes"] for f in finals],
                     "memory_source": memory_source,
                     # What the worker's loop spends per step on reporting (metrics, the driver's
                     # sink) rather than training: the orchestrator's own tax, measured per rank.
                     "orchestration_overhead_s_per_step": [f.get("overhead_s_per_step") for f in finals],
                     "orchestration_overhead_share": overhead_share(finals, measured_step)},
        "notes": notes(setups),
        "warnings": warnings,
        "nodes": sorted({r["node_id"] for r in reports}),
        "startup": state.startup,
        "restarts": state.restarts,
        "stragglers": state.stragglers.report(where(plan)),
        "compile": compile_record(plan, state.rows, finals, setups),
    }


def write_loss_curve(run: RunDir, cfg: JobConfig, plan: Plan, state: RunState) -> None:
    train = [(r["step"], r["loss"]) for r in state.rows]
    run.write_text("loss.svg", loss_svg(train, state.val, f"{cfg.name}: {plan.strategy} on {plan.world_size} workers",
                                        [r["resumed_from_step"] for r in state.restarts]))


def print_summary(console: Console, s: dict[str, Any], run: RunDir) -> None:
    t = Table(title=f"{s['job']}: {s['strategy']} on {s['world_size']} workers", show_header=False)
    t.add_column(style="bold")
    t.add_column(justify="right")
    fmt = lambda v, f: "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, f)  # noqa: E731
    t.add_row("parameters", fmt(s["num_params"], ","))
    t.add_row("steps", str(s["steps"]))
    t.add_row("val loss first -> last", f"{fmt(s['first_val_loss'], '.4f')} -> {fmt(s['final_val_loss'], '.4f')}")
    t.add_row("val loss drop", fmt(s["val_loss_drop"], ".1%"))
    t.add_row("tokens/s (steady)", fmt(s["tokens_per_s"], ",.0f"))
    t.add_row("step time (steady)", f"{fmt(s['step_s'] * 1000 if s['step_s'] else None, '.1f')} ms")
    if s["predicted"]["step_s"]:
        t.add_row("step time predicted", f"{s['predicted']['step_s'] * 1000:.1f} ms")
    if s["predicted"].get("step_s_repriced"):
        t.add_row("step time re-priced", f"{s['predicted']['step_s_repriced'] * 1000:.1f} ms")
    exposed = s["measured"]["exposed_comm_s"]
    predicted_exposed = s["predicted"]["exposed_comm_s"]
    t.add_row("exposed communication", f"{fmt(exposed * 1000 if exposed == exposed else None, '.1f')} ms"
              + (f" (predicted {predicted_exposed * 1000:.1f} ms)" if predicted_exposed else ""))
    transfer, wait = s["measured"].get("exposed_transfer_s"), s["measured"].get("straggle_wait_s")
    if transfer is not None and wait is not None:
        t.add_row("  moving bytes", f"{transfer * 1000:.1f} ms"
                  + (f" (predicted {predicted_exposed * 1000:.1f} ms)" if predicted_exposed else ""))
        t.add_row("  waiting for the slowest rank", f"{wait * 1000:.1f} ms (predicted 0.0 ms)")
    peaks, bases = s["measured"]["peak_memory_bytes_per_rank"], s["measured"]["baseline_memory_bytes_per_rank"]
    if peaks:
        grown = max(p - b for p, b in zip(peaks, bases))
        planned = s["predicted"]["peak_memory_bytes_per_rank"] / 2**20
        if s["predicted"].get("peak_memory_predicted", True):
            t.add_row("peak memory above baseline", f"{grown / 2**20:,.0f} MiB (predicted {planned:,.0f} MiB)")
        else:
            t.add_row("peak resident memory above baseline",
                      f"{grown / 2**20:,.0f} MiB (RSS: not predicted; the plan's {planned:,.0f} MiB counts torch's "
                      "allocations)")
    share = s["measured"].get("orchestration_overhead_share")
    if share is not None:
        worst = max(v for v in s["measured"]["orchestration_overhead_s_per_step"] if v is not None)
        t.add_row("orchestrator's own work per step", f"{worst * 1000:.2f} ms ({share:.2%} of a step)")
    t.add_row("wall time", f"{s['wall_s']:.1f} s")
    t.add_row("last checkpoint", s["checkpoints"][-1] if s["checkpoints"] else "-")
    console.print(t)
    for w in s["warnings"]:
        console.print(f"[yellow]warning:[/] {escape(w)}")
    console.print(f"run directory: {run.path}  (loss curve: {run.path / 'loss.svg'})", markup=False)
