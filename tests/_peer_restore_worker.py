"""Restore from survivors' memory, rank by rank, under the real runtime (no Ray).

Four gloo ranks train under a plan with replicated states, every rank keeps a host copy of its
state as a survivor does (`Trainer.hold`), the process group is torn down and formed again
under a new rendezvous, one rank comes back empty as a replaced rank would, and every rank
restores from its replica group's source (`Trainer.start` with a `PeerRestore`). The losses
after it must be those of a run that never stopped. Kept out of the test module so spawned ranks
import it without importing pytest.
"""

from __future__ import annotations

import datetime
import gc
import json

import torch
import torch.distributed as dist
from _reshard_worker import MODELS, PlanCase, _forced, overrides

from orchestrator.config import load_config
from orchestrator.planning import Plan
from orchestrator.runtime.peer_state import PeerRestore, hold
from orchestrator.runtime.step_timer import StepTimer
from orchestrator.runtime.trainer import Trainer

HELD_AT = 2
STEPS = 4
WORLD = 4
CASES = [
    PlanCase("hsdp", WORLD, _forced("hsdp", dp_shard=2, micro=2)),  # local shards of DTensors
    PlanCase("tp2_dp2", WORLD, _forced("ddp", tp=2, micro=2)),  # DDP over tensor-parallel DTensors
    PlanCase("pp2_dp2", WORLD, _forced("ddp", pp=2, schedule="1f1b", micro=1)),  # stages' chunks
]
"""Plans that replicate their states, in the resharding matrix's settings (`overrides`)."""


def _trainer(case: PlanCase, plan: dict, resuming: bool = False) -> Trainer:
    return Trainer(load_config(None, overrides("tied", case)), Plan.from_dict(plan), torch.device("cpu"),
                   resuming=resuming)


def _group(init: str, rank: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))


def run_rank(rank: int, init_prefix: str, spec_file: str, out_file: str) -> None:
    """Spec: {"plans": {case: plan}, "replaced": rank, "source": {case: {rank: source}}}. Rank 0 writes
    {case: {"reference": [losses], "restored": [losses], "digests": [per rank], "step": int}}."""
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    spec = json.loads(open(spec_file).read())
    out: dict = {}
    for n, case in enumerate(CASES):
        plan = spec["plans"][case.name]
        _group(f"{init_prefix}-{n}-a", rank)
        tr = _trainer(case, plan)
        tr.start()
        StepTimer(tr).calibrate()
        reference = [tr.train_step(s).loss for s in range(STEPS)]
        del tr
        gc.collect()
        tr = _trainer(case, plan)
        tr.start()
        StepTimer(tr).calibrate()
        for s in range(HELD_AT):
            tr.train_step(s)
        held = hold(tr.held_tensors(), tr.applied)
        digests = [None] * WORLD
        dist.all_gather_object(digests, held.digest)
        del tr
        gc.collect()
        dist.destroy_process_group()
        # The group re-forms; the replaced rank holds nothing.
        _group(f"{init_prefix}-{n}-b", rank)
        if rank == spec["replaced"]:
            held = None
        tr = _trainer(case, plan, resuming=True)
        source = {int(k): v for k, v in spec["source"][case.name].items()}
        step = tr.start(PeerRestore(step=HELD_AT, source=source), held)
        StepTimer(tr).calibrate()
        restored = [tr.train_step(s).loss for s in range(step, STEPS)]
        out[case.name] = {"reference": reference, "restored": restored, "digests": digests, "step": step}
        del tr, held
        gc.collect()
        dist.destroy_process_group()
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(out, f)


def plans() -> dict[str, dict]:
    from orchestrator.control.preflight import measure_model
    from orchestrator.planning import plan_job
    from orchestrator.topology.model import ClusterTopology, cpu_node

    spec = measure_model(load_config(None, MODELS["tied"]))
    topo = ClusterTopology(nodes=[cpu_node(WORLD)])
    return {c.name: plan_job(load_config(None, overrides("tied", c)), topo, spec).to_dict() for c in CASES}
