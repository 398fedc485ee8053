"""The measured probe: time collectives between real processes and fit alpha-beta models.

The link tables say what a link should carry; this says what it does. One Ray actor per
device (NCCL on GPU, gloo on CPU) joins one torch.distributed process group. Inside a node,
ping-pong send/recv over growing messages times each measured pair; across nodes, an
all-reduce among one actor per node times the network. Each series is fitted by least squares
to t(s) = alpha + s / beta (latency alpha, bandwidth beta), weighted by 1/t so small messages
(latency) count as much as large ones (bandwidth). A link far below its table figure is
flagged `degraded`: a slow NVLink lane, PCIe P2P that the driver claims but routes through the
host, a NIC at a fraction of its rate. Pairs timed one at a time cannot show nodes that share a
host slowing each other down, as they do when a step runs its in-node collectives on every node
at once: one pair per node exchanges data alone, then on every node together, and a node
slowed by `SHARED_MIN_SLOWDOWN` or more has its in-node bandwidth divided by that factor.

Results are cached per node, keyed by host name and GPU UUIDs (a different set of GPUs is a
different machine), under ``~/.cache/orchestrator/measure`` or ``$ORCHESTRATOR_MEASURE_CACHE``.
Declared topologies describe machines that are not there and are not measured.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import TopologyError
from .model import ClusterTopology, Link, Network, NodeTopology

DEGRADED_FRACTION = 0.5
"""A link measuring below this fraction of its table bandwidth is flagged degraded."""
CACHE_ENV = "ORCHESTRATOR_MEASURE_CACHE"
QUICK_SIZES = (4 << 10, 64 << 10, 1 << 20, 8 << 20)
FULL_SIZES = tuple(4 << (10 + 2 * k) for k in range(8))  # 4 KiB .. 64 MiB, x4 steps
_ITERS = 5
_EXCHANGE_ITERS = 10
_SHARED_ROUNDS = 3
EXCHANGE_BYTES = 32 << 20
"""What each end of a pair sends in the shared-host check (`_shared_slowdowns`): long enough
that the pairs of every node overlap for most of it."""
_WARMUP = 2
_READY_TIMEOUT_S = 120.0
# A message this many times slower than the smallest one is dominated by its transfer, so
# its time says what the link sustains (see fit_alpha_beta).
TRANSFER_BOUND = 4.0
_MEASURABLE_SOURCES = ("nvml", "nvidia-smi", "cpu")


@dataclass
class Fit:
    """An alpha-beta model of one series of timings."""

    latency_us: float
    """alpha: the time of an empty message, microseconds."""
    bandwidth_gbps: float
    """beta: GB/s per direction once latency is paid."""


def _weighted_line(sizes: Sequence[float], seconds: list[float]) -> tuple[float, float]:
    """(a, b) of t = a + b s by least squares on relative residuals (weights 1/t)."""
    w = [1.0 / t for t in seconds]
    sw = sum(x * x for x in w)
    sx = sum(x * x * s for x, s in zip(w, sizes))
    sxx = sum(x * x * s * s for x, s in zip(w, sizes))
    sy = sum(x * x * t for x, t in zip(w, seconds))
    sxy = sum(x * x * s * t for x, s, t in zip(w, sizes, seconds))
    det = sw * sxx - sx * sx
    b = (sw * sxy - sx * sy) / det
    return (sy - b * sx) / sw, b


def fit_alpha_beta(sizes: Sequence[float], seconds: list[float]) -> Fit:
    """Least-squares fit of t(s) = alpha + s / beta to (bytes, seconds) samples.

    Residuals are relative (weights 1/t) so the microsecond points are not drowned by the
    millisecond ones. beta, the link's sustained rate, is read from the messages whose time
    their transfer dominates (at least TRANSFER_BOUND times the smallest message's), where
    there are two such sizes: a link that passes its first tens of KiB at once (a token
    bucket's burst, a NIC's coalescing) makes the mid-sized messages look nearly free, and one
    line through every size would then overrate the link by tens of percent. alpha is then
    the intercept that fits every size best under that beta. A negative intercept, which
    noise or such a burst produces, is replaced by the smallest message's time: latency
    cannot be less than zero nor more than that. Raises ValueError when the series cannot be
    fitted (fewer than two sizes, or time not growing with size).
    """
    if len(sizes) != len(seconds):
        raise ValueError(f"sizes and times must pair up, got {len(sizes)} sizes and {len(seconds)} times")
    if len(set(sizes)) < 2:
        raise ValueError(f"a fit needs at least two message sizes, got {sorted(set(sizes))}")
    if any(t <= 0 for t in seconds):
        raise ValueError("every timing must be positive")
    sizes, seconds = list(sizes), list(seconds)
    a, b = _weighted_line(sizes, seconds)
    bound = [(s, t) for s, t in zip(sizes, seconds) if t >= TRANSFER_BOUND * min(seconds)]
    if len({s for s, _ in bound}) >= 2:
        _, b_bound = _weighted_line([s for s, _ in bound], [t for _, t in bound])
        if b_bound > 0:
            b = b_bound
            w2 = [1.0 / (t * t) for t in seconds]
            a = sum(w * (t - b * s) for w, s, t in zip(w2, sizes, seconds)) / sum(w2)
    if b <= 0:
        raise ValueError("time does not grow with message size; the series is noise")
    if a <= 0:
        a = min(seconds)
    return Fit(latency_us=a * 1e6, bandwidth_gbps=1.0 / b / 1e9)


SHARED_MIN_SLOWDOWN = 1.25
"""A node's pair that is slowed by less than this while every other node's pair moves data too
shares nothing with them: one machine's run-to-run spread stays within it."""


def shared_slowdown(alone_s: float, together_s: float) -> float:
    """How much slower a node's in-node exchange ran while every measured node exchanged at once
    than alone, where that is a real slowdown (`SHARED_MIN_SLOWDOWN`); else 1.0."""
    if alone_s <= 0 or together_s <= 0:
        raise ValueError(f"exchange times must be > 0 s, got {alone_s} alone and {together_s} together")
    ratio = together_s / alone_s
    return ratio if ratio >= SHARED_MIN_SLOWDOWN else 1.0


def shared_note(slowdown: float) -> str:
    return (f"in-node links moved data {slowdown:.1f}x slower while every node did at once (nodes sharing a host's "
            f"cores or memory): measured and priced at that rate, as a training step runs on every node at once")


def _shared_slowdowns(ranks: list[_Rank], pairs: list[tuple[int, int] | None], size: int) -> list[float]:
    """Per node (in `pairs`' order; None: nothing measured there), `shared_slowdown` of its first
    measured pair exchanging `size` bytes: alone, one node after another, then every node at
    once. A training step runs its in-node collectives on every node at the same time, and
    nodes that share a host (co-located VMs, the testbed's namespaces) then slow each other
    down, which pairs timed one at a time never show. Separate machines read 1.0."""
    import ray

    timed = [p for p in pairs if p is not None]
    if len(timed) < 2:
        return [1.0] * len(pairs)

    def run(together: list[tuple[int, int]]) -> list[float]:
        """Each pair's time (its slower end's), the pairs of `together` exchanging at once."""
        got = ray.get([r.actor.exchanges.remote(together, size) for r in ranks])
        return [max(got[a], got[b]) for a, b in together]

    # Rounds taken in turn, the fastest of each kind kept: a round that another process on the
    # host slowed says nothing about the nodes.
    alone, together = [float("inf")] * len(timed), [float("inf")] * len(timed)
    for _ in range(_SHARED_ROUNDS):
        alone = [min(t, run([p])[0]) for t, p in zip(alone, timed)]
        together = [min(t, got) for t, got in zip(together, run(timed))]
    found = iter(shared_slowdown(a, t) for a, t in zip(alone, together))
    return [next(found) if p is not None else 1.0 for p in pairs]


def _link_class(link: Link) -> tuple[str, int]:
    return (link.kind, link.nvlinks)


def pairs_to_measure(node: NodeTopology, quick: bool) -> list[tuple[int, int]]:
    """Every pair, or in quick mode the first pair of each link class (kind, NVLink count).

    CPU slots of one host are interchangeable, so one pair stands for all of them.
    """
    links = sorted(node.links, key=lambda l: (l.a, l.b))
    if not quick and not (node.devices and node.devices[0].kind == "cpu"):
        return [(l.a, l.b) for l in links]
    seen: dict[tuple[str, int], tuple[int, int]] = {}
    for l in links:
        seen.setdefault(_link_class(l), (l.a, l.b))
    return list(seen.values())


def apply_fits(node: NodeTopology, fits: dict[tuple[int, int], Fit]) -> None:
    """Write measured pairs into their links and each class's median into the unmeasured rest."""
    by_class: dict[tuple[str, int], list[Fit]] = {}
    for (a, b), measured in fits.items():
        by_class.setdefault(_link_class(node.link(a, b)), []).append(measured)
    for link in node.links:
        fit = fits.get((link.a, link.b))
        if fit is None:
            same = by_class.get(_link_class(link))
            if not same:
                continue
            fit = Fit(statistics.median(f.latency_us for f in same), statistics.median(f.bandwidth_gbps for f in same))
        expected = link.bandwidth_gbps
        # gloo between processes of one host goes through TCP loopback, so the shm figure is
        # no hardware rate to fall short of; only wires (NVLink, PCIe, network) degrade.
        link.degraded = link.kind != "shm" and expected > 0 and fit.bandwidth_gbps < DEGRADED_FRACTION * expected
        link.bandwidth_gbps = round(fit.bandwidth_gbps, 3)
        link.latency_us = round(fit.latency_us, 3)
        link.measured = True
    slow = [f"{l.a}-{l.b}" for l in node.links if l.degraded]
    if slow:
        node.warnings.append(
            f"measured below {DEGRADED_FRACTION:.0%} of the expected bandwidth: device pairs {', '.join(slow)}"
        )


def cache_key(node: NodeTopology) -> str:
    """Host name + GPU UUIDs (+ device count for CPU slots): what makes a node the same node."""
    ids = [d.uuid or f"{d.kind}{d.index}" for d in sorted(node.devices, key=lambda d: d.index)]
    raw = json.dumps([node.hostname, ids])
    return hashlib.sha256(raw.encode()).hexdigest()[:20]


def cache_dir(path: str | os.PathLike | None = None) -> Path:
    if path is not None:
        return Path(path)
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "orchestrator" / "measure"


def _load_cached(node: NodeTopology, directory: Path, quick: bool) -> dict[tuple[int, int], Fit] | None:
    path = directory / f"{cache_key(node)}.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    # A quick result (one pair per class) cannot stand in for a full one.
    if data.get("quick") and not quick:
        return None
    kinds = {f"{l.a}-{l.b}": l.kind for l in node.links}
    fits = {}
    for entry in data.get("pairs", []):
        if kinds.get(f"{entry['a']}-{entry['b']}") != entry.get("kind"):
            return None  # the wiring changed since: measure again
        fits[(entry["a"], entry["b"])] = Fit(entry["latency_us"], entry["bandwidth_gbps"])
    _apply_tflops(node, {int(k): v for k, v in data.get("tflops", {}).items()})
    if fits and data.get("shared_slowdown", 1.0) > 1.0:
        node.warnings.append(shared_note(data["shared_slowdown"]))
    return fits or None


def _apply_tflops(node: NodeTopology, tflops: dict[int, float]) -> None:
    """Record measured matmul rates; CPU slots of one host share the rate of those timed."""
    if not tflops:
        return
    shared = statistics.median(tflops.values())
    for d in node.devices:
        d.measured_tflops = tflops.get(d.index, shared if d.kind == "cpu" else d.measured_tflops)


def _store(node: NodeTopology, directory: Path, quick: bool, fits: dict[tuple[int, int], Fit],
           shared_slowdown: float = 1.0) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    pairs = [
        {"a": a, "b": b, "kind": node.link(a, b).kind, "latency_us": f.latency_us, "bandwidth_gbps": f.bandwidth_gbps}
        for (a, b), f in sorted(fits.items())
    ]
    tflops = {str(d.index): d.measured_tflops for d in node.devices if d.measured_tflops}
    data = {"hostname": node.hostname, "uuids": [d.uuid for d in node.devices], "quick": quick, "pairs": pairs,
            "tflops": tflops, "shared_slowdown": shared_slowdown, "when": time.time()}
    tmp = directory / f".{cache_key(node)}.json.tmp"
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(directory / f"{cache_key(node)}.json")


class BenchWorker:
    """One rank of the benchmark group, on one device (a GPU, or a CPU slot)."""

    def __init__(self, use_gpu: bool) -> None:
        self.use_gpu = use_gpu
        self.device: Any = None

    def info(self) -> dict[str, Any]:
        import socket

        import ray

        ids = ray.get_gpu_ids() if self.use_gpu else []
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return {"ip": ray.util.get_node_ip_address(), "port": port, "gpu_ids": [str(i) for i in ids]}

    def setup(self, rank: int, world: int, master: str, visible: str | None, own: str | None) -> None:
        import torch
        import torch.distributed as dist

        if self.use_gpu:
            # All of a node's GPUs visible to each rank: NCCL needs to see its peer for P2P.
            if own is None:
                raise ValueError("a GPU rank is told which of the visible GPUs is its own")
            os.environ["CUDA_VISIBLE_DEVICES"] = visible or ""
            self.device = torch.device("cuda", (visible or "").split(",").index(own))
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        dist.init_process_group("nccl" if self.use_gpu else "gloo", init_method=f"tcp://{master}",
                                rank=rank, world_size=world)

    def _sync(self) -> None:
        if self.use_gpu:
            import torch

            torch.cuda.synchronize(self.device)

    def pingpong(self, peer: int, first: bool, sizes: list[int]) -> list[float]:
        """Half the round-trip time per size (no clock is shared between the two ends)."""
        import torch
        import torch.distributed as dist

        out = []
        for size in sizes:
            buf = torch.empty(size, dtype=torch.uint8, device=self.device)
            times = []
            for it in range(_WARMUP + _ITERS):
                self._sync()
                t0 = time.perf_counter()
                if first:
                    dist.send(buf, peer)
                    dist.recv(buf, peer)
                else:
                    dist.recv(buf, peer)
                    dist.send(buf, peer)
                self._sync()
                if it >= _WARMUP:
                    times.append((time.perf_counter() - t0) / 2)
            out.append(statistics.median(times))
        return out

    def exchanges(self, pairs: list[tuple[int, int]], size: int) -> float | None:
        """The fastest of `_EXCHANGE_ITERS` times this rank and its partner in `pairs` sent each
        other `size` bytes at once, as the two ends of a ring step do; None for a rank in no
        pair. Every rank of the world calls this (the pairs' ranks form a group of their own),
        and every pair starts each exchange together, after a barrier of that group: a pair
        that ran ahead would otherwise time its last exchanges alone. The fastest, as other
        work on the host only ever adds to it."""
        import torch
        import torch.distributed as dist

        group = dist.new_group(sorted({r for pair in pairs for r in pair}))
        me = dist.get_rank()
        peer = next((b if a == me else a for a, b in pairs if me in (a, b)), None)
        if peer is None:
            return None
        out = torch.empty(size, dtype=torch.uint8, device=self.device)
        back = torch.empty_like(out)
        times = []
        for it in range(_WARMUP + _EXCHANGE_ITERS):
            dist.barrier(group=group)
            self._sync()
            t0 = time.perf_counter()
            for req in (dist.isend(out, peer), dist.irecv(back, peer)):
                req.wait()
            self._sync()
            if it >= _WARMUP:
                times.append(time.perf_counter() - t0)
        return min(times)

    def allreduce(self, ranks: list[int], sizes: list[int]) -> list[float]:
        """All-reduce time per size within `ranks` (every rank of the world calls this)."""
        import torch
        import torch.distributed as dist

        group = dist.new_group(ranks)
        if dist.get_rank() not in ranks:
            return []
        out = []
        for size in sizes:
            buf = torch.ones(size // 4, dtype=torch.float32, device=self.device)
            times = []
            for it in range(_WARMUP + _ITERS):
                dist.barrier(group=group)
                self._sync()
                t0 = time.perf_counter()
                dist.all_reduce(buf, group=group)
                self._sync()
                if it >= _WARMUP:
                    times.append(time.perf_counter() - t0)
            out.append(statistics.median(times))
        return out

    def matmul_tflops(self) -> float | None:
        """Dense matmul TFLOP/s of this rank's device: bf16 on a GPU, one fp32 thread on a CPU slot."""
        if not self.use_gpu:
            from .local import cpu_slot_tflops

            return cpu_slot_tflops()
        import torch

        n = 8192
        a = torch.randn(n, n, device=self.device, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=self.device, dtype=torch.bfloat16)
        for _ in range(3):
            a @ b
        self._sync()
        runs = 20
        t0 = time.perf_counter()
        for _ in range(runs):
            a @ b
        self._sync()
        return 2 * n**3 * runs / (time.perf_counter() - t0) / 1e12

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


@dataclass
class _Rank:
    """Where one benchmark rank runs and which device of its node it stands for."""

    node: NodeTopology
    device: int
    actor: Any = None


def _plan_ranks(cluster: ClusterTopology, to_measure: list[NodeTopology]) -> list[_Rank]:
    """Every device of the nodes to measure (two slots stand for a CPU node), and one rank
    on each other measurable node so the network can be timed."""
    ranks = []
    for node in cluster.nodes:
        if node.source not in _MEASURABLE_SOURCES or not node.devices:
            continue
        if any(node is m for m in to_measure):
            # CPU slots of one host are interchangeable: two show what shared memory does.
            devices = [d.index for d in node.devices][: 2 if node.devices[0].kind == "cpu" else None]
        else:
            devices = [node.devices[0].index]
        ranks += [_Rank(node, i) for i in devices]
    return ranks


def _start(ranks: list[_Rank], use_gpu: bool) -> None:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor_cls = ray.remote(BenchWorker)
    for r in ranks:
        r.actor = actor_cls.options(
            num_cpus=0 if use_gpu else 1,
            num_gpus=1 if use_gpu else 0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=r.node.node_id, soft=False),
            # Ray's GPU ids then count GPUs in PCI bus order, as NVML numbers them.
            runtime_env={"env_vars": {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}},
        ).remote(use_gpu)
    try:
        infos = ray.get([r.actor.info.remote() for r in ranks], timeout=_READY_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        what = "one GPU each" if use_gpu else "one CPU each"
        raise TopologyError(
            f"the measured probe needs {len(ranks)} actors ({what}) and the cluster could not place them within "
            f"{_READY_TIMEOUT_S:.0f} s; free the devices or run `probe` without --measure"
        ) from None
    if use_gpu:
        # The GPU Ray granted an actor is the device it measures, whatever we asked for.
        for r, info in zip(ranks, infos):
            r.device = int(info["gpu_ids"][0])
    master = f"{infos[0]['ip']}:{infos[0]['port']}"
    setups = []
    for rank, (r, info) in enumerate(zip(ranks, infos)):
        visible = ",".join(
            i["gpu_ids"][0] for rr, i in zip(ranks, infos) if rr.node is r.node and i["gpu_ids"]
        ) if use_gpu else None
        own = info["gpu_ids"][0] if use_gpu else None
        setups.append(r.actor.setup.remote(rank, len(ranks), master, visible, own))
    ray.get(setups)


def measure_cluster(
    cluster: ClusterTopology,
    quick: bool = True,
    cache: str | os.PathLike | None = None,
    refresh: bool = False,
) -> ClusterTopology:
    """Measure the links of every probed node (and the network between nodes) in place.

    Nodes with a cached result for the same host and GPUs reuse it unless `refresh`. Returns
    the same ClusterTopology, its measured links marked `measured` and slow ones `degraded`.
    """
    import ray

    sizes = list(QUICK_SIZES if quick else FULL_SIZES)
    directory = cache_dir(cache)
    to_measure = []
    for node in cluster.nodes:
        if node.source not in _MEASURABLE_SOURCES:
            node.warnings.append(f"not measured: the topology is {node.source or 'declared'}, not probed")
            continue
        cached = None if refresh else _load_cached(node, directory, quick)
        if cached is not None:
            apply_fits(node, cached)
        elif node.links:
            to_measure.append(node)
    measurable = [n for n in cluster.nodes if n.source in _MEASURABLE_SOURCES and n.devices]
    kinds = {n.devices[0].kind for n in measurable}
    if len(kinds) > 1:
        # NCCL ranks cannot join gloo ranks in one collective: the GPU nodes are timed, the
        # CPU-only nodes and the network keep their table figures.
        for n in measurable:
            if n.devices[0].kind == "cpu":
                n.warnings.append("not measured: CPU slots cannot join the GPU nodes' NCCL group")
        to_measure = [n for n in to_measure if n.devices[0].kind == "gpu"]
        measurable = [n for n in measurable if n.devices[0].kind == "gpu"]
    need_network = len(measurable) > 1
    if not to_measure and not need_network:
        return cluster

    use_gpu = all(n.devices[0].kind == "gpu" for n in measurable)
    ranks = _plan_ranks(ClusterTopology(nodes=measurable, network=cluster.network), to_measure)
    _start(ranks, use_gpu)
    node_fits: list[tuple[NodeTopology, dict[tuple[int, int], Fit], float]] = []
    try:
        quiet: list[tuple[NodeTopology, dict[tuple[int, int], Fit], tuple[int, int] | None]] = []
        for node in to_measure:
            rank_of = {r.device: i for i, r in enumerate(ranks) if r.node is node}
            fits: dict[tuple[int, int], Fit] = {}
            first = None
            for a, b in pairs_to_measure(node, quick):
                ra, rb = rank_of.get(a), rank_of.get(b)
                if ra is None or rb is None:
                    continue
                times, _ = ray.get([
                    ranks[ra].actor.pingpong.remote(rb, True, sizes),
                    ranks[rb].actor.pingpong.remote(ra, False, sizes),
                ])
                try:
                    fits[(a, b)] = fit_alpha_beta(sizes, times)
                    first = first or (ra, rb)
                except ValueError as e:
                    node.warnings.append(f"devices {a}-{b}: no fit ({e}); the table figure stands")
            quiet.append((node, fits, first))
        slowdowns = _shared_slowdowns(ranks, [pair for _, _, pair in quiet], EXCHANGE_BYTES)
        for (node, fits, _), slowdown in zip(quiet, slowdowns):
            if slowdown > 1.0:
                fits = {pair: Fit(f.latency_us, f.bandwidth_gbps / slowdown) for pair, f in fits.items()}
                node.warnings.append(shared_note(slowdown))
            apply_fits(node, fits)
            node_fits.append((node, fits, slowdown))
        # Every measured rank times its matmuls at once, as a training step computes on every
        # rank at once: nodes that share a host's cores (co-located VMs, the namespaces of
        # `orchestrator.testbed`) then show the rate each rank really gets; separate machines
        # show their own rate either way.
        timed = [(node, r.device, i) for node, _, _ in node_fits for i, r in enumerate(ranks) if r.node is node]
        rates = ray.get([ranks[i].actor.matmul_tflops.remote() for _, _, i in timed])
        for node, fits, slowdown in node_fits:
            _apply_tflops(node, {dev: rate for (n, dev, _), rate in zip(timed, rates) if n is node and rate})
            if fits:
                _store(node, directory, quick, fits, slowdown)
        if need_network:
            leaders = []
            for node in measurable:
                leaders.append(min(i for i, r in enumerate(ranks) if r.node is node))
            results = ray.get([r.actor.allreduce.remote(leaders, sizes) for r in ranks])
            count = len(leaders)
            # A ring all-reduce moves 2(n-1)/n of the buffer through each node's link.
            moved = [s * 2 * (count - 1) / count for s in sizes]
            fit = fit_alpha_beta(moved, results[leaders[0]])
            cluster.network = Network(bandwidth_gbps=round(fit.bandwidth_gbps, 3),
                                      latency_us=round(fit.latency_us, 3), source="measured")
    finally:
        ray.get([r.actor.close.remote() for r in ranks])
        for r in ranks:
            ray.kill(r.actor)
    return cluster
