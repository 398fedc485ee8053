"""When a rank checkpoints, and in which order a background write is committed: every
`checkpoint.interval` completed steps and after the last; a background write (`async_save`)
commits after the next step's row has been sent, so the step it overlapped is whole on every
rank first, and every row before a checkpoint reaches the driver before that checkpoint's
commit. The newest `checkpoint.keep_last` are kept (`checkpoint._commit` prunes the rest)."""

from __future__ import annotations

from typing import Any, Protocol

from ..config import CheckpointConfig
from . import checkpoint
from .messages import Committed
from .outbox import Sink


class Checkpointed(Protocol):
    """What the checkpointer saves: the trainer's state and what meta.json records of its plan."""

    def state_dict(self) -> dict[str, Any]: ...

    def checkpoint_meta(self) -> dict[str, Any]: ...


class Checkpointer:
    """One rank's checkpoints of one step range, written under `root`."""

    def __init__(self, trainer: Checkpointed, root: str, config: CheckpointConfig, max_steps: int,
                 sink: Sink, announces: bool, writer_group: Any | None = None) -> None:
        """`announces`: this rank tells the driver of each commit (rank 0 alone); `writer_group`:
        the group background writes use (`checkpoint.writer_group`), None to write every
        checkpoint in the step's own time."""
        if not config.enabled:
            raise ValueError("a Checkpointer is made only where checkpoint.enabled is true")
        self._trainer = trainer
        self._root = root
        self._config = config
        self._max_steps = max_steps
        self._sink = sink
        self._announces = announces
        self._writer_group = writer_group
        self._pending: checkpoint.PendingSave | None = None
        """A checkpoint being written in the background, committed after the next step."""

    def due(self, completed: int) -> bool:
        """Whether the step that made `completed` steps is checkpointed."""
        every = self._config.interval
        return completed == self._max_steps or bool(every and completed % every == 0)

    def after_step(self, completed: int) -> None:
        """Call once the step that made `completed` steps has sent its row: commit the write the
        step before began, then write this step's checkpoint where one is due."""
        if self._pending is not None:
            # After this step's row: a commit that loses a peer leaves the step whole here.
            self._sink.flush()  # every row before a checkpoint reaches the driver before it is committed
            self._commit(self._pending.commit(), self._pending.step)
            self._pending = None
        if not self.due(completed):
            return
        state, meta, keep = self._trainer.state_dict(), self._trainer.checkpoint_meta(), self._config.keep_last
        if self._writer_group is not None and completed != self._max_steps:
            self._pending = checkpoint.save_async(self._root, completed, state, meta, keep, self._writer_group)
            return
        # The last one, or no background writer: nothing left to overlap it with.
        self._sink.flush()  # as before a commit above
        self._commit(checkpoint.save(self._root, completed, state, meta, keep), completed)

    def close(self) -> None:
        """Commit the write still in the background: a range that stops before max_steps keeps
        its last checkpoint."""
        if self._pending is not None:
            self._commit(self._pending.commit(), self._pending.step)
            self._pending = None

    def _commit(self, path: str, step: int) -> None:
        if self._announces:
            self._sink.add(Committed(step=step, path=str(path)), urgent=True)
