"""Communication cost model: the planner's predicted collective times against measured ones.

    python benchmarks/cost_model.py [--quick] [--world N] [--backend auto|gloo|nccl]

Among N processes of this machine (gloo on CPU; NCCL, one GPU each, where there are N GPUs)
the measured probe's ping-pong is fitted to alpha-beta (`orchestrator.topology.measure`), the
fitted link goes into the planner's own cost functions (`orchestrator.planning.comm`: gloo's
own algorithms on CPU, NCCL's ring and tree on GPUs), and their predictions of
all-reduce, reduce-scatter and all-gather from 4 KiB to 256 MiB (16 MiB with --quick) are set
against the times of the same collectives. Goal: mean relative error under 15%.
Writes benchmarks/results/cost_model.json.

    sudo python benchmarks/cost_model.py --quick --shaped 0.2:0,1:0,5:0 [--per-node 2]

On shaped links instead (`orchestrator.testbed`; root): two ranks, one per network namespace,
whose every collective crosses a link of G Gbit/s (M ms of delay only where the kernel has
`netem`), priced from the probe's ping-pong across it (results/cost_model_shaped.json); with
`--per-node 2`, two namespaces of two ranks each, priced from the probe's in-node ping-pong and
its all-reduce between the nodes, as `probe --measure` measures a cluster: DDP's all-reduce
flat and hierarchical (the runtime's own hook), and the reduce-scatter and all-gather the
sharded strategies (zero2, zero3, hsdp's shard group) run over all four ranks
(results/cost_model_shaped_2x2.json).
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import parse_args, print_table, rel_error, run, write_result

OPS = ("all_reduce", "reduce_scatter", "all_gather")
KIB, MIB = 1 << 10, 1 << 20
FULL_SIZES = tuple(4 * KIB * 4**k for k in range(9))  # 4 KiB .. 256 MiB
QUICK_SIZES = tuple(s for s in FULL_SIZES if s <= 16 * MIB)
GOAL_MEAN_ERROR = 0.15
# Enough repetitions that the median is stable, without spending seconds per large message.
_BYTES_PER_SIZE = 512 * MIB
_MIN_ITERS, _MAX_ITERS, _WARMUP = 3, 30, 2
# Passes of the probe's ping-pong after the discarded first one. Other processes on a shared
# host only ever add time to a round trip, so the fastest pass per size is the link's own.
PROBE_PASSES = 3


def iterations(nbytes: int) -> int:
    """Timed repetitions of one collective of `nbytes`: more for small (noisy) messages."""
    return max(_MIN_ITERS, min(_MAX_ITERS, _BYTES_PER_SIZE // max(nbytes, 1)))


def predict(op: str, nbytes: int, world: int, latency_us: float, bandwidth_gbps: float, backend: str,
            across_nodes: bool = False) -> float:
    """The planner's time of `op` on an n-byte buffer over `world` ranks of one node whose
    links are the fitted (latency, bandwidth): what `planning.cost.group_links` builds for
    the group (gloo with a CPU slot's memory bandwidth, or NCCL), priced by `planning.comm`."""
    from orchestrator.planning.comm import GroupLinks, group_all_gather, group_all_reduce, group_reduce_scatter
    from orchestrator.planning.gpus import CPU_SLOT

    if across_nodes:  # one rank per node: every hop crosses the network
        links = GroupLinks(size=world, per_node=1, intra_gbps=math.inf, intra_lat_us=0.0,
                           inter_gbps=bandwidth_gbps, inter_lat_us=latency_us,
                           gloo_mem_gbps=CPU_SLOT.mem_gbps if backend == "gloo" else None)
    else:
        links = GroupLinks(size=world, per_node=world, intra_gbps=bandwidth_gbps, intra_lat_us=latency_us,
                           inter_gbps=math.inf, inter_lat_us=0.0,
                           gloo_mem_gbps=CPU_SLOT.mem_gbps if backend == "gloo" else None)
    if op == "all_reduce":
        return group_all_reduce(nbytes, links)[0]
    if op == "reduce_scatter":
        return group_reduce_scatter(nbytes, links)
    if op == "all_gather":
        return group_all_gather(nbytes, links)
    raise ValueError(f"unknown collective {op!r}; known: {', '.join(OPS)}")


def _time_collective(op: str, nbytes: int, world: int, device, sync) -> float:
    """Median seconds of one collective; `nbytes` is the full buffer (all-reduce's buffer,
    reduce-scatter's input, all-gather's output), as the cost model counts it."""
    import torch
    import torch.distributed as dist

    n = nbytes // 4
    n -= n % world
    full = torch.ones(n, dtype=torch.float32, device=device)
    part = torch.ones(n // world, dtype=torch.float32, device=device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    times = []
    for it in range(_WARMUP + iterations(nbytes)):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        if op == "all_reduce":
            dist.all_reduce(full)
        elif op == "reduce_scatter":
            scatter(part, full)
        else:
            gather(full, part)
        sync()
        if it >= _WARMUP:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rank(rank: int, world: int, port: int, backend: str, sizes: list[int], probe_sizes: list[int], out: str,
          master: str = "127.0.0.1") -> None:
    """One process: the measured probe's ping-pong between ranks 0 and 1, then every collective."""
    import torch
    import torch.distributed as dist

    from orchestrator.topology.measure import BenchWorker, fit_alpha_beta

    use_gpu = backend == "nccl"
    worker = BenchWorker(use_gpu)
    visible = ",".join(str(i) for i in range(world)) if use_gpu else None
    worker.setup(rank, world, f"{master}:{port}", visible, str(rank) if use_gpu else None)
    sync = (lambda: torch.cuda.synchronize(worker.device)) if use_gpu else (lambda: None)
    if rank < 2:
        # The first exchanges pay for lazily set-up buffers and threads; the probe's own two
        # warm-up rounds per size do not cover that, so one whole pass is thrown away.
        worker.pingpong(1 - rank, rank == 0, probe_sizes)
        passes = [worker.pingpong(1 - rank, rank == 0, probe_sizes) for _ in range(PROBE_PASSES)]
        pingpong = [min(times) for times in zip(*passes)]
    dist.barrier()
    for op in OPS:
        _time_collective(op, max(sizes), world, worker.device, sync)
    measured = {op: [_time_collective(op, s, world, worker.device, sync) for s in sizes] for op in OPS}
    # A collective ends when its slowest rank does.
    flat = torch.tensor([t for op in OPS for t in measured[op]], dtype=torch.float64, device=worker.device)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    if rank == 0:
        try:
            fit = fit_alpha_beta(probe_sizes, pingpong)
        except ValueError as e:
            Path(out).write_text(json.dumps({"error": str(e), "probe": {"sizes": probe_sizes, "seconds": pingpong}}))
            worker.close()
            return
        values = flat.tolist()
        slowest = {op: values[i * len(sizes):(i + 1) * len(sizes)] for i, op in enumerate(OPS)}
        Path(out).write_text(json.dumps({
            "probe": {"sizes": probe_sizes, "seconds": pingpong,
                      "latency_us": fit.latency_us, "bandwidth_gbps": fit.bandwidth_gbps},
            "measured": slowest,
        }))
    worker.close()


def measure(world: int, backend: str, sizes: list[int], probe_sizes: list[int]) -> dict[str, Any]:
    """Run `world` processes; returns the probe's fit and the measured seconds per op and size."""
    import torch.multiprocessing as mp
    from _common import free_port

    if world < 2:
        raise ValueError(f"collectives need at least 2 ranks, got --world {world}")
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "cost.json")
        mp.spawn(_rank, args=(world, free_port(), backend, list(sizes), list(probe_sizes), out), nprocs=world)
        raw = json.loads(Path(out).read_text())
    if "error" in raw:
        raise RuntimeError(f"the measured probe's ping-pong ({raw['probe']['seconds']} s for "
                           f"{raw['probe']['sizes']} bytes) cannot be fitted: {raw['error']}; "
                           f"the machine is too busy to calibrate on, run again when it is quieter")
    return raw


def _rows(raw: dict[str, Any], world: int, backend: str, sizes: list[int], lat: float, bw: float,
          across_nodes: bool = False) -> list[dict]:
    rows = []
    for op in OPS:
        for size, meas in zip(sizes, raw["measured"][op]):
            pred = predict(op, size, world, lat, bw, backend, across_nodes)
            rows.append({"op": op, "bytes": size, "measured_s": meas, "predicted_s": pred,
                         "error": rel_error(pred, meas)})
    return rows


def _errors(rows: list[dict]) -> dict[str, Any]:
    errors = [r["error"] for r in rows]
    per_op = {op: {"mean_error": statistics.fmean(r["error"] for r in rows if r["op"] == op),
                   "max_error": max(r["error"] for r in rows if r["op"] == op)} for op in OPS}
    return {"mean_error": statistics.fmean(errors), "max_error": max(errors), "per_op": per_op}


def allreduce_calibration(raw: dict[str, Any], world: int, backend: str, sizes: list[int]) -> tuple[float, float]:
    """(per-hop latency us, bandwidth GB/s) fitted to the measured all-reduce series, as the
    measured probe fits the network between nodes: the link the planner would need to be
    right about all-reduce, which then tests its reduce-scatter and all-gather out of sample."""
    from orchestrator.planning.comm import GLOO_RING_SLOWDOWN, GLOO_STEP_US, LAUNCH_S, bus_factor
    from orchestrator.topology.measure import fit_alpha_beta

    moved = [s * bus_factor("all_reduce", world) for s in sizes]
    fit = fit_alpha_beta(moved, raw["measured"]["all_reduce"])
    hops = 2 * (world - 1)
    gloo = backend == "gloo"
    per_hop = max(0.0, (fit.latency_us * 1e-6 - LAUNCH_S) / hops * 1e6 - (GLOO_STEP_US if gloo else 0.0))
    # gloo's ring moves bytes at 1/GLOO_RING_SLOWDOWN of the link the planner is given.
    return per_hop, fit.bandwidth_gbps * (GLOO_RING_SLOWDOWN if gloo else 1.0)


def compare(raw: dict[str, Any], world: int, backend: str, sizes: list[int]) -> dict[str, Any]:
    """Predicted beside measured for every (op, size), with the mean and max relative errors,
    once with the measured probe's ping-pong calibration (what the planner uses) and once with
    a calibration fitted to the all-reduce series (which separates the model's shape from the
    probe's calibration)."""
    lat, bw = raw["probe"]["latency_us"], raw["probe"]["bandwidth_gbps"]
    rows = _rows(raw, world, backend, sizes, lat, bw)
    summary = _errors(rows)
    ar_lat, ar_bw = allreduce_calibration(raw, world, backend, sizes)
    ar_rows = _rows(raw, world, backend, sizes, ar_lat, ar_bw)
    return {
        "world": world, "backend": backend,
        "calibration": {"latency_us": lat, "bandwidth_gbps": bw, "probe_sizes": raw["probe"]["sizes"],
                        "probe_seconds": raw["probe"]["seconds"]},
        "rows": rows, **summary,
        "goal": {"mean_error_below": GOAL_MEAN_ERROR, "met": summary["mean_error"] < GOAL_MEAN_ERROR},
        "allreduce_calibrated": {"latency_us": ar_lat, "bandwidth_gbps": ar_bw, "rows": ar_rows, **_errors(ar_rows)},
    }


def measure_shaped(gbit: float, ms: float, sizes: list[int], probe_sizes: list[int]) -> dict[str, Any]:
    """Two ranks, each in its own network namespace, joined by a link shaped to `gbit` Gbit/s and
    `ms` one way (`orchestrator.testbed`): the probe's ping-pong and every collective cross it."""
    import subprocess
    import sys

    from orchestrator.testbed.network import NetworkSpec, Shaping, create, remove

    # Its own prefix and subnet: a topology_gain cluster or the test suite may run beside it.
    spec = NetworkSpec(prefix="orchcm-", subnet="198.18.1.0/24")
    create(spec, 2, Shaping(gbit, ms))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = str(Path(tmp) / "cost.json")
            code = ("import sys; sys.path[:0] = [{bench!r}, {root!r}]; from cost_model import _rank; "
                    "_rank({{r}}, 2, 29512, 'gloo', {sizes}, {probe}, {out!r}, {master!r})").format(
                        bench=str(Path(__file__).parent), root=str(Path(__file__).parent.parent), sizes=list(sizes),
                        probe=list(probe_sizes), out=out, master=spec.address(0))
            env = {**__import__("os").environ, "GLOO_SOCKET_IFNAME": "eth0"}
            procs = [subprocess.Popen(["ip", "netns", "exec", spec.node_ns(r), sys.executable, "-c",
                                       code.replace("{r}", str(r))], env=env) for r in (0, 1)]
            if any(p.wait() != 0 for p in procs):
                raise RuntimeError(f"a rank failed on the {gbit} Gbit/s, {ms} ms link")
            raw = json.loads(Path(out).read_text())
    finally:
        remove(spec.prefix)
    if "error" in raw:
        raise RuntimeError(f"the probe's ping-pong across the {gbit} Gbit/s link cannot be fitted: {raw['error']}")
    return raw


# Ops of the two-level run: the data-parallel all-reduce as DDP runs it (one ring through all
# ranks, or the hierarchical hook), and the sharded strategies' reduce-scatter and all-gather.
OPS_2X2 = ("all_reduce flat", "all_reduce hierarchical", "reduce_scatter", "all_gather")
_MAX_ITERS_2X2 = 8


def _rank_2x2(rank: int, port: int, sizes: list[int], probe_sizes: list[int], out: str, master: str) -> None:
    """One of 4 processes, 2 per namespace: the probe's figures for the in-node pair (ping-pong)
    and for the network (the all-reduce between two nodes' first ranks, as `probe --measure`
    times it), then each op of OPS_2X2 over all 4 ranks."""
    import torch
    import torch.distributed as dist

    from orchestrator.runtime.comm_hooks import build_hierarchy, hierarchical_all_reduce
    from orchestrator.topology.measure import BenchWorker, fit_alpha_beta

    world, nodes = 4, ["n0", "n0", "n1", "n1"]
    worker = BenchWorker(False)
    worker.setup(rank, world, f"{master}:{port}", None, None)
    state = build_hierarchy(dist.group.WORLD, nodes)
    if rank < 2:
        worker.pingpong(1 - rank, rank == 0, probe_sizes)  # first exchanges: lazily built buffers
        intra = worker.pingpong(1 - rank, rank == 0, probe_sizes)
    dist.barrier()
    leaders = [0, 2]
    net = worker.allreduce(leaders, probe_sizes)
    dist.barrier()

    def timed(op: str, nbytes: int) -> float:
        n = nbytes // 4 - (nbytes // 4) % world
        full, part = torch.ones(n), torch.ones(n // world)
        times = []
        for it in range(_WARMUP + max(_MIN_ITERS, min(_MAX_ITERS_2X2, _BYTES_PER_SIZE // 8 // nbytes))):
            dist.barrier()
            t0 = time.perf_counter()
            if op == "all_reduce flat":
                dist.all_reduce(full)
            elif op == "all_reduce hierarchical":
                hierarchical_all_reduce(full, state).wait()
            elif op == "reduce_scatter":
                dist.reduce_scatter_tensor(part, full)
            else:
                dist.all_gather_into_tensor(full, part)
            if it >= _WARMUP:
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    measured = [timed(op, s) for op in OPS_2X2 for s in sizes]
    flat = torch.tensor(measured, dtype=torch.float64)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    if rank == 0:
        values = flat.tolist()
        moved = [s * 2 * (len(leaders) - 1) / len(leaders) for s in probe_sizes]
        f_intra, f_net = fit_alpha_beta(probe_sizes, intra), fit_alpha_beta(moved, net)
        Path(out).write_text(json.dumps({
            "intra": {"latency_us": f_intra.latency_us, "bandwidth_gbps": f_intra.bandwidth_gbps},
            "network": {"latency_us": f_net.latency_us, "bandwidth_gbps": f_net.bandwidth_gbps},
            "measured": {op: values[i * len(sizes):(i + 1) * len(sizes)] for i, op in enumerate(OPS_2X2)},
        }))
    worker.close()


def predict_2x2(op: str, nbytes: int, intra: dict[str, float], network: dict[str, float]) -> float:
    """The planner's time of an op of OPS_2X2 over 2 nodes x 2 ranks whose links are the probe's
    figures, through the same `GroupLinks` that `planning.cost.group_links` builds."""
    from orchestrator.planning.comm import GroupLinks, group_all_gather, group_all_reduce, group_reduce_scatter
    from orchestrator.planning.gpus import CPU_SLOT

    links = GroupLinks(size=4, per_node=2, intra_gbps=intra["bandwidth_gbps"], intra_lat_us=intra["latency_us"],
                       inter_gbps=network["bandwidth_gbps"], inter_lat_us=network["latency_us"],
                       gloo_mem_gbps=CPU_SLOT.mem_gbps)
    if op.startswith("all_reduce"):
        return group_all_reduce(nbytes, links, op.split()[1])[0]
    return group_reduce_scatter(nbytes, links) if op == "reduce_scatter" else group_all_gather(nbytes, links)


def measure_shaped_2x2(gbit: float, ms: float, sizes: list[int], probe_sizes: list[int]) -> dict[str, Any]:
    """Four ranks, two in each of two namespaces joined by a link of `gbit` Gbit/s."""
    import os
    import subprocess
    import sys

    from orchestrator.testbed.network import NetworkSpec, Shaping, create, remove

    spec = NetworkSpec(prefix="orchcm-", subnet="198.18.1.0/24")
    create(spec, 2, Shaping(gbit, ms))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = str(Path(tmp) / "cost.json")
            code = ("import sys; sys.path[:0] = [{bench!r}, {root!r}]; from cost_model import _rank_2x2; "
                    "_rank_2x2({{r}}, 29513, {sizes}, {probe}, {out!r}, {master!r})").format(
                        bench=str(Path(__file__).parent), root=str(Path(__file__).parent.parent), sizes=list(sizes),
                        probe=list(probe_sizes), out=out, master=spec.address(0))
            env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}
            procs = [subprocess.Popen(["ip", "netns", "exec", spec.node_ns(r // 2), sys.executable, "-c",
                                       code.replace("{r}", str(r))], env=env) for r in range(4)]
            if any(p.wait() != 0 for p in procs):
                raise RuntimeError(f"a rank failed on the {gbit} Gbit/s, {ms} ms link")
            return json.loads(Path(out).read_text())
    finally:
        remove(spec.prefix)


def shaped_2x2(shapings: list[tuple[float, float]], sizes: list[int], probe_sizes: list[int]) -> dict[str, Any]:
    """Prediction error of the data-parallel collectives of 2 nodes x 2 ranks over each shaped
    link, priced from the probe's figures (nothing fitted to the collectives)."""
    runs = []
    for gbit, ms in shapings:
        raw = measure_shaped_2x2(gbit, ms, sizes, probe_sizes)
        rows = []
        for op in OPS_2X2:
            for size, meas in zip(sizes, raw["measured"][op]):
                pred = predict_2x2(op, size, raw["intra"], raw["network"])
                rows.append({"op": op, "bytes": size, "measured_s": meas, "predicted_s": pred,
                             "error": rel_error(pred, meas)})
        errors = {op: statistics.fmean(r["error"] for r in rows if r["op"] == op) for op in OPS_2X2}
        runs.append({"inter_gbit": gbit, "inter_ms": ms, "probe_gbit": raw["network"]["bandwidth_gbps"] * 8,
                     "probe_latency_us": raw["network"]["latency_us"], "intra": raw["intra"], "rows": rows,
                     "mean_error": statistics.fmean(r["error"] for r in rows), "per_op": errors})
        print(f"2x2, {gbit} Gbit/s {ms} ms: probe {runs[-1]['probe_gbit']:.3g} Gbit/s, mean error "
              f"{runs[-1]['mean_error']:.1%} ({', '.join(f'{k} {v:.0%}' for k, v in errors.items())})", flush=True)
    mean = statistics.fmean(r["mean_error"] for r in runs)
    return {"layout": "2 nodes x 2 ranks", "shapings": runs, "mean_error": mean,
            "goal": {"mean_error_below": GOAL_MEAN_ERROR, "met": mean < GOAL_MEAN_ERROR}}


def shaped(shapings: list[tuple[float, float]], sizes: list[int], probe_sizes: list[int]) -> dict[str, Any]:
    """Prediction error of collectives between two nodes over each shaped link, the link priced
    from the measured probe's ping-pong across it (nothing fitted to the collectives)."""
    runs = []
    for gbit, ms in shapings:
        raw = measure_shaped(gbit, ms, sizes, probe_sizes)
        lat, bw = raw["probe"]["latency_us"], raw["probe"]["bandwidth_gbps"]
        rows = _rows(raw, 2, "gloo", sizes, lat, bw, across_nodes=True)
        runs.append({"inter_gbit": gbit, "inter_ms": ms, "probe_gbit": bw * 8, "probe_latency_us": lat,
                     "rows": rows, **_errors(rows)})
        print(f"{gbit} Gbit/s {ms} ms: probe {bw * 8:.3g} Gbit/s {lat:.0f} us, mean error "
              f"{runs[-1]['mean_error']:.1%}", flush=True)
    mean = statistics.fmean(r["mean_error"] for r in runs)
    return {"shapings": runs, "mean_error": mean,
            "goal": {"mean_error_below": GOAL_MEAN_ERROR, "met": mean < GOAL_MEAN_ERROR}}


def _size(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB"


def options(ap) -> None:
    ap.add_argument("--world", type=int, default=2, help="processes (ranks) to run the collectives among")
    ap.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                    help="auto: NCCL when there is a GPU per rank, else gloo")
    ap.add_argument("--shaped", metavar="G:M,...", default=None,
                    help="instead: two ranks in network namespaces over links of G Gbit/s and M ms (root)")
    ap.add_argument("--per-node", type=int, choices=(1, 2), default=1,
                    help="with --shaped: 2 runs 2 ranks in each namespace (flat and hierarchical all-reduce, "
                         "reduce-scatter and all-gather over all 4)")


def main(argv: list[str] | None = None) -> int:
    import torch

    args = parse_args(__doc__, argv, options)
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= args.world else "gloo"
    sizes = list(QUICK_SIZES if args.quick else FULL_SIZES)
    from orchestrator.topology.measure import FULL_SIZES as PROBE_FULL
    from orchestrator.topology.measure import QUICK_SIZES as PROBE_QUICK

    probe_sizes = list(PROBE_QUICK if args.quick else PROBE_FULL)
    t0 = time.perf_counter()
    if args.shaped:
        try:
            shapings = [(float(g), float(m)) for g, m in (x.split(":") for x in args.shaped.split(","))]
        except ValueError:
            raise SystemExit(f"--shaped {args.shaped!r}: expected G:M pairs, e.g. 0.2:0.1,1:1,5:5") from None
        if args.per_node == 2:
            result = shaped_2x2(shapings, sizes, probe_sizes)
            result["seconds"] = time.perf_counter() - t0
            print_table("collectives of 2 shaped nodes x 2 ranks: planner's prediction vs measured",
                        ["link", "probe", "op", "size", "measured ms", "predicted ms", "error %"],
                        [[f"{r['inter_gbit']} Gbit/s", f"{r['probe_gbit']:.3g} Gbit/s", row["op"],
                          _size(row["bytes"]), row["measured_s"] * 1e3, row["predicted_s"] * 1e3, row["error"] * 100]
                         for r in result["shapings"] for row in r["rows"]],
                        caption=f"mean error {result['mean_error']:.1%} (goal < {GOAL_MEAN_ERROR:.0%})")
            args.out = args.out or Path(__file__).parent / "results" / "cost_model_shaped_2x2.json"
            out = write_result("cost_model_shaped", result, args)
            print(f"wrote {out}")
            return 0
        result = shaped(shapings, sizes, probe_sizes)
        result["seconds"] = time.perf_counter() - t0
        print_table("collectives between two shaped nodes: planner's prediction vs measured",
                    ["link", "probe", "op", "size", "measured ms", "predicted ms", "error %"],
                    [[f"{r['inter_gbit']} Gbit/s {r['inter_ms']} ms", f"{r['probe_gbit']:.3g} Gbit/s", row["op"],
                      _size(row["bytes"]), row["measured_s"] * 1e3, row["predicted_s"] * 1e3, row["error"] * 100]
                     for r in result["shapings"] for row in r["rows"]],
                    caption=f"mean error {result['mean_error']:.1%} (goal < {GOAL_MEAN_ERROR:.0%})")
        out = write_result("cost_model_shaped", result, args)
        print(f"wrote {out}")
        return 0
    result = compare(measure(args.world, backend, sizes, probe_sizes), args.world, backend, sizes)
    result["seconds"] = time.perf_counter() - t0
    cal = result["calibration"]
    print_table(
        f"collectives among {args.world} {backend} ranks: planner's prediction vs measured",
        ["op", "size", "measured ms", "predicted ms", "error %"],
        [[r["op"], _size(r["bytes"]), r["measured_s"] * 1e3, r["predicted_s"] * 1e3, r["error"] * 100]
         for r in result["rows"]],
        caption=f"calibration (measured probe's ping-pong fit): {cal['latency_us']:.1f} us, "
                f"{cal['bandwidth_gbps']:.2f} GB/s; mean error {result['mean_error']:.1%}, "
                f"max {result['max_error']:.1%} (goal: mean < {GOAL_MEAN_ERROR:.0%})",
    )
    ar = result["allreduce_calibrated"]
    print_table(
        "the same, calibrated on the all-reduce series instead (all_reduce rows are in sample)",
        ["op", "mean error %", "max error %", "mean error % (probe calibration)"],
        [[op, ar["per_op"][op]["mean_error"] * 100, ar["per_op"][op]["max_error"] * 100,
          result["per_op"][op]["mean_error"] * 100] for op in OPS],
        caption=f"all-reduce fit: {ar['latency_us']:.1f} us per hop, {ar['bandwidth_gbps']:.2f} GB/s; "
                f"mean error {ar['mean_error']:.1%}",
    )
    out = write_result("cost_model", result, args)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    run(main)
