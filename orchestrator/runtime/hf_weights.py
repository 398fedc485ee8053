"""`model.hf_weights` loaded into the sharded model, each rank reading only its own slices.

The runtime builds the model on the meta device, splits and shards it there, then allocates
each rank's shards; loading the whole file on every rank first would cost every rank the whole
model's host memory, the very thing the meta build avoids. So the checkpoint is checked
against the meta model from its headers alone (`check_weights`, before anything is
allocated), and read slice by slice into the materialised shards (`load_weights`) by torch's
`HuggingFaceStorageReader`: the planner of `torch.distributed.checkpoint` asks each rank's
DTensors (FSDP2's Shard(0), tensor parallelism's column and row splits, both at once) for
their place in the whole tensor, and the reader takes just that block from the file.

Names are the Hugging Face checkpoint's own: the model's parameter names, as its state dict
gives them (activation checkpointing strips its prefix there, FSDP2 adds none, pipeline stages
keep the whole model's names). A tied output head is one tensor under two names; Hugging Face
saves it once, under the embedding's name, and a rank holding the head alone reads that.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.nn.parallel import DistributedDataParallel

from ..errors import ConfigError
from .materialize import clean_name
from .state_names import tied_aliases

KEY = "model.hf_weights"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_SHOWN = 3
"""Names listed per kind of mismatch; the counts say how many there are."""
"""Name components wrapping may leave in a state dict key (checkpoint_wrapper strips its own
in state_dict; the others are for a wrapper that does not)."""


def weight_files(path: str) -> list[Path]:
    """The safetensors files of the checkpoint `path` names: a `.safetensors` file, or a
    directory holding `model.safetensors` or a sharded checkpoint's index."""
    p = Path(path)
    if p.is_file():
        return [p]
    if (p / INDEX).is_file():
        try:
            weight_map = json.loads((p / INDEX).read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"key '{KEY}': {p / INDEX} is not a safetensors index with a weight_map "
                              f"({type(e).__name__}: {e})") from None
        files = [p / name for name in sorted(set(weight_map.values()))]
        lost = [f.name for f in files if not f.is_file()]
        if lost:
            raise ConfigError(f"key '{KEY}': {p / INDEX} names {len(lost)} missing file(s): {', '.join(lost[:_SHOWN])}")
        return files
    if (p / SINGLE).is_file():
        return [p / SINGLE]
    raise ConfigError(f"key '{KEY}': expected a .safetensors file or a directory holding {SINGLE} or {INDEX}, "
                      f"got {path}")


def file_shapes(files: Iterable[Path]) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape, from the files' headers (no tensor data is read)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        except Exception as e:  # noqa: BLE001 - a corrupt or foreign file is the user's to fix, in one line
            raise ConfigError(f"key '{KEY}': cannot read {file} as safetensors ({type(e).__name__}: {e})") from None
    return shapes


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    """`module`'s state dict under the unwrapped model's names, tensors as they are held
    (Parameters, possibly DTensor shards: loading fills them in place)."""
    if isinstance(module, DistributedDataParallel):
        module = module.module
    out = {}
    for key, value in module.state_dict(keep_vars=True).items():
        out[clean_name(key)] = value
    return out


def _source(name: str, aliases: dict[str, str], shapes: dict[str, tuple[int, ...]]) -> str | None:
    """The file's name for the parameter `name`: its canonical name, or any name of its tied
    group the file holds (Hugging Face saves a tied head once, under the embedding's name)."""
    canonical = aliases.get(name, name)
    if canonical in shapes:
        return canonical
    group = [a for a, c in aliases.items() if c == canonical]
    return next((a for a in [name, *group] if a in shapes), None)


def _listed(names: list[str]) -> str:
    more = ", ..." if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def _mismatch(path: str, missing: list[str], extra: list[str], wrong: list[str]) -> ConfigError | None:
    """One line naming the first few of each kind of mismatch, with their counts."""
    parts = [f"{len(names)} {what} ({_listed(names)})"
             for what, names in (("missing", missing), ("extra", extra), ("with a wrong shape", wrong)) if names]
    if not parts:
        return None
    return ConfigError(f"key '{KEY}': {path} does not fit the model: {'; '.join(parts)}; it must hold every "
                       f"parameter under the model's own name and shape")


