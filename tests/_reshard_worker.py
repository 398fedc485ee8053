"""Resharding matrix harness: train under plan A, checkpoint mid-run, resume under plan B.

Kept out of the test module so spawned ranks import it without importing pytest. Every run is
the real runtime's: the plan comes from `plan_job` with the strategy and mesh forced, the
`Trainer` builds and parallelizes the model and steps it, `checkpoint.save` commits the
checkpoint as a worker does, and `Trainer.load_checkpoint` resumes it. A run under A records
the loss of every step; a resume under B records the losses of the steps after the checkpoint,
which must be A's own.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from orchestrator.config import load_config
from orchestrator.control.preflight import measure_model
from orchestrator.planning import plan_job
from orchestrator.runtime import checkpoint
from orchestrator.runtime.step_timer import StepTimer
from orchestrator.runtime.trainer import Trainer
from orchestrator.topology.model import ClusterTopology, cpu_node

CHECKPOINT_AT = 2
STEPS = 3
"""Steps of every run: the checkpoint after CHECKPOINT_AT steps, then one more step and a
validation pass. The step's loss checks the weights a resume loaded; the validation loss after
it checks the update, which the loaded optimizer moments and step count decide."""

COMMON = ["train.global_batch_size=8", f"train.max_steps={STEPS}", "train.warmup_steps=1", "train.lr=1e-2",
          "train.grad_clip=0.5", "train.eval_iters=1", "train.precision=fp32", "parallel.recompute=none",
          "parallel.compression=none", "parallel.sync=flat", "checkpoint.async_save=false"]

MODELS = {
    # The built-in GPT: embedding and head tied.
    "tied": ["model.n_layer=4", "model.n_head=4", "model.n_embd=32", "model.block_size=16"],
    # The built-in Llama: untied head, grouped-query attention, rotary positions.
    "untied": ["model.factory=orchestrator.workloads.llama:build", "model.args.dim=32", "model.args.n_layers=4",
               "model.args.n_heads=4", "model.args.n_kv_heads=2", "model.args.ffn_dim=64",
               "model.args.vocab_size=256", "model.block_size=16"],
}


@dataclass(frozen=True)
class PlanCase:
    name: str
    world: int
    overrides: tuple[str, ...]


def _forced(strategy: str, *, dp_shard: int | None = None, tp: int = 1, pp: int = 1, schedule: str = "auto",
            micro: int = 1) -> tuple[str, ...]:
    out = [f"parallel.strategy={strategy}", f"parallel.tp={tp}", f"parallel.pp={pp}",
           f"parallel.pp_schedule={schedule}", f"train.micro_batch_size={micro}"]
    if dp_shard is not None:
        out.append(f"parallel.dp_shard={dp_shard}")
    return tuple(out)


PLANS = [
    # Two ranks, where the plan needs no more.
    PlanCase("ddp", 2, _forced("ddp", micro=2)),
    PlanCase("zero1", 2, _forced("zero1", micro=2)),
    PlanCase("zero2", 2, _forced("zero2", micro=2)),
    PlanCase("zero3", 2, _forced("zero3", micro=1)),
    PlanCase("tp2", 2, _forced("ddp", tp=2, micro=2)),
    PlanCase("pp2", 2, _forced("ddp", pp=2, schedule="1f1b", micro=2)),
    PlanCase("pp2_interleaved", 2, _forced("ddp", pp=2, schedule="interleaved_1f1b", micro=2)),
    # Four: two data-parallel axes, and a pipeline of sharded stages; checkpoints cross world
    # sizes both ways.
    PlanCase("hsdp", 4, _forced("hsdp", dp_shard=2, micro=2)),
    PlanCase("pp2_dp2", 4, _forced("zero3", pp=2, schedule="1f1b", micro=1)),
]
WORLDS = sorted({c.world for c in PLANS})


def overrides(model: str, case: PlanCase) -> list[str]:
    return [*MODELS[model], *COMMON, *case.overrides, f"cluster.num_workers={case.world}"]


def plans(world: int) -> dict[str, dict]:
    """{model: {plan name: plan.json}} for every plan case of `world` ranks."""
    topo = ClusterTopology(nodes=[cpu_node(world)])
    out: dict[str, dict] = {}
    for model in MODELS:
        spec = measure_model(load_config(None, MODELS[model]))  # the model alone decides it
        for case in PLANS:
            if case.world == world:
                cfg = load_config(None, overrides(model, case))
                out.setdefault(model, {})[case.name] = plan_job(cfg, topo, spec).to_dict()
    return out


def _trainer(model: str, case: PlanCase, plan: dict) -> Trainer:
    from orchestrator.planning import Plan

    return Trainer(load_config(None, overrides(model, case)), Plan.from_dict(plan), torch.device("cpu"))


def _train(tr: Trainer, start: int, ckpt_root: str | None) -> tuple[dict[str, float], str | None]:
    """Train from `start` to STEPS (committing the checkpoint on the way when `ckpt_root` is
    given), then validate: {"loss N": ..., "val": ...} and the checkpoint's path."""
    losses, path = {}, None
    for step in range(start, STEPS):
        losses[f"loss {step}"] = tr.train_step(step).loss
        if ckpt_root is not None and step + 1 == CHECKPOINT_AT:
            path = checkpoint.save(ckpt_root, CHECKPOINT_AT, tr.state_dict(), tr.checkpoint_meta(), keep_last=1)
    losses["val"] = tr.evaluate()
    return losses, path


