"""Runtime overhead: `submit` against Ray Train's TorchTrainer and a plain torchrun script.

    python benchmarks/runtime_overhead.py [--quick] [--steps N] [--repeats N]

The same GPT, data, world size (2 workers) and strategy (DDP, the same plan: micro-batch,
accumulation, bucket size) are trained seven ways in one run, alternating, each round starting
one launcher later than the last (ABCDEFG BCDEFGA ...), so that no launcher always follows
the same one (whatever a launch leaves behind, a page cache or a process still exiting, falls
on every launcher in turn):

* ours: `python -m orchestrator submit jobs/llm.yaml` (its run directory is read), starting
  its private Ray cluster as the default does;
* ours_warm: the same `submit` to a Ray cluster already running (`cluster.address`), as jobs
  reach a cloud cluster: Ray's start is not paid, every worker process still is;
* ours_compiled: the same `submit` with train.compile=true (its blocks compiled);
* ours_auto: `submit` with train.compile=auto, planned with the compile gain the ours_compiled
  launch before it measured (`parallel.calibration`): compiled where that pays over the run;
* Ray Train: `ray.train.torch.TorchTrainer` on a fresh local Ray cluster;
* torchrun: `python -m torch.distributed.run --nproc-per-node 2`;
* torchrun_busy: the same torchrun beside a process that keeps a steady share of one core busy
  (in 10 ms periods): the share ours' other processes (Ray's daemons, the driver, the metrics
  sink) took beyond torchrun's in this run's launches so far. Where ours' throughput matches
  it, the gap to torchrun is that CPU and nothing in the step.

Ray Train and torchrun run the runtime's own step loop (`orchestrator/runtime/loop.py`, over
the same `Trainer`, started and calibrated as a worker actor does; one thread per worker, as
our worker actors use), so only the launcher differs. Each launch is a fresh process that starts
what it needs (a Ray cluster for ours and Ray Train), as a user's first run does. Figures:
seconds from launch to the end of the first optimizer step; steady-state tokens/s from the wall
time between step ends (so whatever a launcher does between steps counts), beside the figure
from the step's own timing; ours' loop overhead per step as its summary.json measures it; the
share of the machine's CPU that processes other than the ranks took during the steady steps
(`_cpu.py`: a launcher's agent, Ray's daemons, the driver: time a step on a busy host loses);
and the ratios. For ours_auto, its time from Ray up to the last step over eager ours' (compiling,
or not, must never leave the run behind). Goals: ours >= 0.99x torchrun's and >= 1.0x Ray
Train's throughput, and launch-to-first-step no slower than Ray Train's and at most 1.5x
torchrun's (cold and warm stated apart).
Writes benchmarks/results/runtime_overhead.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import ROOT, child_env, parse_args, print_table, python, run, steady_mean, write_result
from _cpu import CpuSampler, split

JOB = ROOT / "jobs" / "llm.yaml"
WORLD = 2
LAUNCHERS = ("ours", "ours_warm", "ours_compiled", "ours_auto", "ray_train", "torchrun", "torchrun_busy")
"""`ours_compiled` is `submit` with train.compile=true: the same run with its blocks compiled;
`ours_auto` with train.compile=auto priced by what the `ours_compiled` launch just before it
measured (`parallel.calibration` naming its run directory): compiled where that pays over the
run's steps, else eager."""
GOAL_THROUGHPUT_VS_TORCHRUN = 0.99
GOAL_THROUGHPUT_VS_RAY_TRAIN = 1.0
GOAL_FIRST_STEP_VS_TORCHRUN = 1.5
_POLL_S = 0.02
BUSY_PERIOD_S = 0.01
BUSY_DEFAULT_CORES = 0.045
"""torchrun_busy's share of one core until this run has measured both ours and torchrun."""
_BUSY = """
import sys, time
share, period = float(sys.argv[1]), float(sys.argv[2])
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < share * period:
        pass
    time.sleep(period * (1 - share))
"""
_TIMEOUT_S = 600
_CPU_SAMPLE_S = 1.0
"""How often every process's CPU time is read during a launch: one read of ~100 processes costs
about 4 ms of one core, beside every launcher alike."""


_BASE = ["parallel.strategy=ddp", "parallel.tp=1", f"cluster.num_workers={WORLD}", "checkpoint.enabled=false",
         "monitor.progress=false", "monitor.dashboard=false"]


