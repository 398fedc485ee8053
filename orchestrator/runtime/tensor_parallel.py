"""Tensor parallelism for any model that declares a plan, as DTensor `parallelize_module` styles.

A plan maps module paths (`*` for a block index) to `colwise` or `rowwise`: the built-in
models carry theirs (`GPT.tp_plan`, `Llama.tp_plan`: Megatron's split, attention by heads,
the MLP by its width: an all-reduce per row-parallel output in forward and one per
column-parallel input gradient in backward), a Hugging Face model its config's
`base_model_tp_plan`. Everything the plan does not name stays an ordinary replicated parameter
(embeddings, norms, the output head), so a tied weight stays one Parameter. Attention that
reshapes with ``-1`` heads then runs ``heads / tp`` of them per rank.
"""

from __future__ import annotations

import fnmatch

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from orchestrator.errors import PlanError
from orchestrator.workloads.models import heads_of, tp_plan


def _style(kind: str) -> ColwiseParallel | RowwiseParallel:
    # Fresh style objects per module: parallelize_module keeps references to them in hooks.
    return ColwiseParallel() if kind == "colwise" else RowwiseParallel()


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard the modules `model`'s plan names over `tp_mesh`; PlanError when it has no plan or
    a sharded dimension does not divide by the degree."""
    tp = tp_mesh.size()
    plan = tp_plan(model)
    if plan is None:
        raise PlanError(f"tensor parallelism (tp={tp}) needs a model that declares a tensor-parallel plan; "
                        f"{type(model).__name__} declares none; use tp=1")
    for what, n in zip(("attention heads", "key/value heads"), heads_of(model)):
        if n is not None and n % tp:
            raise PlanError(f"tp={tp} must divide the model's {n} {what}: attention is split by whole heads")
    targets: dict[str, nn.Module] = {}
    for name, mod in model.named_modules():
        kind = next((k for pat, k in plan.items() if fnmatch.fnmatchcase(name, pat)), None)
        if kind is None:
            continue
        if not isinstance(mod, nn.Linear):
            raise PlanError(f"the tensor-parallel plan names {name}, a {type(mod).__name__}; only Linear layers "
                            f"are split")
        dim = mod.out_features if kind == "colwise" else mod.in_features
        if dim % tp:
            raise PlanError(f"tp={tp} must divide the {'output' if kind == 'colwise' else 'input'} width {dim} "
                            f"of {name}: the plan splits it by whole heads or columns")
        targets[name] = mod
    if not targets:
        raise PlanError(f"the tensor-parallel plan of {type(model).__name__} names no module of it")
    for name, mod in targets.items():
        if plan_kind(plan, name) == "colwise":
            # Before the style's own hook, which makes the input a replicated DTensor: its
            # gradient is all-reduced in the dtype the input has there.
            mod.register_forward_pre_hook(_to_autocast_dtype, prepend=True)
    parallelize_module(model, tp_mesh, {name: _style(plan_kind(plan, name)) for name in targets})


def _to_autocast_dtype(_module: nn.Module, args: tuple) -> tuple | None:
    """A column-parallel Linear's input in the dtype autocast would compute it in. The Linear
    casts it so anyway; cast first, its gradient's all-reduce in backward moves 16-bit values
    where a normalisation autocast runs in fp32 (CUDA's policy) would make it fp32."""
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        return None
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return None
    dtype = torch.get_autocast_dtype(device)
    return None if x.dtype == dtype else (x.to(dtype), *args[1:])


def plan_kind(plan: dict[str, str], name: str) -> str:
    return next(k for pat, k in plan.items() if fnmatch.fnmatchcase(name, pat))
