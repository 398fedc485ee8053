"""Sharded checkpoints with torch.distributed.checkpoint, committed atomically.

Every rank writes its shards into `.step_NNNNNNNN.partial/`. After DCP has written its
metadata and all ranks have passed a barrier, rank 0 writes `meta.json` (step, world size,
strategy, and the size and SHA-256 of every file) and, on a local filesystem, renames the
directory to `step_NNNNNNNN`. On object stores (`s3://`, `gs://`, any fsspec URI), where a
rename is a copy, shards go straight to the final name and `meta.json`, written last, is the
commit. Either way a checkpoint counts only when its `meta.json` exists and every file matches
it, so a crash mid-write leaves the previous checkpoint as the latest whole one. `meta.json`
holds the plain-data state, so loading never unpickles anything.
"""

from __future__ import annotations

import hashlib
import json
import re
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import fsspec
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from ..errors import CheckpointError

_STEP_DIR = re.compile(r"^step_(\d{8})$")
META = "meta.json"


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of(path: str) -> int | None:
    """The step a checkpoint directory's name holds (`.../step_00000024` is 24); None for any
    other name."""
    m = _STEP_DIR.match(str(path).rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


def _fs(root: str):
    fs, path = fsspec.core.url_to_fs(str(root))
    return fs, path.rstrip("/")


def _is_local(fs) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def _url(fs, path: str) -> str:
    return path if _is_local(fs) else fs.unstrip_protocol(path)


def _digest(fs, path: str) -> dict[str, Any]:
    h = hashlib.sha256()
    with fs.open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return {"bytes": fs.size(path), "sha256": h.hexdigest()}


def _manifest(fs, directory: str, rank: int) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of the files this rank wrote: DCP names each rank's shards `__<rank>_*`;
    rank 0 also takes every other file (DCP's `.metadata`). Each rank reads only its own shards,
    so hashing a checkpoint takes as long as its largest shard, not the sum of them."""
    files = {}
    for f in sorted(fs.find(directory)):
        name = f[len(directory) + 1:]
        owner = re.match(r"__(\d+)_", name)
        if name != META and (int(owner.group(1)) == rank if owner else rank == 0):
            files[name] = _digest(fs, f)
    return files


def _prepare(root: str, step: int) -> tuple[Any, str, str, str]:
    """Make the directory the shards of `step` go to (rank 0, then a barrier)."""
    fs, base = _fs(root)
    final = f"{base}/{step_dir_name(step)}"
    target = f"{base}/.{step_dir_name(step)}.partial" if _is_local(fs) else final
    if dist.get_rank() == 0:
        if fs.exists(f"{final}/{META}"):
            # Never overwrite a committed checkpoint: a user may be relying on it.
            raise CheckpointError(f"checkpoint {_url(fs, final)} already exists; refusing to overwrite it")
        if fs.exists(target):
            fs.rm(target, recursive=True)  # left by an interrupted write of this same step
        fs.makedirs(target, exist_ok=True)
    dist.barrier()
    return fs, base, target, final


def _commit(fs, base: str, target: str, final: str, step: int, meta: dict[str, Any], keep_last: int,
            mine: dict[str, dict[str, Any]] | None = None) -> str:
    """Every rank's shards are written: gather the manifests (`mine`: this rank's, when already
    made), write meta.json last, rename."""
    parts: list[dict[str, Any] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine if mine is not None else _manifest(fs, target, dist.get_rank()))
    if dist.get_rank() == 0:
        files = {name: rec for part in parts for name, rec in (part or {}).items()}
        record = {"step": step, **meta, "files": dict(sorted(files.items()))}
        with fs.open(f"{target}/{META}", "w") as f:
            f.write(json.dumps(record, indent=2))
        if target != final:
            fs.mv(target, final, recursive=True)
        _prune(fs, base, keep_last)
    dist.barrier()
    return _url(fs, final)


def save(root: str, step: int, state: dict[str, Any], meta: dict[str, Any], keep_last: int) -> str:
    """Write the checkpoint of `step` under `root`; returns the committed checkpoint's path."""
    fs, base, target, final = _prepare(root, step)
    dcp.save(state, checkpoint_id=_url(fs, target))
    return _commit(fs, base, target, final, step, meta, keep_last)


def writer_group():
    """The process group background writes use (call on every rank, after the default group
    starts). Its own gloo group: DCP's collectives run in the writer thread, and sharing the
    training group would interleave them with the step's collectives (NCCL cannot run them on
    CPU at all)."""
    return dist.new_group(backend="gloo")


@dataclass
class PendingSave:
    """A checkpoint copied to CPU memory and being written in the background. Training goes
    on; `commit()` (every rank, at the same step) waits for this rank's write and then commits
    exactly as `save` does, so until it returns the previous checkpoint is the latest whole one."""

    step: int
    upload: Future
    """This rank's write; then its manifest (the files' sizes and hashes), also made in the background."""
    where: tuple[Any, str, str, str]
    meta: dict[str, Any]
    keep_last: int

    def commit(self) -> str:
        mine = self.upload.result()  # this rank's shards (and, on rank 0, DCP's metadata) are written
        fs, base, target, final = self.where
        dist.barrier()  # every rank's background write has finished
        return _commit(fs, base, target, final, self.step, self.meta, self.keep_last, mine)


def save_async(root: str, step: int, state: dict[str, Any], meta: dict[str, Any], keep_last: int,
               group) -> PendingSave:
    """Stage `state` to CPU memory now (the only part training waits for) and write it in a
    background thread over `group` (`writer_group`); commit with the returned `PendingSave`."""
    where = _prepare(root, step)
    fs, _, target, _ = where
    res = dcp.async_save(state, checkpoint_id=_url(fs, target), process_group=group)
    written = res.upload_completion if isinstance(res, AsyncSaveResponse) else res
    rank = dist.get_rank()
    # Hashing this rank's shards is as long as reading them: done by the writer's side too.
    done: Future = Future()

    def hashed(f: Future) -> None:
        try:
            f.result()
            done.set_result(_manifest(fs, target, rank))
        except BaseException as e:  # noqa: BLE001 - handed to commit(), which raises it
            done.set_exception(e)

    written.add_done_callback(hashed)
    return PendingSave(step, done, where, meta, keep_last)


def _prune(fs, base: str, keep_last: int) -> None:
    for old in committed(_url(fs, base))[:-keep_last]:
        o_fs, o_path = _fs(old)
        o_fs.rm(o_path, recursive=True)


def committed(root: str) -> list[str]:
    """Checkpoints under `root` that have been committed (meta.json present), oldest first."""
    fs, base = _fs(root)
    if not fs.isdir(base):
        return []
    found = []
    for entry in fs.ls(base, detail=False):
        step = step_of(entry)
        if step is not None and fs.exists(f"{entry}/{META}"):
            found.append((step, _url(fs, entry.rstrip("/"))))
    return [p for _, p in sorted(found)]


def verify(path: str, hashes: bool = True) -> dict[str, Any]:
    """meta.json of a committed checkpoint whose every file matches its manifest, else
    CheckpointError. `hashes=False` checks presence and sizes only (for ranks loading a
    checkpoint the driver has just verified in full)."""
    fs, p = _fs(path)
    try:
        with fs.open(f"{p}/{META}", "r") as f:
            meta = json.loads(f.read())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path}: no {META}, so it was never committed (a partial write)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: {META} is corrupted ({e})") from None
    for name, want in meta.get("files", {}).items():
        f = f"{p}/{name}"
        if not fs.exists(f):
            raise CheckpointError(f"checkpoint {path}: file {name} is missing")
        if fs.size(f) != want["bytes"]:
            raise CheckpointError(f"checkpoint {path}: file {name} has {fs.size(f)} bytes, expected {want['bytes']}")
        if hashes and _digest(fs, f)["sha256"] != want["sha256"]:
            raise CheckpointError(f"checkpoint {path}: file {name} is corrupted (checksum mismatch)")
    return meta


