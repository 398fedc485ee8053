"""Per-block `torch.compile`, as torchtitan applies it.

Each repeated block is compiled in place (`Module.compile`: parameter names, and with them
checkpoints, stay as they are) with `fullgraph=True`, after tensor parallelism and activation
checkpointing and before data parallelism wraps it, so FSDP2's and DDP's hooks stay outside the
compiled graphs and the blocks of one class share one compiled graph. Evaluation runs eager
(`eager_for_eval`): a forward without gradients is another graph, and compiling it would cost
more than the few evaluation batches save.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn

from orchestrator.workloads.models import block_slots


def compile_blocks(model: nn.Module) -> None:
    """Compile every repeated block of `model` in place."""
    for blocks, key in block_slots(model):
        blocks[key].compile(fullgraph=True)


@contextlib.contextmanager
def eager_for_eval(compiled: bool) -> Iterator[None]:
    """Run compiled blocks eager inside (no compile for the evaluation's own graph)."""
    if not compiled:
        yield
        return
    with torch.compiler.set_stance("force_eager"):
        yield


def cache_counters() -> dict[str, int]:
    """Inductor's compiled-graph cache hits and misses in this process so far: a restart or a
    resume on the same node finds the graphs its first run compiled (misses 0)."""
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return {"fxgraph_cache_hit": int(inductor.get("fxgraph_cache_hit", 0)),
            "fxgraph_cache_miss": int(inductor.get("fxgraph_cache_miss", 0))}
