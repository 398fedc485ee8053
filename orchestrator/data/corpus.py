"""Text in, token file out: what `prepare` does, streamed so no input is ever held whole.

Documents come from a text file (one document), a directory (every file in it, sorted; `.jsonl`
files as below, others as text) or a JSONL file (one document per line, its `text` field).
A tokenizer (a Hugging Face `tokenizer.json` loaded with `tokenizers`, or plain UTF-8 bytes)
turns them into ids, an end-of-document id follows every document, and the ids stream into
`.bin` (uint16, nanoGPT's format) or `.npy` (uint16 or uint32, from the vocabulary size). The
output and its metadata are written under temporary names and renamed when complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import UserError
from .tokenfiles import BYTE_VOCAB, META_FORMAT, DataError, dtype_for_vocab, meta_path

CHUNK_BYTES = 4 << 20
"""Text files are read this much at a time and cut between words (see `_cut`)."""
BATCH_PIECES = 64
"""Pieces tokenized together (the Rust tokenizer encodes a batch on all cores)."""
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]")
NPY_HEADER_BYTES = 128


@dataclass
class Piece:
    """Part of a document: its text (bytes for text files, str for JSONL) and whether it ends it."""

    text: bytes | str
    ends_document: bool
    input_bytes: int
    """Input bytes this piece accounts for (for the progress bar)."""


def input_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not any(
            part.startswith(".") for part in p.relative_to(path).parts))
        if not files:
            raise DataError(f"{path}: the directory holds no files")
        return files
    raise DataError(f"{path}: no such file or directory")


_SPACE = frozenset(b" \t\n\r\x0b\x0c")


def _cut(buf: bytes) -> int:
    """Where to end a piece: before the last space that sits between two non-space bytes. A
    pre-tokenizer (GPT-2's byte-level regex, SentencePiece's metaspace) starts a new word
    there whatever came before, so the pieces tokenize exactly as the whole text would; and
    a space is ASCII, never inside a UTF-8 character. -1 when there is none."""
    i = len(buf) - 1
    while i > 0:
        i = buf.rfind(b" ", 0, i)
        if i <= 0:
            return -1
        if buf[i - 1] not in _SPACE and buf[i + 1] not in _SPACE:
            return i
    return -1


def _char_boundary(buf: bytes) -> int:
    """The start of the last UTF-8 character in buf (continuation bytes are 0b10xxxxxx)."""
    i = len(buf) - 1
    while i > 0 and buf[i] & 0xC0 == 0x80:
        i -= 1
    return i


def _text_pieces(path: Path) -> Iterator[Piece]:
    with open(path, "rb") as f:
        buf = b""
        while True:
            data = f.read(CHUNK_BYTES)
            buf += data
            if not data:  # the end of the file ends the document (an empty file holds none)
                if buf:
                    yield Piece(buf, True, len(buf))
                return
            cut = _cut(buf)
            if cut < 0:
                if len(buf) < 4 * CHUNK_BYTES:
                    continue  # no word boundary yet (text without spaces): read on
                cut = _char_boundary(buf)
            piece, buf = buf[:cut], buf[cut:]
            yield Piece(piece, False, len(piece))


def _jsonl_pieces(path: Path) -> Iterator[Piece]:
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                yield Piece("", False, len(line))
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise DataError(f"{path}:{n}: not a JSON object ({e})") from None
            if not isinstance(record, dict) or "text" not in record:
                raise DataError(f"{path}:{n}: no 'text' field (each JSONL line needs one, a string)")
            if not isinstance(record["text"], str):
                raise DataError(f"{path}:{n}: 'text' is a {type(record['text']).__name__}, expected a string")
            yield Piece(record["text"], True, len(line))


def pieces(path: Path) -> Iterator[Piece]:
    for f in input_files(path):
        if f.suffix.lower() == ".jsonl":
            yield from _jsonl_pieces(f)
        else:
            yield from _text_pieces(f)


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, and 256 as the end-of-document id."""

    name = "bytes"
    vocab_size = BYTE_VOCAB + 1
    eos_id = BYTE_VOCAB
    eos = "<eos>"
    sha256 = None

    def encode(self, texts: list[bytes | str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8") if isinstance(t, str) else t, dtype=np.uint8) for t in texts]


class HFTokenizer:
    """A Hugging Face `tokenizer.json`, loaded with `tokenizers` (no hub, no network)."""

    def __init__(self, path: str, eos: str | None) -> None:
        p = Path(path)
        if not p.is_file():
            raise DataError(f"--tokenizer {path}: no such file")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise UserError("--tokenizer needs the `tokenizers` package: pip install -e '.[hf]'") from None
        try:
            self.tok = Tokenizer.from_file(str(p))
        except Exception as e:  # tokenizers raises a bare Exception on a malformed file
            raise DataError(f"--tokenizer {path}: not a tokenizers JSON file ({str(e).splitlines()[0]})") from None
        self.name = str(p.resolve())
        self.sha256 = hashlib.sha256(p.read_bytes()).hexdigest()
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        names = [eos] if eos else list(EOS_CANDIDATES)
        found = [(n, self.tok.token_to_id(n)) for n in names]
        found = [(n, i) for n, i in found if i is not None]
        if not found:
            raise DataError(
                f"--tokenizer {path}: " + (f"has no token {eos!r}" if eos else
                                           f"has none of the end-of-document tokens {', '.join(EOS_CANDIDATES)}")
                + "; name one it has with --eos TOKEN"
            )
        self.eos, self.eos_id = found[0]

    def encode(self, texts: list[bytes | str]) -> list[np.ndarray]:
        strs = [t.decode("utf-8", errors="replace") if isinstance(t, bytes) else t for t in texts]
        return [np.asarray(e.ids, dtype=np.int64) for e in self.tok.encode_batch(strs, add_special_tokens=False)]


def npy_header(dtype: np.dtype, n: int) -> bytes:
    """A .npy v1.0 header of a fixed size, so the count can be written after streaming the data."""
    body = repr({"descr": dtype.str, "fortran_order": False, "shape": (n,)}).encode("latin1")
    pad = NPY_HEADER_BYTES - 10 - len(body) - 1
    return b"\x93NUMPY\x01\x00" + (NPY_HEADER_BYTES - 10).to_bytes(2, "little") + body + b" " * pad + b"\n"


class TokenWriter:
    """Appends ids to a temporary file beside `out`; `commit` renames it into place."""

    def __init__(self, out: Path, dtype: np.dtype) -> None:
        self.out, self.dtype, self.npy = out, dtype.newbyteorder("<"), out.suffix.lower() == ".npy"
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent)
        self.tmp = Path(tmp)
        self.f = os.fdopen(fd, "wb")
        if self.npy:
            self.f.write(npy_header(self.dtype, 0))
        self.count = 0
        self.max_id = -1

    def write(self, ids: np.ndarray) -> None:
        if ids.size:
            self.max_id = max(self.max_id, int(ids.max()))
            self.f.write(ids.astype(self.dtype, copy=False).tobytes())
            self.count += int(ids.size)

    def commit(self) -> None:
        if self.npy:
            self.f.seek(0)
            self.f.write(npy_header(self.dtype, self.count))
        self.f.close()
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(self.tmp, 0o666 & ~umask)  # mkstemp makes it private; give it a plain file's mode
        os.replace(self.tmp, self.out)

    def abort(self) -> None:
        self.f.close()
        self.tmp.unlink(missing_ok=True)


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def prepare(source: Path, out: Path, tokenizer: ByteTokenizer | HFTokenizer,
            progress: Callable[[int], None] = lambda n: None) -> dict[str, Any]:
    """Tokenize `source` into `out` (+ its metadata); returns the metadata."""
    if out.suffix.lower() not in (".bin", ".npy"):
        raise DataError(f"--out {out}: a token file ends in .bin (uint16, nanoGPT's format) or .npy")
    dtype = dtype_for_vocab(tokenizer.vocab_size)
    if out.suffix.lower() == ".bin" and dtype != np.uint16:
        raise DataError(
            f"--out {out}: .bin holds uint16 ids, too narrow for a vocabulary of {tokenizer.vocab_size:,}; "
            f"write a .npy (uint32) instead"
        )
    if not out.parent.is_dir():
        raise DataError(f"--out {out}: no such directory {out.parent}")
    files = input_files(source)  # checked before anything is written
    writer = TokenWriter(out, dtype)
    docs = 0
    try:
        batch: list[Piece] = []

        def flush() -> None:
            nonlocal docs
            for piece, ids in zip(batch, tokenizer.encode([p.text for p in batch])):
                writer.write(ids)
                if piece.ends_document:
                    writer.write(np.array([tokenizer.eos_id]))
                    docs += 1
                progress(piece.input_bytes)
            batch.clear()

        for piece in pieces(source):
            batch.append(piece)
            if len(batch) >= BATCH_PIECES:
                flush()
        flush()
        if writer.count == 0:
            raise DataError(f"{source}: no text to tokenize")
        meta = {
            "format": META_FORMAT,
            "tokenizer": tokenizer.name,
            "tokenizer_sha256": tokenizer.sha256,
            "vocab_size": tokenizer.vocab_size,
            "eos": tokenizer.eos,
            "eos_id": tokenizer.eos_id,
            "dtype": dtype.name,
            "tokens": writer.count,
            "documents": docs,
            "max_token_id": writer.max_id,
            "source": str(source.resolve()),
            "files": len(files),
        }
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    _write_json_atomic(meta_path(out), meta)
    return meta
