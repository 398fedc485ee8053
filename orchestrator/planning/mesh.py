"""The device mesh: named axes, as torchtitan's ParallelDims names them.

Ranks are numbered as `init_device_mesh` numbers them: the last axis (tp) varies fastest, so a
tensor-parallel group is adjacent ranks, and node n holds ranks [n*g, (n+1)*g).
"""

from __future__ import annotations

from dataclasses import dataclass

AXES = ("dp_replicate", "dp_shard", "tp")
"""The mesh axes, outermost first."""


@dataclass(frozen=True)
class Mesh:
    """Ranks along each axis; their product is the world size."""

    dp_replicate: int = 1
    """Replicas of the model states (DDP's data parallelism, HSDP's replica groups)."""
    dp_shard: int = 1
    """Ranks model states are sharded over (ZeRO's N, HSDP's shard group)."""
    tp: int = 1
    """Tensor-parallel ranks, which split every block's matmuls."""

    def __post_init__(self) -> None:
        for axis in AXES:
            size = getattr(self, axis)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"mesh axis {axis} must be a positive integer, got {size!r}")

    @property
    def shape(self) -> tuple[int, ...]:
        """Sizes in `AXES` order, for `init_device_mesh`."""
        return tuple(getattr(self, a) for a in AXES)

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel ranks: those that take different samples of a step."""
        return self.dp_replicate * self.dp_shard

    def size(self, axis: str) -> int:
        if axis not in AXES:
            raise KeyError(f"mesh axes are {', '.join(AXES)}; got {axis!r}")
        return getattr(self, axis)

    def to_dict(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in AXES}

    @classmethod
    def from_dict(cls, d: dict[str, int]) -> "Mesh":
        unknown = set(d) - set(AXES)
        if unknown:
            raise ValueError(f"mesh axes are {', '.join(AXES)}; got {', '.join(sorted(unknown))}")
        return cls(**{a: int(d[a]) for a in AXES if a in d})

    def groups(self) -> dict[str, list[list[int]]]:
        """The rank sets varying along each axis, in init_device_mesh's numbering."""
        rep, shard, tp = self.shape
        return {
            "dp_replicate": [[(r * shard + s) * tp + t for r in range(rep)] for s in range(shard) for t in range(tp)],
            "dp_shard": [[(r * shard + s) * tp + t for s in range(shard)] for r in range(rep) for t in range(tp)],
            "tp": [[(r * shard + s) * tp + t for t in range(tp)] for r in range(rep) for s in range(shard)],
        }

    def __str__(self) -> str:
        return " x ".join(f"{a}={getattr(self, a)}" for a in AXES)


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
        return {"rank": self.rank, "node": self.node, "gpu": self.gpu, "nic": self.nic,
                "nvlink_domain": self.nvlink_domain}
