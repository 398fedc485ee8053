"""Gradient compression: DDP communication hooks and the FSDP2 reduce dtype.

The plan names one compression (none | fp16 | bf16 | powersgd). DDP gets torch's own
hooks; FSDP2 has no hook API, so fp16/bf16 become its ``MixedPrecisionPolicy.reduce_dtype``
and PowerSGD (a low-rank all-reduce) has no FSDP2 counterpart. Every fallback is returned
as a note so the run records that it did something other than the plan.

:func:`fsdp_policy` is the whole FSDP2 mixed-precision policy, as torchtitan builds it:
weights all-gathered in the compute dtype (``param_dtype``), gradients reduced in fp32
unless the compression asks for 16 bits, sharded weights and optimizer state in fp32.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.nn.parallel import DistributedDataParallel

COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")
PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""What FSDP2 may all-gather weights in (its ``param_dtype``), by the name plans use."""


def _bf16_unsupported(group: dist.ProcessGroup) -> str | None:
    """Why bf16 gradient reduction cannot run on this group, or None when it can."""
    backend = dist.get_backend(group)
    if backend != "nccl":
        return f"bf16 gradient compression skipped: it needs the NCCL backend, this group uses {backend}"
    if not (torch.cuda.is_available() and torch.cuda.is_bf16_supported()):
        return "bf16 gradient compression skipped: this GPU has no bf16 support"
    return None


def register_ddp_compression(
    ddp: DistributedDataParallel, compression: str, group: dist.ProcessGroup
) -> list[str]:
    """Register the DDP comm hook for `compression` on `group`; returns notes on what was skipped.

    PowerSGD uses torch's defaults (rank 1, error feedback, warm start, 1000 plain
    all-reduce iterations before compressing) because the warm-up is what keeps its
    early steps equal to uncompressed training.
    """
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
    if compression == "none":
        return []
    if compression == "fp16":
        ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
        return []
    if compression == "bf16":
        reason = _bf16_unsupported(group)
        if reason:
            return [reason]
        ddp.register_comm_hook(group, default_hooks.bf16_compress_hook)
        return []
    state = powersgd.PowerSGDState(process_group=group)
    ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    return []


def fsdp_reduce_policy(compression: str, group: dist.ProcessGroup) -> tuple[MixedPrecisionPolicy, list[str]]:
    """FSDP2 mixed-precision policy carrying `compression` as the gradient reduce dtype, plus notes."""
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
    if compression == "fp16":
        return MixedPrecisionPolicy(reduce_dtype=torch.float16), []
    if compression == "bf16":
        reason = _bf16_unsupported(group)
        if reason:
            return MixedPrecisionPolicy(), [reason]
        return MixedPrecisionPolicy(reduce_dtype=torch.bfloat16), []
    if compression == "powersgd":
        return MixedPrecisionPolicy(), [
            "powersgd compression skipped: it is a DDP comm hook and FSDP2 reduce-scatters "
            "sharded gradients, which a low-rank all-reduce cannot express"
        ]
    return MixedPrecisionPolicy(), []


def fsdp_policy(param_dtype: str, compression: str, group: dist.ProcessGroup) -> tuple[MixedPrecisionPolicy, list[str]]:
    """FSDP2 policy gathering weights in `param_dtype` and reducing gradients in fp32, or in
    the 16-bit dtype `compression` names; plus the notes of :func:`fsdp_reduce_policy`.

    Gradients are computed in `param_dtype`, so fp32 reduction is what keeps a bf16
    all-gather from also rounding the sum over ranks (torchtitan's default). FSDP2 casts the
    reduced shard back to the fp32 sharded parameter's dtype, so the optimizer steps fp32
    master weights either way; output_dtype stays unset because autocast decides the
    activations' dtype.
    """
    if param_dtype not in PARAM_DTYPES:
        raise ValueError(f"param_dtype must be one of {', '.join(PARAM_DTYPES)}, got {param_dtype!r}")
    reduce, notes = fsdp_reduce_policy(compression, group)
    return MixedPrecisionPolicy(
        param_dtype=PARAM_DTYPES[param_dtype],
        reduce_dtype=reduce.reduce_dtype or torch.float32,
    ), notes
