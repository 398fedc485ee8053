"""Hugging Face `transformers` causal LMs from a local config.json (and local safetensors weights).

Optional (`pip install -e ".[hf]"`); nothing here ever reaches a model hub.
"""

from __future__ import annotations

import json

import torch.nn as nn


def build(config: str, weights: str | None = None) -> nn.Module:
    """A causal LM of the architecture `config` describes, randomly initialised, or loaded from
    the local safetensors file `weights`.

    Built with its parameters on the meta device (the runtime's build, a model's inspection),
    it loads nothing: there is nowhere to put the values, and reading the whole file on every
    rank is what the runtime avoids; it loads each rank's slices once the shards exist
    (`runtime/hf_weights.py`)."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as e:
        raise ImportError("model.hf_config needs transformers: pip install -e '.[hf]'") from e
    with open(config) as f:
        cfg = AutoConfig.for_model(**json.load(f))
    model = AutoModelForCausalLM.from_config(cfg)
    if weights and not any(p.is_meta for p in model.parameters()):
        from safetensors.torch import load_file

        model.load_state_dict(load_file(weights), strict=False)
        model.tie_weights()
    return model


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
