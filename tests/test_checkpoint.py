"""Checkpoint commit protocol on a filesystem URI (fsspec's in-memory filesystem stands in for
s3:// and gs://, where no rename exists and meta.json written last is the commit)."""

from __future__ import annotations

import fsspec
import pytest
import torch

from orchestrator.errors import CheckpointError
from orchestrator.runtime import checkpoint, checkpoint_files


def test_uri_checkpoints_commit_prune_verify_and_load(one_rank):
    root = "memory://ckpt-test/run"
    for step in (1, 2, 3):
        checkpoint.save(root, step, {"w": torch.full((16,), float(step))}, {"world_size": 1}, keep_last=2)
    committed = checkpoint_files.committed(root)
    assert [c.rsplit("/", 1)[-1] for c in committed] == ["step_00000002", "step_00000003"]
    assert all(c.startswith("memory://") for c in committed)
    meta = checkpoint_files.verify(committed[-1])
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
    assert [c.rsplit("/", 1)[-1] for c in checkpoint_files.committed(root)] == ["step_00000001"]
    with pytest.raises(CheckpointError, match="never committed"):
        checkpoint_files.verify(f"{root}/step_00000002")
    shard = next(f for f in fs.find("/ckpt-test/torn/step_00000001") if f.endswith(".distcp"))
    fs.pipe(shard, fs.cat(shard)[:-4])  # truncated by a full disk
    with pytest.raises(CheckpointError, match="bytes, expected"):
        checkpoint_files.verify(f"{root}/step_00000001")


def test_async_save_writes_the_staged_state_and_commits_only_when_asked(one_rank, tmp_path):
    from rich.console import Console

    from orchestrator.record.checkpoint_scan import latest_whole_checkpoint

    root = str(tmp_path)
    group = checkpoint.writer_group()
    checkpoint.save(root, 2, {"w": torch.full((64,), 2.0)}, {"world_size": 1}, keep_last=3)
    w = torch.full((64,), 4.0)
    pending = checkpoint.save_async(root, 4, {"w": w}, {"world_size": 1}, keep_last=3, group=group)
    w.add_(100.0)  # training goes on while the write runs: the checkpoint holds the staged values
    pending.upload.result()
    # killed between staging and commit: the shards are all on disk, meta.json is not
    assert [c.rsplit("/", 1)[-1] for c in checkpoint_files.committed(root)] == ["step_00000002"]
    assert latest_whole_checkpoint(root, Console(quiet=True))[1] == 2
    state = {"w": torch.zeros(64)}
    checkpoint.load(latest_whole_checkpoint(root, Console(quiet=True))[0], state)
    assert torch.equal(state["w"], torch.full((64,), 2.0))

    path = pending.commit()
    assert path.endswith("step_00000004") and checkpoint_files.verify(path)["step"] == 4
    checkpoint.load(path, state)
    assert torch.equal(state["w"], torch.full((64,), 4.0))
    assert not list(tmp_path.glob(".*partial"))


def test_async_save_waits_for_an_asynchronous_stager_before_training_goes_on(one_rank, tmp_path, monkeypatch):
    # DCP's stager may copy in a thread of its own; the update after save_async returns would
    # then race the copy, and the checkpoint would hold some tensors of the next step.
    import threading
    import time
    from concurrent.futures import Future

    from torch.distributed.checkpoint.staging import AsyncStager

    class SlowStager(AsyncStager):
        _synchronize_after_execute = False

        def stage(self, state_dict):
            staged: Future = Future()

            def copy():
                time.sleep(0.3)
                staged.set_result({k: v.clone() for k, v in state_dict.items()})

            threading.Thread(target=copy, daemon=True).start()
            return staged

        def synchronize_staging(self):
            pass

        def close(self):
            pass

    real = checkpoint.dcp.async_save
    monkeypatch.setattr(checkpoint.dcp, "async_save", lambda *a, **k: real(*a, async_stager=SlowStager(), **k))
    w = torch.full((64,), 4.0)
    pending = checkpoint.save_async(str(tmp_path), 4, {"w": w}, {"world_size": 1}, keep_last=1,
                                    group=checkpoint.writer_group())
    w.add_(100.0)  # the next step's update
    state = {"w": torch.zeros(64)}
    checkpoint.load(pending.commit(), state)
    assert torch.equal(state["w"], torch.full((64,), 4.0))


