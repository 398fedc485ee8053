"""A local multi-node Ray cluster on a shaped network: one `ray start` per network namespace.

    with ShapedCluster(ClusterSpec(nodes=2, slots_per_node=2, shaping=Shaping(1.0, 1.0))) as c:
        c.run_in_head([sys.executable, "my_driver.py"], env={"RAY_ADDRESS": c.address})

Each node is `ray start --block` inside its own namespace (`network.py`), a process group
this object owns: stopping the cluster kills those groups and deletes the namespaces, and
never runs `ray stop`, which would select other people's Ray processes on the same host.
The driver runs inside the head's namespace (`run_in_head`), so it reaches the nodes over
the shaped network only. Teardown runs on exit, on Ctrl-C/SIGTERM (via `atexit` and a
signal handler) and, after a crash that skipped both, on the next start with the same
prefix. Nodes declare their devices: CPU slots, or fake GPUs with a topology capture in the
raylet's `ORCHESTRATOR_TOPOLOGY_FILE`.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .network import NetworkSpec, ShapedNetworkError, Shaping, create, remove

_GCS_PORT = 6379
_READY_TIMEOUT_S = 240.0


@dataclass(frozen=True)
class ClusterSpec:
    """The shape of a local shaped cluster."""

    nodes: int = 2
    """Ray nodes, one network namespace each (the first is the head)."""
    slots_per_node: int = 2
    """CPU slots (Ray CPUs) each node offers; one training worker per slot."""
    shaping: Shaping = field(default_factory=lambda: Shaping(1.0, 1.0))
    """The limit of every node's link to the others."""
    network: NetworkSpec = field(default_factory=NetworkSpec)
    """Name prefix and subnet; a test and a benchmark use different ones so both can run."""
    gpus_per_node: int = 0
    """Fake GPUs each node declares (0 = CPU slots only)."""
    topology_file: str | None = None
    """A capture each node declares through ORCHESTRATOR_TOPOLOGY_FILE (with fake GPUs)."""

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= 16:
            raise ShapedNetworkError(f"nodes {self.nodes}: allowed 1 to 16")
        if not 1 <= self.slots_per_node <= 64:
            raise ShapedNetworkError(f"slots_per_node {self.slots_per_node}: allowed 1 to 64")
        if self.topology_file and not Path(self.topology_file).is_file():
            raise ShapedNetworkError(f"{self.topology_file}: topology file not found")


