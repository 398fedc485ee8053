"""The package's architecture, checked: the planner stays pure Python (planning a job imports
neither torch nor Ray, so it is fast and usable on a laptop with neither a GPU nor a cluster),
no import cycles, and every import points down the layers (the import-linter contracts in
pyproject.toml, which `.ci/run` runs as `lint-imports` too)."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parent.parent

_PLAN_ONLY = r"""
import sys
from orchestrator.config import load_config
from orchestrator.planning import plan_job
from orchestrator.topology.files import load_topology_file
from orchestrator.topology.model import ClusterTopology
node = load_topology_file(sys.argv[1])
plan = plan_job(load_config(sys.argv[2], ["cluster.gpu=A100"]), ClusterTopology(nodes=[node]))
heavy = sorted(m for m in ("torch", "ray", "pynvml") if m in sys.modules)
print(plan.strategy, heavy)
"""


def test_planning_imports_neither_torch_nor_ray():
    out = subprocess.run(
        [sys.executable, "-c", _PLAN_ONLY, str(ROOT / "tests/fixtures/topology/topo_4gpu_pcie_pxb_pix_nccl667.txt"),
         str(ROOT / "jobs/llm.yaml")],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout.split()
    assert out[-1] == "[]", out


_CHECKPOINT_READER = r"""
import sys
from orchestrator.record import stopped, checkpoint_scan as verify
from orchestrator.runtime import checkpoint_files
print(sorted(m for m in ("torch",) if m in sys.modules))
"""


def test_checkpoints_are_listed_and_verified_without_torch():
    # Before every resume each node hashes its share of the checkpoint in a fresh Ray worker
    # process, and a stopped run lists its checkpoints: importing torch there would cost
    # seconds per node per restart for nothing (checkpoint_scan.py's task runs checkpoint_files only).
    out = subprocess.run([sys.executable, "-c", _CHECKPOINT_READER], capture_output=True, text=True, check=True,
                         timeout=120).stdout.split("\n")
    assert out[0] == "[]", out


PACKAGE = ROOT / "orchestrator"
CONTRACTS = ("every import points down the layers", "no module of the package imports its __init__",
             "the package's __init__ imports neither the CLI nor __main__", "no import cycles")


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    """lint-imports over the package under `root` with the contracts of `root`/pyproject.toml."""
    run = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"
    return subprocess.run([sys.executable, "-c", run], cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                          capture_output=True, text=True, timeout=120)


def test_the_import_contracts_hold():
    out = _lint_imports(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    for name in CONTRACTS:
        assert f"{name} KEPT" in out.stdout, out.stdout


# Each breaks one contract in a copy of the package. Imports inside functions and under
# TYPE_CHECKING count as much as those at the top: either is a dependency the layers must allow.
_BREAKS = {
    "upward, inside a function": ("testbed/network.py", "def _f():\n    from ..planning import mesh\n",
                                  CONTRACTS[:1]),
    "upward, for types only": ("testbed/network.py",
                               "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..planning import mesh\n",
                               CONTRACTS[:1]),
    "across a layer": ("runtime/checkpoint_files.py", "from ..connect import reach\n", CONTRACTS[:1]),
    "a package without a layer": ("extra/__init__.py", "", CONTRACTS[:1]),
    # config reaches the commands through the package's __init__ too: both contracts see it.
    "the package's __init__ from below": ("config.py", "import orchestrator\n", CONTRACTS[:2]),
    "the CLI from the package's __init__": ("__init__.py", "def _f():\n    from . import cli\n", CONTRACTS[2:3]),
    "a cycle inside a package": ("topology/model.py", "def _f():\n    from . import render\n", CONTRACTS[3:]),
}


@pytest.mark.parametrize("where, line, contracts", _BREAKS.values(), ids=_BREAKS.keys())
def test_each_contract_is_broken_by_what_it_forbids(tmp_path, where, line, contracts):
    shutil.copytree(PACKAGE, tmp_path / "orchestrator", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    module = tmp_path / "orchestrator" / where
    module.parent.mkdir(exist_ok=True)
    module.write_text((module.read_text() if module.exists() else "") + line)
    out = _lint_imports(tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    broken = [name for name in CONTRACTS if f"{name} BROKEN" in out.stdout]
    assert tuple(broken) == contracts, out.stdout


def _on_a_cycle(graph: grimp.ImportGraph) -> list[str]:
    """Every module that imports, directly or not, a module that imports it back. import-linter's
    acyclic contract looks between the units of each package, so a cycle through a package's own
    __init__ (planning.plan importing `orchestrator.planning`, which imports planning.plan) is
    left to this."""
    return sorted(m for m in graph.modules if graph.find_upstream_modules(m) & graph.find_downstream_modules(m))


def test_the_cycle_finder_finds_a_cycle_through_a_packages_init(tmp_path, monkeypatch):
    package = tmp_path / "cyclic"
    package.mkdir()
    (package / "__init__.py").write_text("from .a import thing\n")
    (package / "a.py").write_text("def thing():\n    from cyclic import b\n")
    (package / "b.py").write_text("")
    (package / "c.py").write_text("import cyclic\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = grimp.build_graph("cyclic", exclude_type_checking_imports=False, cache_dir=None)
    assert _on_a_cycle(graph) == []
    (package / "b.py").write_text("from cyclic import thing\n")
    graph = grimp.build_graph("cyclic", exclude_type_checking_imports=False, cache_dir=None)
    assert _on_a_cycle(graph) == ["cyclic", "cyclic.a", "cyclic.b"]


def test_no_module_takes_part_in_an_import_cycle():
    graph = grimp.build_graph("orchestrator", exclude_type_checking_imports=False, cache_dir=None)
    assert len(graph.modules) > 100 and graph.find_modules_directly_imported_by("orchestrator.planning.plan")
    assert _on_a_cycle(graph) == []


# What would make a plan depend on the machine that computes it rather than on the topology.
_HOST_MODULES = ("platform", "socket", "psutil")
_HOST_OS_NAMES = ("sysconf", "sysconf_names", "cpu_count", "environ", "environb", "getenv", "sched_getaffinity",
                  "uname", "getloadavg")


def _host_reads(path: Path, root: Path = ROOT) -> list[str]:
    """`file:line what` for every read of the host in a module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        where = f"{path.relative_to(root)}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            found += [f"{where} imports {a.name}" for a in node.names if a.name.split(".")[0] in _HOST_MODULES]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] in _HOST_MODULES:
                found.append(f"{where} imports from {node.module}")
            elif node.module == "os":
                found += [f"{where} imports os.{a.name}" for a in node.names if a.name in _HOST_OS_NAMES]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os" \
                and node.attr in _HOST_OS_NAMES:
            found.append(f"{where} reads os.{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "/proc" in node.value:
            found.append(f"{where} names /proc")
    return found


def test_the_host_read_finder_finds_host_reads(tmp_path):
    src = tmp_path / "mod.py"
    src.write_text("import os, platform\nfrom os import environ\nn = os.cpu_count()\nm = os.sysconf('SC_PAGE_SIZE')\n"
                   "open('/proc/meminfo')\nimport socket as s\n")
    (tmp_path / "clean.py").write_text("import os.path\nx = os.path.join('a', 'b')\n")
    found = _host_reads(src, tmp_path)
    assert [f.split(" ", 1)[0] for f in found] == \
        ["mod.py:1", "mod.py:2", "mod.py:6", "mod.py:3", "mod.py:4", "mod.py:5"], found
    assert _host_reads(tmp_path / "clean.py", tmp_path) == []


def test_planning_does_not_read_the_host_it_runs_on():
    # The planner plans for the topology it is given (probed, captured or described); what the
    # machine running it has is the probe's business (topology/local.py).
    planning = sorted((PACKAGE / "planning").rglob("*.py"))
    assert len(planning) > 10
    found = [f for path in planning for f in _host_reads(path)]
    assert not found, "planning reads the host:\n" + "\n".join(found)