def test_a_fenced_rank_neither_commits_nor_prunes(one_rank, tmp_path, monkeypatch):
    # The driver fences a world before it chooses where the next one resumes: a commit after
    # that would leave a newer checkpoint the next world then refuses to overwrite, and its
    # pruning could delete the one chosen.
    monkeypatch.setattr(checkpoint, "_fenced", False)
    root = str(tmp_path)
    group = checkpoint.writer_group()
    checkpoint.save(root, 2, {"w": torch.full((8,), 2.0)}, {"world_size": 1}, keep_last=1)
    pending = checkpoint.save_async(root, 4, {"w": torch.full((8,), 4.0)}, {"world_size": 1}, keep_last=1,
                                    group=group)
    checkpoint.fence()
    with pytest.raises(CheckpointError, match="checkpoint of step 4 not committed"):
        pending.commit()
    with pytest.raises(CheckpointError, match="not committed"):
        checkpoint.save(root, 6, {"w": torch.full((8,), 6.0)}, {"world_size": 1}, keep_last=1)
    assert [c.rsplit("/", 1)[-1] for c in checkpoint_files.committed(root)] == ["step_00000002"]


def test_hash_shares_cover_every_file_once_keeping_each_writers_shards_together():
    files = {f"__{r}_{i}.distcp": {} for r in range(5) for i in range(2)} | {".metadata": {}}
    parts = checkpoint_files.shares({"files": files}, 2)
    assert len(parts) == 2 and sorted(n for p in parts for n in p) == sorted(files)
    owners = [{n.split("_")[2] for n in p if n.startswith("__")} for p in parts]
    assert not owners[0] & owners[1]
    assert checkpoint_files.shares({"files": files}, 50) and len(checkpoint_files.shares({"files": files}, 50)) == 5


def test_a_corrupted_file_is_found_by_the_share_that_holds_it(one_rank, tmp_path):
    path = checkpoint.save(str(tmp_path), 1, {"w": torch.ones(32)}, {}, keep_last=1)
    meta = checkpoint_files.verify(path)
    assert all(checkpoint_files.mismatched(path, names) == [] for names in checkpoint_files.shares(meta, 2))
    shard = next(tmp_path.glob("step_00000001/*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # same size, different bytes: only the hash sees it
    shard.write_bytes(bytes(data))
    bad = [line for names in checkpoint_files.shares(meta, 2) for line in checkpoint_files.mismatched(path, names)]
    assert bad == [f"checkpoint {path}: file {shard.name} is corrupted (checksum mismatch)"]


def test_a_resuming_trainer_only_allocates_and_takes_every_weight_from_the_checkpoint(one_rank, tmp_path,
                                                                                      monkeypatch):
    """Initialising weights a checkpoint then overwrites is the slowest part of building a large
    model: a trainer built to resume allocates them, loads, and only then times its compute."""
    from orchestrator.config import load_config
    from orchestrator.planning import plan_job
    from orchestrator.runtime import trainer as trainer_module
    from orchestrator.runtime.step_timer import StepTimer
    from orchestrator.runtime.trainer import Trainer
    from orchestrator.topology.model import ClusterTopology, cpu_node

    cfg = load_config(None, ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.block_size=16",
                             "train.global_batch_size=4", "train.max_steps=4", "cluster.num_workers=1"])
    plan = plan_job(cfg, ClusterTopology(nodes=[cpu_node(1)]))
    first = Trainer(cfg, plan, torch.device("cpu"))
    first.start()
    StepTimer(first).calibrate()
    for step in range(2):
        first.train_step(step)
    path = checkpoint.save(str(tmp_path), 2, first.state_dict(), first.checkpoint_meta(), keep_last=1)
    expected = {k: v.detach().clone() for k, v in first.par.model.state_dict().items()}
    next_loss = first.train_step(2).loss

    def never(*_a, **_k):
        raise AssertionError("a resuming trainer initialised its weights")

    monkeypatch.setattr(trainer_module, "materialize", never)
    monkeypatch.setattr(trainer_module, "init_recipe", never)
    resumed = Trainer(cfg, plan, torch.device("cpu"), resuming=True)
    assert resumed.start(path) == 2
    StepTimer(resumed).calibrate()  # the compute is timed on the loaded weights
    got = resumed.par.model.state_dict()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    assert resumed.train_step(2).loss == next_loss
    with pytest.raises(RuntimeError, match="built to resume .* no checkpoint to load"):
        Trainer(cfg, plan, torch.device("cpu"), resuming=True).start(None)
