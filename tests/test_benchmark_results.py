"""Every stored benchmark result traces to the code that makes it.

For each `benchmarks/results/*.json`: its `command` runs a script under benchmarks/ that writes
that benchmark, with options the script's own parser accepts (and that agree with the figures
the file records where both say the same thing); it records the date, the machine and the
Python, torch and Ray versions (`_common.write_result`); and it holds the figures that script
writes. Nothing is run: the commands are parsed, not executed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import re
import shlex
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
RESULTS = BENCH / "results"
sys.path.insert(0, str(BENCH))

import _common  # noqa: E402

# What write_result puts beside the figures.
METADATA = ("benchmark", "command", "quick", "when", "machine")
VERSIONS = ("python", "torch", "ray")
# The figures each benchmark's script writes (at least these keys, each non-empty).
FIGURES: dict[str, tuple[str, ...]] = {
    "activation_memory": ("rows", "max_error", "goal"),
    "checkpoint_cost": ("params_m", "steps", "sync", "async"),
    "first_run": ("runs", "goals", "met"),
    "checkpoint_store": ("ranks", "steps", "stores", "params", "checkpoint_bytes"),
    "compile": ("eager_s", "compiled_s", "speedup", "cold_compile_s", "warm_compile_s"),
    "context_parallel": ("seq", "model", "rows"),
    "rehearsal": ("cases", "max_memory_error", "max_bytes_error", "goal"),
    "cost_model": ("world", "backend", "calibration", "rows", "mean_error", "max_error", "per_op"),
    "cost_model_shaped": ("shapings", "mean_error", "goal"),
    "export_hf": ("params", "model_bytes", "files", "export_s", "peak_rss_bytes_per_rank"),
    "gpu_check": ("parts", "device", "seconds"),
    "large_model_cpu": ("params", "ranks", "loss", "plan_memory_per_rank"),
    "memory_model": ("world", "models", "max_error", "goal"),
    "moe_expert_parallel": ("by_ep", "ep2_over_ep1"),
    "narayanan_ptdp": ("rows", "zero3_vs_ptdp", "flops_counted"),
    "placement_gain": ("models", "rows"),
    "planner_scale": ("model", "rows"),
    "restart_cost": ("steps", "kill", "lose_one_of_3_nodes"),
    "runtime_overhead": ("runs", "median", "ratios", "goals"),
    "step_time": ("steps", "cases", "mean_abs_error"),
    "token_file_memory": ("steps", "baseline", "large"),
    "topology_gain": ("aware_step_s", "blind_step_s", "speedup", "predicted_aware_step_s", "arguments"),
    "topology_gain_sweep": ("rates", "arguments"),
}
_WRITES = re.compile(r"""write_result\(\s*["'](\w+)["']""")


def scripts() -> dict[str, Path]:
    """Every benchmark script, by file name."""
    return {p.name: p for p in sorted(BENCH.glob("*.py")) if not p.name.startswith("_")}


def writers() -> dict[str, str]:
    """Benchmark name -> the script whose source writes it through `write_result`."""
    out: dict[str, str] = {}
    for name, path in scripts().items():
        for bench in _WRITES.findall(path.read_text()):
            out[bench] = name
    return out


def _parser(script: str) -> argparse.ArgumentParser:
    module = importlib.import_module(Path(script).stem)
    return _common.parser(module.__doc__, getattr(module, "options", None))


def _given(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The options' destinations that `argv` sets explicitly."""
    given = set()
    for action in parser._actions:
        if any(a == opt or a.startswith(opt + "=") for opt in action.option_strings for a in argv):
            given.add(action.dest)
    return given


def problems(path: Path) -> list[str]:
    """What keeps the result at `path` from tracing to code; empty when it does."""
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        return [f"not JSON: {e}"]
    if not isinstance(data, dict):
        return ["not a JSON object"]
    found = [f"no {k!r} (results are written by _common.write_result)" for k in METADATA if k not in data]
    if found:
        return found
    machine = data["machine"]
    if not isinstance(machine, dict) or not machine.get("cpu") or not machine.get("cpu_cores"):
        found.append(f"machine {machine!r} names no CPU and core count")
    else:
        found += [f"machine records no {v} version" for v in VERSIONS if not machine.get(v)]
    try:
        datetime.strptime(data["when"], "%Y-%m-%dT%H:%M:%S%z")
    except (TypeError, ValueError):
        found.append(f"when {data['when']!r} is not a date and time")

    argv = shlex.split(data["command"])
    if len(argv) < 2 or Path(argv[0]).name not in ("python", "python3") or not argv[1].startswith("benchmarks/"):
        return found + [f"command {data['command']!r} is not `python benchmarks/SCRIPT.py [OPTIONS]`"]
    script = argv[1].removeprefix("benchmarks/")
    if script not in scripts():
        return found + [f"command names {argv[1]}, which does not exist"]
    bench = data["benchmark"]
    wrote = writers().get(bench)
    if wrote != script:
        found.append(f"benchmark {bench!r} is written by {wrote or 'no script'}, not by {script}")
    if not path.stem.startswith(bench):
        found.append(f"file {path.name} is not named after its benchmark {bench!r}")

    parser = _parser(script)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parser.parse_args(argv[2:])
    except SystemExit:
        return found + [f"{script} does not accept {shlex.join(argv[2:])!r}: {err.getvalue().strip()}"]
    if bool(data["quick"]) != bool(args.quick):
        found.append(f"quick is {data['quick']} but the command {'has' if args.quick else 'lacks'} --quick")
    # An option that the figures record too must agree with them: given explicitly, or its
    # default where --quick (which changes some defaults) was not given. None and "auto" are
    # resolved by the script, so they are not compared.
    given = _given(parser, argv[2:])
    for dest, value in vars(args).items():
        if dest in ("quick", "out") or dest not in data or value is None or value == "auto":
            continue
        # A sweep's option lists every value; each of its results records the one it ran.
        agrees = data[dest] in value if isinstance(value, list) and not isinstance(data[dest], list) \
            else data[dest] == value
        if (dest in given or not args.quick) and not agrees:
            found.append(f"the command sets {dest}={value!r}, the figures say {data[dest]!r}")
    if "arguments" in data and data["arguments"] != argv[2:]:
        found.append(f"the command's options {argv[2:]} are not the recorded arguments {data['arguments']}")

    for key in FIGURES.get(bench, ()):
        if data.get(key) in (None, [], {}, ""):
            found.append(f"no figure {key!r}, which {script} writes")
    if not any(data.get(k) not in (None, [], {}, "") for k in data if k not in METADATA):
        found.append("no figures beside the metadata")
    return found


RESULT_FILES = sorted(RESULTS.glob("*.json"))


def test_there_are_results():
    assert RESULT_FILES


@pytest.mark.parametrize("path", RESULT_FILES, ids=[p.name for p in RESULT_FILES])
def test_result_traces_to_its_script(path):
    assert problems(path) == []


def test_every_script_stores_through_write_result_and_every_benchmark_is_known():
    # Only write_result records the command, machine, date and versions.
    for name, path in scripts().items():
        assert _WRITES.search(path.read_text()), f"{name} stores no result through _common.write_result"
    assert set(writers()) == set(FIGURES)


def _result(tmp_path: Path, name: str, **changes: Any) -> Path:
    data = {"benchmark": "cost_model_shaped", "command": "python benchmarks/cost_model.py --quick --shaped 0.5:0",
            "quick": True, "when": "2026-12-03T15:03:37+0000",
            "machine": {"cpu": "AMD EPYC", "cpu_cores": 2, "python": "3.11.7", "torch": "2.13.0+cpu",
                        "ray": "2.60.0"},
            "shapings": [{"inter_gbit": 0.5}], "mean_error": 0.3, "goal": {"met": False}}
    data.update(changes)
    path = tmp_path / name
    path.write_text(json.dumps({k: v for k, v in data.items() if v is not None}))
    return path


def test_the_check_rejects_what_does_not_trace(tmp_path):
    assert problems(_result(tmp_path, "cost_model_shaped.json")) == []
    # a script that never existed
    bad = problems(_result(tmp_path, "cost_model_shaped_2x2.json", command="python benchmarks/cost_model_shaped.py"
                                                                           " --quick"))
    assert bad and "does not exist" in bad[0]
    # an option the script does not take, a quick flag the command lacks
    assert any("does not accept" in p for p in problems(
        _result(tmp_path, "cost_model_shaped.json", command="python benchmarks/cost_model.py --quick --nodes 2")))
    assert any("lacks --quick" in p for p in problems(
        _result(tmp_path, "cost_model_shaped.json", command="python benchmarks/cost_model.py --shaped 0.5:0")))
    # the wrong script for the benchmark; a value the figures contradict
    assert any("written by cost_model.py" in p for p in problems(
        _result(tmp_path, "cost_model_shaped.json", command="python benchmarks/memory_model.py --quick")))
    assert any("world" in p for p in problems(
        _result(tmp_path, "cost_model.json", benchmark="cost_model", world=2, backend="gloo", calibration={"a": 1},
                rows=[1], max_error=0.4, per_op={"a": 1}, command="python benchmarks/cost_model.py --quick --world 4")))
    # written around write_result: no command, machine or date; or no versions, no figures
    assert any("'command'" in p for p in problems(_result(tmp_path, "x.json", command=None, when=None)))
    assert any("torch version" in p for p in problems(
        _result(tmp_path, "cost_model_shaped.json", machine={"cpu": "x", "cpu_cores": 2, "python": "3.11"})))
    assert any("'shapings'" in p for p in problems(_result(tmp_path, "cost_model_shaped.json", shapings=[])))
