"""Pipeline parity harness: a tiny GPT, and a tiny Hugging Face Llama with tied embeddings,
trained by one process and by gloo ranks with pp > 1.

Kept out of the test module so spawned ranks import it without importing pytest. The ranks
run `build_pipeline`, the trainer's own path: stages split at block boundaries, parallelized
per chunk, torch's schedule over the pp axis, gradients clipped over all stages. Every case
starts from the same seed and global batches; each data-parallel rank takes its rows of every
micro-batch, as the training loop's data does.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _parity_worker import train_one_process

from orchestrator.planning.mesh import Mesh
from orchestrator.planning.model_math import ModelShape
from orchestrator.planning.pipeline import resolve_pipeline
from orchestrator.planning.resolve import Execution, resolve
from orchestrator.runtime.parallelize import build_mesh, data_parallel_rank
from orchestrator.runtime.pipeline import build_pipeline
from orchestrator.workloads.gpt import GPT, GPTConfig, param_groups

CFG = GPTConfig(n_layer=4, n_head=4, n_embd=32, vocab_size=64, block_size=16)
SHAPE = ModelShape(layers=4, hidden=32, heads=4, vocab=64, seq=16)
STEPS = 5
MICROBATCHES = 4
GLOBAL_MICRO_BATCH = 4
MAX_NORM = 0.5  # below the first steps' gradient norm, so clipping really scales the update
LR = 1e-2


def execution(strategy: str, mesh: Mesh, schedule: str, virtual: int = 1) -> Execution:
    pl = resolve_pipeline(SHAPE, mesh.pp, schedule, MICROBATCHES, virtual)
    return resolve(strategy, mesh, precision="fp32", device="cpu", pipeline=pl)


@dataclass(frozen=True)
class Case:
    name: str
    ex: Execution
    checkpoint: bool = False
    """Also save with DCP before the last step and resume a differently initialised replica."""
    model: str = "gpt"
    """`gpt`, or `hf`: a transformers Llama, whose blocks take the rotary tables and mask its
    own forward computes, with its embedding tied to its head across the first and last stage."""


CASES = {
    2: [Case("pp2", execution("ddp", Mesh(pp=2), "1f1b"), checkpoint=True),
        Case("pp2_interleaved", execution("ddp", Mesh(pp=2), "interleaved_1f1b", virtual=2)),
        Case("pp2_zero_bubble", execution("ddp", Mesh(pp=2), "zero_bubble", virtual=2)),
        Case("hf_pp2", execution("ddp", Mesh(pp=2), "1f1b"), checkpoint=True, model="hf")],
    4: [Case("pp2_dp2", execution("zero3", Mesh(pp=2, dp_shard=2), "1f1b"), checkpoint=True),
        Case("pp2_tp2", execution("ddp", Mesh(pp=2, tp=2), "gpipe")),
        Case("hf_pp2_dp2_interleaved", execution("zero3", Mesh(pp=2, dp_shard=2), "interleaved_1f1b", virtual=2),
             model="hf"),
        Case("hf_pp2_tp2", execution("ddp", Mesh(pp=2, tp=2), "gpipe"), model="hf")],
}


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups(model, weight_decay=0.1), lr=LR, betas=(0.9, 0.95))


def batches() -> torch.Tensor:
    """(STEPS, MICROBATCHES, 2, GLOBAL_MICRO_BATCH, block_size): learnable arithmetic sequences."""
    g = torch.Generator().manual_seed(1234)
    shape = (STEPS, MICROBATCHES, GLOBAL_MICRO_BATCH, 1)
    start = torch.randint(0, CFG.vocab_size, shape, generator=g)
    stride = torch.randint(1, 4, shape, generator=g)
    seq = (start + stride * torch.arange(CFG.block_size + 1)) % CFG.vocab_size
    return torch.stack([seq[..., :-1], seq[..., 1:]], dim=2)


def fresh_model(seed: int = 0, model: str = "gpt") -> torch.nn.Module:
    torch.manual_seed(seed)
    if model == "gpt":
        return GPT(CFG)
    import transformers

    from orchestrator.workloads.hf import build

    config = transformers.LlamaConfig(vocab_size=CFG.vocab_size, hidden_size=CFG.n_embd, intermediate_size=64,
                                      num_hidden_layers=CFG.n_layer, num_attention_heads=CFG.n_head,
                                      num_key_value_heads=2, max_position_embeddings=CFG.block_size,
                                      tie_word_embeddings=True)
    with tempfile.TemporaryDirectory() as d:
        config.to_json_file(os.path.join(d, "config.json"))
        torch.manual_seed(seed)
        return build(os.path.join(d, "config.json"))


class _WithLoss(torch.nn.Module):
    """A Hugging Face model as the one-process reference calls a model: (ids, targets) -> loss."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.model(x).logits
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))


