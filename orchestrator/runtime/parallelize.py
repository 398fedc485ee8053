"""Apply a planned sharding strategy to a model with torch's own parallelism.

What runs arrives as the plan's :class:`~orchestrator.planning.resolve.Execution` (the one
statement of it the planner priced); :func:`build_mesh` turns its mesh into a ``DeviceMesh``
with the named axes (dp_replicate, dp_shard, tp) and :func:`parallelize` wraps the model:

========  ==========================================================================
ddp       ``DistributedDataParallel`` over all data-parallel ranks (buckets, comm hooks)
zero1     DDP for gradients + ``ZeroRedundancyOptimizer`` sharding optimizer state
zero2     FSDP2 ``fully_shard(reshard_after_forward=False)`` per block and root
zero3     FSDP2 ``fully_shard(reshard_after_forward=True)`` per block and root
hsdp      FSDP2 over the 2-D (dp_replicate, dp_shard) mesh: shard inside, replicate across
========  ==========================================================================

With ``tp > 1`` the blocks are first split with DTensor tensor parallelism and the data
parallelism is FSDP2 over the dp axes (2-D / 3-D composition, as torchtitan does).

For ddp, zero1, zero2 and zero3 the split of the data-parallel ranks between dp_replicate
and dp_shard does not change the strategy: they use all R*S data-parallel ranks as one
group. Only hsdp gives the two axes different roles.

Mixed precision follows torchtitan too: every FSDP2 unit gets a ``MixedPrecisionPolicy``
that all-gathers weights in the spec's ``param_dtype`` (the dtype autocast computes in) and
reduce-scatters gradients in fp32, so a bf16 run moves and holds half the bytes of gathered
weights while master weights and optimizer state stay fp32 shards. DDP and ZeRO-1 replicate
the fp32 weights and leave the casting to autocast.

This module imports torch only; the Ray worker calls it after ``init_process_group``.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from orchestrator.planning.mesh import AXES, Mesh
from orchestrator.planning.resolve import Execution
from orchestrator.runtime.comm_hooks import HierarchicalAllReduce, fsdp_policy, register_ddp_sync
from orchestrator.runtime.compile import compile_blocks as compile_model_blocks
from orchestrator.runtime.context_parallel import apply_context_parallel, gradient_mesh, replicate_shard_mesh
from orchestrator.runtime.expert_parallel import (
    apply_expert_parallel,
    expert_parallel_mesh,
    install_load_balancing,
    loss_group,
    shard_experts,
)
from orchestrator.runtime.tensor_parallel import apply_tensor_parallel
from orchestrator.workloads.models import apply_recompute, block_slots

_DCP_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def build_mesh(mesh: Mesh, device_type: str) -> DeviceMesh:
    """The job's mesh with its named axes; tp is innermost so a TP group is adjacent ranks.

    Adjacent ranks are what placement puts on one NVLink domain, so the innermost axis
    carries the most frequent collective.
    """
    if not dist.is_initialized():
        raise RuntimeError("build_mesh needs torch.distributed initialised (init_process_group) first")
    world = dist.get_world_size()
    if mesh.world_size != world:
        raise RuntimeError(f"the mesh {mesh} covers {mesh.world_size} ranks but the process group has {world}")
    return init_device_mesh(device_type, mesh.shape, mesh_dim_names=AXES)


def data_parallel_rank(mesh: DeviceMesh) -> tuple[int, int]:
    """(dp rank, dp world): this rank's share of the global batch; the ranks of one tp group share it."""
    r, s = mesh.get_local_rank("dp_replicate"), mesh.get_local_rank("dp_shard")
    size_s = mesh["dp_shard"].size()
    return r * size_s + s, mesh["dp_replicate"].size() * size_s


def _dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """A 1-D mesh over all ranks that average gradients: the data-parallel ranks and the cp ranks
    sharing their sequences (the flattened dp_replicate x dp_shard x cp)."""
    return gradient_mesh(mesh)


def _storage_bytes(tensors: Iterable[torch.Tensor], seen: set[int]) -> int:
    """Bytes of the distinct storages behind `tensors` (local shards of DTensors) not yet in `seen`."""
    total = 0
    for t in tensors:
        local = local_tensor(t)
        storage = local.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


