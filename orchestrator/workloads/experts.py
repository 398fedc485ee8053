"""A model's experts as the planner sees them (`ExpertSpec`): the built-in MoE's own statement,
or a Hugging Face MoE config's fields, checked against the blocks the model really built.

A block is an MoE block when it holds a module named `experts` (the built-in MoE's and every
Hugging Face MoE's routed experts); a Hugging Face model with such blocks whose config names
its experts in fields this module does not read is refused, naming `model.hf_config`, rather
than planned as a dense model it is not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from ..errors import ConfigError
from ..planning.model_spec import ExpertSpec


def is_moe_block(block: nn.Module) -> bool:
    """Whether `block` routes its feed-forward to experts (holds a module named `experts`)."""
    return any(name.rsplit(".", 1)[-1] == "experts" for name, _ in block.named_modules())


@dataclass(frozen=True)
class _HFFields:
    """Where one family of Hugging Face configs keeps its experts."""

    experts: str
    """The routed expert count's field."""
    expert_hidden: str
    """One routed expert's SwiGLU width's field."""
    shared: Callable[[Any], tuple[int, int]] = lambda _c: (0, 0)
    """(shared experts, their width) from the config."""
    groups: Callable[[Any], tuple[int, int]] = lambda _c: (1, 1)
    """(router groups, groups a token may use) from the config."""


_HF_MOE: dict[str, _HFFields] = {
    "mixtral": _HFFields("num_local_experts", "intermediate_size"),
    "gpt_oss": _HFFields("num_local_experts", "intermediate_size"),
    "qwen3_moe": _HFFields("num_experts", "moe_intermediate_size"),
    # One gated shared expert of its own width.
    "qwen2_moe": _HFFields("num_experts", "moe_intermediate_size",
                           shared=lambda c: (1, c.shared_expert_intermediate_size)
                           if c.shared_expert_intermediate_size else (0, 0)),
    "deepseek_v3": _HFFields("n_routed_experts", "moe_intermediate_size",
                             shared=lambda c: (c.n_shared_experts or 0, c.moe_intermediate_size
                                               if c.n_shared_experts else 0),
                             groups=lambda c: (c.n_group or 1, c.topk_group or 1)),
}
"""The Hugging Face MoE families whose expert fields are read (`model_type` -> fields)."""


def expert_spec(model: nn.Module, blocks: nn.ModuleList) -> ExpertSpec | None:
    """The experts of `model` (whole, on meta), whose repeated blocks are `blocks`; None for a
    dense model. ConfigError for a Hugging Face MoE whose config fields are not known here."""
    moe = [b for b in blocks if is_moe_block(b)]
    if not moe:
        return None
    dense = [b for b in blocks if not is_moe_block(b)]
    dense_params = sum(p.numel() for p in dense[0].parameters()) if dense else 0
    own = getattr(model, "expert_spec", None)
    if callable(own):
        spec = own()
        if not isinstance(spec, ExpertSpec):
            raise ConfigError(f"key 'model.factory': {type(model).__name__}.expert_spec() returned "
                              f"{type(spec).__name__}, not an ExpertSpec")
        return spec
    config: Any = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    fields = _HF_MOE.get(str(model_type))
    if fields is None:
        raise ConfigError(f"key 'model.hf_config': {type(model).__name__} ({model_type}) routes its feed-forward to "
                          f"experts, but its config's expert fields are not known; known MoE configs: "
                          f"{', '.join(sorted(_HF_MOE))}")
    try:
        shared, shared_hidden = fields.shared(config)
        groups, top_groups = fields.groups(config)
        return ExpertSpec(experts=int(getattr(config, fields.experts)), top_k=int(config.num_experts_per_tok),
                          expert_hidden=int(getattr(config, fields.expert_hidden)), moe_blocks=len(moe),
                          shared_experts=int(shared), shared_hidden=int(shared_hidden),
                          dense_block_params=dense_params, router_groups=int(groups),
                          router_top_groups=int(top_groups))
    except (AttributeError, TypeError, ValueError) as e:
        raise ConfigError(f"key 'model.hf_config': the {model_type} config's expert fields do not describe its "
                          f"experts: {e}") from e
