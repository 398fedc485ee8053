"""`doctor`: the check an operator runs on a new node or cluster before a long job.

One task per node (`topology.health.node_health`, pinned to the node with all its GPUs) takes
the node's inventory, software versions, wiring and compute figures; then, where a node has two
or more GPUs or the cluster more than one node, the measured probe times every class of link
(peer bandwidth per GPU pair, one all-reduce across the nodes). Each figure is set beside what
the planner would assume (the GPU table, the link tables) and the node gets one verdict:

- **fail**: NVML or CUDA unusable, an NVLink down, a bridge missing or degraded, a link measured
  below half its table figure, a GPU computing or copying below a third of its datasheet;
- **warn**: a GPU below 60% of its datasheet matmul rate (70% of its memory bandwidth), a GPU
  the table does not list, NVML and `nvidia-smi topo -m` disagreeing, the softer wiring faults;
- **ok** otherwise. A machine without a GPU says so and gives its CPU figures.

A node whose check fails (its task raises, or it dies) is one line in the report; the others go
on. `--from CAPTURE` runs the wiring checks on captures, with no cluster at all.
"""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import dataclass, field
from typing import Any

from ..planning.gpus import lookup
from ..topology.files import load_topology_file
from ..topology.model import ClusterTopology, NodeTopology
from ..topology.wiring import check_wiring, nearest_gpus

WARN_COMPUTE, FAIL_COMPUTE = 0.6, 0.3
"""Measured over datasheet matmul rate below which a GPU is a warning, a failure."""
WARN_MEMORY, FAIL_MEMORY = 0.7, 0.35
"""The same for device-memory copy bandwidth (a copy reaches ~90% of the datasheet)."""
NODE_TIMEOUT_S = 600.0


@dataclass
class NodeReport:
    """One node's verdict and what it rests on."""

    name: str
    verdict: str = "ok"
    reasons: list[str] = field(default_factory=list)
    """One line per fault, failures first."""
    details: dict[str, Any] = field(default_factory=dict)

    def add(self, level: str, text: str) -> None:
        self.reasons.append(f"{level}: {text}")
        if level == "fail" or (level == "warn" and self.verdict == "ok"):
            self.verdict = level

    def to_dict(self) -> dict[str, Any]:
        order = sorted(self.reasons, key=lambda r: not r.startswith("fail"))
        return {"name": self.name, "verdict": self.verdict, "reasons": order, **self.details}


def judge_health(report: dict[str, Any], name: str) -> NodeReport:
    """The verdict on what `node_health` found on one node."""
    out = NodeReport(name, details={"health": report})
    inv = report.get("inventory", {})
    kinds = {d.get("kind") for d in report.get("topology", {}).get("devices", [])}
    if "error" in inv and "gpu" in kinds:  # the node has GPUs (declared or probed) NVML cannot reach
        out.add("fail", inv["error"])
    for line in report.get("errors", []):
        out.add("fail", line)
    for line in report.get("links_down", []):
        out.add("fail", line)
    for f in report.get("wiring", []):
        out.add(f["level"], f["text"])
    for line in report.get("wiring_disagreements", []):
        out.add("warn", line)
    gpus = {g["index"]: g for g in inv.get("gpus", [])}
    if not gpus and "error" in inv:
        out.details["note"] = "no GPU: CPU figures only"
    # Each NIC and the GPUs nearest it (what NCCL will pair them with).
    out.details["nics"] = [{"name": n["name"], "nearest": nearest_gpus(n.get("gpu_paths", {}))}
                           for n in report.get("topology", {}).get("nics", [])]
    for c in report.get("compute", []):
        if c["device"] == "cpu":
            continue
        gpu = gpus.get(c["device"], {})
        spec = lookup(gpu.get("name"))
        if spec is None:
            out.add("warn", f"GPU{c['device']} ({gpu.get('name') or 'unnamed'}) is not in the planner's table: "
                            f"plans use its measured {c['bf16_tflops']:.0f} TFLOP/s")
            continue
        c["bf16_ratio"] = round(c["bf16_tflops"] / spec.peak_tflops, 3)
        c["fp32_ratio"] = round(c["fp32_tflops"] / spec.fp32_tflops, 3)
        c["mem_ratio"] = round(c["mem_gbps"] / spec.mem_gbps, 3)
        for key, what, unit, warn, fail, table in (
                ("bf16_ratio", "bf16 matmul", "TFLOP/s", WARN_COMPUTE, FAIL_COMPUTE, spec.peak_tflops),
                ("mem_ratio", "memory copy", "GB/s", WARN_MEMORY, FAIL_MEMORY, spec.mem_gbps)):
            got = c[key] * table
            if c[key] < warn:
                clock = c.get("sm_clock_mhz_after")
                out.add("fail" if c[key] < fail else "warn",
                        f"GPU{c['device']} {what} {got:.0f} {unit} is {c[key]:.0%} of the {spec.name}'s {table:.0f}"
                        + (f" (SM clock {clock} MHz after the check)" if clock else ""))
    return out