def _root(root: str, model: str, name: str) -> str:
    return os.path.join(root, f"{model}-{name}")


def checkpoint_path(root: str, model: str, name: str) -> str:
    """Where the run of `model` under plan `name` commits its checkpoint."""
    return os.path.join(_root(root, model, name), f"step_{CHECKPOINT_AT:08d}")


def run_rank(rank: int, world: int, init_file: str, spec_file: str, out_file: str) -> None:
    """Spec: {"plans": {model: {name: plan}}, "train": [[model, name, ckpt_root, calibrate]],
    "resume": [[model, name, [checkpoint, ...]]]}. Trains each "train" run from scratch, then
    builds each "resume" plan once and loads every listed checkpoint into it in turn (a load
    replaces the whole state, as it does for a run that keeps its actors). Rank 0 writes
    {"train": {model/name: {"losses", "checkpoint"}}, "resume": {model/name<checkpoint: losses},
    "errors": {...}, "seconds": {...}}."""
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    spec = json.loads(open(spec_file).read())
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    cases = {c.name: c for c in PLANS}
    out: dict = {"train": {}, "resume": {}, "errors": {}, "seconds": {}}
    try:
        for model, name, root, calibrate in spec["train"]:
            t0 = time.perf_counter()
            tr = _trainer(model, cases[name], spec["plans"][model][name])
            if calibrate:  # what a worker does before its first step
                tr.start()
                StepTimer(tr).calibrate()
            key = f"{model}/{name}" + ("" if calibrate else "/uncalibrated")
            losses, path = _train(tr, 0, _root(root, model, name) if calibrate else None)
            out["train"][key] = {"losses": losses, "checkpoint": path}
            out["seconds"][f"train {key}"] = time.perf_counter() - t0
            del tr
            gc.collect()
        for model, name, paths in spec["resume"]:
            t0 = time.perf_counter()
            tr = _trainer(model, cases[name], spec["plans"][model][name])
            tr.start()
            StepTimer(tr).calibrate()
            for path in paths:
                key = f"{model}/{name}<{path}"
                try:
                    start = tr.load_checkpoint(path)
                    out["resume"][key] = _train(tr, start, None)[0]
                except Exception as e:  # noqa: BLE001 - reported per pair; the matrix goes on
                    out["errors"][key] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
                    dist.barrier()
            out["seconds"][f"resume {model}/{name}"] = time.perf_counter() - t0
            del tr
            gc.collect()
        if rank == 0:
            with open(out_file, "w") as f:
                json.dump(out, f)
    finally:
        dist.destroy_process_group()
