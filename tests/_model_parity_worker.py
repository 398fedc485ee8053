"""Parity of models the orchestrator did not write: a tiny Hugging Face Llama, the built-in
Llama family and a plain torch.nn model, each trained by one process and by 4 gloo ranks under
ddp, zero3, hsdp and tp=2 (with FSDP2), through the runtime's own `parallelize` and loss.

Kept out of the test module so spawned ranks import it without pytest. One process group
serves every (model, strategy) case.
"""

from __future__ import annotations

import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from orchestrator.planning.mesh import Mesh
from orchestrator.planning.resolve import resolve
from orchestrator.runtime.parallelize import build_mesh, data_parallel_rank, parallelize
from orchestrator.runtime.trainer import Trainer
from orchestrator.workloads.gpt import param_groups

WORLD = 4
STEPS = 4
BATCH = 8
SEQ = 16
VOCAB = 64
LR = 1e-2

MESHES = {
    "ddp": ("ddp", Mesh(dp_replicate=4)),
    "zero3": ("zero3", Mesh(dp_shard=4)),
    "hsdp": ("hsdp", Mesh(dp_replicate=2, dp_shard=2)),
    "tp2": ("zero3", Mesh(dp_shard=2, tp=2)),
}


class MLPBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class PlainLM(nn.Module):
    """A model written with torch.nn only: embedding, a stack of MLP blocks, a head; it declares
    its tensor-parallel plan the way any model can (`tp_plan`)."""

    tp_plan = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}

    def __init__(self, vocab: int = VOCAB, dim: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(MLPBlock(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def hf_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                      attn_implementation="eager")
    return LlamaForCausalLM(cfg)


def builtin_llama() -> nn.Module:
    from orchestrator.workloads.llama import build

    return build("tiny", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, ffn_dim=64)


MODELS = {"hf_llama": hf_llama, "llama": builtin_llama, "plain": PlainLM}


def fresh(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]()


def batches() -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    start = torch.randint(0, VOCAB, (STEPS, BATCH, 1), generator=g)
    stride = torch.randint(1, 4, (STEPS, BATCH, 1), generator=g)
    seq = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    return torch.stack([seq[..., :-1], seq[..., 1:]], dim=1)


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups(model, 0.1), lr=LR)


def reference(name: str) -> list[float]:
    model = fresh(name)
    opt = make_optimizer(model)
    losses = []
    for x, y in batches():
        loss = Trainer._loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _case(name: str, strategy: str, mesh: Mesh) -> dict:
    dmesh = build_mesh(mesh, "cpu")
    dp_rank, dp_world = data_parallel_rank(dmesh)
    ex = resolve(strategy, mesh, precision="fp32", device="cpu")
    par = parallelize(fresh(name), ex, dmesh, make_optimizer, torch.device("cpu"))
    share = BATCH // dp_world
    losses = []
    for x, y in batches():
        sl = slice(dp_rank * share, (dp_rank + 1) * share)
        loss = Trainer._loss(par.model, x[sl], y[sl])
        loss.backward()
        par.optimizer.step()
        par.zero_grad()
        local = loss.detach().clone()
        dist.all_reduce(local)
        losses.append(float(local) / WORLD)
    states = [None] * WORLD
    dist.all_gather_object(states, par.state_bytes())  # the steady-state model states of every rank
    return {"losses": losses, "states": states}


def _rank(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    results = {}
    for name in MODELS:
        for case, (strategy, mesh) in MESHES.items():
            results[f"{name}/{case}"] = _case(name, strategy, mesh)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def run_all() -> dict[str, dict]:
    """Every (model, strategy) case of 4 ranks: its loss trajectory and every rank's model-state bytes."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "results.json")
        mp.start_processes(_rank, args=(port, out), nprocs=WORLD, join=True, start_method="spawn")
        with open(out) as f:
            return json.load(f)
