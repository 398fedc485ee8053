"""The device mesh: named axes, as torchtitan's ParallelDims names them.

Ranks are numbered as `init_device_mesh` numbers them: the last axis (tp) varies fastest, so a
tensor-parallel group is adjacent ranks, and node n holds ranks [n*g, (n+1)*g). Pipeline stages
(pp) are outermost: a stage is a contiguous block of ranks, so consecutive stages sit on
different nodes as soon as a stage fills a node (Narayanan et al. 2021: tensor parallelism
inside a node, pipeline across nodes).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import ClassVar

from ..serialize import from_plain, to_plain

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""The dense mesh's axes, outermost first (torchtitan's order: context parallelism sits between
the shard axis and tp, so a cp group is the next-adjacent ranks after a tp group)."""

EXPERT_AXES = ("pp", "dp_replicate", "efsdp", "ep")
"""The expert mesh's axes: a second factorisation of the same ranks, as torchtitan's sparse
mesh. `ep` borrows from `dp_shard x cp x tp` and is innermost, so an expert-parallel group is
adjacent ranks (the ones placement puts on one NVLink island); experts are FSDP-sharded over
`efsdp`, what remains of `dp_shard x cp x tp`."""


@dataclass(frozen=True)
class Mesh:
    """Ranks along each axis; their product is the world size."""

    PLAIN_KEYS: ClassVar[tuple[str, ...]] = AXES + ("ep",)
    """JSON writes the axes outermost first, as `shape` lists them, then the expert axis."""
    PLAIN_OMIT_AT_DEFAULT: ClassVar[tuple[str, ...]] = ("cp", "ep")
    """Written only above one, so a plan without context or expert parallelism reads as before."""

    dp_replicate: int = 1
    """Replicas of the model states (DDP's data parallelism, HSDP's replica groups)."""
    dp_shard: int = 1
    """Ranks model states are sharded over (ZeRO's N, HSDP's shard group)."""
    tp: int = 1
    """Tensor-parallel ranks, which split every block's matmuls."""
    pp: int = 1
    """Pipeline stages, each holding a contiguous run of blocks (the outermost axis; declared
    last so that `Mesh(dp_replicate, dp_shard, tp)` keeps meaning what it always meant)."""
    cp: int = 1
    """Context-parallel ranks, which split every sequence (and so the activations) between
    them; they take the same samples, and model states are sharded over `dp_shard x cp`."""
    ep: int = 1
    """Expert-parallel ranks, each holding `1/ep` of every MoE layer's experts. Not a factor of
    the world size: it borrows from `dp_shard x cp x tp` (see `EXPERT_AXES`)."""

    def __post_init__(self) -> None:
        for axis in AXES + ("ep",):
            size = getattr(self, axis)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"mesh axis {axis} must be a positive integer, got {size!r}")
        if self.borrowable % self.ep:
            raise ValueError(f"mesh axis ep={self.ep} must divide dp_shard x cp x tp "
                             f"({self.dp_shard} x {self.cp} x {self.tp} = {self.borrowable}), the ranks it borrows")

    @property
    def shape(self) -> tuple[int, ...]:
        """Sizes in `AXES` order, for `init_device_mesh`."""
        return tuple(getattr(self, a) for a in AXES)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def borrowable(self) -> int:
        """The ranks of one replica of one stage, which the expert axis refactors."""
        return self.dp_shard * self.cp * self.tp

    @property
    def efsdp(self) -> int:
        """Ranks each expert is FSDP-sharded over: what `ep` leaves of `dp_shard x cp x tp`."""
        return self.borrowable // self.ep

    @property
    def expert_shape(self) -> tuple[int, ...]:
        """Sizes in `EXPERT_AXES` order, for the expert mesh's `init_device_mesh`."""
        return (self.pp, self.dp_replicate, self.efsdp, self.ep)

    @property
    def dp(self) -> int:
        """Data-parallel ranks: those that take different samples of a step."""
        return self.dp_replicate * self.dp_shard

    def size(self, axis: str) -> int:
        if axis not in AXES + ("ep", "efsdp"):
            raise KeyError(f"mesh axes are {', '.join(AXES + ('ep', 'efsdp'))}; got {axis!r}")
        return getattr(self, axis)

    def to_dict(self) -> dict[str, int]:
        return to_plain(self)

    @classmethod
    def from_dict(cls, d: dict[str, int]) -> "Mesh":
        unknown = set(d) - set(cls.PLAIN_KEYS)
        if unknown:
            raise ValueError(f"mesh axes are {', '.join(cls.PLAIN_KEYS)}; got {', '.join(sorted(unknown))}")
        return from_plain(cls, d)

    def groups(self) -> dict[str, list[list[int]]]:
        """The rank sets varying along each axis, in init_device_mesh's numbering (pp, cp and ep
        only when they have more than one rank, so plans without them read as before)."""
        sizes = self.shape
        strides = [math.prod(sizes[i + 1:]) for i in range(len(sizes))]
        out = {}
        for i, axis in enumerate(AXES):
            if axis in _OPTIONAL_AXES and sizes[i] == 1:
                continue
            others = [range(n) for j, n in enumerate(sizes) if j != i]
            rows = []
            for idx in itertools.product(*others):
                base = sum(k * strides[j] for k, j in zip(idx, [j for j in range(len(sizes)) if j != i]))
                rows.append([base + k * strides[i] for k in range(sizes[i])])
            out[axis] = rows
        if self.ep > 1:
            # ep is innermost on the expert mesh: runs of `ep` consecutive ranks.
            out["ep"] = [list(range(start, start + self.ep)) for start in range(0, self.world_size, self.ep)]
        return out

    def __str__(self) -> str:
        shown = [f"{a}={getattr(self, a)}" for a in AXES if a not in _OPTIONAL_AXES or getattr(self, a) > 1]
        return " x ".join(shown + ([f"ep={self.ep}"] if self.ep > 1 else []))


_OPTIONAL_AXES = ("pp", "cp")
"""Axes left out of `groups()` and `str()` at size one, so plans without them read as before."""


@dataclass(frozen=True)
class RankPlacement:
    """Where one global rank runs."""

    rank: int
    node: str
    """The node's Ray node id (`node<i>` for a described cluster)."""
    gpu: int
    """The device index on that node (GPU index in PCI bus order, or CPU slot)."""
    nic: str | None = None
    """The NIC nearest the GPU (`mlx5_0`, or the capture's column name `NIC0` where it names
    no device) that carries this rank's traffic to other nodes; None when none is known."""
    nvlink_domain: str | None = None
    """The multi-node NVLink domain (`<fabric cluster uuid>/<clique>`) of the rank's node, which
    placement keeps it in; None when the node is in none."""

    def __post_init__(self) -> None:
        # Placement pins a rank to its node and the hierarchical all-reduce groups ranks by it.
        if not isinstance(self.node, str) or not self.node:
            raise ValueError(f"rank {self.rank} needs a non-empty node id, got {self.node!r}")
        if self.rank < 0 or self.gpu < 0:
            raise ValueError(f"rank and device index are non-negative, got rank {self.rank} device {self.gpu}")

    def to_dict(self) -> dict:
        return to_plain(self)
