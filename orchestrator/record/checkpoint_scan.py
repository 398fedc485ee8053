"""A checkpoint's integrity, checked in parallel across the cluster's nodes.

Hashing a 7B run's checkpoint with Adam state means reading about 84 GB; serially on the head
that is minutes before every resume. Sizes are checked on the driver (cheap, catches torn and
truncated writes); the SHA-256 of every file is computed by one task per alive node, each on
its share of the writers' shards, so the wall time is that of the largest share.
"""

from __future__ import annotations

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from rich.console import Console
from rich.markup import escape

from ..errors import CheckpointError
from ..runtime import checkpoint_files


@ray.remote(num_cpus=0)
def _mismatched(path: str, names: list[str]) -> list[str]:
    return checkpoint_files.mismatched(path, names)


def _alive_nodes() -> list[str]:
    return sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))


def verify_parallel(path: str) -> dict:
    """meta.json of the committed checkpoint at `path` when every file is present with its
    size and SHA-256, else CheckpointError naming the first bad file. Without a Ray
    connection, the hashes are checked here."""
    meta = checkpoint_files.verify(path, hashes=False)
    if not ray.is_initialized():
        return checkpoint_files.verify(path)
    nodes = _alive_nodes()
    refs = [
        _mismatched.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=True)).remote(path, names)
        for node, names in zip(nodes, checkpoint_files.shares(meta, len(nodes)))
    ]
    bad = [line for part in ray.get(refs) for line in part]
    if bad:
        raise CheckpointError(bad[0])
    return meta


def latest_whole_checkpoint(root: str, console: Console) -> tuple[str, int] | None:
    """The newest checkpoint under `root` that verifies (hashed in parallel across the nodes),
    with its step; damaged ones are named and skipped."""
    found = checkpoint_files.newest_whole(root, verify_parallel, lambda e: console.print(
        f"[yellow]warning:[/] {escape(str(e))}; trying the previous checkpoint"))
    return (found[0], int(found[1]["step"])) if found else None
