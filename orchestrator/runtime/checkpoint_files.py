"""A committed checkpoint on disk: where each step's directory is, what meta.json records (the
step, the plan, the size and SHA-256 of every file), what counts as committed, and the checks
that a checkpoint is whole.

The format the writers (`checkpoint`) and the driver (verifying, resuming, stopping, exporting)
share. It imports no torch: verifying a checkpoint on every node before a resume, or listing a
stopped run's checkpoints, costs no framework import. Paths are local directories or fsspec
URIs (`s3://bucket/run`).
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

import fsspec

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


def filesystem(root: str):
    fs, path = fsspec.core.url_to_fs(str(root))
    return fs, path.rstrip("/")


def _current(root: str):
    """`filesystem(root)` with no listing this process cached: other processes (every rank, the
    driver) write checkpoints through clients of their own, so an object store's listing cached
    here (s3fs keeps them until this process writes there itself) would miss their commits."""
    fs, path = filesystem(root)
    fs.invalidate_cache()
    return fs, path


def is_local(fs) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def url_of(fs, path: str) -> str:
    return path if is_local(fs) else fs.unstrip_protocol(path)


def digest(fs, path: str) -> dict[str, Any]:
    h = hashlib.sha256()
    with fs.open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return {"bytes": fs.size(path), "sha256": h.hexdigest()}


def manifest(fs, directory: str, rank: int) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of the files this rank wrote: DCP names each rank's shards `__<rank>_*`;
    rank 0 also takes every other file (DCP's `.metadata`). Each rank reads only its own shards,
    so hashing a checkpoint takes as long as its largest shard, not the sum of them."""
    files = {}
    for f in sorted(fs.find(directory)):
        name = f[len(directory) + 1:]
        owner = re.match(r"__(\d+)_", name)
        if name != META and (int(owner.group(1)) == rank if owner else rank == 0):
            files[name] = digest(fs, f)
    return files


def prune(fs, base: str, keep_last: int) -> None:
    for old in committed(url_of(fs, base))[:-keep_last]:
        o_fs, o_path = filesystem(old)
        o_fs.rm(o_path, recursive=True)


def committed(root: str) -> list[str]:
    """Checkpoints under `root` that have been committed (meta.json present), oldest first."""
    fs, base = _current(root)
    if not fs.isdir(base):
        return []
    found = []
    for entry in fs.ls(base, detail=False):
        step = step_of(entry)
        if step is not None and fs.exists(f"{entry}/{META}"):
            found.append((step, url_of(fs, entry.rstrip("/"))))
    return [p for _, p in sorted(found)]


def verify(path: str, hashes: bool = True) -> dict[str, Any]:
    """meta.json of a committed checkpoint whose every file matches its manifest, else
    CheckpointError. `hashes=False` checks presence and sizes only (for ranks loading a
    checkpoint the driver has just verified in full)."""
    fs, p = _current(path)
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
        if hashes and digest(fs, f)["sha256"] != want["sha256"]:
            raise CheckpointError(f"checkpoint {path}: file {name} is corrupted (checksum mismatch)")
    return meta


def mismatched(path: str, names: list[str]) -> list[str]:
    """Of the files `names` of the committed checkpoint at `path`, those whose SHA-256 differs
    from meta.json, each as one line saying so."""
    fs, p = _current(path)
    files = read_meta(path)["files"]
    return [f"checkpoint {path}: file {n} is corrupted (checksum mismatch)" for n in names
            if digest(fs, f"{p}/{n}")["sha256"] != files[n]["sha256"]]


def shares(meta: dict[str, Any], parts: int) -> list[list[str]]:
    """meta.json's files dealt into at most `parts` lists: each writer rank's shards stay
    together, and the writers are dealt in turn (ranks hold about equal shares of the state)."""
    by_owner: dict[int, list[str]] = {}
    for name in meta.get("files", {}):
        writer = re.match(r"__(\d+)_", name)
        by_owner.setdefault(int(writer.group(1)) if writer else 0, []).append(name)
    out: list[list[str]] = [[] for _ in range(max(1, parts))]
    for i, owner in enumerate(sorted(by_owner)):
        out[i % len(out)].extend(by_owner[owner])
    return [x for x in out if x]


def newest_whole(root: str, check=verify, damaged=None) -> tuple[str, dict[str, Any]] | None:
    """The newest committed checkpoint under `root` that `check` (a path -> meta.json function
    raising CheckpointError) accepts, with its meta.json; each refused one is handed to
    `damaged(error)` and the previous tried. None when none is whole."""
    for path in reversed(committed(root)):
        try:
            return path, check(path)
        except CheckpointError as e:
            if damaged is not None:
                damaged(e)
    return None


def read_meta(path: str) -> dict[str, Any]:
    fs, p = filesystem(path)
    with fs.open(f"{p}/{META}", "r") as f:
        return json.loads(f.read())