class ShapedCluster:
    """Starts the namespaces and the Ray nodes; `close()` (or leaving `with`) removes them all."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.addresses: list[str] = []
        self.delay_applied = False
        self._procs: list[subprocess.Popen] = []
        self._tmp: str | None = None
        self._closed = True
        self._old_handlers: dict[int, Any] = {}

    @property
    def address(self) -> str:
        return f"{self.addresses[0]}:{_GCS_PORT}"

    @property
    def head_ns(self) -> str:
        return self.spec.network.node_ns(0)

    def __enter__(self) -> ShapedCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        spec = self.spec
        self._closed = False
        atexit.register(self.close)
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread: atexit still tears down
                pass
        try:
            self.addresses, self.delay_applied = create(spec.network, spec.nodes, spec.shaping)
            # Short: Ray's unix socket paths must stay under 108 bytes.
            self._tmp = tempfile.mkdtemp(prefix=spec.network.prefix, dir="/tmp")
            for i, addr in enumerate(self.addresses):
                self._procs.append(self._start_node(i, addr))
                if i == 0:
                    self._wait_for_nodes(1)
            self._wait_for_nodes(spec.nodes)
        except BaseException:
            self.close()
            raise

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("RAY_ADDRESS", None)
        env["RAY_USAGE_STATS_ENABLED"] = "0"
        # Reachable only from inside its own namespaces, the cluster needs no token; a token
        # mode inherited from the host would lock its own driver out.
        env["RAY_AUTH_MODE"] = "disabled"
        for key in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
            env.pop(key, None)
        # gloo binds to the address the host name resolves to, which inside a namespace is
        # nobody's; the node's own interface is the one its peers reach.
        env["GLOO_SOCKET_IFNAME"] = "eth0"
        if self.spec.topology_file:
            env["ORCHESTRATOR_TOPOLOGY_FILE"] = str(Path(self.spec.topology_file).resolve())
        else:
            env.pop("ORCHESTRATOR_TOPOLOGY_FILE", None)
        return env

    def _start_node(self, i: int, addr: str) -> subprocess.Popen:
        ray = str(Path(sys.executable).with_name("ray"))
        assert self._tmp is not None
        args = [ray, "start", "--block", "--node-ip-address", addr, "--num-cpus", str(self.spec.slots_per_node),
                "--num-gpus", str(self.spec.gpus_per_node), "--disable-usage-stats"]
        if i == 0:
            args += ["--head", "--port", str(_GCS_PORT), "--include-dashboard", "false", "--temp-dir", self._tmp]
        else:
            args += ["--address", self.address]
        log = open(Path(self._tmp) / f"node{i}.log", "w")
        # A session of its own: the whole process group (raylet, GCS, workers) is ours to kill.
        return subprocess.Popen(["ip", "netns", "exec", self.spec.network.node_ns(i), *args],
                                stdout=log, stderr=subprocess.STDOUT, env=self._env(), start_new_session=True)

    def _wait_for_nodes(self, n: int) -> None:
        """Wait until the first `n` nodes' `ray start` said it started, then check that the
        cluster counts them (a loaded host can take a minute per node)."""
        deadline = time.monotonic() + _READY_TIMEOUT_S
        assert self._tmp is not None
        for i in range(n):
            log = Path(self._tmp) / f"node{i}.log"
            while "Ray runtime started" not in log.read_text(errors="replace"):
                if self._procs[i].poll() is not None:
                    tail = log.read_text(errors="replace").strip().splitlines()[-1:]
                    # Ray gives a raylet 30 s to register, which a loaded host can miss: try again.
                    if tail and "timed out during startup" in tail[0] and time.monotonic() < deadline:
                        self._procs[i] = self._start_node(i, self.addresses[i])
                        continue
                    raise ShapedNetworkError(f"Ray node {i} exited with code {self._procs[i].returncode}: "
                                       f"{tail[0] if tail else 'no output'}")
                if time.monotonic() > deadline:
                    raise ShapedNetworkError(f"Ray node {i} of the shaped cluster did not start in "
                                       f"{_READY_TIMEOUT_S:.0f} s; its log: {log}")
                time.sleep(0.5)
        code = (f"import ray, time; ray.init(address='{self.address}', logging_level='ERROR')\n"
                f"while sum(1 for x in ray.nodes() if x['Alive']) < {n}: time.sleep(0.5)")
        left = max(deadline - time.monotonic(), 30.0)
        try:
            self.run_in_head([sys.executable, "-c", code], capture=True, timeout=left)
        except subprocess.TimeoutExpired:
            raise ShapedNetworkError(f"the shaped cluster did not reach {n} Ray nodes in {_READY_TIMEOUT_S:.0f} s; "
                               f"see the logs in {self._tmp}") from None

    def run_in_head(self, cmd: list[str], env: dict[str, str] | None = None, capture: bool = False,
                    check: bool = True, timeout: float | None = None) -> subprocess.CompletedProcess:
        """Run `cmd` inside the head node's namespace, with RAY_ADDRESS set to this cluster."""
        full_env = self._env()
        full_env["RAY_ADDRESS"] = self.address
        full_env.update(env or {})
        res = subprocess.run(["ip", "netns", "exec", self.head_ns, *cmd], env=full_env, text=True,
                             capture_output=capture, timeout=timeout)
        if check and res.returncode != 0:
            raise ShapedNetworkError(f"{' '.join(cmd[:3])} ... in the head namespace failed with code {res.returncode}"
                               + (f": {res.stderr.strip()[-400:]}" if capture else ""))
        return res

    def _on_signal(self, signum: int, frame: object) -> None:
        self.close()
        old = self._old_handlers.get(signum)
        if callable(old):
            old(signum, frame)
        raise KeyboardInterrupt if signum == signal.SIGINT else SystemExit(128 + signum)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for p in self._procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in self._procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        # Whatever is left inside our namespaces (workers Ray re-parented) goes with them.
        remove(self.spec.network.prefix)
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
        for sig, old in self._old_handlers.items():
            try:
                signal.signal(sig, old)
            except (ValueError, TypeError):
                pass
        self._old_handlers.clear()
        atexit.unregister(self.close)
