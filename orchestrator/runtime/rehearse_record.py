"""What a rehearsed rank sends: every collective, seen at torch's dispatcher, by mesh axis.

Both c10d's ops (`c10d.allreduce_`, `_allgather_base_`, `send`, ...) and DTensor's functional
collectives pass through the dispatcher, and so do those that C++ issues: DDP's reducer calls
its ProcessGroup, whose methods dispatch `c10d.allreduce_` as the Python API does, so the
default all-reduce of every bucket is seen without a Python comm hook. FSDP2 calls
`all_gather_into_tensor` / `reduce_scatter_tensor` (c10d's `_allgather_base_`,
`_reduce_scatter_base_`) and, for HSDP's replicas, `all_reduce`.

A fake process group completes its work with no value, which DDP's reducer and torch's comm
hooks read; the recorder hands back a work whose future holds the op's own tensors, as a real
backend's does.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..planning import Plan
from ..planning.mesh import AXES

# Dispatcher ops (without overload) -> the collective they are, in the traffic model's names.
_C10D_OPS = {
    "c10d.allreduce_": "all_reduce", "c10d.allreduce_coalesced_": "all_reduce",
    "c10d._allgather_base_": "all_gather", "c10d.allgather_": "all_gather",
    "c10d.allgather_coalesced_": "all_gather", "c10d.allgather_into_tensor_coalesced_": "all_gather",
    "c10d._reduce_scatter_base_": "reduce_scatter", "c10d.reduce_scatter_": "reduce_scatter",
    "c10d.reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "c10d.broadcast_": "broadcast", "c10d.reduce_": "reduce", "c10d.gather_": "gather", "c10d.scatter_": "scatter",
    "c10d.alltoall_base_": "all_to_all", "c10d.alltoall_": "all_to_all",
    "c10d.send": "send", "c10d.recv_": "recv", "c10d.recv_any_source_": "recv",
}
_FUNCTIONAL_OPS = {
    "all_reduce": "all_reduce", "all_reduce_": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all", "broadcast": "broadcast", "broadcast_": "broadcast",
}
_FUNCTIONAL_NAMESPACES = ("_c10d_functional.", "_c10d_functional_autograd.")


@dataclass(frozen=True)
class Collective:
    """The collectives of one kind on one group that a rank issues in one step."""

    op: str
    """all_reduce, all_gather, reduce_scatter, broadcast, send, recv, all_to_all, ..."""
    axis: str
    """The mesh axis the group spans (pp, dp_replicate, dp_shard, tp), `dp` for the flattened
    data-parallel group, `world` for all ranks, else `ranks a,b,...`."""
    count: int
    """Calls in the step."""
    bytes: int
    """Their bytes: the largest buffer of each call as the rank hands it to torch (all_gather:
    the output; reduce_scatter: the input; all_reduce, broadcast, send, recv: the tensor)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _nbytes(x: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(x) if isinstance(t, torch.Tensor))


class AxisNames:
    """Names a process group by the mesh axis whose ranks it holds, for one rank."""

    def __init__(self, plan: Plan, rank: int) -> None:
        self.names: dict[frozenset[int], str] = {}
        mesh = plan.mesh
        for axis, rows in plan.groups.items():
            if mesh.size(axis) > 1:
                row = next(r for r in rows if rank in r)
                self.names.setdefault(frozenset(row), axis)
        if mesh.cp > 1 and mesh.dp_shard > 1:
            # FSDP's group under context parallelism: dp_shard x cp flattened (`replicate_shard_mesh`).
            self.names.setdefault(_varying(plan, rank, ("dp_shard", "cp")), "dp_shard_cp")
        # The flattened data-parallel group: the ranks sharing this rank's pp and tp positions.
        tp, dp = mesh.tp, mesh.dp
        stage, pos = divmod(rank, dp * tp)
        dp_ranks = frozenset(stage * dp * tp + i * tp + pos % tp for i in range(dp))
        if len(dp_ranks) > 1:
            self.names.setdefault(dp_ranks, "dp")
        self.names.setdefault(frozenset(range(plan.world_size)), "world")

    def __call__(self, ranks: list[int]) -> str:
        key = frozenset(ranks)
        if key in self.names:
            return self.names[key]
        if len(ranks) == 1:
            return "self"
        shown = ",".join(map(str, sorted(ranks)[:8]))
        return f"ranks {shown}" + (",..." if len(ranks) > 8 else "")


def _varying(plan: Plan, rank: int, axes: tuple[str, ...]) -> frozenset[int]:
    """The ranks that share `rank`'s position on every mesh axis but `axes` (init_device_mesh's
    row-major numbering over the mesh's axes)."""
    sizes = plan.mesh.shape
    index = []
    for size in reversed(sizes):
        rank, i = divmod(rank, size)
        index.append(i)
    index.reverse()
    spans = [range(size) if name in axes else [i] for name, size, i in zip(AXES, sizes, index)]
    return frozenset(_ravel(point, sizes) for point in itertools.product(*spans))


def _ravel(point: tuple[int, ...], sizes: tuple[int, ...]) -> int:
    """The rank at mesh coordinates `point`."""
    flat = 0
    for i, size in zip(point, sizes):
        flat = flat * size + i
    return flat


def _group_of(func: Any, args: tuple, kwargs: dict) -> dist.ProcessGroup | None:
    """The process group a collective runs on: a functional collective names it (its schema's
    `group_name`), a c10d op carries the ProcessGroup itself."""
    names = [a.name for a in func._schema.arguments]
    if "group_name" in names:
        from torch.distributed.distributed_c10d import _resolve_process_group

        i = names.index("group_name")
        return _resolve_process_group(kwargs["group_name"] if "group_name" in kwargs else args[i])
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()):
            return dist.ProcessGroup.unbox(a)
    return None


class CollectiveRecorder(TorchDispatchMode):
    """Sees every collective at the dispatcher; while `recording`, counts it by (op, axis)."""

    def __init__(self, axis_of: AxisNames) -> None:
        super().__init__()
        self.axis_of = axis_of
        self.recording = False
        self.seen: dict[tuple[str, str], list[int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor run its local ops (and collectives) first
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func.overloadpacket)  # e.g. "c10d.allreduce_", "_c10d_functional.all_reduce"
        op = _C10D_OPS.get(name)
        if op is None and name.startswith(_FUNCTIONAL_NAMESPACES):
            op = _FUNCTIONAL_OPS.get(name.split(".", 1)[1])
        if op is None:
            return out
        if self.recording:
            group = _group_of(func, args, kwargs)
            axis = self.axis_of(dist.get_process_group_ranks(group)) if group is not None else "world"
            size = max([_nbytes(a) for a in args] + [_nbytes(out)])
            entry = self.seen.setdefault((op, axis), [0, 0])
            entry[0] += 1
            entry[1] += size
        return _with_result_future(out)

    def collectives(self) -> tuple[Collective, ...]:
        return tuple(Collective(op, axis, n, b) for (op, axis), (n, b) in sorted(self.seen.items()))


def _with_result_future(out: Any) -> Any:
    """A c10d op's (tensors, work) with a work whose future holds the tensors, as a real
    backend's work does (the fake backend's future holds None, which DDP's reducer rejects)."""
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], torch.ScriptObject)):
        return out
    tensors = out[0] if isinstance(out[0], list) else [out[0]]
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(tensors)
    return out[0], torch._C._distributed_c10d._create_work_from_future(fut).boxed()
