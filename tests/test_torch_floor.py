"""The oldest torch pyproject.toml admits is one the code really runs on: its floor is the
newest release among the APIs that set it (each named with the release that brought it), and
every one of them is in the torch installed here."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

# The APIs that decide the floor, and the torch release each first shipped in (its release notes).
FLOOR_SETTERS = {
    # runtime/checkpoint.py imports it at the top: DCP's async save with a separate staging stage.
    ("torch.distributed.checkpoint.state_dict_saver", "AsyncSaveResponse"): (2, 9),
    # The public FSDP2, the compile stance the compile gain switches, the grad-norm helpers.
    ("torch.distributed.fsdp", "fully_shard"): (2, 6),
    ("torch.compiler", "set_stance"): (2, 6),
    ("torch.nn.utils", "get_total_norm"): (2, 6),
    ("torch.nn.utils", "clip_grads_with_norm_"): (2, 6),
}


def _floor() -> tuple[int, int]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from gpu_check import torch_floor
    finally:
        sys.path.pop(0)
    major, minor = torch_floor(ROOT / "pyproject.toml").split(".")[:2]
    return int(major), int(minor)


def test_the_floor_is_the_newest_release_the_code_needs():
    assert _floor() == max(FLOOR_SETTERS.values())


def test_every_api_that_sets_the_floor_is_in_this_torch():
    missing = [f"{m}.{n}" for m, n in FLOOR_SETTERS if not hasattr(importlib.import_module(m), n)]
    assert not missing, missing
    installed = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())
    assert installed >= _floor()
