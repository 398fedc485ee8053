"""Where a machine's CPU went while a launch trained: its ranks, and everything else.

On a host whose ranks use every core, any other process that runs (a launcher's agent, Ray's
GCS, raylet, dashboard agent and log monitor, the driver, a metrics actor) takes its CPU time
from a step. `CpuSampler` reads every process's CPU seconds a few times a second while a launch
runs; `split` then charges the steady window's seconds to the ranks (the `world` processes that
used the most) and to the rest, by process. The rest's share of the machine is the tax a launcher
puts on a step that nothing inside the step's own timing can see.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import psutil

Sample = tuple[float, dict[int, tuple[str, float]]]
"""(unix time, {pid: (name, CPU seconds so far)})."""


def _name(proc: psutil.Process) -> str:
    """`ray::Worker.train`, `gcs_server`, `python -m orchestrator submit`: what a reader knows it by."""
    cmd = proc.info["cmdline"] or []
    if not cmd:
        return proc.info["name"] or "?"
    if cmd[0].startswith("ray::"):
        return cmd[0]
    head = os.path.basename(cmd[0])
    if head.startswith("python") and len(cmd) > 1:
        rest = cmd[1:3] if cmd[1] == "-m" or cmd[1] == "-u" else cmd[1:2]
        return " ".join([head, *(os.path.basename(a) for a in rest)])
    return head


class CpuSampler:
    """Samples every process's CPU seconds each `interval_s` from entering to leaving (itself
    left out: the same sampling runs beside every launcher)."""

    def __init__(self, interval_s: float = 0.25) -> None:
        self.interval_s = interval_s
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cpu-sampler", daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        me = os.getpid()
        while True:
            now: dict[int, tuple[str, float]] = {}
            for proc in psutil.process_iter(["pid", "name", "cmdline"]):
                if proc.pid == me:
                    continue
                try:
                    t = proc.cpu_times()
                    now[proc.pid] = (_name(proc), t.user + t.system)
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue
            self.samples.append((time.time(), now))
            if self._stop.wait(self.interval_s):
                return


def split(samples: list[Sample], t_from: float, t_to: float, world: int) -> dict[str, Any]:
    """The CPU the machine spent between the first sample at or after `t_from` and the last at
    or before `t_to`, in cores (CPU seconds per second): `ranks` (the `world` processes that used
    the most), `others` (every other process) and `others_share` (of all the machine's cores),
    with the five largest others by name. A process that started inside the window is charged
    all its seconds; one that ended inside it, none (steady training starts and ends none)."""
    inside = [s for s in samples if t_from <= s[0] <= t_to]
    if len(inside) < 2:
        raise ValueError(f"no two CPU samples between {t_from:.2f} and {t_to:.2f}: the window is too short to read")
    (t0, a), (t1, b) = inside[0], inside[-1]
    span = t1 - t0
    used = sorted(((cpu - a.get(pid, (name, 0.0))[1], name) for pid, (name, cpu) in b.items()), reverse=True)
    ranks, rest = used[:world], used[world:]
    by_name: dict[str, float] = {}
    for seconds, name in rest:
        by_name[name] = by_name.get(name, 0.0) + seconds
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:5]
    others = sum(s for s, _ in rest) / span
    return {"window_s": span, "ranks_cores": sum(s for s, _ in ranks) / span,
            "rank_names": sorted({n for _, n in ranks}), "others_cores": others,
            "others_share": others / (psutil.cpu_count() or 1),
            "largest_others": {name: seconds / span for name, seconds in top}}
