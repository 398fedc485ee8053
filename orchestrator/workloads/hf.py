"""Hugging Face `transformers` causal LMs from a local config.json (and local safetensors weights).

Optional (`pip install -e ".[hf]"`); nothing here ever reaches a model hub.

A decoder laid out as Llama's (`embed_tokens`, a list of `layers` and a final `norm` in the
base model, then `lm_head`: Llama, Mistral, Qwen2 and their kin) also runs in a pipeline. Its
blocks are called with what its own forward hands them (rotary tables, mask, positions):
each stage runs the base model's forward up to its first layer (`_prologue`), so the model's
own code, not a copy of it, decides those for every architecture and version of
`transformers`.
"""

from __future__ import annotations

import contextlib
import json
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn


def build(config: str, weights: str | None = None) -> nn.Module:
    """A causal LM of the architecture `config` describes, randomly initialised, or loaded from
    the local safetensors file `weights`.

    Built with its parameters on the meta device (the runtime's build, a model's inspection),
    it loads nothing: there is nowhere to put the values, and reading the whole file on every
    rank is what the runtime avoids; it loads each rank's slices once the shards exist
    (`runtime/hf_weights.py`)."""
    try:
        import transformers
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as e:
        raise ImportError("model.hf_config needs transformers: pip install -e '.[hf]'") from e
    with open(config) as f:
        cfg = AutoConfig.for_model(**json.load(f))
    # Training keeps no KV cache: with one, every recomputed attention (activation
    # checkpointing) appends its keys and values to the cache again, which holds them, and the
    # recomputed block's other values with them, to the end of backward.
    cfg.use_cache = False
    # A config's dtype is the one its checkpoint was saved in, and transformers would build the
    # model in it, Adam's moments following. Training keeps fp32 master weights (autocast and
    # FSDP2 compute in 16 bits). transformers 5 renamed the argument and warns at the old name.
    dtype_arg = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    model = AutoModelForCausalLM.from_config(cfg, **{dtype_arg: torch.float32})
    if weights and not any(p.is_meta for p in model.parameters()):
        from safetensors.torch import load_file

        model.load_state_dict(load_file(weights), strict=False)
        model.tie_weights()
    _name_pipeline_ends(model)
    return model


class _Reached(Exception):
    """Raised by `_FirstLayer`: the base model's forward got as far as its first layer."""

    def __init__(self, hidden: torch.Tensor, kwargs: dict[str, Any]) -> None:
        super().__init__("the base model reached its first layer")
        self.hidden, self.kwargs = hidden, kwargs


class _FirstLayer(nn.Module):
    """Stands in for the base model's layers for the length of `_prologue`."""

    def __init__(self, attention_type: str | None) -> None:
        super().__init__()
        # Some models pick each layer's mask by its attention type (full, sliding window).
        self.attention_type = attention_type

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise _Reached(hidden_states, kwargs)


def _prologue(model: nn.Module, **inputs: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """(hidden states, keyword arguments) that the base model's forward hands its first layer
    for `inputs` (`input_ids` or `inputs_embeds`), computed by that forward itself."""
    base = model.base_model
    layers = base.layers
    base.layers = nn.ModuleList([_FirstLayer(model.pipeline_attention_type)])
    try:
        base(**inputs, use_cache=False)
    except _Reached as reached:
        return reached.hidden, reached.kwargs
    finally:
        base.layers = layers
    raise RuntimeError(f"{type(base).__name__}'s forward returned without calling its layers")


def _embed(self: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    return _prologue(self, input_ids=idx)[0]


def _block_inputs(self: nn.Module, x: torch.Tensor) -> dict[str, Any]:
    return _prologue(self, inputs_embeds=x)[1]


def _head(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return self.get_output_embeddings()(self.base_model.norm(x))


def _name_pipeline_ends(model: nn.Module) -> None:
    """Give a decoder laid out as Llama's the pipeline protocol of the built-in models
    (`pipeline_embed`, `pipeline_head`, `embed`, `head`), plus the modules every stage needs
    (`pipeline_shared`: the rotary tables), the keyword arguments of a block
    (`block_inputs`) and a tied embedding's two names (`pipeline_tied`). A model laid out
    otherwise, or one whose forward changes the logits past the head (a scale, a soft cap),
    is left as it is: it runs with pp=1."""
    base = getattr(model, "base_model", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    config = getattr(model, "config", None)
    if base is None or base is model or head is None or config is None:
        return
    if not (isinstance(getattr(base, "layers", None), nn.ModuleList) and len(base.layers)
            and isinstance(getattr(base, "embed_tokens", None), nn.Module)
            and isinstance(getattr(base, "norm", None), nn.Module)):
        return
    if any(getattr(config, k, None) not in (None, 1, 1.0) for k in ("final_logit_softcapping", "logit_scale")):
        return
    names = {id(m): n for n, m in model.named_modules()}
    prefix, head_name = names[id(base)], names[id(head)]
    model.pipeline_embed = (f"{prefix}.embed_tokens",)
    model.pipeline_head = (f"{prefix}.norm", head_name)
    model.pipeline_shared = tuple(f"{prefix}.{n}" for n, m in base.named_children()
                                  if n not in ("embed_tokens", "layers", "norm") and next(m.parameters(), None) is None)
    tied = base.embed_tokens.weight is head.weight
    model.pipeline_tied = (f"{prefix}.embed_tokens.weight", f"{head_name}.weight") if tied else ()
    model.pipeline_attention_type = getattr(base.layers[0], "attention_type", None)
    model.embed = types.MethodType(_embed, model)
    model.head = types.MethodType(_head, model)
    model.block_inputs = types.MethodType(_block_inputs, model)


@contextlib.contextmanager
def unpacked_sequences() -> Iterator[None]:
    """Tell a Hugging Face model that its token ids are unpacked sequences, for a forward on
    tensors without values (meta or fake: a measurement, a rehearsal, a trace). Without a KV
    cache, as training runs, its mask code asks the position ids whether they pack several
    sequences: a meta tensor cannot answer, and a fake one makes it build a whole [T, T] mask
    and run attention unfused. A real run of unpacked data answers no, builds no mask and runs
    the fused causal kernel, which is what these forwards must see."""
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:  # a transformers that does not ask
        yield
        return
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def tp_plan(model: nn.Module) -> dict[str, str] | None:
    """The config's `base_model_tp_plan`, its paths made relative to the whole model."""
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        return None
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and hasattr(model, prefix):
        return {f"{prefix}.{k}": v for k, v in plan.items()}
    return dict(plan)