@contextlib.contextmanager
def _without_empty_groups(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Hide parameter groups that hold no parameters, then put them back at their positions.

    ZeRO-1 partitions every group across ranks, so a rank can own nothing of a small group
    (e.g. the no-decay biases); the flattened DCP optimizer format names groups by their
    first parameter and cannot represent an empty one. ZeroRedundancyOptimizer matches its
    groups to the local optimizer's by index, hence the exact reinsertion.
    """
    groups = optimizer.param_groups
    empty = [i for i, g in enumerate(groups) if not g["params"]]
    if not empty:
        yield
        return
    optimizer.param_groups = [g for g in groups if g["params"]]
    try:
        yield
    finally:
        # load_state_dict may have installed new group dicts; keep those and restore the empties.
        restored = list(optimizer.param_groups)
        for i in empty:
            restored.insert(i, groups[i])
        optimizer.param_groups = restored


def _by_mesh(params: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Parameters grouped by their gradients' (mesh, placements): DTensors on different meshes
    (TP-sharded blocks on (dp, tp), replicated embeddings on dp only) cannot share one foreach."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        g = p.grad
        key = (g.device_mesh, g.placements) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(p)
    return list(groups.values())


def total_grad_norm(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all of `params`' gradients (each with a gradient), as a plain tensor: per
    (mesh, placements) group, the norm of this rank's shards, its square summed over the mesh
    axes the group is sharded on; then the groups' norms combined."""
    norms = []
    for group in _by_mesh(params):
        grads = [p.grad for p in group]
        if not isinstance(grads[0], DTensor):
            norms.append(torch.nn.utils.get_total_norm(grads))
            continue
        norms.append(_sharded_norm(grads))
    return torch.nn.utils.get_total_norm(norms)


def _sharded_norm(grads: list[Any]) -> torch.Tensor:
    """The whole 2-norm of DTensor gradients on one mesh with one placement each: this rank's
    shards' squares summed over every axis they are sharded on. (DTensor's own norm does the
    same reductions, and warns on every rank that an expert's two, over `efsdp` and `ep`,
    could be one.)"""
    mesh, placements = grads[0].device_mesh, grads[0].placements
    if any(pl.is_partial() for pl in placements):  # pending sums: their squares do not add up
        return torch.nn.utils.get_total_norm(grads).full_tensor()
    local = torch.nn.utils.get_total_norm([g.to_local() for g in grads]).float()
    names = mesh.mesh_dim_names or ()
    # Not `is_shard()`: FSDP2 over a tensor-parallel or expert shard places a `_StridedShard`,
    # which is not one.
    sharded = tuple(name for name, pl in zip(names, placements) if not pl.is_replicate())
    if not sharded:
        return local
    square = local ** 2
    # The mesh's own groups, not a slice or a flattened mesh of it: those are cached across
    # process groups, and a world re-formed after a failure would find the old one's.
    for name in sharded:
        dist.all_reduce(square, group=mesh.get_group(names.index(name)))
    return square.sqrt()


def clip_grads_with_norm(params: Iterable[torch.Tensor], max_norm: float, total: torch.Tensor) -> None:
    """Scale `params`' gradients so that a total norm of `total` becomes at most `max_norm`."""
    for group in _by_mesh(params):
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)


