"""Meta-build harness: every plan's ranks, between them, hold the one-process model's weights.

Kept out of the test module so spawned ranks import it without importing pytest. Each rank
builds the real `Trainer` under a plan (the model on the meta device, sharded, then each rank
materialising its own shards) and writes every parameter it holds made whole
(`full_tensor`), under its canonical name, together with the first step's loss.
"""

from __future__ import annotations

import datetime
import gc
import os

import _reshard_worker as rw
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from orchestrator.runtime.state_names import canonical

CASES = [c for c in rw.PLANS if c.name in ("ddp", "zero3", "tp2", "pp2", "hsdp", "pp2_dp2")] + [
    # Tensor parallelism under FSDP2 on two data-parallel shards: FSDP2 shards the tp shards
    # again (a strided placement).
    rw.PlanCase("tp2_dp2", 4, rw._forced("zero3", tp=2, micro=1)),
]


def run_rank(rank: int, world: int, init_file: str, plans: dict, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        for model, by_name in plans.items():
            for case in CASES:
                if case.world != world:
                    continue
                tr = rw._trainer(model, case, by_name[case.name])
                held = {}
                for name, value in canonical(tr.par.state_dict(), tr.aliases)["model"].items():
                    # full_tensor over a one-rank mesh is a view: copy before the step changes it.
                    held[name] = (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
                loss = tr.train_step(0).loss
                torch.save({"params": held, "loss": loss}, os.path.join(out_dir, f"{model}-{case.name}-{rank}.pt"))
                del tr
                gc.collect()
    finally:
        _leave()


def plans(world: int) -> dict[str, dict]:
    """{model: {case: plan.json}} for the cases of `world` ranks."""
    from orchestrator.config import load_config
    from orchestrator.control.preflight import measure_model
    from orchestrator.planning import plan_job
    from orchestrator.topology.model import ClusterTopology, cpu_node

    topo = ClusterTopology(nodes=[cpu_node(world)])
    out: dict[str, dict] = {}
    for model in rw.MODELS:
        spec = measure_model(load_config(None, rw.MODELS[model]))
        for case in CASES:
            if case.world == world:
                cfg = rw.load_config(None, rw.overrides(model, case))
                out.setdefault(model, {})[case.name] = plan_job(cfg, topo, spec).to_dict()
    return out


ACCUM_CASE = rw.PlanCase("zero3_accum", 2, rw._forced("zero3", micro=1))
"""zero3 on 2 ranks, micro-batch 1 of a global batch of 8: 4 micro-steps per optimizer step."""


def accum_overrides(mode: str) -> list[str]:
    return [*rw.overrides("untied", ACCUM_CASE), f"parallel.accum_sync={mode}"]


def accum_plans() -> dict[str, dict]:
    """{accum_sync mode: plan.json} of ACCUM_CASE."""
    from orchestrator.config import load_config
    from orchestrator.control.preflight import measure_model
    from orchestrator.planning import plan_job
    from orchestrator.topology.model import ClusterTopology, cpu_node

    topo = ClusterTopology(nodes=[cpu_node(2)])
    spec = measure_model(load_config(None, rw.MODELS["untied"]))
    return {mode: plan_job(load_config(None, accum_overrides(mode)), topo, spec).to_dict()
            for mode in ("per_micro_step", "last_micro_step")}


def _unsharded_grads_held(model: torch.nn.Module) -> bool:
    """Whether any FSDP2 unit holds an unsharded gradient it has not reduce-scattered yet."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            group = m._get_fsdp_state()._fsdp_param_group
            for p in group.fsdp_params if group else ():
                # fp32 keeps it on the unsharded parameter; another reduce dtype in its own buffer.
                unsharded = getattr(p, "_unsharded_param", None)
                if p.unsharded_accumulated_grad is not None or (unsharded is not None and unsharded.grad is not None):
                    return True
    return False


def run_accum(rank: int, world: int, init_file: str, plans: dict, out_dir: str) -> None:
    """Two steps under each accumulation mode: the losses, and whether unsharded gradients
    were held when each micro-step after the first began."""
    from orchestrator.config import load_config
    from orchestrator.planning import Plan
    from orchestrator.runtime.step_timer import StepTimer
    from orchestrator.runtime.trainer import Trainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        out = {}
        for mode, plan in plans.items():
            tr = Trainer(load_config(None, accum_overrides(mode)), Plan.from_dict(plan), torch.device("cpu"))
            tr.start()  # what a worker does first: calibration must not leave unsharded gradients
            timer = StepTimer(tr)
            timer.calibrate()
            after_start = _unsharded_grads_held(tr.par.model)
            held: list[bool] = []
            hook = tr.par.model.register_forward_pre_hook(lambda m, a, held=held: held.append(_unsharded_grads_held(m)))
            losses = [tr.train_step(s).loss for s in range(2)]
            hook.remove()
            out[mode] = {"losses": losses, "held": held, "accum": tr.accum, "after_start": after_start,
                         "calibrated": timer.compute_micro_s is not None,
                         "reduce_every": tr.execution.reduce_every_micro_step}
            del tr
            gc.collect()
        if rank == 0:
            torch.save(out, os.path.join(out_dir, "accum.pt"))
    finally:
        _leave()


def run_loaded(rank: int, world: int, init_file: str, overrides: list[str], plan: dict, out_dir: str) -> None:
    """A Trainer whose job names `model.hf_weights`: every parameter it holds, made whole."""
    from orchestrator.config import load_config
    from orchestrator.planning import Plan
    from orchestrator.runtime.trainer import Trainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        _save_loaded(rank, Trainer(load_config(None, overrides), Plan.from_dict(plan), torch.device("cpu")), out_dir)
    finally:
        _leave()


def _save_loaded(rank: int, tr, out_dir: str) -> None:
    held = {name: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for name, v in canonical(tr.par.state_dict(), tr.aliases)["model"].items()}
    torch.save(held, os.path.join(out_dir, f"loaded-{rank}.pt"))


def _leave() -> None:
    """Free the model (and with it the groups it holds) before the group is destroyed: a group
    still referenced at interpreter exit is torn down by C++ static destruction, which can
    abort the process ("terminate called without an active exception") after its work is done."""
    gc.collect()
    dist.barrier()  # nobody tears down while a peer still reads
    dist.destroy_process_group()
    gc.collect()
