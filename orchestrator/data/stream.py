"""Training data with a sample order that does not depend on the world size.

The samples of optimizer step `s` are drawn from a generator seeded with `(seed, s)`, and
rank r of W takes the r-th contiguous slice of them. So any world size sees the same global
batch at every step (what makes DDP-vs-single-process parity exact), and resuming at step s
needs nothing but s: the data position is the step counter.

The tokens are a memory-mapped file (`orchestrator.data.tokenfiles`: nanoGPT's uint16 `.bin`, an
integer `.npy`, or a text file's UTF-8 bytes), so a rank reads only the pages its own samples
touch, whatever the size of the corpus.
"""

from __future__ import annotations

import numpy as np
import torch

from .tokenfiles import DataError, open_tokens, release


def builtin_text() -> str:
    """The text of `pydoc_data.topics`: ~465 KB of Python's documentation, shipped with Python."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def load_tokens(path: str | None) -> np.ndarray:
    """The tokens of the data file at `path`, memory-mapped (or the built-in corpus's bytes)."""
    if path:
        return open_tokens(path)
    return np.frombuffer(builtin_text().encode("utf-8"), dtype=np.uint8)


class TextData:
    """Train/val split of a token stream and the per-step batches drawn from it.

    `val` given: a separate validation stream, and all of `tokens` trains; otherwise the last
    `val_fraction` of `tokens` validates. `vocab_size` given: every id a batch holds is checked
    against it (files without metadata cannot be checked up front without reading them whole).
    """

    def __init__(self, tokens, block_size: int, val_fraction: float, seed: int, *,
                 val=None, vocab_size: int | None = None, names: tuple[str, str] = ("data", "data")) -> None:
        tokens = _as_array(tokens)
        if val is None:
            n_val = int(len(tokens) * val_fraction)
            self.train, self.val = tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val:]
        else:
            self.train, self.val = tokens, _as_array(val)
        for name, split in (("train", self.train), ("val", self.val)):
            if len(split) <= block_size + 1:
                raise DataError(
                    f"the {name} split has {len(split)} tokens; it needs more than model.block_size + 1 "
                    f"({block_size + 1}): use a larger data file or a smaller block_size / val_fraction"
                )
        self.block_size = block_size
        self.seed = seed
        self.vocab_size = vocab_size
        self.names = dict(zip(("train", "val"), names))

    def _offsets(self, split: np.ndarray, key: int, n: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + key)
        return torch.randint(len(split) - self.block_size - 1, (n,), generator=g)

    def _gather(self, which: str, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        split = self.train if which == "train" else self.val
        # One contiguous slice per sample: a memory map reads just those pages.
        seq = np.stack([split[o:o + self.block_size + 1] for o in offsets.tolist()]).astype(np.int64)
        release(split)  # the batch is copied out: a rank keeps about one batch of the file resident
        if self.vocab_size is not None and seq.size and (seq.max() >= self.vocab_size or seq.min() < 0):
            bad = int(seq.max()) if seq.max() >= self.vocab_size else int(seq.min())
            row = int(np.argwhere((seq >= self.vocab_size) | (seq < 0))[0][0])
            raise DataError(
                f"{self.names[which]}: token id {bad} near token {int(offsets[row]):,} is outside model.vocab_size "
                f"({self.vocab_size}); set model.vocab_size above the largest id, or re-tokenize"
            )
        seq = torch.from_numpy(seq)
        return seq[:, :-1], seq[:, 1:]

    def train_batch(self, step: int, global_batch: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of step `step`'s global batch: (inputs, targets), each [global/world, T]."""
        if global_batch % world:
            raise ValueError(f"global batch {global_batch} must divide evenly over {world} ranks")
        per_rank = global_batch // world
        offsets = self._offsets(self.train, step, global_batch)[rank * per_rank:(rank + 1) * per_rank]
        return self._gather("train", offsets)

    def val_batch(self, i: int, batch: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The i-th validation batch's share for this rank (the same batches at every evaluation)."""
        if batch % world:
            raise ValueError(f"validation batch {batch} must divide evenly over {world} ranks")
        per_rank = batch // world
        offsets = self._offsets(self.val, -1 - i, per_rank * world)[rank * per_rank:(rank + 1) * per_rank]
        return self._gather("val", offsets)


def _as_array(tokens) -> np.ndarray:
    return tokens.numpy() if isinstance(tokens, torch.Tensor) else tokens


def open_data(path: str | None, val_path: str | None, val_fraction: float, block_size: int, seed: int,
              vocab_size: int | None = None) -> TextData:
    """The job's data: `data.path` (or the built-in text), with `data.val_path` or the tail
    fraction for validation."""
    val = open_tokens(val_path) if val_path else None
    return TextData(load_tokens(path), block_size, val_fraction, seed, val=val, vocab_size=vocab_size,
                    names=(path or "built-in text", val_path or path or "built-in text"))
