"""Compiled-vs-eager harness: each rank trains a plan's Trainer eager, then compiled, from the
same weights, and rank 0 writes both runs' losses (3 steps and a validation pass) and how many
graphs dynamo compiled. Kept out of the test module so spawned ranks import it without pytest."""

from __future__ import annotations

import datetime
import gc
import json
import os
from dataclasses import replace

import _reshard_worker as rw
import torch
import torch.distributed as dist

CASES = [
    rw.PlanCase("ddp", 2, rw._forced("ddp", micro=2)),
    # FSDP2 around checkpointed blocks: hooks outside the graph, the recomputation inside it.
    rw.PlanCase("zero3_full_recompute", 2, (*rw._forced("zero3", micro=1), "parallel.recompute=full")),
    rw.PlanCase("tp2", 2, rw._forced("ddp", tp=2, micro=2)),
    rw.PlanCase("pp2", 2, rw._forced("ddp", pp=2, schedule="1f1b", micro=2)),
]


def _losses(cfg, plan) -> list[float]:
    from orchestrator.runtime.trainer import Trainer

    tr = Trainer(cfg, plan, torch.device("cpu"))
    out = [tr.train_step(s).loss for s in range(rw.STEPS)] + [tr.evaluate()]
    del tr
    gc.collect()
    return out


def _calibrated(cfg, plan) -> dict[str, float] | None:
    """What a worker's start measures of compiled blocks (`StepTimer.compile_times`)."""
    from orchestrator.runtime.step_timer import StepTimer
    from orchestrator.runtime.trainer import Trainer

    tr = Trainer(cfg, plan, torch.device("cpu"))
    tr.start()
    timer = StepTimer(tr)
    timer.calibrate()
    times = timer.compile_times
    del tr, timer
    gc.collect()
    return times


def _stepped(cfg, plan) -> dict:
    """A compiled run of COMPILE_GAIN_STEPS' length, stepped as the loop steps it: the steps it
    timed each way, and at which steps its blocks were put eager (`torch.compiler.set_stance`
    watched)."""
    from orchestrator.runtime.step_timer import COMPILE_GAIN_STEPS, StepTimer
    from orchestrator.runtime.trainer import Trainer

    tr = Trainer(cfg, plan, torch.device("cpu"))
    timer = StepTimer(tr)
    stances, step_now = [], [None]
    real = torch.compiler.set_stance

    def watched(stance="default", **kw):
        stances.append((step_now[0], stance))
        return real(stance, **kw)

    torch.compiler.set_stance = watched
    try:
        for s in range(COMPILE_GAIN_STEPS.stop):
            step_now[0] = s
            with timer.gain_stance(s):
                timer.record(tr.train_step(s))
    finally:
        torch.compiler.set_stance = real
    out = {"compile_steps": timer.compile_steps, "eager_at": [s for s, st in stances if st == "force_eager"]}
    del tr, timer
    gc.collect()
    return out


def run_rank(rank: int, world: int, init_file: str, out_dir: str, again: bool) -> None:
    from torch._dynamo.utils import counters

    from orchestrator.config import load_config
    from orchestrator.planning import plan_job
    from orchestrator.planning.compile import CompilePlan
    from orchestrator.runtime.compile import cache_counters
    from orchestrator.topology.model import ClusterTopology, cpu_node

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        for case in CASES[:1] if again else [c for c in CASES if c.world == world]:
            overrides = [o.replace("model.n_layer=4", "model.n_layer=2") for o in rw.overrides("tied", case)]
            cfg = load_config(None, overrides)
            plan = plan_job(cfg, ClusterTopology(nodes=[cpu_node(world)]))
            compiled = replace(plan, compile=CompilePlan(True, "true", 0.0, 0.0, rw.STEPS, "compiled for the test"))
            eager = None if again else _losses(cfg, plan)
            torch._dynamo.reset()
            counters.clear()
            result = {"compiled": _losses(cfg, compiled), "eager": eager,
                      "graphs": int(counters["stats"]["unique_graphs"]), "cache": cache_counters()}
            if again:
                result["compile_times"] = _calibrated(cfg, compiled)
                result["eager_times"] = _calibrated(cfg, plan)
                result["priced_times"] = _calibrated(cfg, replace(compiled, compile=replace(compiled.compile,
                                                                                            measured=True)))
                longer = load_config(None, [*overrides, "train.max_steps=10"])
                result["stepped"] = _stepped(longer, replace(compiled, compile=replace(compiled.compile, steps=10)))
                result["stepped_priced"] = _stepped(longer, replace(compiled, compile=replace(
                    compiled.compile, steps=10, measured=True)))
            if rank == 0:
                name = case.name + ("-again" if again else "")
                with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
                    json.dump(result, f)
    finally:
        dist.barrier()
        dist.destroy_process_group()
