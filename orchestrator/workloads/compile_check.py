"""Whether a model's repeated block compiles as one graph, found before any worker starts.

The runtime compiles each block with `fullgraph=True` (torchtitan's per-block compile): a
block that breaks the graph would fail at its first forward on every rank. Dynamo traces the
block here on the meta device with its own eager backend, which costs no memory and no code
generation, so the planner knows before it decides, and `train.compile=true` can be refused in
one line naming the first break.
"""

from __future__ import annotations

import linecache
import logging
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo

from ..config import ModelConfig
from .hf import unpacked_sequences
from .models import block_list, build_model

_MAX_REASON = 160


def graph_break(m: ModelConfig, model_fn: Callable[..., Any] | None = None) -> str | None:
    """Where the block of the model `m` names (or `model_fn` builds) first breaks the graph, in
    one line (the reason and the source line); None when it compiles as one graph."""
    with torch.device("meta"):
        model = build_model(m, model_fn)
    blocks = block_list(model)
    del blocks[1:]  # the blocks repeat: the first one's inputs are every one's
    seen: dict[str, Any] = {}

    def keep(_mod, args, kwargs):
        seen.setdefault("inputs", (args, kwargs))

    hook = blocks[0].register_forward_pre_hook(keep, with_kwargs=True)
    try:
        with unpacked_sequences():
            model(torch.zeros(1, m.block_size, dtype=torch.long, device="meta"))
    finally:
        hook.remove()
    args, kwargs = seen["inputs"]
    # The break is said once, in the caller's line: dynamo's own warnings and log lines about it
    # would print around that line (a bad config's error is one line).
    quiet = logging.getLogger("torch._dynamo")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.compile(blocks[0], fullgraph=True, backend="eager")(*args, **kwargs)
    except torch._dynamo.exc.TorchDynamoException as e:
        return describe_break(e)
    finally:
        quiet.setLevel(level)
        torch._dynamo.reset()  # nothing traced here is kept for the real compile
    return None


def describe_break(e: BaseException) -> str:
    """One line for a graph break: the user's source line where dynamo stopped, then the reason."""
    reason = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
    if len(reason) > _MAX_REASON:
        reason = reason[:_MAX_REASON - 3] + "..."
    stack = getattr(e, "real_stack", None) or []
    if not stack:
        return reason
    frame = stack[-1]
    code = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
    return f"{os.path.basename(frame.filename)}:{frame.lineno} `{code}`: {reason}"