def reference(model: str = "gpt") -> dict[str, list[float]]:
    """One process over the whole global batch, micro-batch by micro-batch."""
    net = fresh_model(model=model)
    net = net if model == "gpt" else _WithLoss(net)
    return train_one_process(net, make_optimizer(net), batches(), MICROBATCHES, MAX_NORM)


def _train_step(pipe, step: torch.Tensor, dp_rank: int, dp_world: int, loss_ranks: int) -> tuple[float, float]:
    share = GLOBAL_MICRO_BATCH // dp_world
    # This rank's rows of every micro-batch, in micro-batch order: the schedule splits them back.
    rows = step[:, :, dp_rank * share:(dp_rank + 1) * share]
    x, y = rows[:, 0].reshape(-1, CFG.block_size), rows[:, 1].reshape(-1, CFG.block_size)
    loss = pipe.step(x, y)
    norm = float(pipe.clip_grad_norm_(MAX_NORM))
    pipe.optimizer.step()
    pipe.optimizer.zero_grad(set_to_none=True)
    dist.all_reduce(loss)
    return float(loss) / loss_ranks, norm


def _run_case(case: Case, ckpt_root: str) -> dict:
    mesh = build_mesh(case.ex.mesh, "cpu")
    dp_rank, dp_world = data_parallel_rank(mesh)
    loss_ranks = dist.get_world_size() // case.ex.mesh.pp
    pipe = build_pipeline(fresh_model(model=case.model), case.ex, mesh, make_optimizer, torch.device("cpu"))
    data = batches()
    losses, norms = [], []
    for step in data[:-1]:
        loss, norm = _train_step(pipe, step, dp_rank, dp_world, loss_ranks)
        losses.append(loss)
        norms.append(norm)
    resumed = None
    if case.checkpoint:
        ckpt = os.path.join(ckpt_root, case.name)
        dcp.save(pipe.state_dict(), checkpoint_id=ckpt)
        resumed = build_pipeline(fresh_model(seed=99, model=case.model), case.ex, mesh, make_optimizer,
                                 torch.device("cpu"))
        sd = resumed.state_dict()
        dcp.load(sd, checkpoint_id=ckpt)
        resumed.load_state_dict(sd)
    loss, norm = _train_step(pipe, data[-1], dp_rank, dp_world, loss_ranks)
    losses.append(loss)
    norms.append(norm)
    resumed_loss = _train_step(resumed, data[-1], dp_rank, dp_world, loss_ranks)[0] if resumed else None
    keys = sorted(pipe.state_dict()["model"])
    all_keys: list = [None] * dist.get_world_size()
    dist.all_gather_object(all_keys, keys)
    return {"losses": losses, "norms": norms, "resumed_loss": resumed_loss, "keys": all_keys,
            "notes": pipe.notes}


def run_rank(rank: int, world: int, init_file: str, out_file: str) -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results = {}
        with tempfile.TemporaryDirectory() as scratch:
            root = [scratch]
            dist.broadcast_object_list(root)  # one directory shared by all ranks
            for case in CASES[world]:
                results[case.name] = _run_case(case, root[0])
                dist.barrier()
        if rank == 0:
            with open(out_file, "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()
