"""A shaped network of Linux network namespaces: one per node, joined through a bridge.

Every node is a namespace with one veth `eth0` and an address from the RFC 2544
benchmarking range (198.18.0.0/15), which is never routed anywhere; the bridge sits in a
namespace of its own, so nothing is added to, or changed in, the host's own network
namespace and no packet can leave the machine. Each node's link is shaped in both
directions, like a full-duplex NIC: on the node's egress and on the bridge port toward it,
`tbf` limits the rate and `netem` adds half the one-way delay, so a message from one node
to another waits `delay_ms` and crosses two links of `rate_gbit`. (A kernel without
`sch_netem` gets the rate only; `create` says whether the delay was applied.) Loopback inside a namespace
stays unshaped: that is the intra-node path.

Every object is named with the network's prefix (`orch-` by default), so a crash leaves
nothing that the next start with the same prefix does not find and remove. A live network's
prefix is claimed by its process (an advisory lock the kernel drops when the process dies), so
a second run with the same prefix is refused by name instead of tearing the first one down.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
from dataclasses import dataclass

from ..errors import UserError

ADDRESS_RANGE = ipaddress.IPv4Network("198.18.0.0/15")
"""RFC 2544's benchmarking range: never routed, so nothing addressed in it leaves the machine."""
_MAX_PREFIX = 9  # interface and namespace names are kept short (IFNAMSIZ is 16)


class ShapedNetworkError(UserError):
    """The shaped network cannot be made here (not root, no `ip`/`tc`, a bad shaping value)."""


@dataclass(frozen=True)
class Shaping:
    """How one node's link to the others is limited."""

    rate_gbit: float
    """Bandwidth of each node's link, Gbit/s per direction (0 = unlimited)."""
    delay_ms: float
    """One-way delay between two nodes, milliseconds (half on each end of the path)."""

    def __post_init__(self) -> None:
        if not (self.rate_gbit >= 0 and self.rate_gbit <= 100):
            raise ShapedNetworkError(f"inter-node rate {self.rate_gbit} Gbit/s: allowed 0 (unlimited) to 100")
        if not (0 <= self.delay_ms <= 1000):
            raise ShapedNetworkError(f"inter-node delay {self.delay_ms} ms: allowed 0 to 1000")


@dataclass(frozen=True)
class NetworkSpec:
    """Where the shaped network lives: its name prefix and its addresses."""

    prefix: str = "orch-"
    """Name prefix of every namespace; stale namespaces with it are removed on the next start."""
    subnet: str = "198.18.0.0/24"
    """The nodes' subnet, inside 198.18.0.0/15; node i gets host address i + 1."""

    def __post_init__(self) -> None:
        if not (1 <= len(self.prefix) <= _MAX_PREFIX) or not self.prefix.replace("-", "").isalnum():
            raise ShapedNetworkError(f"network prefix {self.prefix!r}: 1-{_MAX_PREFIX} letters, digits or '-'")
        try:
            net = ipaddress.IPv4Network(self.subnet)
        except ValueError:
            raise ShapedNetworkError(f"subnet {self.subnet!r} is not an IPv4 network such as 198.18.0.0/24") from None
        if not net.subnet_of(ADDRESS_RANGE):
            raise ShapedNetworkError(f"subnet {self.subnet}: must lie inside {ADDRESS_RANGE} (RFC 2544), "
                               "so that nothing is routed off the machine")

    def node_ns(self, i: int) -> str:
        return f"{self.prefix}n{i}"

    @property
    def bridge_ns(self) -> str:
        return f"{self.prefix}br"

    def address(self, i: int) -> str:
        net = ipaddress.ip_network(self.subnet)
        if i + 1 >= net.num_addresses - 1:
            raise ShapedNetworkError(f"subnet {self.subnet} has no address for node {i}")
        return str(net.network_address + i + 1)


