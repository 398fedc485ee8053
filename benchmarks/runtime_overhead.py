"""Runtime overhead: `submit` against Ray Train's TorchTrainer and a plain torchrun script.

    python benchmarks/runtime_overhead.py [--quick] [--steps N] [--repeats N]

The same GPT, data, world size (2 workers) and strategy (DDP, the same plan: micro-batch,
accumulation, bucket size) are trained three ways in one run, alternating (ABCABC...):

* ours: `python -m orchestrator submit jobs/llm.yaml` (its run directory is read);
* Ray Train: `ray.train.torch.TorchTrainer` on a fresh local Ray cluster;
* torchrun: `python -m torch.distributed.run --nproc-per-node 2`.

Ray Train and torchrun run the runtime's own `Trainer` (one thread per worker, as our
worker actors use), so only the launcher differs. Each launch is a fresh process that starts
what it needs (a Ray cluster for ours and Ray Train), as a user's first run does. Figures:
seconds from launch to the end of the first optimizer step, steady-state tokens/s (the mean
after the first steps, the same rule for all three), and the ratios. Goals: ours >= 0.97x
torchrun's throughput, and launch-to-first-step no slower than Ray Train's.
Writes benchmarks/results/runtime_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import ROOT, child_env, parse_args, print_table, python, run, steady_mean, write_result

JOB = ROOT / "jobs" / "llm.yaml"
WORLD = 2
LAUNCHERS = ("ours", "ray_train", "torchrun")
GOAL_THROUGHPUT_VS_TORCHRUN = 0.97
# The driver drains the ranks' metrics every half second: ours' first step is seen up to this late.
DRIVER_POLL_S = 0.5
_POLL_S = 0.02
_TIMEOUT_S = 600


def overrides(steps: int) -> list[str]:
    """The job every launcher runs: DDP on 2 CPU workers, no checkpoints, one evaluation batch
    at the start and at the end (as the worker actor evaluates)."""
    return ["parallel.strategy=ddp", "parallel.tp=1", f"cluster.num_workers={WORLD}", "checkpoint.enabled=false",
            "monitor.progress=false", "monitor.dashboard=false", f"train.max_steps={steps}",
            f"train.eval_interval={steps}", "train.eval_iters=1"]


def plan_for(job_overrides: list[str]) -> tuple[dict[str, Any], list[str]]:
    """The plan `submit` makes on 2 CPU slots, and the overrides that pin its micro-batch so
    the three launchers cannot differ in it."""
    from orchestrator.config import load_config
    from orchestrator.planning import plan_job
    from orchestrator.topology.model import ClusterTopology, cpu_node

    plan = plan_job(load_config(JOB, job_overrides), ClusterTopology(nodes=[cpu_node(WORLD)])).to_dict()
    pinned = [*job_overrides, f"train.micro_batch_size={plan['micro_batch_size']}",
              f"parallel.bucket_mb={plan['sync']['bucket_mb']}"]
    return plan, pinned


def train_loop(job_overrides: list[str], plan: dict[str, Any], result: str) -> None:
    """What a worker actor does, without Ray: build the Trainer under the plan, evaluate,
    run every step, evaluate; rank 0 writes when its first step ended and every step's time."""
    import torch
    import torch.distributed as dist

    from orchestrator.config import load_config
    from orchestrator.planning import Plan
    from orchestrator.runtime.trainer import Trainer

    torch.set_num_threads(1)
    cfg = load_config(JOB, job_overrides)
    # The plan arrives as its JSON contract (plan.json's), as the launchers hand it over.
    tr = Trainer(cfg, Plan.from_dict(plan), torch.device("cpu"))
    tr.evaluate()
    first_end, steps = None, []
    for step in range(cfg.train.max_steps):
        res = tr.train_step(step)
        if first_end is None:
            first_end = time.time()
        steps.append(res.step_s)
    tr.evaluate()
    if dist.get_rank() == 0:
        Path(result).write_text(json.dumps({"first_step_end": first_end, "step_s": steps,
                                            "tokens_per_step": tr.tokens_per_step}))


