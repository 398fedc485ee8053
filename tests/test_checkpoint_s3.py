"""Checkpoints on a real S3 server (moto's, on 127.0.0.1, through s3fs, as `checkpoint.path=s3://`
reaches one): meta.json written last is the commit, a torn upload is never taken as committed,
and a background save's upload runs off the step's path."""

from __future__ import annotations

import threading

import pytest
import torch
from s3_server import S3Store, s3_server

from orchestrator.errors import CheckpointError
from orchestrator.runtime import checkpoint, checkpoint_files

# Each test writes and reads a few checkpoints over HTTP: about a second or two on a loaded host.
pytestmark = pytest.mark.slow

s3 = pytest.fixture(scope="module")(s3_server)


def _keys(store: S3Store, prefix: str) -> list[str]:
    """What the server itself holds under `prefix` (asked with boto3, not through fsspec)."""
    import boto3

    listed = boto3.client("s3").list_objects_v2(Bucket=store.bucket, Prefix=prefix)
    return sorted(o["Key"][len(prefix) + 1:] for o in listed.get("Contents", []))


def test_checkpoints_commit_prune_verify_and_load_on_the_server(one_rank, s3):
    root = s3.url("run")
    for step in (1, 2, 3):
        checkpoint.save(root, step, {"w": torch.full((16,), float(step))}, {"world_size": 1}, keep_last=2)
    committed = checkpoint_files.committed(root)
    assert committed == [f"{root}/step_00000002", f"{root}/step_00000003"]
    on_server = _keys(s3, "run")
    # written straight to the final name (no rename on S3), meta.json beside the shards
    assert {k.split("/")[0] for k in on_server} == {"step_00000002", "step_00000003"}
    assert "step_00000003/meta.json" in on_server and "step_00000003/.metadata" in on_server
    meta = checkpoint_files.verify(committed[-1])
    assert meta["step"] == 3 and set(meta["files"]) == {k.split("/", 1)[1] for k in on_server
                                                          if k.startswith("step_00000003/")} - {"meta.json"}
    state = {"w": torch.zeros(16)}
    checkpoint.load(committed[-1], state)
    assert torch.equal(state["w"], torch.full((16,), 3.0))
    with pytest.raises(CheckpointError, match="already exists; refusing to overwrite"):
        checkpoint.save(root, 3, {"w": torch.zeros(16)}, {}, keep_last=2)


def test_a_torn_upload_is_never_taken_as_committed(one_rank, s3):
    import boto3
    from rich.console import Console

    from orchestrator.record.checkpoint_scan import latest_whole_checkpoint

    root = s3.url("torn")
    for step in (1, 2, 3):
        checkpoint.save(root, step, {"w": torch.full((8,), float(step))}, {}, keep_last=5)
    client = boto3.client("s3")
    # step 3: every shard uploaded, the writer gone before meta.json
    client.delete_object(Bucket=s3.bucket, Key="torn/step_00000003/meta.json")
    # step 2: meta.json uploaded, one of the files it names not (a writer that lost its shard)
    shard = next(k for k in _keys(s3, "torn") if k.startswith("step_00000002/") and k.endswith(".distcp"))
    client.delete_object(Bucket=s3.bucket, Key=f"torn/{shard}")
    assert checkpoint_files.committed(root) == [f"{root}/step_00000001", f"{root}/step_00000002"]
    with pytest.raises(CheckpointError, match="never committed"):
        checkpoint_files.verify(f"{root}/step_00000003")
    with pytest.raises(CheckpointError, match=f"file {shard.split('/', 1)[1]} is missing"):
        checkpoint_files.verify(f"{root}/step_00000002")
    said = Console(record=True, width=300)
    path, step = latest_whole_checkpoint(root, said)
    assert (path, step) == (f"{root}/step_00000001", 1)
    warned = said.export_text()
    assert f"{root}/step_00000002: file {shard.split('/', 1)[1]} is missing; trying the previous" in warned
    state = {"w": torch.zeros(8)}
    checkpoint.load(path, state)
    assert torch.equal(state["w"], torch.ones(8))


def test_an_async_save_uploads_off_the_step_and_commits_only_when_asked(one_rank, s3, monkeypatch):
    import s3fs

    root = s3.url("async")
    group = checkpoint.writer_group()
    checkpoint.save(root, 2, {"w": torch.full((64,), 2.0)}, {"world_size": 1}, keep_last=3)
    # Hold every upload until released: an upload on the step's path would hang save_async itself.
    release, uploading = threading.Event(), threading.Event()
    held = s3fs.core.S3File._upload_chunk

    def slow_upload(self, final=False):
        uploading.set()
        assert release.wait(60), "the upload was never released"
        return held(self, final)

    monkeypatch.setattr(s3fs.core.S3File, "_upload_chunk", slow_upload)
    w = torch.full((64,), 4.0)
    pending = checkpoint.save_async(root, 4, {"w": w}, {"world_size": 1}, keep_last=3, group=group)
    w.add_(100.0)  # the next step changes the weights: the checkpoint holds the staged values
    assert uploading.wait(30) and not pending.upload.done()  # returned with the upload under way
    assert checkpoint_files.committed(root) == [f"{root}/step_00000002"]
    release.set()
    pending.upload.result(timeout=60)
    # every shard is on the server, meta.json is not: still not a checkpoint until the commit
    assert "step_00000004/.metadata" in _keys(s3, "async")
    assert checkpoint_files.committed(root) == [f"{root}/step_00000002"]
    path = pending.commit()
    assert path == f"{root}/step_00000004" and checkpoint_files.verify(path)["step"] == 4
    state = {"w": torch.zeros(64)}
    checkpoint.load(path, state)
    assert torch.equal(state["w"], torch.full((64,), 4.0))


def test_a_checkpoint_another_process_commits_is_seen_after_this_one_listed(one_rank, s3):
    # The driver lists the store, then the workers (other processes, other clients) commit a
    # newer checkpoint: the next listing must see it, not the one the client cached.
    import boto3
    from rich.console import Console

    from orchestrator.record.checkpoint_scan import latest_whole_checkpoint

    root = s3.url("others")
    checkpoint.save(root, 1, {"w": torch.ones(8)}, {}, keep_last=5)
    assert checkpoint_files.committed(root) == [f"{root}/step_00000001"]
    assert latest_whole_checkpoint(root, Console(quiet=True))[0] == f"{root}/step_00000001"
    client = boto3.client("s3")
    names = _keys(s3, "others/step_00000001")
    for name in sorted(names, key=lambda n: n == "meta.json"):  # meta.json last, as a commit writes it
        client.copy_object(Bucket=s3.bucket, Key=f"others/step_00000002/{name}",
                           CopySource={"Bucket": s3.bucket, "Key": f"others/step_00000001/{name}"})
    assert checkpoint_files.committed(root) == [f"{root}/step_00000001", f"{root}/step_00000002"]
    assert latest_whole_checkpoint(root, Console(quiet=True))[0] == f"{root}/step_00000002"
