"""Where a process group meets: a store its rank 0 serves before any rank asks for it.

`init_process_group(init_method="tcp://...")` starts rank 0's store inside that call, so a rank
that gets there first finds nothing listening and connects again only after the client's
backoff, at every start and restart where the ranks arrive tens of milliseconds apart (the
figures: benchmarks/README.md, "Start-up settings"). Here rank 0 opens the store when the driver
asks where the group meets (`serve`, before any rank is told), and every rank then joins a store
already listening (`join`).
Each group gets a store of its own, on a port the system chose, so a group that re-forms after a
failure never meets in the broken one's store.

A group on NCCL starts bound to its rank's device (`device_id`): NCCL's communicator then starts
with the group, not at its first collective, and `barrier()` uses that device instead of guessing
one from the rank. Its watchdog only cleans up after a failed collective (`CLEAN_UP_ONLY`), so a
survivor outlives a lost peer and can join the next group with its state.

This module imports torch only.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

TIMEOUT = dist.constants.default_pg_timeout
"""How long a rank waits for the store and its peers: what `init_process_group` allows by default."""

PREFIX = "default_pg"
"""The default group's keys live under this prefix, as `init_process_group`'s own rendezvous
puts them, so other users of the store (the checkpoint writers' group) never collide with them."""

ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
"""What NCCL's watchdog does when a collective fails or times out."""

CLEAN_UP_ONLY = "2"
"""Abort the communicator and leave the process running (torch's default, 3, and 1 also tear the
process down): what survivors-kept recovery needs. A value the user set is kept."""


def group_options(backend: str, device: torch.device | None = None) -> dict[str, torch.device]:
    """What `init_process_group` needs beyond the rendezvous on `backend`: on NCCL the rank's
    `device` (the current CUDA device where none is given) as `device_id`, after setting the
    watchdog to clean up only where the environment does not say otherwise."""
    if backend != "nccl":
        return {}
    os.environ.setdefault(ASYNC_ERROR_HANDLING, CLEAN_UP_ONLY)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type != "cuda":
        raise ValueError(f"a group on nccl binds a CUDA device, not {device}")
    return {"device_id": device}


def serve(host: str) -> dist.TCPStore:
    """A store listening on `host`, at a port the system chose (`.port`): nothing can take the
    port between choosing and binding it. Rank 0 holds it until it `join`s the group."""
    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)


def join(rank: int, world: int, address: tuple[str, int], backend: str,
         served: dist.TCPStore | None = None, device: torch.device | None = None) -> None:
    """Join the default process group that meets at `address` (rank 0 passes the store it
    `serve`d there; the others connect to it), on NCCL bound to `device` (`group_options`)."""
    if rank == 0 and served is None:
        raise ValueError(f"rank 0 of the group at {address[0]}:{address[1]} must join with the store it "
                         "served there (serve() first)")
    store = served if served is not None else dist.TCPStore(address[0], address[1], is_master=False,
                                                            timeout=TIMEOUT)
    dist.init_process_group(backend=backend, store=dist.PrefixStore(PREFIX, store), rank=rank, world_size=world,
                            **group_options(backend, device))
