"""The package's architecture, checked: the planner stays pure Python (planning a job imports
neither torch nor Ray, so it is fast and usable on a laptop with neither a GPU nor a cluster),
no import cycles, and every import points down the layers."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

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


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name; a package's name stands for its __init__."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules `name` imports anywhere in its file, function-level (deferred)
    imports and TYPE_CHECKING blocks included: `import a.b` imports a.b; `from a import b`
    imports the module a.b where there is one, and else a (a package's __init__)."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                sub = f"{target}.{a.name}"
                if sub in modules:
                    out.add(sub)
                elif target in modules:
                    out.add(target)
    out.discard(name)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _a_cycle(graph: dict[str, set[str]], members: list[str]) -> list[str]:
    """One import cycle through the component, start and end at its first module."""
    inside, start = set(members), members[0]
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v] & inside):
            if w == start:
                return paths[v] + [start]
            if w not in paths:
                paths[w] = paths[v] + [w]
                queue.append(w)
    return members


def test_the_cycle_finder_reports_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _a_cycle(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_relative_and_deferred_imports_are_resolved(tmp_path):
    modules = {"orchestrator": PACKAGE / "__init__.py", "orchestrator.planning": PACKAGE / "planning/__init__.py",
               "orchestrator.planning.plan": PACKAGE / "planning/plan.py", "orchestrator.config": PACKAGE / "config.py"}
    src = tmp_path / "mod.py"
    src.write_text("from ..config import JobConfig\nfrom . import plan\n"
                   "def f():\n    from ..planning import Plan\n    import orchestrator.config\n")
    assert _imports("orchestrator.planning.mod", src, modules) == {
        "orchestrator.config", "orchestrator.planning.plan", "orchestrator.planning"}


def test_no_module_takes_part_in_an_import_cycle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert len(graph) > 30 and graph["orchestrator.planning.plan"]  # the walk found the package
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(_a_cycle(graph, c)) for c in cycles)


# The package's layers, lowest first. A module may import its own unit and any unit of a lower
# layer, never one of its own layer's other units or a higher layer's: the driver side (control)
# reaches down into what runs in a worker (runtime), never the reverse; the planner sees the
# topology model and the config, nothing that runs; the CLI commands sit on top of it all.
LAYERS: list[tuple[str, ...]] = [
    ("orchestrator.errors", "orchestrator.choices", "orchestrator.serialize"),
    ("orchestrator.data",),
    ("orchestrator.config",),
    ("orchestrator.topology", "orchestrator.testbed"),
    ("orchestrator.planning",),
    ("orchestrator.workloads",),
    ("orchestrator.runtime", "orchestrator.connect"),
    ("orchestrator.record",),
    ("orchestrator.control",),
    ("orchestrator.commands",),
    ("orchestrator.cli", "orchestrator"),
    ("orchestrator.__main__",),
]


def _unit(module: str) -> str:
    """The layered unit a module belongs to: its top package under orchestrator, or the
    top-level module itself."""
    parts = module.split(".")
    return ".".join(parts[:2])


def _rank(unit: str) -> int:
    for i, layer in enumerate(LAYERS):
        if unit in layer:
            return i
    raise AssertionError(f"{unit} is in no layer of tests/test_layering.py: give it one")


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """`a -> b` for every import of a unit that is not below the importer's own."""
    found = []
    for name, targets in sorted(graph.items()):
        here = _unit(name)
        for t in sorted(targets):
            there = _unit(t)
            if there != here and _rank(there) >= _rank(here):
                found.append(f"{name} -> {t} ({here} is layer {_rank(here)}, {there} layer {_rank(there)})")
    return found


def test_the_layer_check_finds_upward_and_sideways_imports():
    graph = {"orchestrator.runtime.worker": {"orchestrator.control.driver", "orchestrator.planning.plan"},
             "orchestrator.runtime.trainer": {"orchestrator.connect.remote", "orchestrator.runtime.worker"},
             "orchestrator.control.driver": {"orchestrator.runtime.worker"}}
    found = _upward(graph)
    assert [f.split(" (")[0] for f in found] == ["orchestrator.runtime.trainer -> orchestrator.connect.remote",
                                                 "orchestrator.runtime.worker -> orchestrator.control.driver"]


def test_every_unit_of_the_package_has_a_layer():
    units = {_unit(m) for m in _modules()}
    assert {"orchestrator.control", "orchestrator.runtime", "orchestrator.data", "orchestrator.connect"} <= units
    for u in units:
        _rank(u)


def test_no_module_imports_up_or_across_a_layer():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    found = _upward(graph)
    assert not found, "imports that reach up or across a layer:\n" + "\n".join(found)


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
