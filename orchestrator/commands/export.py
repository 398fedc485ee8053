"""`export RUN_DIR --out DIR`: a run's final weights, read from its DCP shards, as a directory
`transformers.AutoModelForCausalLM.from_pretrained(DIR)` loads: the built-in GPT in GPT-2's
layout, the built-in Llama as `LlamaForCausalLM`, a `model.hf_config` model in its own
(see orchestrator/control/export.py)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (runs/<name>-<time>)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="the directory to write; must not exist yet, or be empty (see --force)")
    p.add_argument("--checkpoint", metavar="PATH",
                   help="export this checkpoint instead of the run's latest whole one "
                        "(e.g. RUN_DIR/checkpoints/step_00000100)")
    p.add_argument("--force", action="store_true",
                   help="replace what --out holds (the new export takes its place only once complete)")
    p.add_argument("--max-shard-gb", type=float, default=5.0, metavar="GB",
                   help="the largest safetensors file of a sharded export, in GB (default %(default)g)")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ..control.export import export_run
    from ..errors import UserError

    if args.max_shard_gb <= 0:
        raise UserError(f"--max-shard-gb must be positive, got {args.max_shard_gb}")
    console = Console(stderr=True)
    with console.status(f"exporting the weights of {args.run_dir}"):
        out = export_run(args.run_dir, args.out, args.checkpoint, force=args.force,
                         max_shard_bytes=int(args.max_shard_gb * 1e9))
    print(f"exported to {out}: load it with transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return 0
