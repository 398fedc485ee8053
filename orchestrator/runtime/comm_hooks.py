"""Gradient sync: DDP communication hooks and the FSDP2 reduce dtype.

The plan names one compression (none | fp16 | bf16 | powersgd). DDP gets torch's own
hooks; FSDP2 has no hook API, so fp16/bf16 become its ``MixedPrecisionPolicy.reduce_dtype``
and PowerSGD (a low-rank all-reduce) has no FSDP2 counterpart. Every fallback is returned
as a note so the run records that it did something other than the plan.

The plan also names the all-reduce schedule (flat | hierarchical). For DDP a hierarchical
plan becomes :func:`hierarchical_hook`: reduce-scatter inside each node, all-reduce of one
shard per rank between nodes (ranks with the same local position), all-gather inside each
node, so only 1/per_node of every bucket crosses the network from each rank. fp16/bf16
compression composes with it (the bucket travels in 16 bits through all three steps).
FSDP2 needs no hook: HSDP's 2-D mesh already is that hierarchy.

:func:`fsdp_policy` is the whole FSDP2 mixed-precision policy, as torchtitan builds it:
weights all-gathered in the compute dtype (``param_dtype``), gradients reduced in fp32
unless the compression asks for 16 bits, sharded weights and optimizer state in fp32.
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.nn.parallel import DistributedDataParallel

from orchestrator.choices import Compression, SyncAlgorithm
from orchestrator.planning.resolve import POWERSGD_MIN_WARMUP
from orchestrator.planning.sync import POWERSGD_RANK

COMPRESSIONS = tuple(str(c) for c in Compression.concrete())
SYNC_ALGORITHMS = tuple(str(a) for a in SyncAlgorithm.concrete())
_WIRE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
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
    ddp: DistributedDataParallel, compression: str, group: dist.ProcessGroup, warmup_steps: int = POWERSGD_MIN_WARMUP
) -> list[str]:
    """Register the DDP comm hook for `compression` on `group`; returns notes on what was skipped.

    PowerSGD runs at the rank the planner priced (POWERSGD_RANK), with torch's error feedback
    and warm start, after `warmup_steps` plain all-reduce iterations (the plan's
    `compression_warmup_steps`, which the planner prices too): the warm-up is what keeps its
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
    state = powersgd.PowerSGDState(process_group=group, matrix_approximation_rank=POWERSGD_RANK,
                                   start_powerSGD_iter=max(warmup_steps, POWERSGD_MIN_WARMUP))
    ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    return []


def hierarchy_groups(dp_ranks: Sequence[int], node_of_rank: Sequence[str]) -> tuple[list[list[int]], list[list[int]]]:
    """(intra, inter): the data-parallel ranks of each node, nodes in order of their lowest
    rank, and for each local position i the i-th rank of every node.

    Raises ValueError when the nodes hold different numbers of data-parallel ranks: the
    inter-node all-reduce pairs shards by local position, so every node needs each position.
    """
    by_node: dict[str, list[int]] = {}
    for r in sorted(dp_ranks):
        if not 0 <= r < len(node_of_rank):
            raise ValueError(f"rank {r} has no node: node_of_rank covers ranks 0..{len(node_of_rank) - 1}")
        by_node.setdefault(node_of_rank[r], []).append(r)
    intra = list(by_node.values())
    sizes = {len(g) for g in intra}
    if len(sizes) > 1:
        held = ", ".join(f"{node} holds {len(g)}" for node, g in by_node.items())
        raise ValueError(f"nodes hold unequal numbers of data-parallel ranks ({held})")
    inter = [list(col) for col in zip(*intra)]
    return intra, inter


@dataclass
class HierarchicalAllReduce:
    """State of :func:`hierarchical_hook` on one rank: its two groups and what it has reduced."""

    intra: dist.ProcessGroup
    """This rank's node-local data-parallel group (reduce-scatter, all-gather)."""
    inter: dist.ProcessGroup
    """The ranks at this rank's local position on every node (all-reduce of the shard)."""
    intra_ranks: list[list[int]]
    """Global ranks of every intra-node group, as built on all ranks."""
    inter_ranks: list[list[int]]
    """Global ranks of every inter-node group, as built on all ranks."""
    wire_dtype: torch.dtype | None = None
    """The dtype the bucket travels in (fp16/bf16 compression); None keeps the gradients' own."""
    buckets_reduced: int = field(default=0)
    """Buckets this rank has reduced through the hierarchy (it counts every hook call)."""

    @property
    def world(self) -> int:
        """Data-parallel ranks the gradient is averaged over."""
        return self.intra.size() * self.inter.size()


