"""Command line: `python -m orchestrator <command> ...`.

Each command lives in `orchestrator/commands/<name>.py` with `add_arguments(parser)` and
`run(args) -> int`, so a command's imports (Ray, torch) load only when it runs. A
:class:`UserError` becomes one line on stderr and exit code 2; `--debug` shows the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback

from .errors import UserError

# name -> (module, one-line help)
COMMANDS = {
    "submit": ("submit", "train a job: probe, plan, place and run it"),
    "plan": ("plan", "show the plan for a job on this cluster or a described one"),
    "probe": ("probe", "show the interconnect topology of this cluster or of a capture file"),
    "doctor": ("doctor", "check every node (GPUs, NVLink, wiring, compute, links) before a long job"),
    "status": ("status", "list the jobs of a Ray cluster, or show one"),
    "logs": ("logs", "print (or follow) the output of a job on a Ray cluster"),
    "stop": ("stop", "stop a job on a Ray cluster and wait until it has ended"),
    "prepare": ("prepare", "tokenize text (a file, a directory, JSONL) into a token file to train on"),
    "export": ("export", "write a run's final weights as safetensors (a transformers GPT-2 model)"),
    "report": ("report", "rebuild a run directory's report.html (plan, topology, loss, ranks) and print its path"),
    "node-labels": ("node_labels", "print this machine's Ray node labels for `ray start --labels`"),
    "testbed": ("testbed", "run a command on a local multi-node Ray cluster with shaped links (root)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m orchestrator",
        description="Topology-aware distributed training on Ray.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks of errors")
        importlib.import_module(f"orchestrator.commands.{module}").add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # argparse stops collecting `key=value` overrides at the first option, so
    # `plan JOB --topology F key=value` leaves the override over; take such leftovers back.
    args, extra = parser.parse_known_args(argv)
    stray = [e for e in extra if e.startswith("-") or "=" not in e or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    try:
        module = importlib.import_module(f"orchestrator.commands.{args._module}")
        return int(module.run(args) or 0)
    except UserError as e:
        if args.debug:
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt as e:
        from .control.signals import exit_code

        # Ctrl-C exits 130 and SIGTERM 143 (128 + the signal), as shells report them.
        code = exit_code(e)
        print("stopped (SIGTERM)" if code == 143 else "interrupted", file=sys.stderr)
        return code