def overrides(steps: int, extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The job every launcher runs: DDP on 2 CPU workers, no checkpoints, one evaluation batch
    at the start and at the end (as the worker actor evaluates); `extra` (`--set`) after them,
    so it can change the model or the strategy (the later value of a key wins)."""
    return [*_BASE, f"train.max_steps={steps}", f"train.eval_interval={steps}", "train.eval_iters=1", *extra]


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


class _Rows:
    """The step loop's sink here: keeps the metrics rows rank 0 sends (`Stepped`), drops the rest."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def add(self, item: Any, urgent: bool = False) -> None:
        from orchestrator.runtime.messages import Stepped

        if isinstance(item, Stepped):
            self.rows.append(item.row)

    def flush(self) -> None:
        pass

    def end(self) -> None:
        pass


def train_loop(job_overrides: list[str], plan: dict[str, Any], result: str) -> None:
    """What a worker actor does, without Ray: build the Trainer under the plan, start it, time
    its compute-only pass, and run the shared step loop (`runtime/loop.py`: evaluate, every
    step, evaluate); rank 0 writes when each step ended (its row's time) and every step's time."""
    import torch
    import torch.distributed as dist

    from orchestrator.config import load_config
    from orchestrator.planning import Plan
    from orchestrator.runtime.loop import run_steps
    from orchestrator.runtime.step_timer import StepTimer
    from orchestrator.runtime.trainer import Trainer
    from orchestrator.runtime.validator import Validator

    torch.set_num_threads(1)
    cfg = load_config(JOB, job_overrides)
    # The plan arrives as its JSON contract (plan.json's), as the launchers hand it over.
    tr = Trainer(cfg, Plan.from_dict(plan), torch.device("cpu"))
    start = tr.start()
    timer = StepTimer(tr)
    timer.calibrate()
    t = cfg.train
    sink = _Rows()
    run_steps(tr, range(start, t.max_steps), timer, Validator(tr.evaluate, t.eval_interval, t.max_steps), sink)
    if dist.get_rank() == 0:
        Path(result).write_text(json.dumps({"step_end": [r["time"] for r in sink.rows],
                                            "step_s": [r["step_s"] for r in sink.rows],
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


@contextlib.contextmanager
def warm_cluster():
    """A Ray cluster of one node with the private cluster's settings (WORLD CPUs,
    `PRIVATE_CLUSTER_CONFIG`); yields its address."""
    from ray.cluster_utils import Cluster

    from orchestrator.connect.cluster import PRIVATE_CLUSTER_CONFIG

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": WORLD, "include_dashboard": False, "_system_config": dict(PRIVATE_CLUSTER_CONFIG)})
    try:
        yield cluster.address
    finally:
        cluster.shutdown()
        Path("/tmp/ray/ray_current_cluster").unlink(missing_ok=True)  # later bare ray.init()s start their own


def _started(log: Path) -> float:
    """When `_launch` started the command whose output is `log` (it writes that first)."""
    return float(log.with_suffix(".start").read_text())


def _launch(cmd: list[str], log: Path, cpu: CpuSampler) -> float:
    """Run `cmd` to the end, sampling every process's CPU time into `cpu`; its launch wall time."""
    with open(log, "w") as out, cpu:
        t0 = time.time()
        log.with_suffix(".start").write_text(repr(t0))
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=out, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            if time.time() - t0 > _TIMEOUT_S:
                proc.kill()
                raise RuntimeError(f"{' '.join(cmd[:4])} ran past {_TIMEOUT_S} s; see {log}")
            time.sleep(_POLL_S)
    if proc.returncode != 0:
        tail = log.read_text().strip().splitlines()[-15:]
        raise RuntimeError(f"{' '.join(cmd[:5])} exited with {proc.returncode}:\n" + "\n".join(tail))
    return t0


def run_once(launcher: str, plan: dict[str, Any], job_overrides: list[str], tmp: Path,
             warm_address: str | None = None, calibration: str | None = None,
             busy_cores: float = 0.0) -> dict[str, Any]:
    """One launch; the seconds to the first step's end and the steady tokens/s. `warm_address`:
    the running Ray cluster `ours_warm` submits to; `calibration`: the run directory whose
    measured compile gain `ours_auto` plans with; `busy_cores`: the share of one core
    torchrun_busy's load process keeps busy."""
    work = Path(tempfile.mkdtemp(prefix=f"{launcher}-", dir=tmp))
    log = work / "output.log"
    exit_note = None
    cpu = CpuSampler(_CPU_SAMPLE_S)
    if launcher.startswith("ours"):
        runs = work / "runs"
        compile_ = {"ours_compiled": "true", "ours_auto": "auto"}.get(launcher, "false")
        cmd = [python(), "-m", "orchestrator", "submit", str(JOB), *job_overrides, f"monitor.runs_dir={runs}",
               f"train.compile={compile_}"]
        if launcher == "ours_warm":
            cmd.append(f"cluster.address={warm_address}")
        if launcher == "ours_auto":
            cmd.append(f"parallel.calibration={calibration}")
        t0 = _launch(cmd, log, cpu)
        run_dir = next(runs.iterdir())
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        got = json.loads((run_dir / "plan.json").read_text())
        same = all(got[k] == plan[k] for k in ("strategy", "mesh", "micro_batch_size")) and \
            got["sync"]["grad_accum_steps"] == plan["sync"]["grad_accum_steps"]
        if not same:
            raise RuntimeError(f"submit planned {got['strategy']} {got['mesh']} micro {got['micro_batch_size']}, "
                               f"not the plan the other launchers run; see {run_dir / 'plan.json'}")
        step_s = [r["step_s"] for r in rows if "step_s" in r]
        ends = [r["time"] for r in rows if "step_s" in r]
        tokens = rows[0]["tokens_per_s"] * rows[0]["step_s"]
        summary = json.loads((run_dir / "summary.json").read_text())
        overhead = max(summary["measured"]["orchestration_overhead_s_per_step"])
        startup = summary.get("startup")
        compile_s = summary["compile"].get("measured_compile_s")
        compiled = {"enabled": summary["compile"]["enabled"], "reason": summary["compile"]["reason"],
                    **{k: summary["compile"][k] for k in ("measured_speedup", "measured_compile_s",
                                                          "measured_step_speedup", "measured_speedup_from")
                       if k in summary["compile"]}}
        # When rank 0's first step ended, as it stamped it: what torchrun's and Ray Train's
        # ranks write too, so no launcher's figure includes how late its parent saw the step.
        first = ends[0] if ends else None
    else:
        result = work / "result.json"
        spec = work / "spec.json"
        spec.write_text(json.dumps({"overrides": job_overrides, "plan": plan, "result": str(result)}))
        me = str(Path(__file__).resolve())
        if launcher.startswith("torchrun"):
            cmd = [python(), "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
                   me, "--child", "torchrun", "--spec", str(spec)]
        else:
            cmd = [python(), me, "--child", "ray_train", "--spec", str(spec)]
        load = (subprocess.Popen([python(), "-c", _BUSY, repr(busy_cores), repr(BUSY_PERIOD_S)])
                if launcher == "torchrun_busy" else None)
        try:
            t0 = _launch(cmd, log, cpu)
        except RuntimeError as e:
            # A rank that aborts while the process group is torn down, after rank 0 wrote every
            # step's time, leaves the timings whole: they are kept, and the exit is said.
            if not result.is_file():
                raise
            t0, exit_note = _started(log), str(e).splitlines()[0]
        finally:
            if load is not None:
                load.kill()
                load.wait()
        data = json.loads(result.read_text())
        ends, step_s, tokens = data["step_end"], data["step_s"], data["tokens_per_step"]
        first, overhead, compile_s, startup, compiled = ends[0] if ends else None, None, None, None, None
    if first is None:
        raise RuntimeError(f"{launcher}: no step was seen; see {log}")
    wall = steady_interval(ends)
    # The steady steps' window, as `steady_interval` counts them.
    steady = ends[min(len(ends) // 5, 10):-1]
    return {"launcher": launcher, "first_step_s": first - t0, "steps": len(step_s),
            "step_s": steady_mean(step_s), "wall_step_s": wall, "tokens_per_s": tokens / wall,
            "in_step_tokens_per_s": tokens / steady_mean(step_s), "loop_overhead_s_per_step": overhead,
            "compile_s": compile_s, "wall_s": ends[-1] - t0 if ends else None,
            "cpu": split(cpu.samples, steady[0], steady[-1], WORLD),
            # The driver's own breakdown, from run_job's start (Ray already up) to the first step.
            **({"startup": startup} if startup else {}),
            # From Ray up to the last step: what compiling (or not) did to the run's whole time,
            # without the spread of starting Ray.
            **({"wall_past_ray_s": ends[-1] - t0 - startup["ray_start_s"]} if startup and ends else {}),
            **({"compile": compiled, "run_dir": str(run_dir)} if compiled else {}),
            **({"busy_cores": busy_cores} if launcher == "torchrun_busy" else {}),
            **({"exit": exit_note} if exit_note else {})}


def busy_share(runs: list[dict[str, Any]]) -> float:
    """The share of one core ours' other processes took beyond torchrun's, medians of this
    run's launches so far (BUSY_DEFAULT_CORES until both have run)."""
    def others(name: str) -> list[float]:
        return [r["cpu"]["others_cores"] for r in runs if r["launcher"] == name and r.get("cpu")]

    ours, torchrun = others("ours"), others("torchrun")
    if not ours or not torchrun:
        return BUSY_DEFAULT_CORES
    return max(0.0, statistics.median(ours) - statistics.median(torchrun))


def steady_interval(ends: list[float]) -> float:
    """Wall seconds from one step's end to the next, over the steady steps (the same rule as
    `steady_mean`): what a run's throughput really is, including whatever a launcher does between
    steps. The last interval is left out: it holds the final evaluation in ours' figure only."""
    gaps = [b - a for a, b in zip(ends, ends[1:])][:-1]
    return steady_mean(gaps)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median per launcher over the repetitions, and ours against each peer."""
    med: dict[str, dict[str, Any]] = {}
    for name in LAUNCHERS:
        mine = [r for r in runs if r["launcher"] == name]
        if not mine:
            continue
        med[name] = {"first_step_s": statistics.median(r["first_step_s"] for r in mine),
                     "tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine), "repeats": len(mine)}
        for key in ("in_step_tokens_per_s", "wall_step_s", "loop_overhead_s_per_step", "compile_s", "wall_past_ray_s"):
            values = [r[key] for r in mine if r.get(key) is not None]
            if values:
                med[name][key] = statistics.median(values)
        shares = [r["cpu"]["others_share"] for r in mine if r.get("cpu")]
        if shares:  # the machine's CPU that processes other than the ranks took during the steady steps
            med[name]["others_cpu_share"] = statistics.median(shares)
        parts = [r["startup"] for r in mine if r.get("startup")]
        if parts:  # each part's median: where ours' seconds to a first step go
            med[name]["startup"] = {k: statistics.median(p[k] for p in parts) for k in parts[0]
                                    if all(isinstance(p.get(k), (int, float)) for p in parts)}
    ours, rt, tr = med["ours"], med.get("ray_train"), med["torchrun"]
    ratios = {
        "throughput_ours_over_torchrun": ours["tokens_per_s"] / tr["tokens_per_s"],
        "first_step_ours_over_torchrun": ours["first_step_s"] / tr["first_step_s"],
    }
    if rt is not None:
        ratios["throughput_ours_over_ray_train"] = ours["tokens_per_s"] / rt["tokens_per_s"]
        ratios["first_step_ours_over_ray_train"] = ours["first_step_s"] / rt["first_step_s"]
    warm = med.get("ours_warm")
    if warm is not None:
        ratios["first_step_warm_over_torchrun"] = warm["first_step_s"] / tr["first_step_s"]
    busy = med.get("torchrun_busy")
    if busy is not None:
        ratios["throughput_ours_over_torchrun_busy"] = ours["tokens_per_s"] / busy["tokens_per_s"]
        ratios["throughput_torchrun_busy_over_torchrun"] = busy["tokens_per_s"] / tr["tokens_per_s"]
    if "in_step_tokens_per_s" in ours and "in_step_tokens_per_s" in tr:
        ratios["in_step_throughput_ours_over_torchrun"] = ours["in_step_tokens_per_s"] / tr["in_step_tokens_per_s"]
    compiled = med.get("ours_compiled")
    if compiled is not None:
        ratios["throughput_compiled_over_eager"] = compiled["tokens_per_s"] / ours["tokens_per_s"]
        ratios["throughput_compiled_over_torchrun"] = compiled["tokens_per_s"] / tr["tokens_per_s"]
        saved = ours.get("wall_step_s", 0.0) - compiled.get("wall_step_s", 0.0)
        if saved > 0 and compiled.get("compile_s") is not None:
            # Steps after which the compiled run has made up its compile time on the eager one.
            ratios["compile_break_even_steps"] = compiled["compile_s"] / saved
    auto = med.get("ours_auto")
    if auto is not None and "wall_past_ray_s" in auto and "wall_past_ray_s" in ours:
        ratios["wall_auto_over_eager"] = auto["wall_past_ray_s"] / ours["wall_past_ray_s"]
        ratios["auto_compiled_launches"] = sum(1 for r in runs if r["launcher"] == "ours_auto"
                                               and r.get("compile", {}).get("enabled"))
    goals = {
        "throughput_vs_torchrun": {"at_least": GOAL_THROUGHPUT_VS_TORCHRUN,
                                   "met": ratios["throughput_ours_over_torchrun"] >= GOAL_THROUGHPUT_VS_TORCHRUN},
        "first_step_vs_torchrun": {"at_most": GOAL_FIRST_STEP_VS_TORCHRUN,
                                   "met": ratios["first_step_ours_over_torchrun"] <= GOAL_FIRST_STEP_VS_TORCHRUN},
    }
    if rt is not None:
        goals["throughput_vs_ray_train"] = {
            "at_least": GOAL_THROUGHPUT_VS_RAY_TRAIN,
            "met": ratios["throughput_ours_over_ray_train"] >= GOAL_THROUGHPUT_VS_RAY_TRAIN}
        goals["first_step_vs_ray_train"] = {"at_most": 1.0, "met": ratios["first_step_ours_over_ray_train"] <= 1.0}
    if warm is not None:
        goals["first_step_warm_cluster_vs_torchrun"] = {
            "at_most": GOAL_FIRST_STEP_VS_TORCHRUN,
            "met": ratios["first_step_warm_over_torchrun"] <= GOAL_FIRST_STEP_VS_TORCHRUN}
    return {"median": med, "ratios": ratios, "goals": goals}


def _last_compiled_run(runs: list[dict[str, Any]]) -> str:
    """The run directory of the latest ours_compiled launch: whose measured gain ours_auto plans with."""
    return next(r["run_dir"] for r in reversed(runs) if r["launcher"] == "ours_compiled")


def options(ap) -> None:
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per launch (30 quick, 120 full)")
    ap.add_argument("--repeats", type=int, default=None, help="launches of each kind (1 quick, 3 full)")
    ap.add_argument("--launchers", nargs="+", choices=LAUNCHERS, default=list(LAUNCHERS),
                    help="which launchers run (ours and torchrun always; ours_auto needs ours_compiled): "
                         "a long run of only the ones it is about")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                    help="config overrides after the defaults: another model or strategy "
                         "(e.g. model.n_embd=192 parallel.strategy=zero3)")


def main(argv: list[str] | None = None) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--child", choices=("torchrun", "ray_train"))
    pre.add_argument("--spec")
    known, rest = pre.parse_known_args(argv)
    if known.child:
        return _child(known.child, known.spec)

    args = parse_args(__doc__, rest, options)
    launchers = [name for name in LAUNCHERS if name in {*args.launchers, "ours", "torchrun"}]
    if "ours_auto" in launchers and "ours_compiled" not in launchers:
        raise SystemExit("--launchers: ours_auto plans from an ours_compiled launch's measurement; add ours_compiled")
    steps = args.steps or (30 if args.quick else 120)
    repeats = args.repeats or (1 if args.quick else 3)
    t0 = time.perf_counter()
    plan, job_overrides = plan_for(overrides(steps, args.set))
    runs = []
    with tempfile.TemporaryDirectory(prefix="runtime_overhead-") as tmp:
        for rep in range(repeats):
            for launcher in launchers[rep % len(launchers):] + launchers[:rep % len(launchers)]:
                # Started before its launch and stopped after it: a second cluster alive during
                # the others' launches slows their own Ray start (by 4 s here).
                with warm_cluster() if launcher == "ours_warm" else contextlib.nullcontext() as address:
                    measured = _last_compiled_run(runs) if launcher == "ours_auto" else None
                    r = run_once(launcher, plan, job_overrides, Path(tmp), address, measured, busy_share(runs))
                r["repeat"] = rep
                runs.append(r)
                print(f"  {launcher:<10} first step after {r['first_step_s']:6.2f} s, "
                      f"{r['tokens_per_s']:,.0f} tokens/s", file=sys.stderr)
    result = {"job": str(JOB.relative_to(ROOT)), "overrides": job_overrides, "world": WORLD, "steps": steps,
              "plan": {k: plan[k] for k in ("strategy", "mesh", "micro_batch_size", "sync")},
              "runs": runs, **summarize(runs), "seconds": time.perf_counter() - t0,
              "notes": ["every launcher's first step ends when its rank 0 stamped it (time.time(), one clock)"]}
    med, rat = result["median"], result["ratios"]
    print_table(
        f"{plan['strategy']} on {WORLD} CPU workers, {steps} steps, median of {repeats} launch(es) each",
        ["launcher", "launch to first step s", "tokens/s (steady, wall)", "tokens/s (in-step)",
         "ours / this: tokens/s", "ours / this: first step"],
        [[name, med[name]["first_step_s"], med[name]["tokens_per_s"], med[name].get("in_step_tokens_per_s"),
          med["ours"]["tokens_per_s"] / med[name]["tokens_per_s"],
          med["ours"]["first_step_s"] / med[name]["first_step_s"]]
         for name in LAUNCHERS if name in med],
        caption=f"goals: throughput >= {GOAL_THROUGHPUT_VS_TORCHRUN}x torchrun's "
                f"({rat['throughput_ours_over_torchrun']:.3f}x) and >= {GOAL_THROUGHPUT_VS_RAY_TRAIN}x Ray Train's "
                f"({rat.get('throughput_ours_over_ray_train', float('nan')):.3f}x); first step no later than Ray "
                f"Train's ({rat.get('first_step_ours_over_ray_train', float('nan')):.2f}x) and <= "
                f"{GOAL_FIRST_STEP_VS_TORCHRUN}x torchrun's "
                f"({rat['first_step_ours_over_torchrun']:.2f}x; on a running cluster "
                f"{rat.get('first_step_warm_over_torchrun', float('nan')):.2f}x)",
    )
    for name in ("ours", "ours_warm"):
        if med.get(name, {}).get("startup"):
            print(f"{name}, from the driver's start (Ray up) to the first step: "
                  + ", ".join(f"{k.removesuffix('_s').replace('_', ' ')} {v:.2f} s"
                              for k, v in med[name]["startup"].items()))
    if "ours_compiled" in med:
        c = med["ours_compiled"]
        print(f"compiled: {rat['throughput_compiled_over_eager']:.3f}x eager's tokens/s, "
              f"{rat['throughput_compiled_over_torchrun']:.3f}x torchrun's; compile took {c.get('compile_s', 0):.1f} s"
              + (f", made up after {rat['compile_break_even_steps']:.0f} steps" if "compile_break_even_steps" in rat
                 else ", never made up"))
    if "wall_auto_over_eager" in rat:
        last = next(r for r in reversed(runs) if r["launcher"] == "ours_auto")
        print(f"auto, priced by the compiled launch's measurement: compiled in {rat['auto_compiled_launches']} of "
              f"{med['ours_auto']['repeats']} launches; from Ray up to the last step "
              f"{rat['wall_auto_over_eager']:.3f}x eager's. Its plan said: {last['compile']['reason']}")
    if "throughput_ours_over_torchrun_busy" in rat:
        busy = [r["busy_cores"] for r in runs if r["launcher"] == "torchrun_busy"]
        print(f"torchrun beside a load of {statistics.median(busy):.1%} of one core (what ours' other processes "
              f"took beyond torchrun's): {rat['throughput_torchrun_busy_over_torchrun']:.3f}x torchrun's tokens/s; "
              f"ours {rat['throughput_ours_over_torchrun_busy']:.3f}x it")
    print("CPU other processes took during the steady steps (share of the machine's cores): "
          + ", ".join(f"{name} {med[name]['others_cpu_share']:.1%}" for name in LAUNCHERS
                      if "others_cpu_share" in med.get(name, {})))
    print(f"ours' own loop work per step: {med['ours'].get('loop_overhead_s_per_step', 0) * 1e3:.3f} ms")
    out = write_result("runtime_overhead", result, args)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    run(main)