@dataclass
class Parallelized:
    """A model wrapped for its strategy, with the optimizer built over the wrapped parameters."""

    model: nn.Module
    """The wrapped model (DDP, or the GPT itself with FSDP2/TP applied in place); call it as the GPT."""
    optimizer: torch.optim.Optimizer
    """Steps this rank's parameters (a ZeroRedundancyOptimizer for zero1)."""
    notes: list[str] = field(default_factory=list)
    """What was done differently from the plan, and why (one sentence each)."""
    hierarchy: HierarchicalAllReduce | None = None
    """The hierarchical gradient all-reduce DDP runs (its groups, buckets reduced); None when flat."""
    keeps_gathered: bool = False
    """FSDP2 that keeps each unit's gathered weights from forward to backward (zero2): it keeps
    them across the micro-steps of a step too (`micro_step`)."""
    _synced_once: bool = field(default=False, init=False, repr=False)
    """Whether DDP has run a forward with gradient sync on (its graph-recording iteration)."""
    _grad_bytes_at_step: int = field(default=0, init=False, repr=False)
    """Gradient storage when the optimizer last stepped (all gradients are live then)."""

    def __post_init__(self) -> None:
        if isinstance(self.model, DistributedDataParallel):
            self.model.register_forward_pre_hook(self._note_sync)
        self.optimizer.register_step_pre_hook(self._note_grad_bytes)

    def _note_grad_bytes(self, *_: object) -> None:
        self._grad_bytes_at_step = self._grad_bytes()

    def _grad_bytes(self) -> int:
        return _storage_bytes((p.grad for p in self.model.parameters() if p.grad is not None), set())

    def _note_sync(self, module: DistributedDataParallel, _args: object) -> None:
        if module.require_backward_grad_sync:
            self._synced_once = True

    def zero_grad(self) -> None:
        """Zero the gradients between steps. DDP's are views of its buckets (see `parallelize`):
        zeroed in place, so accumulation keeps adding into the buckets; FSDP2's are dropped, as
        its sharded gradients are made anew by each reduce-scatter."""
        self.optimizer.zero_grad(set_to_none=not isinstance(self.model, DistributedDataParallel))

    @contextlib.contextmanager
    def micro_step(self, sync: bool, last: bool) -> Iterator[None]:
        """One micro-step's forward and backward: gradients reduced if `sync`; and where FSDP2
        keeps gathered weights to backward (zero2), kept past backward until the `last`
        micro-step of the step, as torch's pipeline stages do, so that every micro-step after
        the first gathers nothing (zero2 holds them all at the start of backward anyway)."""
        if self.keeps_gathered:
            for m in self.model.modules():
                if isinstance(m, FSDPModule):
                    m.set_reshard_after_backward(last, recurse=False)
        with contextlib.nullcontext() if sync else self.no_sync():
            yield

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Skip gradient synchronisation (use for all but the last micro-batch of an accumulation)."""
        if isinstance(self.model, DistributedDataParallel):
            if self.model.static_graph and not self._synced_once:
                # A static-graph DDP records the graph in its first iteration and cannot skip
                # that iteration's all-reduce; syncing every micro-batch once is still exact.
                return contextlib.nullcontext()
            return self.model.no_sync()
        return self._fsdp_no_sync()

    @contextlib.contextmanager
    def _fsdp_no_sync(self) -> Iterator[None]:
        fsdp = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        for m in fsdp:
            m.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for m in fsdp:
                m.set_requires_gradient_sync(True, recurse=False)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip all gradients to a global 2-norm of `max_norm`; returns the norm before clipping,
        as a 0-dim tensor on the device (reading it is the caller's choice: a `float()` here
        would stall the step until backward and its reductions have finished).

        Gradients can be DTensors on different meshes (TP-sharded blocks on (dp, tp),
        replicated embeddings on dp only), which one foreach norm cannot mix, so the norm
        is taken per (mesh, placements) group, each made whole with ``full_tensor`` (the
        cross-shard reduction), and combined.
        """
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return torch.zeros(())
        total = total_grad_norm(params)
        clip_grads_with_norm(params, max_norm, total)
        return total

    def _local_optimizer(self) -> torch.optim.Optimizer:
        # ZeRO-1 keeps this rank's shard of the state in an ordinary optimizer over its partition.
        if isinstance(self.optimizer, ZeroRedundancyOptimizer):
            return self.optimizer.optim
        return self.optimizer

    def state_bytes(self) -> dict[str, int]:
        """This rank's model-state storage in bytes: params, grads, optimizer.

        Counts real storages (padded FSDP2 shards, DDP's gradient buckets when grads are
        bucket views) and each storage once, so tied weights and views are not doubled.
        Gradients are those held now or, between ``zero_grad(set_to_none=True)`` and the
        next backward, those held at the last optimizer step: the steady-state footprint.
        """
        param_bytes = _storage_bytes(self.model.parameters(), set())
        states = (
            v for s in self._local_optimizer().state.values() for v in s.values() if isinstance(v, torch.Tensor)
        )
        optim_bytes = _storage_bytes(states, set())
        grad_bytes = self._grad_bytes() or self._grad_bytes_at_step
        return {"params": param_bytes, "grads": grad_bytes, "optimizer": optim_bytes}

    def state_dict(self) -> dict[str, Any]:
        """{"model", "optimizer"} state with FQN keys and sharded tensors, ready for ``dcp.save``.

        The optimizer state is flattened to one key per parameter and entry
        (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``), so every strategy writes the
        same keys and DCP can reshard between them. Under ZeRO-1 each key exists on the one
        rank that owns the parameter, which DCP saves from that rank alone.
        """
        optimizer = self._local_optimizer()
        _create_optimizer_state(optimizer)
        with _without_empty_groups(optimizer):
            model_sd, optim_sd = get_state_dict(self.model, optimizer, options=_DCP_OPTIONS)
        return {"model": model_sd, "optimizer": optim_sd}

    def live_state(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor of this rank's model and optimizer state where it lives (a DTensor as its
        local shard, a view), named, in an order the same model and optimizer always give; with
        no collective, so a rank can take it after its group broke (`peer_state.hold`), and fill
        it in place (`peer_state.restore`). The optimizer's part exists once it has stepped or
        :meth:`state_dict` created it."""
        # A step that failed half-way leaves FSDP2 units unsharded (their full parameters
        # registered): back to the sharded ones the optimizer steps, freeing the rest, locally.
        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()
        optimizer = self._local_optimizer()
        names = {id(p): n for n, p in self.model.named_parameters()}
        out = [(f"model/{n}", local_tensor(t)) for n, t in self.model.named_parameters()]
        out += [(f"buffer/{n}", local_tensor(t)) for n, t in self.model.named_buffers()]
        for group in optimizer.param_groups:
            for p in group["params"]:
                entries = optimizer.state.get(p, {})
                out += [(f"optimizer/{names[id(p)]}/{k}", local_tensor(entries[k])) for k in sorted(entries)
                        if isinstance(entries[k], torch.Tensor)]
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned (after ``dcp.load`` filled it in place)."""
        optimizer = self._local_optimizer()
        with _without_empty_groups(optimizer):
            set_state_dict(
                self.model,
                optimizer,
                model_state_dict=state_dict["model"],
                optim_state_dict=state_dict["optimizer"],
                options=_DCP_OPTIONS,
            )


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view of it), any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _create_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give an optimizer that has not stepped its state (Adam's moments), as torch's
    `get_state_dict` does itself where no gradient exists: DCP loads a checkpoint only into
    state that exists. DDP's gradients exist from the wrap on (its bucket views, zero until a
    backward), so torch declines; one step at learning rate 0 over them creates the state and
    moves no weight, and what a checkpoint holds then overwrites it."""
    if optimizer.state or not any(p.grad is not None for g in optimizer.param_groups for p in g["params"]):
        return
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    try:
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, lrs):
            g["lr"] = lr


def _zero_optimizer(
    model: nn.Module, make_optimizer: Callable[[nn.Module], torch.optim.Optimizer], group: dist.ProcessGroup
) -> ZeroRedundancyOptimizer:
    """ZeRO-1 with the optimizer class, parameter groups and options that `make_optimizer` chose."""
    template = make_optimizer(model)
    accepted = inspect.signature(type(template).__init__).parameters
    defaults = {k: v for k, v in template.defaults.items() if k in accepted}
    groups = [dict(g) for g in template.param_groups]
    # Each rank broadcasts its updated partition as one bucket after the step: one broadcast per
    # rank rather than one per parameter (hundreds of latencies for a transformer).
    return ZeroRedundancyOptimizer(groups, optimizer_class=type(template), process_group=group,
                                   parameters_as_bucket_view=True, **defaults)


def parallelize(
    model: nn.Module,
    ex: Execution,
    mesh: DeviceMesh,
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    device: torch.device,
    node_of_rank: tuple[str, ...] | None = None,
    static_graph: bool = False,
    materialize: Callable[[nn.Module], None] | None = None,
    compile_blocks: bool = False,
) -> Parallelized:
    """Wrap `model` as `ex` says on `mesh`: a model initialised identically on every rank, or
    one whose parameters are on the meta device, which `materialize` allocates and fills once
    the model is sharded (each rank then only ever holds its own shards).

    Order follows torchtitan: tensor parallelism, then activation checkpointing, then per-block
    compilation (`compile_blocks`), then data parallelism, then the optimizer over the resulting
    (possibly sharded) parameters.
    `node_of_rank` (the node of every global rank) groups a hierarchical all-reduce;
    `static_graph` is DDP's (the set of used parameters is the same every step).
    """
    if mesh.mesh_dim_names != AXES:
        raise ValueError(f"mesh must come from build_mesh with axes {AXES}; got {mesh.mesh_dim_names}")
    if tuple(mesh.mesh.shape) != ex.mesh.shape:
        raise ValueError(f"the device mesh has shape {tuple(mesh.mesh.shape)}, the execution is for {ex.mesh}")
    on_meta = any(p.is_meta for p in model.parameters())
    if on_meta and materialize is None:
        raise ValueError("the model's parameters are on the meta device and no materialize step was given")
    notes: list[str] = list(ex.notes)
    if not on_meta:
        model.to(device)
    if ex.mesh.tp > 1:
        apply_tensor_parallel(model, mesh["tp"])
    if ex.mesh.cp > 1:
        apply_context_parallel(model, mesh["cp"], ex.cp_attention)
    expert_mesh = expert_parallel_mesh(ex, device.type)
    if expert_mesh is not None:
        apply_expert_parallel(model, expert_mesh, mesh["tp"])
    apply_recompute(model, ex.recompute)
    if compile_blocks:
        compile_model_blocks(model)

    if ex.ddp_reduces:
        if on_meta:
            # DDP replicates whole weights: they exist before it wraps (it broadcasts rank 0's).
            assert materialize is not None
            materialize(model)
        group = _dp_mesh(mesh).get_group()
        # Gradients that exist when DDP wraps become views of its buckets for good (it copies
        # them in), and `Parallelized.zero_grad` keeps them: micro-steps under no_sync then
        # accumulate into the buckets. Left to autograd, the first no_sync backward allocates
        # gradients of its own beside the buckets, a second copy of every gradient at the peak.
        for p in model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        ddp = DistributedDataParallel(
            model,
            device_ids=[device] if device.type == "cuda" else None,
            process_group=group,
            bucket_cap_mb=ex.bucket_mb,
            gradient_as_bucket_view=True,
            static_graph=static_graph,
        )
        hierarchy, sync_notes = register_ddp_sync(
            ddp, group, str(ex.compression), str(ex.sync_algorithm), node_of_rank, ex.compression_warmup_steps
        )
        notes += sync_notes
        optimizer = _zero_optimizer(ddp, make_optimizer, group) if ex.zero_optimizer else make_optimizer(ddp)
        install_load_balancing(ddp, optimizer, loss_group(mesh), copies=ex.mesh.tp)
        return Parallelized(ddp, optimizer, notes, hierarchy)

    # FSDP2 over the 2-D (dp_replicate, dp_shard x cp) mesh replicates across the first axis (hsdp,
    # and ddp with tensor parallelism, whose shard axis has size one); else it shards over all
    # data-parallel ranks as one flat group.
    dp_mesh = replicate_shard_mesh(mesh) if ex.fsdp_replicates else _dp_mesh(mesh)
    policy, policy_notes = fsdp_policy(str(ex.param_dtype), str(ex.compression), _dp_mesh(mesh).get_group())
    notes += policy_notes
    if expert_mesh is not None:
        shard_experts(model, expert_mesh, ex.fsdp_replicates, ex.reshard_after_forward, policy, ex.mesh.dp * ex.mesh.cp)
    for blocks, key in block_slots(model):
        fully_shard(blocks[key], mesh=dp_mesh, reshard_after_forward=ex.reshard_after_forward, mp_policy=policy)
    # The root holds the embeddings and the output head, so a tied weight has one owner.
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=ex.reshard_after_forward, mp_policy=policy)
    if on_meta:
        assert materialize is not None
        materialize(model)  # sharded now: each rank allocates its own shards only
    optimizer = make_optimizer(model)
    install_load_balancing(model, optimizer, loss_group(mesh), copies=ex.mesh.tp)
    return Parallelized(model, optimizer, notes, keeps_gathered=not ex.reshard_after_forward)
