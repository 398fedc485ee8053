"""Probe the machine this process runs on: the per-node chain every Ray node runs.

In order: a declared topology (``ORCHESTRATOR_TOPOLOGY_FILE`` in the environment, which is how
simulated nodes and containers without NVML describe their wiring), then NVML, then the text
of ``nvidia-smi topo -m``, then plain CPU slots. GPU probes are completed from sysfs: the NICs
with their PCIe distance to each GPU, and the NUMA nodes.
"""

from __future__ import annotations

import json
import os
import re
import socket
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .files import load_topology_file
from .model import NodeTopology, cpu_node
from .nvml import NvmlUnavailable, normalize_bus_id, probe_nvml
from .smi import parse_topo_matrix
from .sysfs import numa_nodes, pci_numa_node, pcie_path_kind, read_nics

TOPOLOGY_FILE_ENV = "ORCHESTRATOR_TOPOLOGY_FILE"
MISSING_NIC_WARNING = "names NIC(s) this node does not have"
# NIC names that are placeholders, not device names: `NIC3` columns without a legend, PCI addresses.
_PLACEHOLDER_NIC = re.compile(r"^(NIC\d+|[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])$")
_SMI_TIMEOUT_S = 30
CACHE_DIR_ENV = "ORCHESTRATOR_CACHE_DIR"
"""Where the probe keeps what it measured of a host's CPU (default: ~/.cache/orchestrator)."""
CPU_RATE_SPREAD = 0.15
"""Timed passes of the CPU rate that differ by more than this share of their median were taken
while something else ran: they are timed again."""
CPU_RATE_AGREEMENT = 0.15
"""A run's own measured CPU rate within this share of the kept one agrees with it; beyond, it
replaces it."""


def probe_local(
    num_cpu_slots: int = 0,
    *,
    sysfs_root: str | Path = "/",
    pynvml_module: Any = None,
) -> NodeTopology:
    """This node's topology. `num_cpu_slots` (default: the CPU count) sizes a GPU-less node."""
    declared = os.environ.get(TOPOLOGY_FILE_ENV)
    node: NodeTopology | None
    if declared:
        node = load_topology_file(declared)
        node.source = f"declared:{declared}"
        node.hostname = node.hostname or socket.gethostname()
        missing = missing_nics(node, sysfs_root)
        if missing:
            node.warnings.append(f"{declared} {MISSING_NIC_WARNING}: {', '.join(missing)} (no entry in "
                                 f"/sys/class/infiniband or /sys/class/net on {node.hostname}); the plan still "
                                 "assigns them, but NCCL will not find them there")
        return node

    reasons: list[str] = []
    try:
        node = probe_nvml(pynvml_module)
    except NvmlUnavailable as e:
        reasons.append(str(e))
        node = probe_smi(reasons)
    if node is not None:
        node.hostname = node.hostname or socket.gethostname()
        add_sysfs(node, sysfs_root)
        return node
    slots = num_cpu_slots or os.cpu_count() or 1
    node = cpu_node(slots, hostname=socket.gethostname())
    node.numa_nodes = numa_nodes(sysfs_root)
    share = host_memory_bytes() // slots
    # CPUs differ by 10x in what one core multiplies; no table knows this one, so measure it.
    tflops = known_cpu_slot_tflops()
    for d in node.devices:
        d.measured_tflops = tflops
        d.memory_bytes = d.memory_bytes or share
    return node


def missing_nics(node: NodeTopology, root: str | Path = "/") -> list[str]:
    """The NICs a declared node names that this host has no device of (placeholders skipped)."""
    base = Path(root)
    return [n.name for n in node.nics if not _PLACEHOLDER_NIC.match(n.name)
            and not any((base / "sys/class" / cls / n.name).exists() for cls in ("infiniband", "net"))]


def known_cpu_slot_tflops() -> float | None:
    """`cpu_slot_tflops`, measured once per kind of host and kept in the cache directory: the
    figure belongs to the CPU model, its core count and the torch build, and measuring it
    means importing torch in the probe (a second of CPU on every node, on the critical path
    to the first step). `cluster.measure` measures afresh, and a run that measures its compute
    otherwise corrects it (`correct_cpu_slot_tflops`)."""
    key = _cpu_key()
    if key is None:  # no torch here: nothing to measure with
        return None
    value = _read_cache().get(key)
    if isinstance(value, (int, float)) and value > 0:
        return float(value)
    value = cpu_slot_tflops()
    if value:
        _write_cache(key, value)
    return value


def correct_cpu_slot_tflops(measured: float, agree_within: float = CPU_RATE_AGREEMENT) -> float | None:
    """Keep `measured` (the per-slot rate a run's own timed compute implies) as this host's
    figure where it differs from the kept one by more than `agree_within`, so that one busy
    moment at the first measurement is not kept for good. Returns the figure now kept."""
    key = _cpu_key()
    if key is None or not measured > 0:
        return None
    kept = _read_cache().get(key)
    if isinstance(kept, (int, float)) and kept > 0 and abs(measured / kept - 1) <= agree_within:
        return float(kept)
    _write_cache(key, measured)
    return measured


