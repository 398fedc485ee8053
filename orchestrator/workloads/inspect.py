"""Measure a model for the planner without memory: build it on the meta device, count its
parameters exactly, find its repeated block, count FLOPs with FlopCounterMode and the bytes
autograd saves per block, and hand back a `ModelSpec` (pure data)."""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from ..config import ModelConfig
from ..errors import ConfigError
from ..model_source import is_builtin_gpt  # noqa: F401 - re-exported for the driver
from ..planning.model_spec import ModelSpec
from .models import block_list, build_model, factory_name, heads_of, logits_of, tp_plan


def distinct_params(module: nn.Module) -> int:
    """Parameters of `module`, a tensor shared by two modules counted once."""
    return sum(p.numel() for p in module.parameters())  # parameters() already skips duplicates


def _tp_sharded(model: nn.Module, plan: dict[str, str] | None) -> int:
    """Parameters the plan shards: the weight and bias of column-parallel Linears, the weight of
    row-parallel ones (their bias is added after the reduction, whole on every rank)."""
    if not plan:
        return 0
    total = 0
    for name, mod in model.named_modules():
        style = next((s for pat, s in plan.items() if fnmatch.fnmatchcase(name, pat)), None)
        if style is None:
            continue
        total += mod.weight.numel() if getattr(mod, "weight", None) is not None else 0
        if style == "colwise" and getattr(mod, "bias", None) is not None:
            total += mod.bias.numel()
    return total


@contextlib.contextmanager
def _fused_attention() -> Iterator[None]:
    """Route unmasked scaled_dot_product_attention to the fused (flash) kernel, which has a meta
    implementation and keeps only q, k, v, the output and its log-sum-exp for backward."""
    original = F.scaled_dot_product_attention

    def fused(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if attn_mask is not None:
            return original(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                            enable_gqa=enable_gqa)
        if enable_gqa and k.shape[-3] != q.shape[-3]:
            rep = q.shape[-3] // k.shape[-3]
            k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal,
                                                                          scale=scale)[0]

    F.scaled_dot_product_attention = fused
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def model_spec(m: ModelConfig, model_fn: Callable[..., Any] | None = None, vocab_needed: int = 256) -> ModelSpec:
    """The measured spec of the model `m` names (or `model_fn` builds) at sequence length
    `m.block_size`; ConfigError, naming the key, when the model breaks the contract or its
    vocabulary is smaller than the data's `vocab_needed` tokens."""
    name = "python callable" if model_fn is not None else factory_name(m)
    with torch.device("meta"):
        model = build_model(m, model_fn)
    params = distinct_params(model)
    distinct = len(list(model.parameters()))
    blocks = block_list(model)
    n = len(blocks)
    block_params = sum(distinct_params(b) for b in blocks) // n
    seen: dict[str, Any] = {"hidden": None, "inside": False, "bytes": 0.0, "keys": set(), "alive": []}

    def pre(mod, args, kwargs):
        x = args[0] if args else kwargs.get("hidden_states")
        seen["hidden"] = x.shape[-1] if isinstance(x, torch.Tensor) else None
        seen["inside"] = True

    def post(mod, args, out):
        seen["inside"] = False

    def pack(t: torch.Tensor):
        # Only what the first block saves, each storage once, weights excluded: activations.
        key = _storage_key(t)
        if seen["inside"] and key not in weights and key not in seen["keys"]:
            seen["keys"].add(key)
            seen["alive"].append(t)  # held, so no later storage can take this one's address
            seen["bytes"] += t.untyped_storage().nbytes()
        return t

    plan = tp_plan(model)
    tp_sharded = _tp_sharded(model, plan)
    named = sum(1 for _ in model.named_parameters(remove_duplicate=False))
    # The blocks repeat, so one is measured: the forward runs with the list cut to its first block
    # (an op under FlopCounterMode on meta tensors costs milliseconds; a 70B model has 80 blocks).
    del blocks[1:]
    # Keys of the weights left: a storage freed with the cut blocks may be reused by an activation.
    weights = {_storage_key(p) for p in model.parameters()}
    h1 = blocks[0].register_forward_pre_hook(pre, with_kwargs=True)
    h2 = blocks[0].register_forward_hook(post)
    seq = m.block_size
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    counter = FlopCounterMode(display=False)
    try:
        with counter:
            out = model(ids)
        # Activations in a second pass, with the fused attention kernel a real run uses (meta
        # tensors take the math path, which keeps the s x s attention matrix a real run does not).
        with _fused_attention(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(ids)
    except Exception as e:  # noqa: BLE001 - the user's forward, reported in one line
        raise ConfigError(f"key 'model.factory': the forward of {name} on token ids [1, {seq}] failed: "
                          f"{type(e).__name__}: {e}") from e
    finally:
        h1.remove()
        h2.remove()
    logits = logits_of(out) if isinstance(out, torch.Tensor) or hasattr(out, "logits") else None
    if logits is None or logits.dim() != 3 or tuple(logits.shape[:2]) != (1, seq):
        got = tuple(logits.shape) if logits is not None else type(out).__name__
        raise ConfigError(f"key 'model.factory': the forward of {name} must return logits [B, T, V] (or an object "
                          f"with .logits) for token ids [1, {seq}]; got {got}")
    vocab = logits.shape[-1]
    if vocab < vocab_needed:
        raise ConfigError(f"key 'model.args': the model's vocabulary ({vocab} logits) is smaller than the data's "
                          f"{vocab_needed} tokens (largest token id {vocab_needed - 1})")
    counts = counter.get_flop_counts()
    path = _block_path(model, blocks) + ".0"
    # FlopCounterMode names modules by their path under the root's class name ("Llama.layers.0").
    block_key = next((k for k in counts if k == path or k.endswith("." + path)), None)
    block_flops = sum(counts[block_key].values()) if block_key else 0.0
    hidden = seen["hidden"] or 1
    heads, kv_heads = heads_of(model)
    return ModelSpec(
        name=name, params=params, blocks=n, block_class=type(blocks[0]).__name__, block_params=block_params,
        root_params=params - n * block_params, hidden=hidden, heads=heads or 1, kv_heads=kv_heads or 1,
        vocab=vocab, seq=seq, forward_flops_per_token=(counter.get_total_flops() + (n - 1) * block_flops) / seq,
        block_forward_flops_per_token=block_flops / seq,
        # Measured in the fp32 the meta model holds; the spec states 16-bit values.
        block_activation_bytes=seen["bytes"] * 2 / logits.element_size(),
        tp_sharded_params=tp_sharded, tp_plan=plan is not None,
        tied_embeddings=named > distinct,
    )


def _block_path(model: nn.Module, blocks: nn.ModuleList) -> str:
    return next(name for name, mod in model.named_modules() if mod is blocks)
