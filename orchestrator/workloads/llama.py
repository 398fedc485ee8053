"""A Llama-family decoder: RMSNorm, rotary positions, SwiGLU, grouped-query attention, untied
embeddings, no biases (Touvron et al. 2023; Llama 3's shapes as presets).

Imports torch only. Every projection is its own named Linear so the tensor-parallel plan
(`Llama.tp_plan`) can address it; attention reshapes with ``-1`` heads, so a rank that holds
``n_heads / tp`` query heads and ``n_kv_heads / tp`` key/value heads runs unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from .sequence import WHOLE_SEQUENCE


@dataclass(frozen=True)
class LlamaConfig:
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 256
    ffn_dim: int = 352
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0


# Llama 3's published shapes (Meta, "The Llama 3 Herd of Models", Table 3).
PRESETS: dict[str, LlamaConfig] = {
    "llama3-8b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim=14336),
    "llama3-70b": LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256, ffn_dim=28672),
    "tiny": LlamaConfig(),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _rotate(x: torch.Tensor, theta: float, positions: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of x [B, H, T, D] at its T `positions` (the half-split form, as
    Hugging Face's Llama)."""
    D = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D)
    ang = torch.outer(positions.to(torch.float32), inv)
    cos, sin = torch.cat([ang, ang], -1).cos().to(x.dtype), torch.cat([ang, ang], -1).sin().to(x.dtype)
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.rep = cfg.n_heads // cfg.n_kv_heads
        self.theta = cfg.rope_theta
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)
        self.sequence_layout = WHOLE_SEQUENCE  # the context-parallel hook (workloads/sequence.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        positions = self.sequence_layout.positions(T, x.device)
        q, k = _rotate(q, self.theta, positions), _rotate(k, self.theta, positions)
        y = self.sequence_layout.attend(q, k, v, enable_gqa=self.rep > 1)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    tp_plan: dict[str, str] = {
        "layers.*.attention.q_proj": "colwise",
        "layers.*.attention.k_proj": "colwise",
        "layers.*.attention.v_proj": "colwise",
        "layers.*.attention.o_proj": "rowwise",
        "layers.*.feed_forward.gate_proj": "colwise",
        "layers.*.feed_forward.up_proj": "colwise",
        "layers.*.feed_forward.down_proj": "rowwise",
    }

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        if cfg.dim % cfg.n_heads or cfg.n_heads % cfg.n_kv_heads:
            raise ValueError(f"dim {cfg.dim} must divide by n_heads {cfg.n_heads}, and n_heads by n_kv_heads "
                             f"{cfg.n_kv_heads}")
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        for name, module in self.named_modules():
            self.init_module(module, name)

    def init_module(self, module: nn.Module, name: str) -> None:
        """One module's initialisation, after its own reset_parameters: normal(0, 0.02)
        matrices, the residual projections scaled by 1 / sqrt(2 * n_layers) (GPT-2's and
        torchtitan's). The runtime calls it module by module (`runtime/materialize.py`)."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            scale = math.sqrt(2 * self.cfg.n_layers) if name.endswith(("o_proj", "down_proj")) else 1
            nn.init.normal_(module.weight, mean=0.0, std=0.02 / scale)

    # The pipeline contract (runtime/pipeline.py): forward is head(blocks(embed(idx))).
    pipeline_embed = ("tok_embeddings",)
    pipeline_head = ("norm", "output")

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok_embeddings(idx)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(x))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build(preset: str | None = None, **overrides) -> Llama:
    """The Llama factory: `preset` (llama3-8b, llama3-70b, tiny) with any LlamaConfig field overridden."""
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; one of {', '.join(PRESETS)}")
    return Llama(replace(PRESETS[preset or "tiny"], **overrides))
