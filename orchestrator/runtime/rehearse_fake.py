"""What the runtime needs to run on fake tensors and a fake process group, for a rehearsal only.

Each piece makes one step of the runtime that reads real storage, retypes tensors or waits for
a peer safe under FakeTensorMode, without changing what it allocates or sends; the peak tracker
is torch's MemTracker with what fake mode would make it miscount left out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

PROPAGATING: list[bool] = [False]
"""Whether DTensor is computing an op's output metadata (see `peak_tracker`)."""


CUDA_FP32_NORMS = ("layer_norm", "rms_norm")
"""Normalisations on CUDA autocast's fp32 list that CPU autocast leaves in their input's dtype
(`ATen/autocast_mode.h`): the only ops of either list whose difference changes what a
transformer keeps for backward (an fp32 norm output is copied to 16 bits by every matmul
reading it)."""


@contextlib.contextmanager
def cuda_autocast_norms() -> Iterator[None]:
    """While open, CPU autocast runs `CUDA_FP32_NORMS` in fp32 as CUDA's does: a rehearsal of a
    GPU plan, which runs on a CPU device, keeps what the GPU would. The kernels are registered
    for this scope only (a `torch.library` scope, unregistered when it closes)."""
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)

    def to_fp32(value: Any) -> Any:
        return value.float() if isinstance(value, torch.Tensor) and value.is_floating_point() else value

    def in_fp32(op: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            with torch._C._ExcludeDispatchKeyGuard(keys):  # CUDA's cast_policy::fp32
                return op(*map(to_fp32, args), **{k: to_fp32(v) for k, v in kwargs.items()})
        return run

    with torch.library._scoped_library("aten", "IMPL") as lib:
        for name in CUDA_FP32_NORMS:
            lib.impl(name, in_fp32(getattr(torch.ops.aten, name).default), "AutocastCPU")
        yield


def peak_tracker() -> Any:
    """torch's MemTracker counting every storage, with two differences.

    It keeps no per-module statistics (`NoModules`): those allow each module one forward per
    iteration, and accumulation and pipelines run several; the total, all the rehearsal reads,
    is kept at the dispatcher either way. And it leaves out what DTensor allocates to learn an
    op's output shapes: DTensor runs the op on global-shape tensors in the active fake mode,
    which under a rehearsal is the rehearsal's own, so MemTracker cannot tell them from the
    rank's tensors (a clip over FSDP2 gradients would count every weight whole)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class NoModules:
        """MemTracker's module tracker, tracking nothing: torch's ModTracker hooks every module's
        inputs for backward, which `torch.autograd.grad` (a pipeline stage's shape inference)
        refuses on leaf inputs."""

        is_bw = False
        parents: set[str] = set()

        def register_user_hooks(self, *hooks: Any) -> None:
            pass

        def clear_user_hooks(self) -> None:
            pass

        def get_known_fqn(self, module: Any) -> str:
            return ""

        def __enter__(self) -> None:
            pass

        def __exit__(self, *args: Any) -> None:
            pass

    class PeakTracker(MemTracker):
        def __init__(self) -> None:
            super().__init__()
            self._mod_tracker = NoModules()  # type: ignore[assignment]

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if PROPAGATING[0]:
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

    return PeakTracker()


class _ShapesOnly:
    """An `InitRecipe` that hands out uninitialised whole values: a rehearsal's tensors have no
    values, and computing them re-creates each module under fake mode, which torch cannot swap
    back into a module. Allocation, slicing and copying into the shards stay the runtime's."""

    def __init__(self, recipe: Any) -> None:
        self.recipe = recipe

    def full_value(self, name: str, device: torch.device) -> torch.Tensor:
        module_name, local = self.recipe.owners[name]
        p = getattr(self.recipe.stand_ins[module_name], local)
        return torch.empty(p.shape, dtype=p.dtype, device=device)

    def clear(self) -> None:
        pass


def _allocate_whole(module: Any, device: torch.device) -> None:
    """A replicated (DDP) model's parameters allocated in place of `materialize`'s `to_empty`:
    torch swaps a fake parameter into its module, and the swap refuses a tensor the fake mode
    holds weak references to. The same bytes are allocated; tied parameters stay one tensor."""
    import torch.nn as nn

    new: dict[int, nn.Parameter] = {}
    for mod in module.modules():
        for name, p in list(mod._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in new:
                new[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                          requires_grad=p.requires_grad)
            mod._parameters[name] = new[id(p)]


SENT_META: dict[str, Any] = {}
"""The forward metadata a rehearsed pipeline stage sent (its output: a block's hidden states)."""


def _keep_meta(stage: Any, meta: Any, dst_stage: int) -> None:
    """`PipelineStage._send_meta` in a rehearsal: keep the metadata for the stages rehearsed
    later instead of sending it (its peer is not there to receive it)."""
    from torch.distributed.pipelining._utils import _StageForwardMeta

    if isinstance(meta, _StageForwardMeta):
        SENT_META["forward"] = meta


def _peer_meta(stage: Any, src_stage: int) -> Any:
    """`PipelineStage._recv_meta` in a rehearsal: what the peer stage would have sent.

    Backward: the gradient of this stage's outputs, which torch derives from their metadata as
    the next stage does. Forward: the output of the stage before, which ends with a block as
    every stage but the last does: what the first stage, rehearsed first, kept (`_keep_meta`).
    """
    from torch.distributed.pipelining._utils import _derive_grad_metas, _StageBackwardMeta

    if src_stage > stage.stage_index:
        return _StageBackwardMeta(backward_metas=tuple(_derive_grad_metas(stage._stage_meta.outputs)))
    if "forward" not in SENT_META:
        raise RuntimeError("a later pipeline stage is rehearsed after the first one, whose output it receives: "
                           "rehearse rank 0 first (`rehearse` does)")
    return SENT_META["forward"]


@contextlib.contextmanager
def fake_safe_runtime() -> Iterator[None]:
    """The runtime's steps that read real storage or retype tensors, made fake-safe for the
    rehearsal only (what they allocate is unchanged).

    init_device_mesh reads its rank tensor back (`.tolist()`), which a fake tensor cannot do:
    the mesh is built outside fake mode (it holds rank numbers, no model memory). The
    per-shard initialisation goes through `_ShapesOnly`.
    DDP checks that every rank's parameters have the same shapes by reading their storages
    across processes: in one process there is nothing to compare, and a fake tensor has no
    storage.
    """
    import torch.nn.parallel.distributed as ddp_module
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from . import trainer as trainer_module

    build_mesh = trainer_module.build_mesh
    materialize: Any = getattr(trainer_module, "materialize", None)
    verify = ddp_module._verify_param_shape_across_processes

    def outside(fn: Any, *args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            return fn(*args, **kwargs)

    def mesh_outside_fake_mode(*args: Any, **kwargs: Any) -> Any:
        return outside(build_mesh, *args, **kwargs)

    def materialize_shapes(module: Any, recipe: Any, device: torch.device, aliases: Any) -> None:
        from torch.distributed.tensor import DTensor

        if any(isinstance(p, DTensor) for p in module.parameters()):
            materialize(module, _ShapesOnly(recipe), device, aliases)
        else:
            _allocate_whole(module, device)

    trainer_module.build_mesh = mesh_outside_fake_mode
    # Every mesh torch derives later (a flattened dp group, FSDP2's dp x tp mesh) finds this
    # rank's coordinates with nonzero(): rank numbers again, computed outside fake mode.
    from torch.distributed.device_mesh import DeviceMesh

    mesh_init = DeviceMesh.__init__
    DeviceMesh.__init__ = lambda self, *a, **k: outside(mesh_init, self, *a, **k)  # type: ignore[method-assign]
    # torch's pipeline stages vote over point-to-point whether their shapes are static and
    # read the vote back (`.item()`). Stages built without shapes, as the runtime builds them,
    # all vote dynamic in a real run; a fake group has no peer to vote with (some torch builds
    # refuse the vote on one outright), so the rehearsal records the outcome a real run reaches:
    # dynamic, whose metadata exchange `_peer_meta` and `_keep_meta` stand in for.
    from torch.distributed.pipelining._utils import InferenceMode
    from torch.distributed.pipelining.schedules import _PipelineSchedule
    from torch.distributed.pipelining.stage import PipelineStage

    warmup = _PipelineSchedule._warmup_p2p

    def decided_dynamic(self: Any, stages: list[Any], *args: Any, **kwargs: Any) -> None:
        if not all(isinstance(st, PipelineStage) for st in stages):
            outside(warmup, self, stages, *args, **kwargs)
            return
        for st in stages:
            st._inference_mode = InferenceMode.DYNAMIC

    _PipelineSchedule._warmup_p2p = decided_dynamic  # type: ignore[method-assign]
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    propagate = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagating(self: Any, *args: Any, **kwargs: Any) -> Any:
        PROPAGATING[0] = True
        try:
            return propagate(self, *args, **kwargs)
        finally:
            PROPAGATING[0] = False

    ShardingPropagator._propagate_tensor_meta_non_cached = propagating  # type: ignore[method-assign]
    recv_meta, send_meta = PipelineStage._recv_meta, PipelineStage._send_meta
    PipelineStage._recv_meta = _peer_meta  # type: ignore[method-assign]
    PipelineStage._send_meta = _keep_meta  # type: ignore[method-assign]
    if materialize is not None:
        trainer_module.materialize = materialize_shapes
    ddp_module._verify_param_shape_across_processes = lambda *a, **k: None
    try:
        yield
    finally:
        trainer_module.build_mesh = build_mesh
        DeviceMesh.__init__ = mesh_init  # type: ignore[method-assign]
        _PipelineSchedule._warmup_p2p = warmup  # type: ignore[method-assign]
        ShardingPropagator._propagate_tensor_meta_non_cached = propagate  # type: ignore[method-assign]
        PipelineStage._recv_meta, PipelineStage._send_meta = recv_meta, send_meta  # type: ignore[method-assign]
        if materialize is not None:
            trainer_module.materialize = materialize
        ddp_module._verify_param_shape_across_processes = verify


def forget_world() -> None:
    """Drop what DTensor cached about the world just destroyed: its sharding decisions hold the
    meshes they were made on, whose groups the next rank's world does not have."""
    from torch.distributed.tensor import DTensor

    prop = DTensor._op_dispatcher.sharding_propagator
    cached: Any
    for cached in (prop.propagate_op_sharding, getattr(prop, "_propagate_tensor_meta_cached", None)):
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