def mismatched(path: str, names: list[str]) -> list[str]:
    """Of the files `names` of the committed checkpoint at `path`, those whose SHA-256 differs
    from meta.json, each as one line saying so."""
    fs, p = _fs(path)
    files = read_meta(path)["files"]
    return [f"checkpoint {path}: file {n} is corrupted (checksum mismatch)" for n in names
            if _digest(fs, f"{p}/{n}")["sha256"] != files[n]["sha256"]]


def shares(meta: dict[str, Any], parts: int) -> list[list[str]]:
    """meta.json's files dealt into at most `parts` lists: each writer rank's shards stay
    together, and the writers are dealt in turn (ranks hold about equal shares of the state)."""
    by_owner: dict[int, list[str]] = {}
    for name in meta.get("files", {}):
        owner = re.match(r"__(\d+)_", name)
        by_owner.setdefault(int(owner.group(1)) if owner else 0, []).append(name)
    out: list[list[str]] = [[] for _ in range(max(1, parts))]
    for i, owner in enumerate(sorted(by_owner)):
        out[i % len(out)].extend(by_owner[owner])
    return [x for x in out if x]


def load(path: str, state: dict[str, Any]) -> None:
    """Fill `state` in place from the checkpoint at `path` (DCP reshards to this run's layout)."""
    try:
        dcp.load(state, checkpoint_id=path)
    except Exception as e:
        raise CheckpointError(f"checkpoint {path} cannot be loaded into this run: {str(e).splitlines()[0]}") from e


def read_meta(path: str) -> dict[str, Any]:
    fs, p = _fs(path)
    with fs.open(f"{p}/{META}", "r") as f:
        return json.loads(f.read())


def load_model_weights(path: str, model) -> None:
    """Load the model part of a checkpoint into a plain (unwrapped) module, with no process
    group: for evaluation, export, and checking runs against each other."""
    verify(path)
    sd = model.state_dict()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*load in a single process.*")
        dcp.load({"model": sd}, checkpoint_id=path, no_dist=True)
    model.load_state_dict(sd)
