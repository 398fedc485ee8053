"""Which device a rank trains on: what Ray assigned it, checked against what this process sees.

A GPU plan only runs on CPU where the node says its GPUs are simulated: its topology is declared
(`ORCHESTRATOR_TOPOLOGY_FILE`), as on a test cluster whose nodes tell Ray of GPUs they lack.
Anywhere else a rank that was given a GPU and finds no CUDA (a CPU build of torch, a missing
driver, a container started without its GPUs) would train a GPU plan on CPU at a fraction of its
speed with every figure wrong, so it stops before the process group forms, in one line.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError


class NoCudaDevice(UserError):
    """Ray gave a rank a GPU, this process has no CUDA, and the node does not declare its GPUs simulated."""


@dataclass(frozen=True)
class RankDevice:
    """Where one rank trains and how its process group talks."""

    kind: str
    """`cuda` or `cpu`."""
    index: int | None
    """The CUDA device index inside this process's `CUDA_VISIBLE_DEVICES`; None on CPU."""
    backend: str
    """The process group backend: `nccl` on CUDA, `gloo` on CPU."""
    note: str | None = None
    """One line for the run's notes where the rank runs other than planned (a simulated GPU)."""


def rank_device(assigned_gpu: int | None, visible_index: int | None, cuda_available: bool,
                declared_topology: str | None, rank: int) -> RankDevice:
    """The device rank `rank` trains on. `assigned_gpu`: the GPU Ray assigned it (None: none);
    `visible_index`: that GPU's index among the job's GPUs this process sees; `declared_topology`:
    the node's declared topology file, which marks its GPUs as simulated."""
    if assigned_gpu is None:
        return RankDevice("cpu", None, "gloo")
    if cuda_available:
        if visible_index is None:
            raise ValueError(f"rank {rank}: GPU {assigned_gpu} is assigned but not among the visible devices")
        return RankDevice("cuda", visible_index, "nccl")
    if declared_topology:
        return RankDevice("cpu", None, "gloo", f"Ray assigned GPU {assigned_gpu} but this process has no CUDA "
                                                f"device (the node's GPUs are declared by {declared_topology}): "
                                                "running on CPU with gloo")
    raise NoCudaDevice(
        f"rank {rank}: Ray assigned GPU {assigned_gpu} but this process has no CUDA device (a CPU build of torch, "
        "no driver, or a container without its GPUs); a GPU plan does not train on CPU: install a CUDA build of "
        "torch on the node, or declare simulated GPUs with ORCHESTRATOR_TOPOLOGY_FILE")
