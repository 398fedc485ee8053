"""A GPT decoder in the style of nanoGPT: learned positions, pre-LayerNorm, biases, tied embeddings.

Imports torch only; the orchestrator's runtime wraps it (DDP, FSDP2, tensor parallelism)
without the model knowing. Attention and MLP keep their projections as separate named
Linear layers (`q_proj`, `k_proj`, `v_proj`, `c_proj`, `c_fc`) so tensor-parallel plans can address them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .sequence import WHOLE_SEQUENCE


@dataclass
class GPTConfig:
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    vocab_size: int = 256
    block_size: int = 128
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        # q, k and v as three Linears (not one fused c_attn) so that tensor parallelism can
        # shard each by heads with a plain ColwiseParallel.
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.sequence_layout = WHOLE_SEQUENCE  # the context-parallel hook (workloads/sequence.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 for the head count: under tensor parallelism this rank holds n_head / tp heads.
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        y = self.sequence_layout.attend(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    # Megatron's split of every block, as parallelize_module styles by module path: attention
    # by heads (q/k/v column-parallel, output row-parallel), the MLP by its width. Embeddings,
    # LayerNorms and the tied lm_head stay replicated so wte and lm_head remain one Parameter.
    tp_plan: dict[str, str] = {
        "h.*.attn.q_proj": "colwise",
        "h.*.attn.k_proj": "colwise",
        "h.*.attn.v_proj": "colwise",
        "h.*.attn.c_proj": "rowwise",
        "h.*.mlp.c_fc": "colwise",
        "h.*.mlp.c_proj": "rowwise",
    }

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as GPT-2
        # The hook on the module that reads positions: a pipeline stage holds it, not the root.
        self.wpe.sequence_layout = WHOLE_SEQUENCE
        for name, module in self.named_modules():
            self.init_module(module, name)

    def init_module(self, module: nn.Module, name: str) -> None:
        """GPT-2's initialisation of one module, after its own reset_parameters: normal(0, 0.02)
        weights, zero biases, and the residual projections scaled by 1 / sqrt(2 * n_layer).
        The runtime calls it module by module on each rank's device (`runtime/materialize.py`)."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if name.endswith("c_proj") else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def num_params(self) -> int:
        """Distinct parameters (the tied embedding counted once)."""
        return sum(p.numel() for p in self.parameters())

    # The pipeline contract (runtime/pipeline.py): forward is head(blocks(embed(idx))), and
    # `embed` and `head` name the modules they use, so a stage keeps only its own.
    pipeline_embed = ("wte", "wpe", "drop")
    pipeline_head = ("ln_f", "lm_head")
    # One Parameter in two places: a pipeline's first and last stages each hold it and sum its gradient.
    pipeline_tied = ("wte.weight", "lm_head.weight")

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        pos = self.wpe.sequence_layout.positions(idx.shape[1], idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        T = idx.shape[1]
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds model.block_size {self.cfg.block_size}")
        x = self.embed(idx)
        for block in self.h:
            x = block(x)
        logits = self.head(x)
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


def build(**kwargs) -> GPT:
    """The built-in GPT as a model factory (`model.factory` default): GPTConfig's fields as keywords."""
    return GPT(GPTConfig(**kwargs))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: decay matrices (Linear/Embedding weights), not biases or LayerNorm."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
