"""Token files on disk: opened as memory maps, checked from their header, size and metadata only.

Formats, chosen by the file's suffix:

- `.bin`: raw little-endian uint16 with no header, as nanoGPT's `prepare.py` writes it;
- `.npy`: a 1-D numpy array of any integer dtype (uint32 for vocabularies above 65,535);
- anything else: text, whose UTF-8 bytes are the tokens (vocabulary 256).

`prepare` writes a small JSON file beside a token file, `<file>.meta.json` (tokenizer,
vocabulary size, token count, end-of-document id), which `submit` reads to check the model's
vocabulary before anything starts. Nothing here reads a corpus whole: opening maps the file,
and checks read its header, its size and its metadata. numpy only, so checking a job's config
stays free of torch.
"""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import UserError

META_SUFFIX = ".meta.json"
META_FORMAT = "orchestrator-tokens/1"
BYTE_VOCAB = 256
TOKEN_SUFFIXES = (".bin", ".npy")


class DataError(UserError):
    """A data file (text, token file or its metadata) cannot be used as it is."""


def kind(path: str | os.PathLike) -> str:
    """`bin`, `npy` or `text`, from the suffix."""
    suffix = Path(path).suffix.lower()
    return suffix[1:] if suffix in TOKEN_SUFFIXES else "text"


def meta_path(path: str | os.PathLike) -> Path:
    return Path(str(path) + META_SUFFIX)


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every id of a vocabulary."""
    if vocab_size <= 1 << 16:
        return np.dtype(np.uint16)
    if vocab_size <= 1 << 32:
        return np.dtype(np.uint32)
    raise DataError(f"a vocabulary of {vocab_size:,} ids does not fit in uint32")


def open_tokens(path: str | os.PathLike) -> np.ndarray:
    """The tokens of a data file as a read-only 1-D array backed by a memory map (never read
    whole: only the pages a sample touches are ever loaded)."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: no such file")
    k = kind(p)
    size = p.stat().st_size
    if k == "npy":
        shape, dtype, offset = _npy_header(p)
        if dtype.kind not in "ui":
            raise DataError(f"{p}: a token file needs an integer dtype (uint16, uint32, ...), got {dtype}")
        if len(shape) != 1:
            raise DataError(f"{p}: a token file is 1-D (one stream of token ids), got shape {shape}")
        if size != offset + shape[0] * dtype.itemsize:
            raise DataError(
                f"{p}: {size - offset:,} bytes of data is not the {shape[0]:,} x {dtype.itemsize} bytes ({dtype}) "
                f"its header says; the file is truncated or was changed"
            )
        return _random_access(np.load(p, mmap_mode="r", allow_pickle=False))
    dtype = np.dtype(np.uint16) if k == "bin" else np.dtype(np.uint8)
    if size % dtype.itemsize:
        raise DataError(
            f"{p}: {size:,} bytes is not a multiple of {dtype.itemsize} ({dtype.name}, the dtype of .bin token "
            f"files); the file is truncated or not a token file"
        )
    if size == 0:
        raise DataError(f"{p}: the file is empty")
    return _random_access(np.memmap(p, dtype=dtype.newbyteorder("<"), mode="r"))


def release(arr: np.ndarray) -> None:
    """Unmap the pages of a mapped token file this process has touched (they stay in the page
    cache). The kernel maps whole page-cache folios around every sample read, so without this a
    rank's resident set would grow with every distinct sample over a long run, toward the
    file's size; after it, a rank holds about one batch. nanoGPT re-creates its memmap every
    batch for the same reason."""
    mm = getattr(arr, "_mmap", None)
    if mm is not None and hasattr(mmap, "MADV_DONTNEED"):
        mm.madvise(mmap.MADV_DONTNEED)


def _npy_header(p: Path) -> tuple[tuple[int, ...], np.dtype, int]:
    """(shape, dtype, data offset) from a .npy header, without touching the data."""
    try:
        with open(p, "rb") as f:
            major, _ = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
            shape, _, dtype = read(f)
            return shape, dtype, f.tell()
    except ValueError as e:
        raise DataError(f"{p}: not a .npy file ({str(e).splitlines()[0]})") from None


def _random_access(arr: np.ndarray) -> np.ndarray:
    """Samples are windows at random offsets: tell the kernel not to read ahead of each one,
    which would read (and keep resident) many times what a step uses."""
    mm = getattr(arr, "_mmap", None)
    if mm is not None and hasattr(mmap, "MADV_RANDOM"):
        mm.madvise(mmap.MADV_RANDOM)
    return arr


def read_meta(path: str | os.PathLike) -> dict[str, Any] | None:
    """The metadata `prepare` wrote beside a token file, or None when there is none."""
    m = meta_path(path)
    if not m.is_file():
        return None
    try:
        meta = json.loads(m.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{m}: not valid JSON ({e})") from None
    for key in ("vocab_size", "tokens"):
        if not isinstance(meta.get(key), int):
            raise DataError(f"{m}: key '{key}' is missing or not an integer")
    return meta


def vocab_needed(path: str | os.PathLike) -> tuple[int | None, str]:
    """The vocabulary a data file needs, as far as it can be known without reading it, and
    where that figure comes from (for messages)."""
    if kind(path) == "text":
        return BYTE_VOCAB, "its UTF-8 bytes"
    meta = read_meta(path)
    if meta is not None:
        return int(meta["vocab_size"]), f"{meta_path(path).name}, tokenizer {meta.get('tokenizer', '?')}"
    return None, "no metadata"


def check_data(path: str | None, val_path: str | None, vocab_size: int, block_size: int) -> None:
    """What can be checked before training, cheaply: each file opens as tokens (size, dtype),
    is long enough for one sample, agrees with its metadata, and the model's vocabulary covers
    what the metadata says the tokens need. Ids of files without metadata are checked batch by
    batch as training reads them."""
    tokenizers = {}
    for key, p in (("data.path", path), ("data.val_path", val_path)):
        if p is None:
            continue
        tokens = open_tokens(p)
        if len(tokens) <= block_size + 1:
            raise DataError(
                f"key '{key}': {p} has {len(tokens):,} tokens; a sample needs more than model.block_size + 1 "
                f"({block_size + 1})"
            )
        meta = read_meta(p) if kind(p) != "text" else None
        if meta is not None:
            if meta["tokens"] != len(tokens):
                raise DataError(
                    f"{p}: holds {len(tokens):,} tokens but {meta_path(p).name} says {meta['tokens']:,}; "
                    f"the file was changed after `prepare` wrote it"
                )
            tokenizers[key] = meta.get("tokenizer")
        need, source = vocab_needed(p)
        if need is not None and need > vocab_size:
            raise DataError(
                f"key 'model.vocab_size': {vocab_size:,} is smaller than the {need:,} ids {key} {p} needs "
                f"({source}); set model.vocab_size={need} or more"
            )
    if len(tokenizers) == 2 and tokenizers["data.path"] != tokenizers["data.val_path"]:
        raise DataError(
            f"key 'data.val_path': tokenized with {tokenizers['data.val_path']}, but data.path with "
            f"{tokenizers['data.path']}; both need the same tokenizer"
        )
