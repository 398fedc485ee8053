"""The sequence hook: how a model's positions and causal attention see the tokens a rank holds.

A model opts in to context parallelism by reading both through one attribute,
``sequence_layout``, that every module computing positions or attention declares:

    self.sequence_layout = WHOLE_SEQUENCE
    ...
    positions = self.sequence_layout.positions(T, x.device)   # [T] token positions
    y = self.sequence_layout.attend(q, k, v)                   # q, k, v: [B, heads, T, head_dim]

Alone on a rank the layout is the whole sequence: positions ``0..T-1`` and causal SDPA. Under
``cp > 1`` the runtime (`runtime/context_parallel.py`) replaces every module's layout with the
rank's share of the sequence: the positions of its chunks and attention of its queries against
the keys and values of the whole sequence. The model's code is the same in both. Imports torch only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

HOOK = "sequence_layout"
"""The attribute a module declares to have its positions and attention placed by the runtime."""


@dataclass(frozen=True)
class WholeSequence:
    """The whole sequence on this rank, in order: what a model runs with no context parallelism."""

    def positions(self, length: int, device: torch.device) -> torch.Tensor:
        """The positions of the `length` tokens this rank holds: 0 to length - 1."""
        return torch.arange(length, device=device)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout_p: float = 0.0,
               scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
        """Causal attention of q [B, H, T, D] over k, v [B, H_kv, T, D] (grouped-query where
        `enable_gqa`; `scale` None for 1/sqrt(D)): ``scaled_dot_product_attention`` with ``is_causal``."""
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p, scale=scale,
                                              enable_gqa=enable_gqa)


WHOLE_SEQUENCE = WholeSequence()
"""The layout every module starts with."""
