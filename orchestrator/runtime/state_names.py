"""One name per parameter in a checkpoint, whatever the plan that wrote or reads it.

torch's `get_state_dict` names the model's and the (flattened) optimizer's state by fully
qualified parameter names, and strips what wrapping adds (DDP's ``module.``, FSDP2,
activation checkpointing); pipeline stages keep the whole model's names (`pipeline.py`). What
still depends on the plan is a parameter registered under two names, a tied embedding and
output head: the whole model lists both in its state dict and keys the optimizer by the first,
while a pipeline's last stage holds the head alone and keys both by the second. So a checkpoint
written with a pipeline lacked the optimizer state a run without one looks for, and the
reverse.

Here every parameter has one canonical name, the first the whole model registers it under
(`named_parameters` order: `wte.weight` for the built-in GPT, `model.embed_tokens.weight` for a
tied Hugging Face model). A checkpoint holds state under canonical names only, once, and a rank
holding the parameter under another name reads and writes it under the canonical one. Old
checkpoints, which also hold the alias in the model section, load unchanged: the alias is
simply not asked for.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

_OPTIMIZER_SECTIONS = ("state.", "param_groups.")


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """{alias: canonical name} for every parameter `model` registers under more than one name.
    Call it on the whole model, before a pipeline splits it (a stage sees one name only)."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def _optimizer_key(key: str, rename: dict[str, str]) -> str:
    """`state.<fqn>.<entry>` / `param_groups.<fqn>.<entry>` with the fqn renamed (an entry
    name has no dot; the fqn may have many)."""
    for section in _OPTIMIZER_SECTIONS:
        if key.startswith(section):
            fqn, _, entry = key[len(section):].rpartition(".")
            if fqn in rename:
                return f"{section}{rename[fqn]}.{entry}"
    return key


def canonical(state: dict[str, Any], aliases: dict[str, str]) -> dict[str, Any]:
    """`state` ({"model", "optimizer"} as `get_state_dict` names them) under canonical names,
    each parameter once. The values are the same objects, so `dcp.load` filling the result
    in place fills `state`'s tensors too."""
    if not aliases:
        return state
    model: dict[str, Any] = {}
    for key, value in state["model"].items():
        name = aliases.get(key, key)
        if name not in model or name == key:  # the canonical entry wins; an alias is the same tensor
            model[name] = value
    optimizer = {_optimizer_key(k, aliases): v for k, v in state.get("optimizer", {}).items()}
    return {**state, "model": model, "optimizer": optimizer}


def restore_names(local: dict[str, Any], loaded: dict[str, Any], aliases: dict[str, str]) -> dict[str, Any]:
    """What `dcp.load` put into `canonical(local)`, under `local`'s own names again, for
    `set_state_dict` (non-tensor entries, such as learning rates, are replaced, not filled)."""
    if not aliases:
        return loaded
    model = {k: loaded["model"][aliases.get(k, k)] for k in local["model"]}
    optimizer = {k: loaded["optimizer"][_optimizer_key(k, aliases)] for k in local.get("optimizer", {})}
    return {**local, "model": model, "optimizer": optimizer}
