"""The sequence hook for Hugging Face decoders, through transformers' attention-function registry.

A model whose attention calls the registry (``ALL_ATTENTION_FUNCTIONS``: Llama, Mistral, Qwen2
and their kin) attends through a function registered under :data:`ATTENTION_NAME` once its
config's attention implementation names it; the function attends through the calling module's
``sequence_layout`` (`workloads/sequence.py`), as the built-in models do. The rotary embedding
declares the hook too, and takes the position ids of the tokens the rank holds from it (every
pipeline stage holds that module, as it holds its attention). With no registered mask function
under that name, transformers builds no mask: the layout makes the causal mask of the positions
its queries hold.

Only plain causal attention can be replaced so: a sliding window, a logit soft cap or a model
that does not call the registry keeps its own attention, and runs with cp=1.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from .sequence import HOOK, WHOLE_SEQUENCE

ATTENTION_NAME = "orchestrator_sequence"
"""The name the sequence-hook attention is registered under in transformers' registry."""


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
               **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: q [B, H, T, D], k, v [B, H_kv, T, D] in,
    [B, T, H, D] out. The mask transformers made is not used: none, under this name."""
    y = getattr(module, HOOK).attend(query, key, value, dropout_p=dropout, scale=scaling,
                                     enable_gqa=query.shape[1] != key.shape[1])
    return y.transpose(1, 2).contiguous(), None


def _why_not(model: nn.Module) -> str | None:
    config = getattr(model, "config", None)
    layers = getattr(getattr(model, "base_model", None), "layers", None)
    if config is None or not hasattr(config, "_attn_implementation") or not isinstance(layers, nn.ModuleList):
        return f"{type(model).__name__} is not a Hugging Face decoder with a list of layers"
    if not getattr(model, "_supports_attention_backend", False):
        return f"{type(model).__name__}'s attention does not call transformers' attention-function registry"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return f"{type(model).__name__} attends in a sliding window ({config.sliding_window} tokens)"
    if getattr(config, "attn_logit_softcapping", None):
        return f"{type(model).__name__} soft-caps its attention logits"
    if not isinstance(getattr(model.base_model, "rotary_emb", None), nn.Module):
        return f"{type(model).__name__} has no rotary_emb to take its positions"
    for layer in layers:
        attention = getattr(layer, "self_attn", None)
        if attention is None or not getattr(attention, "is_causal", False):
            return f"{type(layer).__name__} has no causal self_attn"
    return None


def declare_sequence_hooks(model: nn.Module) -> str | None:
    """Make a Hugging Face decoder attend and take positions through the sequence hook; None
    when done, else why its attention cannot be replaced (the model is left as it was)."""
    problem = _why_not(model)
    if problem:
        return problem
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _attention)
    model.config._attn_implementation = ATTENTION_NAME
    for layer in model.base_model.layers:
        setattr(layer.self_attn, HOOK, WHOLE_SEQUENCE)
    rotary = model.base_model.rotary_emb
    setattr(rotary, HOOK, WHOLE_SEQUENCE)
    rotary.register_forward_pre_hook(_position_ids, with_kwargs=True)
    return None


def _position_ids(rotary: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """The rotary embedding's inputs with the positions of the tokens this rank holds for its
    position ids (given by position or by name: transformers numbers a rank's tokens 0 to T-1,
    as if they were the whole sequence)."""
    given = kwargs["position_ids"] if "position_ids" in kwargs else args[1]
    positions = getattr(rotary, HOOK).positions(given.shape[-1], given.device).expand_as(given)
    if "position_ids" in kwargs:
        return args, {**kwargs, "position_ids": positions}
    return (args[0], positions, *args[2:]), kwargs


def is_hugging_face(model: nn.Module) -> bool:
    """Whether `model` is a transformers model (their classes live in its package)."""
    return type(model).__module__.startswith("transformers.")
