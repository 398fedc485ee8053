"""The driver of one job: probe, plan, place, run, record.

It runs wherever `submit` runs (the user's shell, or a Ray job on the head node), holds no
training state itself, and writes everything to the run directory as it goes.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from rich.console import Console
from rich.table import Table

from ..config import JobConfig, to_yaml
from ..errors import PlanError
from ..rundir import RunDir
from .curve import loss_svg
from .progress import ProgressView


@dataclass
class RunState:
    """What the driver has seen of the run so far."""

    train: list[tuple[int, float]] = field(default_factory=list)
    val: list[tuple[int, float]] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)
    last_step: int = 0


def _use_gpu(topology) -> bool:
    kinds = {d.kind for n in topology.nodes for d in n.devices}
    return kinds == {"gpu"} and ray.cluster_resources().get("GPU", 0) >= 1


def _plan(cfg: JobConfig, topology) -> dict[str, Any]:
    from ..planning import plan_job

    plan = plan_job(cfg, topology)
    if not plan.fits:
        raise PlanError(f"the plan does not fit: {plan.reason}")
    return plan.to_dict()


def _steady_mean(values: list[float]) -> float:
    """Mean over the steps after the first few (which include warm-up and allocation)."""
    tail = values[min(len(values) // 5, 10):] or values
    return sum(tail) / len(tail) if tail else float("nan")


def run_job(cfg: JobConfig, run: RunDir, console: Console, dashboard_url: str | None = None) -> dict[str, Any]:
    """Run the job on the connected Ray cluster; returns the summary written to summary.json."""
    from ..placement import place
    from ..topology.cluster_probe import probe_cluster

    t_start = time.monotonic()
    run.write_text("config.yaml", to_yaml(cfg))
    with console.status("probing the cluster topology"):
        topology = probe_cluster(num_cpu_slots=cfg.cluster.num_workers)
    run.write_text("topology.json", topology.to_json())
    use_gpu = _use_gpu(topology)

    plan = _plan(cfg, topology)
    run.write_json("plan.json", plan)
    mesh = " x ".join(f"{k}={v}" for k, v in plan["mesh"].items())
    console.print(
        f"plan: [bold]{plan['strategy']}[/] on {plan['world_size']} {'GPUs' if use_gpu else 'CPU workers'} "
        f"({mesh}), micro-batch {plan['micro_batch_size']} x {plan['sync']['grad_accum_steps']} accumulation steps"
    )
    if dashboard_url:
        console.print(f"Ray dashboard: http://{dashboard_url}")

    with console.status(f"placing {plan['world_size']} workers"):
        placement = place(
            plan, job=cfg.name, use_gpu=use_gpu, cpus_per_worker=cfg.cluster.cpus_per_worker,
            threads_per_worker=max(1, int(cfg.cluster.cpus_per_worker)),
            timeout_s=cfg.cluster.placement_timeout_s,
        )
    try:
        run.write_json("placement.json", placement.reports)
        actors = placement.actors
        master = ray.get(actors[0].rendezvous_address.remote())
        with console.status("starting the process group and building the model"):
            setups = ray.get([a.setup.remote(cfg, plan, master) for a in actors])
        for note in setups[0]["notes"]:
            console.print(f"[yellow]note:[/] {note}")
        state, finals = _train(cfg, run, console, actors)
        ray.get([a.shutdown.remote() for a in actors])
    finally:
        placement.release()

    wall = time.monotonic() - t_start
    summary = _summary(cfg, plan, state, setups, finals, wall, placement.reports)
    run.write_json("summary.json", summary)
    run.write_text("loss.svg", loss_svg(state.train, state.val, f"{cfg.name}: {plan['strategy']} on {plan['world_size']} workers"))
    _print_summary(console, summary, run)
    return summary


def _train(cfg: JobConfig, run: RunDir, console: Console, actors: list) -> tuple[RunState, list[dict[str, Any]]]:
    """Start every rank's step loop and follow it through the metrics sink until all return."""
    from .worker import MetricsSink

    sink = MetricsSink.options(num_cpus=0).remote()
    ckpt_dir = cfg.checkpoint.path or str(run.checkpoints)
    refs = [a.train.remote(0, cfg.train.max_steps, sink, ckpt_dir) for a in actors]
    state = RunState()
    pending = list(refs)
    with ProgressView(cfg.train.max_steps, console, cfg.monitor.progress) as view:
        while True:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=0.5)
            for ref in done:
                ray.get(ref)  # re-raises a rank's failure here, with its traceback under --debug
            _consume(ray.get(sink.drain.remote()), state, run, view, cfg.monitor.log_interval)
            if not pending:
                break
    finals = ray.get(refs)
    ray.kill(sink)
    return state, finals