def judge_links(node: NodeTopology, out: NodeReport) -> None:
    """Measured links below half their table figure (`measure` marks them degraded)."""
    measured = [l for l in node.links if l.measured]
    for l in measured:
        if l.degraded:
            out.add("fail", f"GPU{l.a}-GPU{l.b} ({l.kind}) measured {l.bandwidth_gbps:.1f} GB/s, under half "
                            "its table figure")
    by_class: dict[str, list[float]] = {}
    for l in measured:
        by_class.setdefault(l.kind if l.kind != "nvlink" else f"NV{l.nvlinks}", []).append(l.bandwidth_gbps)
    out.details["links"] = [{"a": l.a, "b": l.b, "kind": l.kind, "nvlinks": l.nvlinks,
                             "bandwidth_gbps": l.bandwidth_gbps, "latency_us": l.latency_us,
                             "measured": l.measured, "degraded": l.degraded} for l in node.links]
    out.details["link_classes_gbps"] = {k: round(statistics.median(v), 2) for k, v in sorted(by_class.items())}


def check_captures(paths: list[str], gpu_name: str | None = None) -> list[NodeReport]:
    """The wiring checks on capture files (any format the probe reads)."""
    out = []
    for path in paths:
        node = load_topology_file(path, gpu_name)
        rep = NodeReport(path, details={"source": path, "gpus": node.num_devices, "nics": len(node.nics)})
        for f in check_wiring(node):
            rep.add(f.level, f.text)
        out.append(rep)
    return out


def check_cluster(quick: bool = True, progress=None) -> tuple[list[NodeReport], dict[str, Any]]:
    """Every alive node of the connected Ray cluster; then its links, measured. Returns the node
    reports and the cluster-wide figures (the network's all-reduce bus bandwidth)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from ..topology.cluster_probe import probe_cluster
    from ..topology.health import node_health
    from ..topology.measure import measure_cluster

    alive = [n for n in ray.nodes() if n.get("Alive")]
    task = ray.remote(node_health)
    refs = {}
    for n in alive:
        gpus = int(n.get("Resources", {}).get("GPU", 0))
        refs[n["NodeID"]] = task.options(
            num_cpus=0, num_gpus=gpus, max_retries=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n["NodeID"], soft=False),
            runtime_env={"env_vars": {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}},
        ).remote(quick)
    reports: dict[str, NodeReport] = {}
    for n in alive:
        node_id, where = n["NodeID"], f"node {n['NodeID'][:12]} ({n.get('NodeManagerAddress', '?')})"
        if progress:
            progress(f"checking {where}")
        try:
            health = ray.get(refs[node_id], timeout=NODE_TIMEOUT_S)
            rep = judge_health(health, f"{health.get('hostname', '?')} {where}")
        except Exception as e:  # noqa: BLE001 - the node's one line; the other nodes go on
            rep = NodeReport(where)
            rep.add("fail", f"the check did not finish: {(str(e).strip().splitlines() or [type(e).__name__])[-1]}")
        rep.details["node_id"] = node_id
        reports[node_id] = rep
    cluster_figures: dict[str, Any] = {}
    try:
        topo = probe_cluster()
    except Exception as e:  # noqa: BLE001 - a node whose probe fails is failed above already
        cluster_figures["links"] = f"not measured: {(str(e).strip().splitlines() or [type(e).__name__])[-1]}"
        return list(reports.values()), cluster_figures
    gpu_nodes = [n for n in topo.nodes if n.devices and n.devices[0].kind == "gpu"]
    if any(n.num_devices > 1 for n in gpu_nodes) or len(gpu_nodes) > 1:
        if progress:
            progress("measuring links (peer bandwidth per GPU pair, all-reduce across nodes)")
        try:
            # Fresh figures, kept out of the probe's cache: the doctor writes only its report.
            with tempfile.TemporaryDirectory(prefix="orchestrator-doctor-") as cache:
                measured = measure_cluster(ClusterTopology(nodes=gpu_nodes, network=topo.network), quick=quick,
                                           cache=cache, refresh=True)
            if len(gpu_nodes) > 1:
                cluster_figures["network"] = {"all_reduce_bus_gbps": measured.network.bandwidth_gbps,
                                              "latency_us": measured.network.latency_us}
        except Exception as e:  # noqa: BLE001 - the links stay unmeasured; every node says so
            for n in gpu_nodes:
                reports[str(n.node_id)].add("warn", f"links not measured: {(str(e).strip().splitlines() or [''])[-1]}")
    for n in topo.nodes:
        if n.node_id in reports:
            judge_links(n, reports[n.node_id])
    return list(reports.values()), cluster_figures
