"""Models for the compile tests, importable by `model.factory` (the tests put this directory on
sys.path): a block that breaks torch.compile's graph, and one that does not."""

from __future__ import annotations

import os

import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, width: int, breaks: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.breaks = breaks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        if self.breaks:
            # A C builtin dynamo cannot trace: the graph breaks here.
            y = y + os.getpid() * 0
        return x + y


class Model(nn.Module):
    def __init__(self, breaks: bool, width: int = 16, vocab: int = 256, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.h = nn.ModuleList([Block(width, breaks) for _ in range(layers)])
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for b in self.h:
            x = b(x)
        return self.head(x)


def build(breaks: bool = True, width: int = 16, layers: int = 2, **_: object) -> Model:
    return Model(breaks, width=width, layers=layers)