def _read_cache() -> dict:
    try:
        known = json.loads((_cache_dir() / "cpu_slot_tflops.json").read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def _write_cache(key: str, value: float) -> None:
    path = _cache_dir() / "cpu_slot_tflops.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({**_read_cache(), key: value}, indent=1))
        tmp.replace(path)  # concurrent probes of one host never see half a file
    except OSError:  # a read-only home: measured again next time
        pass


def _cache_dir() -> Path:
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "orchestrator"


def _cpu_key() -> str | None:
    """The CPU model, logical CPU count and torch version, or None without torch."""
    from importlib import metadata

    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    return f"{model or 'unknown CPU'} | {os.cpu_count()} CPUs | torch {torch_version}"


def cpu_slot_tflops(seconds: float = 0.2, n: int = 512, passes: int = 5, tries: int = 3,
                    max_spread: float = CPU_RATE_SPREAD) -> float | None:
    """fp32 matmul TFLOP/s of one CPU thread (a worker's share on a GPU-less node): the median
    of `passes` timed passes over `seconds`. Each pass is timed by the thread's own CPU time,
    not the wall clock: the probe runs while the node starts its workers (on a small host they
    share its cores, and a wall clock would count their turns as this core's slowness, a third
    of the rate on 2 cores), and the plan prices a worker that has its slot. What CPU time
    still varies by (a sibling hyperthread, the caches) shows as spread: where the passes
    differ by more than `max_spread` of their median, they are timed again, up to `tries`
    times, and the steadiest try's median is kept."""
    try:
        import torch
    except ImportError:  # the probe also runs where only the planner is installed
        return None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b  # warm-up

        def one_pass() -> float:
            # One intra-op thread: the matmul runs on this thread, so its CPU time is the work's.
            runs, t0, cpu0 = 0, time.perf_counter(), time.thread_time()
            while runs == 0 or time.perf_counter() - t0 < seconds / passes:
                a @ b
                runs += 1
            return 2 * n**3 * runs / max(time.thread_time() - cpu0, 1e-9) / 1e12

        return steadiest_median(one_pass, passes, tries, max_spread)
    finally:
        torch.set_num_threads(threads)


def steadiest_median(one_pass: Callable[[], float], passes: int, tries: int, max_spread: float) -> float:
    """The median of `passes` calls of `one_pass`, taken again (up to `tries` times in all)
    while their spread, (max - min) / median, is over `max_spread`; the steadiest try's median."""
    if passes < 1 or tries < 1:
        raise ValueError(f"a rate needs at least one pass and one try, got passes={passes}, tries={tries}")

    def one_try() -> tuple[float, float]:  # (spread, median)
        rates = sorted(one_pass() for _ in range(passes))
        median = statistics.median(rates)
        return ((rates[-1] - rates[0]) / median if median > 0 else float("inf")), median

    best = one_try()
    for _ in range(tries - 1):
        if best[0] <= max_spread:
            break
        best = min(best, one_try(), key=lambda t: t[0])
    return best[1]


def _run(cmd: list[str], reasons: list[str]) -> str | None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=_SMI_TIMEOUT_S, check=False)
    except FileNotFoundError:
        reasons.append(f"{cmd[0]} is not installed")
        return None
    except subprocess.TimeoutExpired:
        reasons.append(f"`{' '.join(cmd)}` did not answer within {_SMI_TIMEOUT_S} s")
        return None
    if done.returncode != 0:
        reasons.append(f"`{' '.join(cmd)}` failed: {(done.stderr or done.stdout).strip()[:200]}")
        return None
    return done.stdout


def probe_smi(reasons: list[str]) -> NodeTopology | None:
    """The `nvidia-smi topo -m` matrix, for machines where the NVML binding cannot load."""
    text = _run(["nvidia-smi", "topo", "-m"], reasons)
    if text is None:
        return None
    # The matrix does not name the GPU model, which sets the NVLink rate; ask for it.
    names_text = _run(["nvidia-smi", "--query-gpu=index,name", "--format=csv,noheader"], reasons) or ""
    names = {}
    for line in names_text.splitlines():
        idx, _, name = line.partition(",")
        if idx.strip().isdigit() and name.strip():
            names[int(idx)] = name.strip()
    node = parse_topo_matrix(text, source="nvidia-smi", gpu_names=names or None)
    node.warnings = reasons + node.warnings
    return node


def add_sysfs(node: NodeTopology, root: str | Path = "/") -> None:
    """Complete a GPU probe from sysfs: NUMA nodes, device NUMA affinity, NICs and their paths.

    NICs the probe already named (the `NIC Legend` of `topo -m`) keep their GPU paths and gain
    speed, kind and PCI address; NICs only sysfs knows get their paths from the PCI tree.
    """
    node.numa_nodes = numa_nodes(root) or node.numa_nodes
    for dev in node.devices:
        if dev.numa_node is None and dev.pci_bus_id:
            dev.numa_node = pci_numa_node(normalize_bus_id(dev.pci_bus_id), root)
    found = {n.name: n for n in read_nics(root)}
    for nic in node.nics:
        seen = found.pop(nic.name, None)
        if seen is not None:
            nic.speed_gbps = nic.speed_gbps or seen.speed_gbps
            nic.kind = seen.kind if nic.kind == "unknown" else nic.kind
            nic.numa_node = nic.numa_node if nic.numa_node is not None else seen.numa_node
            nic.pci_bus_id = nic.pci_bus_id or seen.pci_bus_id
    for nic in found.values():
        if nic.pci_bus_id:
            for dev in node.devices:
                if dev.pci_bus_id:
                    kind = pcie_path_kind(nic.pci_bus_id, normalize_bus_id(dev.pci_bus_id), root)
                    if kind is not None:
                        nic.gpu_paths[dev.index] = kind
        node.nics.append(nic)


def host_memory_bytes() -> int:
    """Physical memory of this host (what its CPU slots share); 0 when the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0
