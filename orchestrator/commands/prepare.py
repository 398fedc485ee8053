"""`prepare INPUT --out FILE [--tokenizer tokenizer.json]`: text to a token file `data.path` trains on.

INPUT is a text file, a directory of files, or JSONL with a `text` field per line. Without
`--tokenizer` the tokens are UTF-8 bytes (ids 0..255, end-of-document 256). The output and
`FILE.meta.json` beside it appear only once complete.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("input", help="a text file, a directory of files, or a .jsonl file with a 'text' field per line")
    p.add_argument("--out", required=True, metavar="FILE",
                   help="the token file to write: .bin (uint16, nanoGPT's format) or .npy (uint16 or uint32 "
                        "by vocabulary)")
    p.add_argument("--tokenizer", metavar="JSON",
                   help="a Hugging Face tokenizer.json (loaded with `tokenizers`, nothing downloaded); default: bytes")
    p.add_argument("--eos", metavar="TOKEN",
                   help="the end-of-document token of the tokenizer (default: the first of <|endoftext|>, </s>, ...)")
    p.add_argument("--force", action="store_true",
                   help="replace --out if it exists (only once the new one is complete)")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    from ..data.corpus import ByteTokenizer, HFTokenizer, input_files, prepare
    from ..errors import UserError

    source, out = Path(args.input), Path(args.out)
    if out.exists() and not args.force:
        raise UserError(f"--out {out}: the file exists; choose another name or pass --force to replace it")
    if args.eos and not args.tokenizer:
        raise UserError("--eos names a token of --tokenizer; the byte tokenizer's end-of-document id is 256")
    tokenizer = HFTokenizer(args.tokenizer, args.eos) if args.tokenizer else ByteTokenizer()
    total = sum(f.stat().st_size for f in input_files(source))
    console = Console(stderr=True)
    with Progress(TextColumn("tokenizing"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=console, transient=True) as bar:
        task = bar.add_task("tokenizing", total=total)
        meta = prepare(source, out, tokenizer, progress=lambda n: bar.advance(task, n))
    print(f"wrote {meta['tokens']:,} tokens ({meta['documents']:,} documents, vocabulary {meta['vocab_size']:,}, "
          f"{meta['dtype']}, end-of-document id {meta['eos_id']}) to {out}")
    print(f"set data.path={out} and model.vocab_size={meta['vocab_size']} (or more)")
    return 0
