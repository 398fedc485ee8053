"""Ray nodes as `ray start --block` processes, each in its own process group, ports and temp
dir: what tests of real multi-process clusters (`ray start`, not `ray.cluster_utils`) share.
Teardown ends exactly the processes a node started."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _ray() -> str:
    return str(Path(sys.executable).with_name("ray"))


@dataclass
class Node:
    """One `ray start --block` process, its temp dir and its ports."""

    proc: subprocess.Popen
    temp_dir: Path
    metrics_port: int
    log: Path


def _start_node(args: list[str], env: dict[str, str], temp_dir: Path, metrics_port: int, name: str,
                head: bool = False) -> Node:
    """A node whose processes run under `temp_dir`: the head's own, which joining nodes share."""
    log = temp_dir.with_suffix(f".{name}.log")
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [_ray(), "start", "--block", "--disable-usage-stats", *([f"--temp-dir={temp_dir}"] if head else []),
             f"--metrics-export-port={metrics_port}", *args],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT,
        )
    return Node(proc, temp_dir, metrics_port, log)


def _stop_node(node: Node) -> None:
    """End this node's processes only: its `ray start --block` group, then anything left that
    runs under its temp dir (workers Ray started in a session of their own)."""
    import psutil

    if node.proc.poll() is None:
        node.proc.send_signal(signal.SIGTERM)
        try:
            node.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(node.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    marker = str(node.temp_dir)
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(marker in arg for arg in p.info["cmdline"] or ()):
                p.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


def _wait(predicate, timeout: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as e:  # the service is still coming up
            last_error = e
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what} (last error: {last_error})")
