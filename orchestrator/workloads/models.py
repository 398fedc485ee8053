"""The model contract: any factory by import path, its logits, its repeated blocks, its TP plan.

A factory is `package.module:callable`; called with `model.args` as keywords it returns an
`nn.Module` whose forward takes token ids [B, T] (int64) and returns logits [B, T, V] or an
object with `.logits` (Hugging Face). Imports torch only.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from ..config import GPT_FACTORY, ModelConfig
from ..errors import ConfigError

HF_FACTORY = "orchestrator.workloads.hf:build"
TP_STYLES = ("colwise", "rowwise")
"""Tensor-parallel styles the runtime applies (parallelize_module's ColwiseParallel, RowwiseParallel)."""


def factory_name(m: ModelConfig) -> str:
    return HF_FACTORY if m.hf_config else m.factory


def factory_kwargs(m: ModelConfig) -> dict[str, Any]:
    """What the factory is called with: `model.args`; the built-in GPT also gets nanoGPT's fields.
    A Hugging Face model gets its config and weights paths alone: `hf_config` stands in for the
    factory, and the factory's `args` (a job's `preset`, say) go with it."""
    if m.hf_config:
        return {"config": m.hf_config, "weights": m.hf_weights}
    if m.factory == GPT_FACTORY:
        gpt = {f.name: getattr(m, f.name) for f in dataclasses.fields(m)
               if f.name not in ("factory", "args", "hf_config", "hf_weights")}
        return {**gpt, **m.args}
    return dict(m.args)


def load_factory(path: str) -> Callable[..., Any]:
    """The callable `package.module:callable` names; ConfigError naming model.factory otherwise."""
    mod_name, _, attr = path.partition(":")
    if not mod_name or not attr:
        raise ConfigError(f"key 'model.factory': expected 'package.module:callable', got {path!r}")
    try:
        module = importlib.import_module(mod_name)
    except Exception as e:  # noqa: BLE001 - any import failure is the user's to fix, in one line
        raise ConfigError(f"key 'model.factory': cannot import {mod_name!r} ({type(e).__name__}: {e}); "
                          f"it must be importable from the current directory or PYTHONPATH") from e
    fn: Any = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ConfigError(f"key 'model.factory': module {mod_name!r} has no {attr!r}")
    if not callable(fn):
        raise ConfigError(f"key 'model.factory': {path} is not callable")
    return fn


def build_model(m: ModelConfig, model_fn: Callable[..., Any] | None = None) -> nn.Module:
    """Call the factory (`model_fn` when the Python API passed one) and check it gave a module."""
    name = "model" if model_fn is not None else factory_name(m)
    fn = model_fn if model_fn is not None else load_factory(name)
    kwargs = factory_kwargs(m) if model_fn is None else dict(m.args)
    try:
        model = fn(**kwargs)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"key 'model.args': {name}({', '.join(kwargs)}) failed: {type(e).__name__}: {e}") from e
    if not isinstance(model, nn.Module):
        raise ConfigError(f"key 'model.factory': {name} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def logits_of(out: Any) -> torch.Tensor:
    """Logits from a forward's output: a tensor, or an object with `.logits` (Hugging Face)."""
    return out if isinstance(out, torch.Tensor) else out.logits


def block_list(model: nn.Module) -> nn.ModuleList:
    """The model's repeated blocks: the ModuleList of one class holding the most parameters.

    The unit of FSDP wrapping, activation checkpointing and pipeline stages."""
    best, best_params = None, -1
    for mod in model.modules():
        if isinstance(mod, nn.ModuleList) and len(mod) and len({type(b) for b in mod}) == 1:
            n = sum(p.numel() for p in mod.parameters())
            if n > best_params:
                best, best_params = mod, n
    if best is None:
        raise ConfigError(f"key 'model.factory': {type(model).__name__} has no repeated block list "
                          f"(an nn.ModuleList of one block class)")
    return best


def block_slots(model: nn.Module) -> list[tuple[nn.Module, int | str]]:
    """(container, key) of every repeated block, so a caller can wrap one in place: the block
    list's positions, or a pipeline stage's own blocks (`stage_blocks`, a ModuleDict keyed by
    each block's index in the whole model, which keeps checkpoint names global)."""
    own = getattr(model, "stage_blocks", None)
    if isinstance(own, nn.ModuleDict):
        return [(own, k) for k in own.keys()]
    blocks = block_list(model)
    return [(blocks, i) for i in range(len(blocks))]


def block_list_name(model: nn.Module) -> str:
    """The module path of the model's repeated block list (`h`, `layers`, `model.layers`)."""
    blocks = block_list(model)
    return next(name for name, mod in model.named_modules() if mod is blocks)


def pipeline_ends(model: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """(embedding module paths, head module paths) of a model whose forward is
    ``head(blocks(embed(idx)))`` and that says so (`embed`, `head`, `pipeline_embed`,
    `pipeline_head`, as the built-in GPT and Llama do, and `hf.py` for a Hugging Face decoder
    laid out as Llama's); None for any other model."""
    embed, head = getattr(model, "pipeline_embed", None), getattr(model, "pipeline_head", None)
    if embed and head and callable(getattr(model, "embed", None)) and callable(getattr(model, "head", None)):
        return tuple(embed), tuple(head)
    return None


def tp_plan(model: nn.Module) -> dict[str, str] | None:
    """The model's tensor-parallel plan, module path pattern (`*` for a block index) -> style;
    None when it declares none. Built-in models carry `tp_plan`; Hugging Face ones
    `config.base_model_tp_plan`. A plan with a style the runtime does not apply counts as none."""
    from .hf import tp_plan as hf_plan

    # Hugging Face models first: their own `tp_plan` property also names output-layer styles.
    plan = hf_plan(model) or getattr(model, "tp_plan", None)
    if not isinstance(plan, dict):
        return None
    if not plan or any(style not in TP_STYLES for style in plan.values()):
        return None
    return dict(plan)


def apply_recompute(model: nn.Module, recompute: str) -> None:
    """Wrap the repeated blocks (full) or their attention (selective) in non-reentrant activation
    checkpointing; a block without an attention submodule is wrapped whole. The runtime applies
    it after tensor parallelism; the measurement of a model applies it on the meta device."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if recompute == "none":
        return
    for blocks, key in block_slots(model):
        block = blocks[key]
        found = attention_of(block) if recompute == "selective" else None
        if found is None:
            blocks[key] = checkpoint_wrapper(block)
        else:
            setattr(block, found[0], checkpoint_wrapper(found[1]))


def attention_of(block: nn.Module) -> tuple[str, nn.Module] | None:
    """(name, module) of a block's attention child (`attn`, `attention`, `self_attn`, ...), or None."""
    for name, child in block.named_children():
        if "attn" in name or "attention" in name.lower():
            return name, child
    return None


_HEADS = ("n_head", "n_heads", "num_heads", "num_attention_heads")
_KV_HEADS = ("n_kv_heads", "num_key_value_heads")


def _config_int(model: nn.Module, names: tuple[str, ...]) -> int | None:
    for holder in (getattr(model, "config", None), getattr(model, "cfg", None), model):
        for n in names:
            v = getattr(holder, n, None) if holder is not None else None
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def heads_of(model: nn.Module) -> tuple[int | None, int | None]:
    """(attention heads, key/value heads) as the model (or its `config` / `cfg`) states them, e.g.
    `n_heads`, `num_attention_heads`, `n_kv_heads`; None where it does not."""
    heads = _config_int(model, _HEADS)
    return heads, _config_int(model, _KV_HEADS) or heads
