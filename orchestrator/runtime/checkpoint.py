"""Sharded checkpoints with torch.distributed.checkpoint, committed atomically.

Every rank writes its shards into `.step_XXXXXXXX.partial/`; after DCP has written its
metadata and all ranks have passed a barrier, rank 0 writes `meta.json` and renames the
directory to `step_XXXXXXXX`. A checkpoint directory therefore exists whole or not at all, and
a crash mid-write leaves only a `.partial` directory that loading ignores. `meta.json` holds
the plain-data part of the state (step, world size, strategy), so loading never unpickles.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

_STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def save(root: str | Path, step: int, state: dict[str, Any], meta: dict[str, Any], keep_last: int) -> Path:
    """Write the checkpoint of `step` under `root`; returns the committed directory."""
    root = Path(root)
    final = root / step_dir_name(step)
    partial = root / f".{step_dir_name(step)}.partial"
    if dist.get_rank() == 0:
        if final.exists():
            # Never overwrite a committed checkpoint: a user may be relying on it.
            raise FileExistsError(f"checkpoint {final} already exists; refusing to overwrite it")
        root.mkdir(parents=True, exist_ok=True)
        if partial.exists():
            shutil.rmtree(partial)  # left by an interrupted write of this same step
    dist.barrier()
    dcp.save(state, checkpoint_id=str(partial))
    dist.barrier()
    if dist.get_rank() == 0:
        (partial / "meta.json").write_text(json.dumps({"step": step, **meta}, indent=2))
        partial.rename(final)
        _prune(root, keep_last)
    dist.barrier()
    return final


def _prune(root: Path, keep_last: int) -> None:
    for old in committed(root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def committed(root: str | Path) -> list[Path]:
    """Committed checkpoint directories under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name) and (p / "meta.json").is_file()]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))  # type: ignore[union-attr]


def read_meta(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / "meta.json").read_text())
