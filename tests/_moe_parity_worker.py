"""MoE parity harness: MoE decoders trained by one process and by 4 gloo ranks, with and without
expert parallelism.

Kept out of the test module so spawned ranks import it without importing pytest. As in
tests/_parity_worker.py, every case starts from the same seed and the same global batches,
and a rank trains on its data-parallel slice; the experts' bias update runs before every
optimizer step in both, so routing stays the same only if the token counts are summed right.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from _parity_worker import cpu_execution, make_optimizer
from torch.distributed.tensor import DTensor

from orchestrator.planning.mesh import Mesh
from orchestrator.planning.resolve import Execution
from orchestrator.runtime.expert_parallel import install_load_balancing
from orchestrator.runtime.parallelize import build_mesh, data_parallel_rank, parallelize
from orchestrator.workloads import moe

WORLD = 4
STEPS = 5
GLOBAL_MICRO_BATCH = 8
SEQ = 16
MAX_NORM = 0.5
SHAPES: dict[str, dict] = {
    "tiny": {"preset": "tiny", "load_balance_coeff": 1e-2},
    # Another expert count and top-k, a shared expert, two dense blocks first, sigmoid scores
    # routed within 2 of 3 groups, the sequence-wise loss, and expert rows off grouped_mm's
    # 16-byte rule (width 30): the per-expert loop.
    "other": {"dim": 40, "n_layers": 4, "n_heads": 4, "n_kv_heads": 4, "num_experts": 12, "top_k": 3,
              "moe_dim": 30, "shared_experts": 1, "dense_layers": 2, "score_function": "sigmoid",
              "route_scale": 2.0, "router_groups": 3, "router_top_groups": 2, "aux_loss_coeff": 0.01,
              "load_balance_coeff": 1e-2},
    # One expert per rank of an ep=2 group and 2 expert-FSDP ranks: the experts shard by width.
    "two": {"preset": "tiny", "num_experts": 2, "top_k": 1, "dense_layers": 0},
    # A collapsed router: every token's choice is expert 0 (its bias far above the scores,
    # never balanced), so one rank of an ep group gets every row and its peer none.
    "collapsed": {"preset": "tiny", "top_k": 1, "load_balance_coeff": 0.0},
}
TOLERANCE = {"tiny": 1e-5, "other": 2e-4, "two": 1e-5, "collapsed": 1e-5}
"""Loss tolerance by shape. The per-expert loop's matmuls over a rank's few rows round
differently from one process's over all of them, a few ulps that grow to some 8e-5 by the
fifth step here (measured; as much at ep=1 as at ep=4). A mis-divided expert gradient (a
factor of ep) or a wrong permutation shows from the second step at 1e-3 and more."""


@dataclass(frozen=True)
class Case:
    name: str
    shape: str
    ex: Execution
    resume_from: list[str] = field(default_factory=list)
    """Earlier cases (same shape, other ep) whose checkpoints this one also resumes from."""


CASES = [
    Case("tiny_ep1", "tiny", cpu_execution("zero3", Mesh(dp_shard=4), max_steps=STEPS)),
    Case("tiny_ep2", "tiny", cpu_execution("zero3", Mesh(dp_shard=4, ep=2), max_steps=STEPS),
         resume_from=["tiny_ep1"]),
    Case("tiny_ep4", "tiny", cpu_execution("zero3", Mesh(dp_shard=4, ep=4), max_steps=STEPS),
         resume_from=["tiny_ep2"]),
    Case("tiny_hsdp_ep2", "tiny", cpu_execution("hsdp", Mesh(dp_replicate=2, dp_shard=2, ep=2), max_steps=STEPS),
         resume_from=["tiny_ep4"]),
    Case("tiny_back_ep1", "tiny", cpu_execution("zero2", Mesh(dp_shard=4), max_steps=STEPS),
         resume_from=["tiny_ep4"]),
    Case("other_ep1", "other", cpu_execution("zero3", Mesh(dp_shard=4), max_steps=STEPS)),
    Case("other_ep2", "other", cpu_execution("zero3", Mesh(dp_shard=4, ep=2), max_steps=STEPS),
         resume_from=["other_ep1"]),
    Case("other_ep4", "other", cpu_execution("zero3", Mesh(dp_shard=4, ep=4), max_steps=STEPS)),
    Case("two_ep2", "two", cpu_execution("zero3", Mesh(dp_shard=4, ep=2), max_steps=STEPS)),
    # ep borrowing the tensor-parallel ranks: each dispatches its half of the rows.
    Case("tiny_tp2_ep2", "tiny", cpu_execution("zero3", Mesh(dp_shard=2, tp=2, ep=2), max_steps=STEPS),
         resume_from=["tiny_ep4"]),
    Case("other_tp2_ep4", "other", cpu_execution("zero3", Mesh(dp_shard=2, tp=2, ep=4), max_steps=STEPS),
         resume_from=["other_ep2"]),
    Case("collapsed_ep2", "collapsed", cpu_execution("zero3", Mesh(dp_shard=4, ep=2), max_steps=STEPS)),
]


def fresh_model(shape: str, seed: int = 0) -> moe.MoETransformer:
    torch.manual_seed(seed)
    model = moe.build(**SHAPES[shape])
    if shape == "collapsed":
        for layer in moe.moe_layers(model):
            layer.expert_bias[0] = 10.0
    return model


def batches() -> torch.Tensor:
    """(STEPS, 2, GLOBAL_MICRO_BATCH, SEQ) arithmetic token sequences: inputs and targets."""
    g = torch.Generator().manual_seed(1234)
    shape = (STEPS, GLOBAL_MICRO_BATCH, 1)
    start = torch.randint(0, 256, shape, generator=g)
    stride = torch.randint(1, 4, shape, generator=g)
    seq = (start + stride * torch.arange(SEQ + 1)) % 256
    return torch.stack([seq[..., :-1], seq[..., 1:]], dim=1)


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))


def reference(shape: str) -> dict[str, list]:
    """One process on whole global batches: the trajectory every case of `shape` must match."""
    model = fresh_model(shape)
    opt = make_optimizer(model)
    install_load_balancing(model, opt, None)
    losses, norms = [], []
    for x, y in batches():
        loss = _loss(model, x, y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "norms": norms, "bias": _biases(model)}


def _biases(model: torch.nn.Module) -> list[list[float]]:
    return [m.expert_bias.tolist() for m in moe.moe_layers(model)]


def _train_step(par, x: torch.Tensor, y: torch.Tensor, dp_rank: int, dp_world: int) -> tuple[float, float]:
    share = GLOBAL_MICRO_BATCH // dp_world
    loss = _loss(par.model, x[dp_rank * share:(dp_rank + 1) * share], y[dp_rank * share:(dp_rank + 1) * share])
    loss.backward()
    norm = float(par.clip_grad_norm_(MAX_NORM))
    par.optimizer.step()
    par.zero_grad()
    local = loss.detach().clone()
    dist.all_reduce(local)
    return float(local) / dist.get_world_size(), norm


def _parallelize(case: Case, mesh, seed: int = 0):
    return parallelize(fresh_model(case.shape, seed), case.ex, mesh, make_optimizer, torch.device("cpu"))


def _restore(case: Case, mesh, ckpt: str):
    restored = _parallelize(case, mesh, seed=99)
    sd = restored.state_dict()
    dcp.load(sd, checkpoint_id=ckpt)
    restored.load_state_dict(sd)
    return restored


def _run_case(case: Case, ckpt_root: str) -> dict:
    mesh = build_mesh(case.ex.mesh, "cpu")
    dp_rank, dp_world = data_parallel_rank(mesh)
    par = _parallelize(case, mesh)
    experts = next(p for n, p in par.model.named_parameters() if n.endswith("experts.w1"))
    data = batches()
    losses, norms = [], []
    for x, y in data[:-1]:
        loss, norm = _train_step(par, x, y, dp_rank, dp_world)
        losses.append(loss)
        norms.append(norm)
    dcp.save(par.state_dict(), checkpoint_id=os.path.join(ckpt_root, case.name))
    others = [_restore(case, mesh, os.path.join(ckpt_root, name)) for name in case.resume_from]
    x, y = data[-1]
    loss, norm = _train_step(par, x, y, dp_rank, dp_world)
    losses.append(loss)
    norms.append(norm)
    resumed = {name: _train_step(other, x, y, dp_rank, dp_world)[0] for name, other in zip(case.resume_from, others)}
    load = [m.last_load.tolist() for m in moe.moe_layers(par.model) if m.last_load is not None]
    return {"losses": losses, "norms": norms, "bias": _biases(par.model), "resumed": resumed, "load": load,
            "experts_local_shape": list(experts.to_local().shape) if isinstance(experts, DTensor) else None,
            "experts_mesh": list(experts.device_mesh.mesh_dim_names or ()) if isinstance(experts, DTensor) else None,
            "experts_placements": [str(p) for p in experts.placements] if isinstance(experts, DTensor) else None}


def run_rank(rank: int, init_file: str, out_file: str, names: list[str]) -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        results = {}
        with tempfile.TemporaryDirectory() as scratch:
            ckpt_root = [scratch]
            dist.broadcast_object_list(ckpt_root)  # one directory shared by all ranks
            for case in CASES:
                if case.name in names:
                    results[case.name] = _run_case(case, ckpt_root[0])
                dist.barrier()
        if rank == 0:
            with open(out_file, "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()
