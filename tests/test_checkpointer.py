"""The checkpointer (`runtime/checkpointer.py`): when a rank checkpoints, and that a background
write commits only after the next step's row was sent, every row before it flushed first."""

from __future__ import annotations

import pytest

from orchestrator.config import CheckpointConfig
from orchestrator.runtime import checkpointer as checkpointer_module
from orchestrator.runtime.checkpointer import Checkpointer
from orchestrator.runtime.messages import Committed


class _Trainer:
    def state_dict(self):
        return {"w": 1}

    def checkpoint_meta(self):
        return {"world_size": 2}


class _Pending:
    def __init__(self, step: int, events: list) -> None:
        self.step = step
        self._events = events

    def commit(self) -> str:
        self._events.append(f"commit {self.step}")
        return f"/ckpt/step_{self.step}"


class _Sink:
    def __init__(self, events: list) -> None:
        self._events = events

    def add(self, item, urgent: bool = False) -> None:
        assert urgent, "a commit goes to the driver at once"
        self._events.append(item)

    def flush(self) -> None:
        self._events.append("flush")

    def end(self) -> None:
        pass


@pytest.fixture
def events(monkeypatch):
    got: list = []

    def save_async(root, step, state, meta, keep_last, group):
        got.append(f"write {step} in the background, keep {keep_last}")
        return _Pending(step, got)

    def save(root, step, state, meta, keep_last):
        got.append(f"write {step}, keep {keep_last}")
        return f"{root}/step_{step}"

    monkeypatch.setattr(checkpointer_module.checkpoint, "save_async", save_async)
    monkeypatch.setattr(checkpointer_module.checkpoint, "save", save)
    return got


def _checkpointer(events: list, interval: int = 2, max_steps: int = 5, writer_group="writers", announces=True):
    return Checkpointer(_Trainer(), "/ckpt", CheckpointConfig(interval=interval, keep_last=3), max_steps,
                        _Sink(events), announces=announces, writer_group=writer_group)


def test_a_background_write_commits_after_the_next_step_and_the_last_checkpoint_is_written_in_its_step(events):
    c = _checkpointer(events)
    for completed in range(1, 6):
        events.append(f"step {completed}")
        c.after_step(completed)
    c.close()
    assert events == [
        "step 1",
        "step 2", "write 2 in the background, keep 3",
        "step 3", "flush", "commit 2", Committed(step=2, path="/ckpt/step_2"),
        "step 4", "write 4 in the background, keep 3",
        "step 5", "flush", "commit 4", Committed(step=4, path="/ckpt/step_4"),
        "flush", "write 5, keep 3", Committed(step=5, path="/ckpt/step_5"),
    ]


def test_a_range_that_stops_early_commits_its_last_background_write(events):
    c = _checkpointer(events, max_steps=100, announces=False)
    for completed in (1, 2):
        c.after_step(completed)
    c.close()
    c.close()  # nothing left: nothing committed twice
    assert events == ["write 2 in the background, keep 3", "commit 2"]  # rank 0 alone tells the driver


def test_without_a_background_writer_every_checkpoint_is_written_in_its_step(events):
    c = _checkpointer(events, interval=0, writer_group=None)
    assert [s for s in range(1, 6) if c.due(s)] == [5]  # no interval: the last step only
    c = _checkpointer(events, interval=2, writer_group=None)
    for completed in range(1, 6):
        c.after_step(completed)
    assert [e for e in events if isinstance(e, str) and e.startswith("write")] == [
        "write 2, keep 3", "write 4, keep 3", "write 5, keep 3"]
    assert events.count("flush") == 3


def test_a_checkpointer_is_made_only_where_checkpoints_are_enabled():
    with pytest.raises(ValueError, match="checkpoint.enabled is true"):
        Checkpointer(_Trainer(), "/ckpt", CheckpointConfig(enabled=False), 5, _Sink([]), announces=True)
