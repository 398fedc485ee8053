"""Megatron-style tensor parallelism for the GPT blocks, expressed as a DTensor plan.

Attention is split by heads (q/k/v column-parallel, output projection row-parallel) and
the MLP by its hidden width (c_fc column-parallel, c_proj row-parallel), so each block
costs one all-reduce in forward and one in backward. Embeddings, LayerNorms and the tied
lm_head stay ordinary replicated parameters: they are small next to the blocks, and
keeping the tied weight whole means wte and lm_head remain one Parameter.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from orchestrator.errors import PlanError

# Block-relative names, matching orchestrator/workloads/gpt.py.
BLOCK_PLAN_NAMES: dict[str, str] = {
    "attn.q_proj": "colwise",
    "attn.k_proj": "colwise",
    "attn.v_proj": "colwise",
    "attn.c_proj": "rowwise",
    "mlp.c_fc": "colwise",
    "mlp.c_proj": "rowwise",
}


def _block_plan() -> dict[str, ColwiseParallel | RowwiseParallel]:
    # Fresh style objects per block: parallelize_module keeps references to them in hooks.
    return {
        name: ColwiseParallel() if kind == "colwise" else RowwiseParallel()
        for name, kind in BLOCK_PLAN_NAMES.items()
    }


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard every transformer block of `model` (a GPT with `.h` and `.cfg`) over `tp_mesh`.

    The attention module reshapes with ``-1`` heads, so after this each rank runs
    ``n_head / tp`` heads without any change to the model code.
    """
    tp = tp_mesh.size()
    blocks = getattr(model, "h", None)
    cfg = getattr(model, "cfg", None)
    if not isinstance(blocks, nn.ModuleList) or cfg is None:
        raise PlanError(
            f"tensor parallelism (tp={tp}) needs the GPT workload (a model with .h blocks and .cfg); "
            f"got {type(model).__name__}; use tp=1 for other models"
        )
    if cfg.n_head % tp:
        raise PlanError(f"tp={tp} must divide model.n_head={cfg.n_head}: attention is split by whole heads")
    if (4 * cfg.n_embd) % tp:
        raise PlanError(f"tp={tp} must divide the MLP width 4*model.n_embd={4 * cfg.n_embd}")
    for block in blocks:
        parallelize_module(block, tp_mesh, _block_plan())