def available() -> str | None:
    """Why shaped namespaces cannot be made here, or None when they can."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    ns = f"orchprobe-x{os.getpid()}"  # its own: two runs may ask at once
    try:
        _ip("netns", "add", ns)
    except ShapedNetworkError as e:
        return f"cannot create a network namespace: {e}"
    try:
        if _run(["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "1gbit", "burst", "256k",
                 "latency", "50ms"], ns=ns, check=False).returncode != 0:
            return "the kernel has no `tbf` qdisc to limit a link's rate"
    finally:
        _ip("netns", "del", ns, check=False)
    return None


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["ip", *args], ns=ns, check=check)


def _run(cmd: list[str], ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    full = ["ip", "netns", "exec", ns, *cmd] if ns else cmd
    res = subprocess.run(full, capture_output=True, text=True)
    if check and res.returncode != 0:
        raise ShapedNetworkError(f"`{' '.join(full)}` failed: {res.stderr.strip() or res.returncode}")
    return res


def namespaces(prefix: str) -> list[str]:
    """The namespaces whose names start with `prefix`."""
    res = _ip("netns", "list", check=False)
    names = [line.split()[0] for line in res.stdout.splitlines() if line.strip()]
    return [n for n in names if n.startswith(prefix)]


def pids_in(ns: str) -> list[int]:
    res = _ip("netns", "pids", ns, check=False)
    return [int(p) for p in res.stdout.split() if p.isdigit()]


_CLAIMS: dict[str, int] = {}
"""Prefix -> the open lock file by which this process holds the network of that prefix."""


def _claim(prefix: str) -> None:
    """Hold `prefix` for this process, or raise naming the live process that holds it."""
    import fcntl

    if prefix in _CLAIMS:
        return
    path = f"/tmp/orchestrator-netns-{prefix}lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise ShapedNetworkError(
            f"the shaped network {prefix!r} is in use by process {holder}; give this run another "
            "network prefix and subnet, or stop that one") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    _CLAIMS[prefix] = fd


def _release(prefix: str) -> None:
    fd = _CLAIMS.pop(prefix, None)
    if fd is not None:
        os.close(fd)  # closing drops the lock


def remove(prefix: str) -> list[str]:
    """Kill every process inside, and delete, each namespace named with `prefix`.

    Only processes inside these namespaces are touched: they can only be ones this network
    started, since nobody else's process lives in a namespace of this name. Deleting a
    namespace deletes its veth ends (and their peers), the bridge and their qdiscs. A network
    another live process holds is refused (ShapedNetworkError), not removed.
    """
    _claim(prefix)
    try:
        return _remove_claimed(prefix)
    finally:
        _release(prefix)


def _remove_claimed(prefix: str) -> list[str]:
    import signal
    import time

    gone = namespaces(prefix)
    for ns in gone:
        for pid in pids_in(ns):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 5
    for ns in gone:
        while pids_in(ns) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in pids_in(ns):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _ip("netns", "del", ns, check=False)
    return gone


def netem_available() -> bool:
    """Whether this kernel has the `netem` qdisc (sch_netem), which adds the delay."""
    ns = f"orchprobe-q{os.getpid()}"  # its own: two runs may ask at once
    _ip("netns", "add", ns, check=False)
    try:
        return _run(["tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"], ns=ns,
                    check=False).returncode == 0
    finally:
        _ip("netns", "del", ns, check=False)


_MTU = 1500
_GSO_MAX = 65536
# The smallest bucket: about ten MTU-sized packets, a NIC's worth of queue.
_SMALL_BURST = 16 << 10
# The bucket holds this long of the link's traffic: what lets a timer that fires late (an idle
# virtual CPU wakes in hundreds of microseconds) still find the tokens it slept through.
_BURST_S = 0.0008
# GSO packets at most this share of the bucket: a packet waits for its whole size in tokens, so
# only the bucket's rest absorbs a late timer. At half, an idle host lost up to 30% of a
# 0.2 Gbit/s link; at an eighth it keeps 700 us of slack.
_GSO_SHARE = 1 / 8


def _shape(dev: str, ns: str, shaping: Shaping, delay: bool) -> None:
    """tbf limits the rate; netem (as tbf's parent, where the kernel has it) adds the delay."""
    parent = ["root"]
    if delay and shaping.delay_ms > 0:
        _run(["tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
              "delay", f"{shaping.delay_ms / 2 * 1000:.0f}us", "limit", "100000"], ns=ns)
        parent = ["parent", "1:1"]
    if shaping.rate_gbit > 0:
        rate_bytes = shaping.rate_gbit * 1e9 / 8
        # The bucket must hold the largest packet the stack hands the device. With GSO that is
        # 64 KiB, and a bucket that size lets every small message pass at once, which a real
        # NIC does not do (on a slow link, collectives under 100 KiB then look nearly free). So
        # the bucket holds 800 us of the link's traffic (what lets this host's timers keep a
        # fast link at its rate), at least ten MTU-sized packets, and the device's GSO packets
        # are capped at an eighth of it; a kernel that refuses the cap keeps a 96 KiB bucket.
        burst = max(int(rate_bytes * _BURST_S), _SMALL_BURST)
        gso = min(_GSO_MAX, max(_MTU, int(burst * _GSO_SHARE)))
        if _run(["ip", "link", "set", "dev", dev, "gso_max_size", str(gso)], ns=ns, check=False).returncode != 0:
            burst = max(burst, 96 << 10)
        _run(["tc", "qdisc", "add", "dev", dev, *parent, "handle", "10:", "tbf",
              "rate", f"{shaping.rate_gbit * 1000:.0f}mbit", "burst", str(burst), "latency", "200ms"], ns=ns)


def create(spec: NetworkSpec, nodes: int, shaping: Shaping) -> tuple[list[str], bool]:
    """Make `nodes` namespaces joined through a shaped bridge.

    Returns the nodes' addresses and whether the delay was applied: a kernel without
    `netem` shapes the rate only (the caller says so; the measured probe sees the real
    latency either way). Namespaces left by an earlier run with the same prefix are removed
    first.
    """
    if nodes < 1:
        raise ShapedNetworkError(f"nodes must be at least 1, got {nodes}")
    why = available()
    if why:
        raise ShapedNetworkError(why)
    remove(spec.prefix)
    _claim(spec.prefix)  # held until `remove`, or until this process ends
    delay = shaping.delay_ms > 0 and netem_available()
    prefixlen = ipaddress.ip_network(spec.subnet).prefixlen
    br = spec.bridge_ns
    try:
        _ip("netns", "add", br)
        _ip("link", "add", "br0", "type", "bridge", ns=br)
        _ip("link", "set", "br0", "up", ns=br)
        addresses = []
        for i in range(nodes):
            ns = spec.node_ns(i)
            _ip("netns", "add", ns)
            _ip("link", "set", "lo", "up", ns=ns)
            # Created inside the bridge's namespace, so the host never holds either end.
            _ip("link", "add", f"p{i}", "type", "veth", "peer", "name", "eth0", "netns", ns, ns=br)
            _ip("link", "set", f"p{i}", "master", "br0", ns=br)
            _ip("link", "set", f"p{i}", "up", ns=br)
            addr = spec.address(i)
            _ip("addr", "add", f"{addr}/{prefixlen}", "dev", "eth0", ns=ns)
            _ip("link", "set", "eth0", "up", ns=ns)
            _shape("eth0", ns, shaping, delay)
            _shape(f"p{i}", br, shaping, delay)
            addresses.append(addr)
        return addresses, delay
    except BaseException:
        remove(spec.prefix)
        raise


_SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print('ready', flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
for _ in range(int(sys.argv[3])):
    c.recv(int(sys.argv[4]), socket.MSG_WAITALL); c.sendall(b'k')
while c.recv(1 << 20):
    pass
"""
_CLIENT = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2]))); s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []; ping = b'x' * int(sys.argv[5])
for _ in range(int(sys.argv[3])):
    time.sleep(float(sys.argv[6]))
    t = time.perf_counter(); s.sendall(ping); s.recv(1); rtts.append(time.perf_counter() - t)
buf = b'x' * (1 << 20); warm = time.perf_counter() + 0.3; n = 0
while time.perf_counter() < warm:
    s.sendall(buf)
t0 = time.perf_counter()
while time.perf_counter() - t0 < float(sys.argv[4]):
    s.sendall(buf); n += len(buf)
print(sorted(rtts)[len(rtts) // 2], n * 8 / (time.perf_counter() - t0) / 1e9)
"""


def tcp_link(spec: NetworkSpec, src: int, dst: int, seconds: float = 1.0, pings: int = 20,
             ping_bytes: int = 1, gap_s: float = 0.0) -> tuple[float, float]:
    """(median round trip in ms of a `ping_bytes` message and a 1-byte answer, each after
    `gap_s` of silence, TCP throughput in Gbit/s) from node `src` to node `dst`: what the
    shaping lets through, before any collective library adds its own costs."""
    import sys

    addr, port = spec.address(dst), 5599
    server = subprocess.Popen(["ip", "netns", "exec", spec.node_ns(dst), sys.executable, "-c", _SERVER,
                               addr, str(port), str(pings), str(ping_bytes)], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    try:
        server.stdout.readline()  # 'ready': listening
        res = _run([sys.executable, "-c", _CLIENT, addr, str(port), str(pings), str(seconds), str(ping_bytes),
                    str(gap_s)], ns=spec.node_ns(src))
        rtt, gbit = (float(x) for x in res.stdout.split())
        return rtt * 1e3, gbit
    finally:
        server.wait(timeout=30)