def hierarchical_all_reduce(tensor: torch.Tensor, state: HierarchicalAllReduce) -> torch.futures.Future[torch.Tensor]:
    """Average the flat `tensor` over all data-parallel ranks in place, in three steps; the
    future holds `tensor` once the last step (the intra-node all-gather) has landed.

    The first two steps wait for their predecessor before the next is issued, from this
    thread: every rank must issue the collectives of each group in the same order, and a
    step launched from a future's callback would run on the backend's completion thread and
    could overtake the next bucket's reduce-scatter on some ranks and not on others. On
    NCCL ``work.wait()`` only makes the current stream wait, so the host does not block; on
    gloo it does, which costs nothing because gloo reduces on the same cores that run
    backward (the plan turns overlap off there).
    """
    wire = tensor if state.wire_dtype is None else tensor.to(state.wire_dtype)
    # Divide first, as torch's hooks do, so a 16-bit sum over many ranks cannot overflow.
    wire.div_(state.world)
    m = state.intra.size()
    n = wire.numel()
    # reduce_scatter_tensor splits the input into m equal shards; pad the tail with zeros. (It and
    # all_gather_into_tensor exist in every torch this runs on; the newer *_single names do not.)
    flat = torch.nn.functional.pad(wire, (0, -n % m)) if n % m else wire
    shard = flat.new_empty(flat.numel() // m)
    dist.reduce_scatter_tensor(shard, flat, group=state.intra, async_op=True).wait()
    dist.all_reduce(shard, group=state.inter, async_op=True).wait()
    gathered = dist.all_gather_into_tensor(flat, shard, group=state.intra, async_op=True).get_future()
    state.buckets_reduced += 1

    def unpack(_: torch.futures.Future) -> torch.Tensor:
        if flat is not tensor:
            tensor.copy_(flat[:n])
        return tensor

    return gathered.then(unpack)


def hierarchical_hook(state: HierarchicalAllReduce, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket's average by :func:`hierarchical_all_reduce`."""
    return hierarchical_all_reduce(bucket.buffer(), state)


# DDP checks a hook's annotations by comparing them with dist.GradBucket and Future[Tensor];
# postponed evaluation (the __future__ import) leaves them as strings, so resolve them here.
hierarchical_hook.__annotations__ = typing.get_type_hints(hierarchical_hook)


def build_hierarchy(
    group: dist.ProcessGroup, node_of_rank: Sequence[str], wire_dtype: torch.dtype | None = None
) -> HierarchicalAllReduce | str:
    """The hierarchical all-reduce state over `group`, or why the all-reduce runs flat instead.

    Must be called on every rank of the job with the same arguments: ``new_group`` is
    collective over the whole world, so every rank creates every intra-node group and then
    every inter-node group, in the same order, including those it is not part of.
    """
    dp_ranks = dist.get_process_group_ranks(group)
    try:
        intra, inter = hierarchy_groups(dp_ranks, node_of_rank)
    except ValueError as e:
        return f"hierarchical all-reduce ran flat: {e}"
    if len(intra) == 1 or len(inter) == 1:
        shape = "one node" if len(intra) == 1 else "one data-parallel rank per node"
        return f"hierarchical all-reduce ran flat: the data-parallel group has {shape}, so there is no level to split"
    my_intra, _ = dist.new_subgroups_by_enumeration(intra, group_desc="dp_intra_node")
    my_inter, _ = dist.new_subgroups_by_enumeration(inter, group_desc="dp_inter_node")
    return HierarchicalAllReduce(my_intra, my_inter, intra, inter, wire_dtype)


def register_ddp_sync(
    ddp: DistributedDataParallel,
    group: dist.ProcessGroup,
    compression: str,
    algorithm: str = "flat",
    node_of_rank: Sequence[str] | None = None,
    warmup_steps: int = POWERSGD_MIN_WARMUP,
) -> tuple[HierarchicalAllReduce | None, list[str]]:
    """Register the DDP comm hook for the plan's `algorithm` and `compression` on `group`.

    Returns the hierarchical state (None when the all-reduce is flat) and notes on what ran
    differently from the plan. fp16/bf16 compression rides inside the hierarchical hook;
    PowerSGD is an all-reduce scheme of its own, so with it the schedule stays flat.
    """
    if algorithm not in SYNC_ALGORITHMS:
        raise ValueError(f"algorithm must be one of {SYNC_ALGORITHMS}, got {algorithm!r}")
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
    if algorithm == "flat":
        return None, register_ddp_compression(ddp, compression, group, warmup_steps)
    if node_of_rank is None:
        raise ValueError("a hierarchical all-reduce needs node_of_rank, the node of every rank")
    notes: list[str] = []
    if compression == "powersgd":
        notes.append("hierarchical all-reduce ran flat: powersgd compression is its own all-reduce scheme")
        return None, notes + register_ddp_compression(ddp, compression, group, warmup_steps)
    wire_dtype = _WIRE_DTYPES.get(compression)
    if compression == "bf16":
        reason = _bf16_unsupported(group)
        if reason:
            notes.append(reason)
            wire_dtype = None
    state = build_hierarchy(group, node_of_rank, wire_dtype)
    if isinstance(state, str):
        # The flat path applies (or skips, with its note) the compression on its own.
        return None, [state] + register_ddp_compression(ddp, compression, group)
    ddp.register_comm_hook(state, hierarchical_hook)
    return state, notes


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
