"""A launch without Ray: torchrun starts one process per device of one node, and each runs the
same step loop a worker actor runs.

    torchrun --nproc-per-node N -m orchestrator.runtime.launch JOB.yaml [key=value ...]

Rank 0 probes this node and plans the job for its N devices (N GPUs, or N CPU slots with gloo
where there are none), every rank builds the plan's model, and rank 0 prints what a worker
would send the driver, one JSON line each: the untrained model's validation loss, every step's
metrics row (metrics.jsonl's keys), each committed checkpoint; then the run's last validation
loss. Checkpoints are written under `checkpoint.path` where one is given. What only the driver
does is not done: no recovery (a failed rank ends the launch, as torchrun does), no placement
beyond the plan's own layout (each rank takes the GPU the plan gives it; no CPU pinning, no
NCCL settings per NIC), no run directory, no resume, one node only.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from typing import Any

from ..config import JobConfig, load_config
from ..errors import UserError
from ..planning import Plan, plan_job
from .messages import Committed, Evaluated, Message, RankTimes, Stepped


class PrintedSink:
    """The step loop's messages as JSON lines on stdout (rank 0's; other ranks print nothing).
    A rank's own timings, which feed the driver's straggler report, are not printed."""

    def __init__(self, prints: bool) -> None:
        self._prints = prints

    def add(self, item: Message, urgent: bool = False) -> None:
        if not self._prints or isinstance(item, RankTimes):
            return
        if isinstance(item, Stepped):
            line: dict[str, Any] = item.row
        elif isinstance(item, Evaluated):
            line = {"step": item.step, "val_loss": item.val_loss}
        elif isinstance(item, Committed):
            line = {"committed_step": item.step, "path": item.path}
        else:
            return
        print(json.dumps(line), flush=urgent)

    def flush(self) -> None:
        sys.stdout.flush()

    def end(self) -> None:
        sys.stdout.flush()


def plan_here(cfg: JobConfig, world: int) -> Plan:
    """The plan for this node's `world` devices, as the driver would make it for one node: the
    model measured where it is not the built-in GPT, its block traced once the plan compiles."""
    from ..topology.local import probe_local
    from ..topology.model import ClusterTopology
    from ..workloads.source import is_builtin_gpt

    node = probe_local(world)
    if len(node.devices) != world:
        raise UserError(f"torchrun started {world} processes but this node has {len(node.devices)} GPUs: a launch "
                        f"without Ray runs one process per GPU (--nproc-per-node {len(node.devices)})")
    topology = ClusterTopology(nodes=[node])
    spec = None
    if not is_builtin_gpt(cfg.model):
        from ..workloads.inspect import model_spec

        spec = model_spec(cfg.model)
    plan = plan_job(cfg, topology, spec)
    if plan.compile.enabled and spec is not None and not spec.compile_checked:
        from ..workloads.compile_check import graph_break

        plan = plan_job(cfg, topology, replace(spec, graph_break=graph_break(cfg.model), compile_checked=True))
    if not plan.fits:
        raise UserError(f"the plan does not fit: {plan.reason}")
    return plan


PLAN_KEY = "orchestrator/plan"
"""Where rank 0 leaves the plan (or its one-line refusal) in torchrun's store."""


def agreed_plan(cfg: JobConfig, rank: int, world: int, store: Any) -> Plan:
    """Rank 0's plan, on every rank, through torchrun's store before any process group forms (so
    the group can start bound to the GPU the plan gives each rank); rank 0's refusal (a
    UserError's one line) raised on every rank."""
    if rank == 0:
        try:
            made = json.dumps(plan_here(cfg, world).to_dict())
        except UserError as e:
            made = json.dumps(f"error: {e}")
        store.set(PLAN_KEY, made)
    agreed = json.loads(store.get(PLAN_KEY))  # waits for rank 0, up to the store's timeout
    if isinstance(agreed, str):
        raise UserError(agreed.removeprefix("error: "))
    return Plan.from_dict(agreed)


def rank_device(plan: Plan, rank: int) -> Any:
    """The device rank `rank` trains on: the GPU the plan lays it on (its layout keeps tp groups on
    the fastest links), numbered as NVML and the plan number them (`main` sets PCI bus order);
    a CPU slot where the plan is for CPUs."""
    import torch

    if plan.execution.device != "gpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError(f"rank {rank}: the plan is for GPUs but this process has no CUDA device (a CPU build of "
                        "torch, or no driver)")
    return torch.device("cuda", plan.ranks[rank].gpu)


def run(cfg: JobConfig, plan: Plan, device: Any) -> dict[str, Any]:
    """Build and train `cfg` under `plan` on this torchrun world (its process group formed on
    `device`); rank 0's answer: the last validation loss and the loop's own work per step."""
    import torch.distributed as dist

    from .checkpoint import writer_group
    from .checkpointer import Checkpointer
    from .loop import run_steps
    from .step_timer import StepTimer
    from .trainer import Trainer
    from .validator import Validator

    rank = dist.get_rank()
    checkpoints = cfg.checkpoint.path if cfg.checkpoint.enabled else None
    writers = writer_group() if checkpoints and cfg.checkpoint.async_save else None
    trainer = Trainer(cfg, plan, device)
    start = trainer.start()
    timer = StepTimer(trainer)
    timer.calibrate()
    sink = PrintedSink(prints=rank == 0)
    t = cfg.train
    checkpointer = (Checkpointer(trainer, checkpoints, cfg.checkpoint, t.max_steps, sink, announces=rank == 0,
                                 writer_group=writers) if checkpoints else None)
    validator = Validator(trainer.evaluate, t.eval_interval, t.max_steps)
    end = run_steps(trainer, range(start, t.max_steps), timer, validator, sink, checkpointer=checkpointer)
    return {"last_val_loss": end.last_val_loss, "overhead_s_per_step": end.overhead_s_per_step,
            "strategy": str(plan.strategy), "mesh": plan.mesh.to_dict(),
            **({"compile_gain_steps": timer.gain_steps_trained} if all(timer.compile_steps.values()) else {})}


def main(argv: list[str] | None = None) -> int:
    import torch
    import torch.distributed as dist

    from .rendezvous import group_options

    args = sys.argv[1:] if argv is None else argv
    if not args or args[0].startswith("-") or "=" in args[0]:
        print("usage: torchrun --nproc-per-node N -m orchestrator.runtime.launch JOB.yaml [key=value ...]",
              file=sys.stderr)
        return 2
    if "RANK" not in os.environ:
        print("error: start this under torchrun (it sets RANK, WORLD_SIZE and the rendezvous): "
              "torchrun --nproc-per-node N -m orchestrator.runtime.launch JOB.yaml", file=sys.stderr)
        return 2
    rank = int(os.environ["RANK"])
    try:
        cfg = load_config(args[0], args[1:])
    except UserError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    # CUDA's device numbers as NVML's (PCI bus order), which the plan's ranks name: before
    # anything initialises CUDA in this process.
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    # The store torchrun's environment names, as init_process_group would make it; the plan
    # travels through it first, so the group starts on the plan's device.
    store, rank, world = next(dist.rendezvous("env://"))
    try:
        plan = agreed_plan(cfg, rank, world, store)
        device = rank_device(plan, rank)
    except UserError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, **group_options(backend, device))
    try:
        answer = run(cfg, plan, device)
    except UserError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        dist.destroy_process_group()
    if rank == 0:
        print(json.dumps({"end": answer}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
