"""Workers' stdout and stderr: all of it in the run directory, only what matters on the console.

Ray streams every worker's output to the driver (from each node's log monitor, so this works
for a driver on a remote head too) and prints it raw between our progress lines. This
replaces Ray's printer for the run: each line goes to `logs/rank-N.log` (ranks found by pid in
placement.json, which the driver writes as soon as the actors exist) or `logs/ray.log`
(Ray's own processes, other tasks); the console shows each worker error, and the first
occurrence of each distinct warning with the rank and the file to read. `verbose` shows every
line live as well.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console
from rich.markup import escape

from .rundir import RunDir

_RAY_HANDLER = "ray_print_logs"
_OUR_HANDLER = "orchestrator_worker_logs"
# glog-style lines of torch and Ray's C++: `[rank0]:W1203 11:50:06.634000 17460 file.py:390] message`
_GLOG = re.compile(r"^(?:\[rank\d+\]:)?([IWEF])\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ [^\]]*\] ?(.*)$")
# Python's warnings module: `/path/file.py:12: UserWarning: message`
_PY_WARNING = re.compile(r"^.*?:\d+: (\w*Warning): (.*)$")
# The last line of a traceback, and logging's `ERROR:name:message` / `... ERROR ...`
_EXCEPTION = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception|Interrupt|Exit)(?:: .*)?$")
_LOG_LEVEL = re.compile(r"\b(WARNING|WARN|ERROR|CRITICAL|FATAL)\b")
_NUMBERS = re.compile(r"0x[0-9a-fA-F]+|\d+")


def classify(line: str) -> tuple[str, str] | None:
    """('warning' | 'error', the message) for a line that is one, else None."""
    text = line.strip()
    m = _GLOG.match(text)
    if m:
        level, msg = m.groups()
        return ({"W": "warning", "E": "error", "F": "error"}[level], msg) if level != "I" else None
    m = _PY_WARNING.match(text)
    if m:
        return "warning", f"{m.group(1)}: {m.group(2)}"
    if _EXCEPTION.match(text) and not text.startswith(("During handling", "The above exception")):
        return "error", text
    m = _LOG_LEVEL.search(text)
    if m:
        return ("warning" if m.group(1).startswith("WARN") else "error"), text
    return None


class WorkerLogs:
    """While entered, the driver's handler of Ray's worker output (see the module docstring)."""

    def __init__(self, run: RunDir, console: Console, verbose: bool = False) -> None:
        self.run = run
        self.console = console
        self.verbose = verbose
        self.dir = run.path / "logs"
        self._files: dict[str, TextIO] = {}
        self._seen: set[tuple[str, str]] = set()
        self._ranks: dict[tuple[str, int], int] = {}
        self._placement_mtime = 0.0
        self._lock = threading.Lock()
        self._removed: list[tuple[str, Any]] = []

    def __enter__(self) -> "WorkerLogs":
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

        self.dir.mkdir(exist_ok=True)
        with dispatcher._lock:
            self._removed = [h for h in dispatcher.handlers if h[0] == _RAY_HANDLER]
        dispatcher.remove_handler(_RAY_HANDLER)
        dispatcher.add_handler(_OUR_HANDLER, self.handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

        dispatcher.remove_handler(_OUR_HANDLER)
        for name, handler in self._removed:
            dispatcher.add_handler(name, handler)
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()

    def handle(self, data: dict[str, Any]) -> None:
        """One batch of lines from one process (Ray's logger thread calls this)."""
        try:
            with self._lock:
                self._handle(data)
        except Exception as e:  # never break Ray's logger thread; say once that logs are incomplete
            key = ("internal", type(e).__name__)
            if key not in self._seen:
                self._seen.add(key)
                self.console.print(f"[yellow]warning:[/] worker output could not be recorded: {escape(str(e))}")

    def _handle(self, data: dict[str, Any]) -> None:
        lines = [l for l in data.get("lines", []) if l is not None]
        if data.get("pid") == "autoscaler":
            # Its periodic status report is noise here; Ray's own printer keeps only its events too.
            from ray._private.worker import filter_autoscaler_events

            lines = list(filter_autoscaler_events(lines))
        if not lines:
            return
        rank = self._rank(data)
        name = f"rank-{rank}.log" if rank is not None else "ray.log"
        who = f"rank {rank}" if rank is not None else _process(data)
        f = self._files.get(name)
        if f is None:
            f = self._files[name] = open(self.dir / name, "a", buffering=1, encoding="utf-8", errors="replace")
        for line in lines:
            f.write(line + "\n" if rank is not None else f"({_process(data)}) {line}\n")
        f.flush()
        path = self.dir / name
        for line in lines:
            if self.verbose:
                self.console.print(f"[dim]({escape(who)})[/] {escape(line)}", highlight=False)
                continue
            found = classify(line)
            if found is None:
                continue
            kind, msg = found
            key = (kind, _NUMBERS.sub("#", msg))
            if key in self._seen:
                continue
            self._seen.add(key)
            colour = "yellow" if kind == "warning" else "red"
            first = "first occurrence; " if kind == "warning" else ""
            self.console.print(
                f"[{colour}]{kind} from {escape(who)}[/] ({first}see {escape(str(path))}): {escape(msg)}",
                highlight=False, soft_wrap=True)

    def _rank(self, data: dict[str, Any]) -> int | None:
        try:
            pid = int(data.get("pid", ""))
        except (TypeError, ValueError):
            return None  # "raylet", "autoscaler"
        ip = str(data.get("ip", ""))
        # Looked at for every line (a stat, unless placement.json changed): a trial may give a
        # known process another rank.
        self._reload_placement()
        if (ip, pid) in self._ranks:
            return self._ranks[(ip, pid)]
        return next((r for (_, p), r in self._ranks.items() if p == pid), None)

    def _reload_placement(self) -> None:
        path = Path(self.run.path / "placement.json")
        try:
            mtime = path.stat().st_mtime
        except FileNotFoundError:
            return
        if mtime == self._placement_mtime:
            return
        self._placement_mtime = mtime
        # Keep earlier attempts' ranks: a restarted run's late lines from dead workers still belong.
        for report in json.loads(path.read_text()):
            self._ranks[(str(report.get("ip", "")), int(report["pid"]))] = int(report["rank"])


def _process(data: dict[str, Any]) -> str:
    pid = data.get("pid")
    if pid in ("raylet", "autoscaler"):
        return str(pid)
    what = data.get("actor_name") or data.get("task_name") or "worker"
    return f"{what} pid={pid}"
