"""Checkpoint commit protocol on a filesystem URI (fsspec's in-memory filesystem stands in for
s3:// and gs://, where no rename exists and meta.json written last is the commit)."""

from __future__ import annotations

import socket

import fsspec
import pytest
import torch
import torch.distributed as dist

from orchestrator.errors import CheckpointError
from orchestrator.runtime import checkpoint


@pytest.fixture(scope="module")
def one_rank():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_uri_checkpoints_commit_prune_verify_and_load(one_rank):
    root = "memory://ckpt-test/run"
    for step in (1, 2, 3):
        checkpoint.save(root, step, {"w": torch.full((16,), float(step))}, {"world_size": 1}, keep_last=2)
    committed = checkpoint.committed(root)
    assert [c.rsplit("/", 1)[-1] for c in committed] == ["step_00000002", "step_00000003"]
    assert all(c.startswith("memory://") for c in committed)
    meta = checkpoint.verify(committed[-1])
    assert meta["step"] == 3 and meta["world_size"] == 1 and meta["files"]
    state = {"w": torch.zeros(16)}
    checkpoint.load(committed[-1], state)
    assert torch.equal(state["w"], torch.full((16,), 3.0))
    with pytest.raises(CheckpointError, match="already exists; refusing to overwrite"):
        checkpoint.save(root, 3, {"w": torch.zeros(16)}, {}, keep_last=2)


def test_uncommitted_or_damaged_uri_checkpoint_is_not_taken(one_rank):
    root = "memory://ckpt-test/torn"
    checkpoint.save(root, 1, {"w": torch.ones(8)}, {}, keep_last=3)
    checkpoint.save(root, 2, {"w": torch.ones(8) * 2}, {}, keep_last=3)
    fs = fsspec.filesystem("memory")
    fs.rm("/ckpt-test/torn/step_00000002/meta.json")  # a writer that died before its commit
    assert [c.rsplit("/", 1)[-1] for c in checkpoint.committed(root)] == ["step_00000001"]
    with pytest.raises(CheckpointError, match="never committed"):
        checkpoint.verify(f"{root}/step_00000002")
    shard = next(f for f in fs.find("/ckpt-test/torn/step_00000001") if f.endswith(".distcp"))
    fs.pipe(shard, fs.cat(shard)[:-4])  # truncated by a full disk
    with pytest.raises(CheckpointError, match="bytes, expected"):
        checkpoint.verify(f"{root}/step_00000001")
