"""A model the orchestrator has never seen: plain torch.nn, importable from this directory."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.ModuleDict({k: nn.Linear(dim, dim) for k in "qkv"})
        self.proj = nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        h = self.norm1(x)
        # -1 heads: under tensor parallelism a rank holds heads / tp of them.
        q, k, v = (self.qkv[n](h).view(B, T, -1, x.shape[-1] // self.heads).transpose(1, 2) for n in "qkv")
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
        x = x + self.proj(a)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyLM(nn.Module):
    # Optional: how tensor parallelism may split it (module path patterns -> colwise / rowwise).
    tp_plan = {"blocks.*.qkv.*": "colwise", "blocks.*.proj": "rowwise",
               "blocks.*.up": "colwise", "blocks.*.down": "rowwise"}

    def __init__(self, vocab: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.n_heads = heads  # the planner reads n_heads (or config.num_attention_heads) for tensor parallelism
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # token ids [B, T] -> logits [B, T, V]
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build(vocab: int = 256, dim: int = 64, layers: int = 2, heads: int = 4) -> TinyLM:
    return TinyLM(vocab, dim, layers, heads)