def _ray_train_worker(config: dict[str, Any]) -> None:
    train_loop(config["overrides"], config["plan"], config["result"])


def _child(mode: str, spec_path: str) -> int:
    """Run inside a launched process: torchrun's ranks, or the Ray Train driver."""
    spec = json.loads(Path(spec_path).read_text())
    if mode == "torchrun":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        try:
            train_loop(spec["overrides"], spec["plan"], spec["result"])
        finally:
            dist.destroy_process_group()
        return 0
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(address="local", num_cpus=WORLD, include_dashboard=False, logging_level="WARNING")
    try:
        TorchTrainer(
            _ray_train_worker,
            train_loop_config=spec,
            scaling_config=ScalingConfig(num_workers=WORLD, use_gpu=False, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(name="runtime_overhead", storage_path=str(Path(spec["result"]).parent / "ray_train")),
        ).fit()
    finally:
        ray.shutdown()
    return 0


def _launch(cmd: list[str], log: Path, watch: Path | None = None) -> tuple[float, float | None]:
    """Run `cmd` to the end; (launch wall time, when a metrics.jsonl under `watch` first had a line)."""
    seen = None
    with open(log, "w") as out:
        t0 = time.time()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=out, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            if watch is not None and seen is None:
                for m in watch.glob("*/metrics.jsonl"):
                    if m.stat().st_size > 0:
                        seen = time.time()
            if time.time() - t0 > _TIMEOUT_S:
                proc.kill()
                raise RuntimeError(f"{' '.join(cmd[:4])} ran past {_TIMEOUT_S} s; see {log}")
            time.sleep(_POLL_S)
    if proc.returncode != 0:
        tail = log.read_text().strip().splitlines()[-15:]
        raise RuntimeError(f"{' '.join(cmd[:5])} exited with {proc.returncode}:\n" + "\n".join(tail))
    return t0, seen


def run_once(launcher: str, plan: dict[str, Any], job_overrides: list[str], tmp: Path) -> dict[str, Any]:
    """One launch; the seconds to the first step's end and the steady tokens/s."""
    work = Path(tempfile.mkdtemp(prefix=f"{launcher}-", dir=tmp))
    log = work / "output.log"
    if launcher == "ours":
        runs = work / "runs"
        cmd = [python(), "-m", "orchestrator", "submit", str(JOB), *job_overrides, f"monitor.runs_dir={runs}"]
        t0, first = _launch(cmd, log, watch=runs)
        run_dir = next(runs.iterdir())
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        got = json.loads((run_dir / "plan.json").read_text())
        same = all(got[k] == plan[k] for k in ("strategy", "mesh", "micro_batch_size")) and \
            got["sync"]["grad_accum_steps"] == plan["sync"]["grad_accum_steps"]
        if not same:
            raise RuntimeError(f"submit planned {got['strategy']} {got['mesh']} micro {got['micro_batch_size']}, "
                               f"not the plan the other launchers run; see {run_dir / 'plan.json'}")
        step_s = [r["step_s"] for r in rows if "step_s" in r]
        tokens = rows[0]["tokens_per_s"] * rows[0]["step_s"]
    else:
        result = work / "result.json"
        spec = work / "spec.json"
        spec.write_text(json.dumps({"overrides": job_overrides, "plan": plan, "result": str(result)}))
        me = str(Path(__file__).resolve())
        if launcher == "torchrun":
            cmd = [python(), "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
                   me, "--child", "torchrun", "--spec", str(spec)]
        else:
            cmd = [python(), me, "--child", "ray_train", "--spec", str(spec)]
        t0, _ = _launch(cmd, log)
        data = json.loads(result.read_text())
        first, step_s, tokens = data["first_step_end"], data["step_s"], data["tokens_per_step"]
    if first is None:
        raise RuntimeError(f"{launcher}: no step was seen; see {log}")
    return {"launcher": launcher, "first_step_s": first - t0, "steps": len(step_s),
            "step_s": steady_mean(step_s), "tokens_per_s": tokens / steady_mean(step_s)}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median per launcher over the repetitions, and ours against each peer."""
    med = {}
    for name in LAUNCHERS:
        mine = [r for r in runs if r["launcher"] == name]
        med[name] = {"first_step_s": statistics.median(r["first_step_s"] for r in mine),
                     "tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine), "repeats": len(mine)}
    ours, rt, tr = med["ours"], med["ray_train"], med["torchrun"]
    ratios = {
        "throughput_ours_over_ray_train": ours["tokens_per_s"] / rt["tokens_per_s"],
        "throughput_ours_over_torchrun": ours["tokens_per_s"] / tr["tokens_per_s"],
        "first_step_ours_over_ray_train": ours["first_step_s"] / rt["first_step_s"],
        "first_step_ours_over_torchrun": ours["first_step_s"] / tr["first_step_s"],
    }
    goals = {
        "throughput_vs_torchrun": {"at_least": GOAL_THROUGHPUT_VS_TORCHRUN,
                                   "met": ratios["throughput_ours_over_torchrun"] >= GOAL_THROUGHPUT_VS_TORCHRUN},
        "first_step_vs_ray_train": {"at_most": 1.0, "met": ratios["first_step_ours_over_ray_train"] <= 1.0},
    }
    return {"median": med, "ratios": ratios, "goals": goals}


def options(ap) -> None:
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per launch (30 quick, 120 full)")
    ap.add_argument("--repeats", type=int, default=None, help="launches of each kind (1 quick, 3 full)")


def main(argv: list[str] | None = None) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--child", choices=("torchrun", "ray_train"))
    pre.add_argument("--spec")
    known, rest = pre.parse_known_args(argv)
    if known.child:
        return _child(known.child, known.spec)

    args = parse_args(__doc__, rest, options)
    steps = args.steps or (30 if args.quick else 120)
    repeats = args.repeats or (1 if args.quick else 3)
    t0 = time.perf_counter()
    plan, job_overrides = plan_for(overrides(steps))
    runs = []
    with tempfile.TemporaryDirectory(prefix="runtime_overhead-") as tmp:
        for rep in range(repeats):
            for launcher in LAUNCHERS:
                r = run_once(launcher, plan, job_overrides, Path(tmp))
                r["repeat"] = rep
                runs.append(r)
                print(f"  {launcher:<10} first step after {r['first_step_s']:6.2f} s, "
                      f"{r['tokens_per_s']:,.0f} tokens/s", file=sys.stderr)
    result = {"job": str(JOB.relative_to(ROOT)), "overrides": job_overrides, "world": WORLD, "steps": steps,
              "plan": {k: plan[k] for k in ("strategy", "mesh", "micro_batch_size", "sync")},
              "runs": runs, **summarize(runs), "seconds": time.perf_counter() - t0,
              "notes": [f"ours' first step is seen through the run directory, which the driver writes every "
                        f"{DRIVER_POLL_S} s: up to {DRIVER_POLL_S} s of its launch figure is that polling"]}
    med, rat = result["median"], result["ratios"]
    print_table(
        f"DDP on {WORLD} CPU workers, {steps} steps, median of {repeats} launch(es) each",
        ["launcher", "launch to first step s", "tokens/s (steady)", "ours / this: tokens/s", "ours / this: first step"],
        [[name, med[name]["first_step_s"], med[name]["tokens_per_s"],
          med["ours"]["tokens_per_s"] / med[name]["tokens_per_s"],
          med["ours"]["first_step_s"] / med[name]["first_step_s"]]
         for name in LAUNCHERS],
        caption=f"goals: throughput >= {GOAL_THROUGHPUT_VS_TORCHRUN}x torchrun's "
                f"({rat['throughput_ours_over_torchrun']:.3f}x); first step no later than Ray Train's "
                f"({rat['first_step_ours_over_ray_train']:.2f}x)",
    )
    out = write_result("runtime_overhead", result, args)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    run(main)
