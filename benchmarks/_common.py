"""What every benchmark shares: its command line, the machine it ran on, its table and its JSON.

Each benchmark is a script, `python benchmarks/NAME.py [--quick]`, that prints a table and
writes `benchmarks/results/NAME.json` with the figures, the machine and the command beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NoReturn

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def run(main: Callable[[], int | None]) -> NoReturn:
    """Run a benchmark's `main` as the CLI runs a command: a UserError (a bad value, a network
    that cannot be made here) is one line on stderr and exit code 2; `--debug` keeps its traceback."""
    from orchestrator.errors import UserError

    debug = "--debug" in sys.argv
    if debug:
        sys.argv.remove("--debug")
    try:
        code = main()
    except UserError as e:
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(e.exit_code) from None
    raise SystemExit(code or 0)


def parser(doc: str, extra: Callable[[argparse.ArgumentParser], Any] | None = None) -> argparse.ArgumentParser:
    """A benchmark's command line: `--quick` (the under-five-minute variant) and `--out` (where
    the JSON goes), plus what `extra(parser)` adds. Each script keeps its `extra` at module level
    as `options`, so that a stored result's command can be checked against the script's own
    options (tests/test_benchmark_results.py)."""
    ap = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes and fewer repetitions (minutes, not tens)")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON here instead of benchmarks/results/")
    if extra is not None:
        extra(ap)
    return ap


def parse_args(doc: str, argv: Sequence[str] | None, extra=None) -> argparse.Namespace:
    """The options of `parser(doc, extra)` parsed from `argv` (the process's own when None),
    with the arguments as given kept for the result's command."""
    args = parser(doc, extra).parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the result records the command as given
    return args


def machine() -> dict[str, Any]:
    """The machine the figures came from: CPU, cores, GPU (if any), and the library versions."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpus = ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if torch.cuda.is_available() else [])
    try:
        import ray

        ray_version = ray.__version__
    except ImportError:
        ray_version = None
    return {
        "cpu": cpu,
        "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "gpus": gpus,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": ray_version,
        "os": f"{platform.system()} {platform.release()}",
    }


def _command(name: str, args: argparse.Namespace) -> str:
    """The command line that made a result: the script run (NAME.py when called from elsewhere,
    as a test does) and every argument it was given, so the figure can be made again."""
    import shlex

    script = Path(sys.argv[0])
    script = script.name if script.parent.resolve() == ROOT / "benchmarks" else f"{name}.py"
    return shlex.join(["python", f"benchmarks/{script}", *getattr(args, "argv", [])])


def write_result(name: str, figures: dict[str, Any], args: argparse.Namespace) -> Path:
    """Write `figures` as benchmarks/results/NAME.json (or `--out`) beside what makes them
    traceable: the command as given (`_command`), whether it was `--quick`, the date and time
    (`when`) and the machine with its Python, torch and Ray versions (`machine`). Every stored
    result goes through here."""
    out = args.out or RESULTS / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "benchmark": name,
        "command": _command(name, args),
        "quick": bool(args.quick),
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(),
        **figures,
    }
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(out)
    return out


def print_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]], caption: str | None = None) -> None:
    """A rich table; numeric columns right-aligned."""
    from rich.console import Console
    from rich.table import Table

    rows = [list(r) for r in rows]
    t = Table(title=title, caption=caption)
    for i, c in enumerate(columns):
        numeric = bool(rows) and all(isinstance(r[i], (int, float)) or r[i] in ("-", "") for r in rows)
        t.add_column(c, justify="right" if numeric else "left")
    for r in rows:
        t.add_row(*(fmt(v) for v in r))
    Console(width=max(170, Console().width)).print(t)


def fmt(v: Any) -> str:
    """Three significant figures for floats, thousands separators for ints."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if v != v:
            return "-"
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def rel_error(predicted: float, measured: float) -> float:
    """|predicted - measured| / measured."""
    if measured <= 0:
        raise ValueError(f"a measured figure must be positive to compare against, got {measured}")
    return abs(predicted - measured) / measured


def steady_mean(values: Sequence[float]) -> float:
    """Mean over the steps after the first few (warm-up, allocation): the same rule for every
    launcher, so their figures compare."""
    tail = list(values[min(len(values) // 5, 10):]) or list(values)
    if not tail:
        raise ValueError("no steps to average")
    return statistics.fmean(tail)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict[str, str]:
    """The environment of a benchmark's child processes: the project importable, no stray
    Ray address (each launcher starts its own cluster, as a user's first run does)."""
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def python() -> str:
    return sys.executable
