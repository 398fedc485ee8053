"""Restoring a recovered group from its survivors' memory instead of a checkpoint.

Where the model states are replicated (DDP, HSDP's replica groups: the `dp_replicate` axis), a
survivor holds exactly what the dead rank of its replica group held. So when a rank fails, each
survivor takes its state as it leaves the broken group and then keeps a host copy (`hold`), the driver picks
one survivor per replica group that holds the newest step (`control/heal.py`), and that survivor
broadcasts its copy to the rest of its group once the group has re-formed (`restore`): no
storage is read, and no step since the last checkpoint is trained again.

A copy is held only when it is one whole step: a rank that applied a step's update but has not
made that step's metrics row holds none, and is restored like a replaced rank.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024
"""Tensors broadcast per coalesced call: DDP's own bucket for syncing module states."""


@dataclass(frozen=True)
class PeerRestore:
    """Where a recovered group's ranks take their state from: no checkpoint, a survivor."""

    step: int
    """The optimizer steps the held state has applied: training resumes at this step."""
    source: dict[int, int] = field(default_factory=dict)
    """Each rank's source: the survivor of its replica group that broadcasts the state."""

    def __post_init__(self) -> None:
        if self.step < 0:
            raise ValueError(f"a restore step is non-negative, got {self.step}")

    def __str__(self) -> str:
        return f"the survivors' memory (ranks {sorted(set(self.source.values()))})"


@dataclass
class Held:
    """One survivor's copy of its state, on the host."""

    step: int
    tensors: dict[str, Any]
    """Each tensor of the rank's state (its local shard, where it is a DTensor) by its name in
    `live_state` (`model/...`, `optimizer/<param>/exp_avg`)."""
    digest: str
    """SHA-256 over every tensor's name and bytes in order: replicas of one step agree on it."""


def digest(tensors: list[tuple[str, Any]]) -> str:
    """SHA-256 over each host tensor's name and bytes, in the order given."""
    import torch

    h = hashlib.sha256()
    for name, t in tensors:
        h.update(name.encode())
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def hold(live: list[tuple[str, Any]], step: int) -> Held:
    """A host copy of `live` (a rank's `live_state()`) after `step` optimizer steps. Nothing in
    it refers to the process group, so the group's connections can close while it is held. On
    the CPU the tensors are the state's own (no second copy); from a GPU they are copied to host
    memory, leaving the device free for the rebuilt model."""
    tensors = [(n, t.detach() if t.device.type == "cpu" else t.detach().to("cpu")) for n, t in live]
    return Held(step=step, tensors=dict(tensors), digest=digest(tensors))


def restore(live: list[tuple[str, Any]], held: Held | None, peers: PeerRestore, rank: int, group) -> None:
    """Fill `live` (a rebuilt rank's `live_state()`) in place with the state of this rank's
    source: the source copies in what it holds, then broadcasts it over `group`, the ranks of
    its replica group (the `dp_replicate` axis), which every member calls together."""
    import torch
    import torch.distributed as dist
    from torch.distributed.utils import _sync_params_and_buffers

    source = peers.source[rank]
    with torch.no_grad():
        if rank == source:
            _copy_held(live, held, peers.step, rank)
        members = dist.get_process_group_ranks(group)
        if len(members) == 1:
            return
        tensors = [t for _, t in live]
        device = next((t.device for t in tensors if t.device.type != "cpu"), torch.device("cpu"))
        # NCCL broadcasts device tensors only: the optimizer's CPU step counts travel staged.
        here = [t for t in tensors if t.device == device]
        elsewhere = [t for t in tensors if t.device != device]
        staged = [t.to(device) for t in elsewhere]
        _sync_params_and_buffers(group, here + staged, BROADCAST_BUCKET_BYTES, members.index(source))
        for t, s in zip(elsewhere, staged):
            t.copy_(s)


def _copy_held(live: list[tuple[str, Any]], held: Held | None, step: int, rank: int) -> None:
    if held is None or held.step != step:
        have = "nothing" if held is None else f"step {held.step}"
        raise RuntimeError(f"rank {rank} was chosen to restore step {step} from its memory but holds {have}")
    names = [n for n, _ in live]
    if names != list(held.tensors):
        differ = sorted(set(names) ^ set(held.tensors)) or names
        raise RuntimeError(f"rank {rank}'s held state does not match its rebuilt model's: {differ[:3]}")
    for name, t in live:
        if t.shape != held.tensors[name].shape:
            raise RuntimeError(f"rank {rank}'s held {name} is {tuple(held.tensors[name].shape)}, "
                               f"the rebuilt model's {tuple(t.shape)}")
        t.copy_(held.tensors[name])
