"""What compiling a block costs and buys: the figures `planning/compile.py` prices with.

    python benchmarks/compile_gain.py [--quick] [--job JOB] [--steps N]

Three measurements of the job's model, one thread per process (as a worker on this machine
runs):

* blocks alone, in one process: the repeated blocks' forward and backward on one micro-batch
  of hidden states, eager and compiled the way the runtime compiles them
  (`runtime/compile.compile_blocks`, per block, fullgraph), timed alternately;
* the runtime's whole step: the `Trainer` under the plan `submit` makes on 2 CPU workers (DDP
  over gloo), on 2 spawned ranks, an eager and a compiled Trainer side by side, stepped
  alternately in rounds so drift hits both (`COMPILE_SPEEDUP['cpu']` is this ratio: what a run
  gets, the head and the collectives included, so it understates the blocks' own gain);
* the compile itself, each time in a fresh process: against an empty inductor cache (cold,
  what a first run pays: `COMPILE_S['cpu']`) and against the cache the cold run filled (warm,
  what a restart or resume on the same node pays).

Writes benchmarks/results/compile.json.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import ROOT, child_env, parse_args, print_table, python, run, write_result

WORLD = 2


def _blocks(job: str):
    """The job's model on this host, its block list, and a micro-batch of hidden states."""
    import torch

    from orchestrator.config import load_config
    from orchestrator.planning import plan_job
    from orchestrator.topology.model import ClusterTopology, cpu_node
    from orchestrator.workloads.models import block_list, build_model

    cfg = load_config(job, ["cluster.num_workers=2"])
    micro = plan_job(cfg, ClusterTopology(nodes=[cpu_node(2)])).micro_batch_size
    torch.manual_seed(0)
    model = build_model(cfg.model, None)
    blocks = block_list(model)
    x = torch.randn(micro, cfg.model.block_size, cfg.model.n_embd)
    return model, blocks, x, micro


def _step(blocks, x) -> None:
    h = x.requires_grad_(True)
    for b in blocks:
        h = b(h)
    h.float().pow(2).mean().backward()


def child_compile(job: str) -> dict[str, float]:
    """In a fresh process: seconds the first compiled step takes over an eager one."""
    import torch

    from orchestrator.runtime.compile import compile_blocks

    torch.set_num_threads(1)
    _, blocks, x, _ = _blocks(job)
    for _ in range(2):
        _step(blocks, x.clone())
    t = time.perf_counter()
    _step(blocks, x.clone())
    eager = time.perf_counter() - t
    compile_blocks(blocks)
    t = time.perf_counter()
    _step(blocks, x.clone())
    return {"compile_s": time.perf_counter() - t - eager}


def _compile_in_fresh_process(job: str, cache: str) -> float:
    env = {**child_env(), "TORCHINDUCTOR_CACHE_DIR": cache}
    out = subprocess.run([python(), __file__, "--child-compile", job], cwd=ROOT, env=env, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["compile_s"]


def measure_speed(job: str, steps: int) -> dict[str, Any]:
    """Eager and compiled block time, alternating, on the same inputs."""
    import copy

    import torch

    from orchestrator.runtime.compile import compile_blocks

    torch.set_num_threads(1)
    _, blocks, x, micro = _blocks(job)
    eager = copy.deepcopy(blocks)
    compiled = blocks
    compile_blocks(compiled)
    for _ in range(2):  # warm-up: allocation, and the compile
        _step(eager, x.clone())
        _step(compiled, x.clone())
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for _ in range(steps):
        for name, mods in (("eager", eager), ("compiled", compiled)):
            t = time.perf_counter()
            _step(mods, x.clone())
            times[name].append(time.perf_counter() - t)
    e, c = statistics.median(times["eager"]), statistics.median(times["compiled"])
    return {"micro_batch": micro, "blocks": len(blocks), "eager_s": e, "compiled_s": c, "speedup": e / c,
            "steps": steps}


def _rank(rank: int, job: str, init: str, steps: int, rounds: int, out: str) -> None:
    """One of 2 gloo ranks: an eager and a compiled Trainer of the job's plan, stepped in turn."""
    from dataclasses import replace

    import torch
    import torch.distributed as dist

    from orchestrator.config import load_config
    from orchestrator.planning import plan_job
    from orchestrator.planning.compile import CompilePlan
    from orchestrator.runtime.trainer import Trainer
    from orchestrator.topology.model import ClusterTopology, cpu_node

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=WORLD)
    try:
        cfg = load_config(job, [f"cluster.num_workers={WORLD}"])
        plan = plan_job(cfg, ClusterTopology(nodes=[cpu_node(WORLD)]))
        trainers = {mode: Trainer(cfg, replace(plan, compile=CompilePlan(mode == "compiled", "true", 0.0, 0.0,
                                                                           steps, "measured")), torch.device("cpu"))
                    for mode in ("eager", "compiled")}
        for tr in trainers.values():  # warm-up: allocation, and the compile
            for s in range(2):
                tr.train_step(s)
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        for _ in range(rounds):
            for mode, tr in trainers.items():
                times[mode] += [tr.train_step(s).step_s for s in range(steps)]
        if rank == 0:
            Path(out).write_text(json.dumps({"strategy": str(plan.strategy), "times": times}))
    finally:
        dist.destroy_process_group()


def measure_step(job: str, steps: int, rounds: int) -> dict[str, Any]:
    """The runtime's whole step on 2 ranks, eager against compiled (medians)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="compile_gain-step-") as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(_rank, args=(job, os.path.join(tmp, "init"), steps, rounds, out), nprocs=WORLD, join=True)
        got = json.loads(Path(out).read_text())
    e, c = statistics.median(got["times"]["eager"]), statistics.median(got["times"]["compiled"])
    return {"world": WORLD, "strategy": got["strategy"], "steps_each": steps * rounds, "eager_step_s": e,
            "compiled_step_s": c, "speedup": e / c}


def options(ap) -> None:
    ap.add_argument("--job", default="jobs/llm.yaml", help="the job whose model is measured (default jobs/llm.yaml)")
    ap.add_argument("--steps", type=int, default=None,
                    help="timed steps of each mode (10 quick, 30 full; the whole step: that many per round, 4 rounds)")


def main(argv: list[str] | None = None) -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--child-compile":
        print(json.dumps(child_compile(sys.argv[2])))
        return 0
    args = parse_args(__doc__, argv, options)
    steps = args.steps or (10 if args.quick else 30)
    job = str(ROOT / args.job)  # relative to the repository, wherever this runs from
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="compile_gain-") as cache:
        cold = _compile_in_fresh_process(job, cache)
        warm = _compile_in_fresh_process(job, cache)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # the speed runs reuse the compiled graphs
        blocks = measure_speed(job, steps)
        step = measure_step(job, steps, 4)
    result = {"job": args.job, **blocks, "step": step, "cold_compile_s": cold, "warm_compile_s": warm,
              "seconds": time.perf_counter() - t0}
    print_table(f"per-block compile of {result['job']}'s {blocks['blocks']} blocks, one thread per process",
                ["measured", "eager ms", "compiled ms", "speedup"],
                [[f"blocks alone, micro-batch {blocks['micro_batch']}", blocks["eager_s"] * 1e3,
                  blocks["compiled_s"] * 1e3, blocks["speedup"]],
                 [f"whole step, {step['strategy']} on {WORLD} ranks", step["eager_step_s"] * 1e3,
                  step["compiled_step_s"] * 1e3, step["speedup"]]],
                caption=f"compile: {cold:.1f} s cold, {warm:.1f} s warm (same node's cache)")
    out = write_result("compile", result, args)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    run(main)
