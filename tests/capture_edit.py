"""Edits of a `nvidia-smi topo -m` capture that keep its columns aligned: a healthy machine's
capture made into a faulty one, for the wiring checks and the doctor."""

from __future__ import annotations

import re


def set_cell(text: str, row: str, col: str, value: str, both: bool = True) -> str:
    """The capture with cell (row, col) (and (col, row)) replaced, keeping every column aligned."""
    lines = text.split("\n")
    header = next(l for l in lines if l.split()[:1] == ["GPU0"] and "X" not in l.split())
    columns = header.split()
    for r, c in ((row, col), (col, row)) if both and col.startswith("GPU") else ((row, col),):
        i = next(k for k, l in enumerate(lines) if l.split()[:1] == [r] and "X" in l.split())
        cell = list(re.finditer(r"\S+", lines[i]))[1 + columns.index(c)]
        width = max(len(value), cell.end() - cell.start())
        lines[i] = lines[i][:cell.start()] + value.ljust(width) + lines[i][cell.end():]
    return "\n".join(lines)


def set_numa(text: str, row: str, numa: str) -> str:
    lines = text.split("\n")
    i = next(k for k, l in enumerate(lines) if l.split()[:1] == [row] and "X" in l.split())
    tokens = list(re.finditer(r"\S+", lines[i]))
    numa_cell = tokens[-2]  # NUMA Affinity, before GPU NUMA ID (N/A)
    lines[i] = lines[i][:numa_cell.start()] + numa + lines[i][numa_cell.end():]
    return "\n".join(lines)