def _shape_note(name: str, file: tuple[int, ...], model: torch.Size) -> str:
    return f"{name}: file {list(file)} vs model {list(model)}"


def check_weights(model: nn.Module, path: str) -> None:
    """ConfigError, in one line, unless the checkpoint `path` holds every parameter of the
    whole `model` (meta is fine: only shapes are compared) under its name and shape and nothing
    else but the model's buffers. Reads the files' headers only."""
    shapes = file_shapes(weight_files(path))
    state = _state(model)
    aliases = tied_aliases(model)
    buffers = {n for n, _ in model.named_buffers()}  # non-persistent ones too: old files hold inv_freq
    missing, wrong, used = [], [], set()
    for name, value in state.items():
        source = _source(name, aliases, shapes)
        if source is None:
            if isinstance(value, nn.Parameter):
                missing.append(name)
            continue
        used.add(source)
        if shapes[source] != tuple(value.shape):
            wrong.append(_shape_note(source, shapes[source], value.shape))
    extra = [n for n in shapes if n not in used and n not in state and n not in buffers]
    error = _mismatch(path, missing, extra, list(dict.fromkeys(wrong)))
    if error is not None:
        raise error


class _FilesReader(HuggingFaceStorageReader):
    """torch's Hugging Face safetensors reader, kept to the checkpoint's own files: by itself
    it reads every `.safetensors` file in their directory, and a download may keep another copy
    of the weights beside them under other names (Mistral's `consolidated.safetensors`)."""

    def __init__(self, files: list[Path]) -> None:
        super().__init__(str(files[0].parent))
        self.fs: Any = _Listing(self.fs, {os.path.realpath(f) for f in files})


class _Listing:
    """A DCP file system that lists only `keep` (everything else passes through)."""

    def __init__(self, fs, keep: set[str]) -> None:
        self._fs, self._keep = fs, keep

    def ls(self, path) -> list[str]:
        return [p for p in self._fs.ls(path) if os.path.realpath(p) in self._keep]

    def __getattr__(self, name: str):
        return getattr(self._fs, name)


def load_weights(modules: list[nn.Module], path: str, aliases: dict[str, str]) -> None:
    """Fill this rank's parameters (and the persistent buffers the file holds) in `modules`
    from the checkpoint `path`, each rank reading only the slices it holds. `modules`: the
    rank's materialised model, or its pipeline stages, whatever wraps or shards them;
    `aliases`: `tied_aliases` of the whole model. Every rank calls it (it plans collectively
    when torch.distributed is initialised). ConfigError when a parameter is not in the file
    or has another shape there."""
    files = weight_files(path)
    shapes = file_shapes(files)
    wanted: dict[str, torch.Tensor] = {}
    missing, wrong = [], []
    for module in modules:
        for name, value in _state(module).items():
            source = _source(name, aliases, shapes)
            if source is None:
                if isinstance(value, nn.Parameter):
                    missing.append(name)
                continue  # a buffer the file lacks keeps what materialising gave it
            if shapes[source] != tuple(value.shape):
                wrong.append(_shape_note(source, shapes[source], value.shape))
                continue
            held = wanted.setdefault(source, value)
            if held is not value:
                # One file tensor is read into one target; two distinct tensors would leave one unfilled.
                raise RuntimeError(f"{source} is held by two distinct tensors on this rank ({name} is the "
                                   f"second); tie them before loading")
    error = _mismatch(path, missing, [], list(dict.fromkeys(wrong)))
    alone = not (dist.is_available() and dist.is_initialized())
    if not alone:
        # A rank may hold what the others do not (a pipeline stage): all refuse together, or
        # the others would wait in dcp.load's collectives for it.
        errors: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, None if error is None else str(error))
        error = next((ConfigError(e) for e in errors if e), None)
    if error is not None:
        raise error
    with torch.no_grad(), warnings.catch_warnings():
        # One process without a group is a use of its own here, not the mistake DCP warns of.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(wanted, storage_reader=_FilesReader(files), no_dist=alone)