def _consume(items: list[dict[str, Any]], state: RunState, run: RunDir, view: ProgressView, every: int) -> None:
    rows = []
    for it in items:
        kind = it.pop("kind")
        if kind == "eval":
            state.val.append((it["step"], it["val_loss"]))
        elif kind == "checkpoint":
            state.checkpoints.append(it["path"])
        elif kind == "step":
            state.last_step = it["step"]
            state.train.append((it["step"], it["loss"]))
            state.step_s.append(it["step_s"])
            state.tokens_per_s.append(it["tokens_per_s"])
            if it.get("val_loss") is not None:
                state.val.append((it["step"], it["val_loss"]))
            view.update(it, state.val[-1][1] if state.val else None)
            if it["step"] % every == 0 or it.get("val_loss") is not None:
                rows.append({k: it[k] for k in ("step", "loss", "lr", "tokens_per_s", "step_s", "grad_norm", "val_loss")})
    run.append_jsonl("metrics.jsonl", rows)


def _summary(cfg, plan, state: RunState, setups, finals, wall: float, reports) -> dict[str, Any]:
    first_val = state.val[0][1] if state.val else None
    final_val = state.val[-1][1] if state.val else None
    measured_step = _steady_mean(state.step_s)
    predicted = plan.get("step_time", {}).get("total_s")
    predicted_mem = plan.get("memory_per_rank", {})
    measured_mem = [f["state_bytes"] for f in finals]
    warnings = []
    if predicted and measured_step and not (0.5 <= measured_step / predicted <= 2.0):
        warnings.append(f"measured step time {measured_step:.3g}s differs from the plan's {predicted:.3g}s by more than 2x")
    model_state_pred = sum(predicted_mem.get(k, 0) for k in ("params", "grads", "optimizer"))
    model_state_meas = max((sum(m.values()) for m in measured_mem), default=0)
    if model_state_pred and model_state_meas and not (0.5 <= model_state_meas / model_state_pred <= 2.0):
        warnings.append(f"measured model-state bytes {model_state_meas:,} differ from the plan's {model_state_pred:,} by more than 2x")
    return {
        "job": cfg.name,
        "strategy": plan["strategy"],
        "world_size": plan["world_size"],
        "mesh": plan["mesh"],
        "num_params": setups[0]["num_params"],
        "backend": setups[0]["backend"],
        "steps": state.last_step,
        "first_val_loss": first_val,
        "final_val_loss": final_val,
        "val_loss_drop": (1 - final_val / first_val) if first_val and final_val is not None else None,
        "final_train_loss": state.train[-1][1] if state.train else None,
        "tokens_per_s": _steady_mean(state.tokens_per_s),
        "step_s": measured_step,
        "wall_s": wall,
        "checkpoints": state.checkpoints,
        "predicted": {"step_s": predicted, "model_state_bytes_per_rank": model_state_pred},
        "measured": {"step_s": measured_step, "model_state_bytes_per_rank": measured_mem},
        "notes": setups[0]["notes"],
        "warnings": warnings,
        "nodes": sorted({r["node_id"] for r in reports}),
    }


def _print_summary(console: Console, s: dict[str, Any], run: RunDir) -> None:
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
    t.add_row("wall time", f"{s['wall_s']:.1f} s")
    t.add_row("last checkpoint", s["checkpoints"][-1] if s["checkpoints"] else "-")
    console.print(t)
    for w in s["warnings"]:
        console.print(f"[yellow]warning:[/] {w}")
    console.print(f"run directory: {run.path}  (loss curve: {run.path / 'loss.svg'})")
