"""Byte-level text data with a sample order that does not depend on the world size.

The samples of optimizer step `s` are drawn from a generator seeded with `(seed, s)`, and
rank r of W takes the r-th contiguous slice of them. So any world size sees the same global
batch at every step (what makes DDP-vs-single-process parity exact), and resuming at step s
needs nothing but s: the data position is the step counter.
"""

from __future__ import annotations

from pathlib import Path

import torch


def builtin_text() -> str:
    """The text of `pydoc_data.topics`: ~465 KB of Python's documentation, shipped with Python."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def load_tokens(path: str | None) -> torch.Tensor:
    """UTF-8 bytes of the file at `path` (or of the built-in corpus) as a uint8 tensor."""
    raw = Path(path).read_bytes() if path else builtin_text().encode("utf-8")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


class TextData:
    """Train/val split of a token stream and the per-step batches drawn from it."""

    def __init__(self, tokens: torch.Tensor, block_size: int, val_fraction: float, seed: int) -> None:
        n_val = int(len(tokens) * val_fraction)
        self.train = tokens[: len(tokens) - n_val]
        self.val = tokens[len(tokens) - n_val:]
        for name, split in (("train", self.train), ("val", self.val)):
            if len(split) <= block_size + 1:
                raise ValueError(
                    f"the {name} split has {len(split)} tokens; it needs more than model.block_size + 1 "
                    f"({block_size + 1}): use a larger data file or a smaller block_size / val_fraction"
                )
        self.block_size = block_size
        self.seed = seed

    def _offsets(self, split: torch.Tensor, key: int, n: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + key)
        return torch.randint(len(split) - self.block_size - 1, (n,), generator=g)

    def _gather(self, split: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = offsets[:, None] + torch.arange(self.block_size + 1)[None, :]
        seq = split[idx].long()
        return seq[:, :-1], seq[:, 1:]

    def train_batch(self, step: int, global_batch: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of step `step`'s global batch: (inputs, targets), each [global/world, T]."""
        if global_batch % world:
            raise ValueError(f"global batch {global_batch} must divide evenly over {world} ranks")
        per_rank = global_batch // world
        offsets = self._offsets(self.train, step, global_batch)[rank * per_rank:(rank + 1) * per_rank]
        return self._gather(self.train, offsets)

    def val_batch(self, i: int, batch: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The i-th validation batch's share for this rank (the same batches at every evaluation)."""
        if batch % world:
            raise ValueError(f"validation batch {batch} must divide evenly over {world} ranks")
        per_rank = batch // world
        offsets = self._offsets(self.val, -1 - i, per_rank * world)[rank * per_rank:(rank + 1) * per_rank]
        return self._gather(self.val, offsets)
