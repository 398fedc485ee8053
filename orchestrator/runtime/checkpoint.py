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

import json
import threading
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from ..errors import CheckpointError
from .checkpoint_files import META, filesystem, is_local, manifest, prune, step_dir_name, url_of, verify
from .state_names import canonical, restore_names, tied_aliases

_commit_lock = threading.Lock()
_fenced = False


def fence() -> None:
    """Commit no checkpoint from this process from now on; returns once a commit under way has
    finished. Called before the driver kills a world it chooses a resume point for: a rank that
    commits (and prunes) after that choice would leave the next world resuming from an older
    checkpoint than the newest, or from one pruned away. Ray's kill is asynchronous and another
    node's processes cannot be waited for, so the commit itself must be refused. A fenced
    process is killed next: nothing lifts the fence."""
    global _fenced
    with _commit_lock:
        _fenced = True


def _prepare(root: str, step: int) -> tuple[Any, str, str, str]:
    """Make the directory the shards of `step` go to (rank 0, then a barrier)."""
    fs, base = filesystem(root)
    final = f"{base}/{step_dir_name(step)}"
    target = f"{base}/.{step_dir_name(step)}.partial" if is_local(fs) else final
    if dist.get_rank() == 0:
        if fs.exists(f"{final}/{META}"):
            # Never overwrite a committed checkpoint: a user may be relying on it.
            raise CheckpointError(f"checkpoint {url_of(fs, final)} already exists; refusing to overwrite it")
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
    dist.all_gather_object(parts, mine if mine is not None else manifest(fs, target, dist.get_rank()))
    if dist.get_rank() == 0:
        files = {name: rec for part in parts for name, rec in (part or {}).items()}
        record = {"step": step, **meta, "files": dict(sorted(files.items()))}
        with _commit_lock:
            if _fenced:
                raise CheckpointError(f"checkpoint of step {step} not committed: this world is being stopped")
            with fs.open(f"{target}/{META}", "w") as f:
                f.write(json.dumps(record, indent=2))
            if target != final:
                fs.mv(target, final, recursive=True)
            prune(fs, base, keep_last)
    dist.barrier()
    return url_of(fs, final)


def save(root: str, step: int, state: dict[str, Any], meta: dict[str, Any], keep_last: int) -> str:
    """Write the checkpoint of `step` under `root`; returns the committed checkpoint's path."""
    fs, base, target, final = _prepare(root, step)
    dcp.save(state, checkpoint_id=url_of(fs, target))
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
    res = dcp.async_save(state, checkpoint_id=url_of(fs, target), process_group=group)
    if isinstance(res, AsyncSaveResponse):
        # An asynchronous stager copies in the background too: the next update would change
        # tensors it has not copied yet, and the checkpoint would hold two steps at once.
        res.staging_completion.result()
        written = res.upload_completion
    else:
        written = res
    rank = dist.get_rank()
    # Hashing this rank's shards is as long as reading them: done by the writer's side too.
    done: Future = Future()

    def hashed(f: Future) -> None:
        try:
            f.result()
            done.set_result(manifest(fs, target, rank))
        except BaseException as e:  # noqa: BLE001 - handed to commit(), which raises it
            done.set_exception(e)

    written.add_done_callback(hashed)
    return PendingSave(step, done, where, meta, keep_last)


def load(path: str, state: dict[str, Any]) -> None:
    """Fill `state` in place from the checkpoint at `path` (DCP reshards to this run's layout)."""
    try:
        dcp.load(state, checkpoint_id=path)
    except (Exception, CheckpointException) as e:  # DCP's collective failure is a BaseException
        raise CheckpointError(f"checkpoint {path} cannot be loaded into this run: {_first_cause(e)}") from e


def _first_cause(e: BaseException) -> str:
    """The first line of what went wrong: for DCP's collective failure, the lowest rank's own error."""
    if isinstance(e, CheckpointException) and e.failures:
        e = e.failures[min(e.failures)]
        if isinstance(e, tuple):  # (exception, traceback) where torch keeps both
            e = e[0]
    return (str(e).splitlines() or [type(e).__name__])[0]


def load_model_weights(path: str, model) -> None:
    """Load the model part of a checkpoint into a plain (unwrapped) module, with no process
    group: for evaluation, export, and checking runs against each other."""
    verify(path)
    aliases = tied_aliases(model)
    local = {"model": model.state_dict()}
    wanted = canonical(local, aliases)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*load in a single process.*")
        dcp.load(wanted, checkpoint_id=path, no_dist=True)
    model.load_state_dict(restore_names(local, wanted, aliases)["model"])
