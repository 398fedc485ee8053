"""`export RUN_DIR --out DIR`: a run's final weights, gathered from its DCP shards, as safetensors
in the layout `transformers.GPT2LMHeadModel.from_pretrained(DIR)` loads (see orchestrator/control/export.py)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (runs/<name>-<time>)")
    p.add_argument("--out", required=True, metavar="DIR", help="the directory to write; must not exist yet")
    p.add_argument("--checkpoint", metavar="PATH",
                   help="export this checkpoint instead of the run's latest whole one "
                        "(e.g. RUN_DIR/checkpoints/step_00000100)")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ..control.export import export_run

    console = Console(stderr=True)
    with console.status(f"gathering the weights of {args.run_dir}"):
        out = export_run(args.run_dir, args.out, args.checkpoint)
    print(f"exported to {out}: load it with transformers.GPT2LMHeadModel.from_pretrained({str(out)!r}) "
          f"or orchestrator.control.export.load_exported({str(out)!r})")
    return 0
