"""Context-parallel attention on gloo ranks against one process's causal attention.

Kept out of the test module so spawned ranks import it without importing pytest. Every rank
builds the same whole q, k, v [B, H, T, D] (one seed), takes its head-tail chunks of them,
attends through each of the runtime's context-parallel attentions (`ZigzagShard`,
`UlyssesShard`) and backpropagates a fixed upstream gradient; the output and the q, k, v
gradients of its chunks must equal those chunks of the whole sequence's, computed in-process.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from orchestrator.runtime.context_parallel import UlyssesShard, ZigzagShard

KINDS = {"allgather_kv": ZigzagShard, "ulysses": UlyssesShard}


def _whole(batch: int, heads: int, kv_heads: int, seq: int, width: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(batch, h, seq, width, generator=g) for h in (heads, kv_heads, kv_heads, heads)]


def run_rank(rank: int, world: int, init_file: str, out_file: str, shapes: list[list[int]]) -> None:
    """Rank `rank` of a cp group of `world`: for each (B, H, H_kv, T, D) in `shapes` and each
    attention kind, the largest difference of its output and gradients from the whole run's."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    out: dict[str, float | str] = {}
    for batch, heads, kv_heads, seq, width in shapes:
        q, k, v, upstream = _whole(batch, heads, kv_heads, seq, width)
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        y = F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=heads != kv_heads)
        (y * upstream).sum().backward()
        expected = [y.detach()] + [t.grad for t in ref]
        for kind, shard_class in KINDS.items():
            key = f"{kind} B{batch} H{heads} kv{kv_heads} T{seq} D{width}"
            shard = shard_class(mesh["cp"])
            mine = shard.positions(seq // world, torch.device("cpu"))
            local = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
            try:
                got = shard.attend(*local, enable_gqa=heads != kv_heads)
            except ValueError as e:
                out[key] = str(e)
                continue
            (got * upstream[:, :, mine]).sum().backward()
            results = [got.detach()] + [t.grad for t in local]
            out[key] = max((a - b[:, :, mine]).abs().max().item() for a, b in zip(results, expected))
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()
