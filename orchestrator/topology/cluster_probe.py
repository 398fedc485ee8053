"""Probe every node of the Ray cluster this process is connected to.

One probe task is pinned to each alive node (hard node affinity, so a busy node is waited for
rather than probed by a neighbour) and runs :func:`orchestrator.topology.local.probe_local`
there. Nodes are keyed by Ray node id: in simulated clusters every node shares one host name
and IP.
"""

from __future__ import annotations

import logging
from typing import Any

from ..errors import TopologyError, UserError
from .local import probe_local
from .measure import measure_cluster
from .model import ClusterTopology, NodeTopology
from .network import network_from_nodes

PROBE_TIMEOUT_S = 120.0
ON_WORKER_TIMEOUT_S = 60.0
"""How long a node's probe waits for the job's worker there (`on`) before a task probes it."""

log = logging.getLogger(__name__)

RAY_GPUS_UNSEEN = "but no GPU is visible to NVML here: it runs CPU workers"
"""Said of a node whose GPUs exist only as Ray resources (started with --num-gpus, no driver)."""
HOLDS_NO_WORKER = "hold no worker of cluster.cpus_per_worker"
"""Said of a node whose CPUs are fewer than one worker needs."""


def _probe_on_node(num_cpu_slots: int) -> dict[str, Any]:
    return probe_local(num_cpu_slots).to_dict()


def cpu_slots(node_cpus: float, cpus_per_worker: float, num_workers: int) -> int:
    """How many CPU workers a node without a usable GPU holds: as many as its Ray CPUs give
    `cpus_per_worker` each, at most `num_workers` (0: no cap)."""
    fit = int(node_cpus / cpus_per_worker + 1e-9)  # 3 CPUs of 1.5 each are two, not 1.9999
    return min(fit, num_workers) if num_workers else fit


def probe_cluster(measure: bool = False, num_cpu_slots: int = 0, on: dict[str, Any] | None = None,
                  cpus_per_worker: float = 1.0) -> ClusterTopology:
    """The topology of every alive node of the connected Ray cluster (ray.init must have run).

    A node without a GPU NVML can see offers `cpu_slots` CPU workers: its Ray CPUs over
    `cpus_per_worker`, at most `num_cpu_slots` (`cluster.num_workers`; 0: no cap). One that
    holds none is kept without devices, which leaves it out of every plan, and a cluster where
    no node holds a worker at all is refused. With `measure`, links are then measured (see
    :mod:`.measure`). `on` maps
    a node id to an actor already started there with a `probe(num_cpu_slots)` method (the
    job's own workers): that node is probed in it, with no process to start for the task;
    where the actor cannot answer, by the task after all.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if not ray.is_initialized():
        raise RuntimeError("probe_cluster needs a connected Ray cluster (orchestrator.connect.cluster.connect)")
    alive = [n for n in ray.nodes() if n.get("Alive")]
    if not alive:
        raise TopologyError("the Ray cluster has no alive node to probe")
    task = ray.remote(_probe_on_node)
    on = on or {}

    def cpus_of(n: dict) -> float:
        return float(n.get("Resources", {}).get("CPU", 0))

    def slots_of(n: dict) -> int:
        # A node that holds no worker is probed as one slot, then stripped of it (below).
        return max(1, cpu_slots(cpus_of(n), cpus_per_worker, num_cpu_slots))

    def by_task(n: dict):
        return task.options(
            # The probe uses no slot a training worker could use, so it runs on a full node too.
            num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n["NodeID"], soft=False),
            max_retries=0,
        ).remote(slots_of(n))

    refs = {n["NodeID"]: on[n["NodeID"]].probe.remote(slots_of(n)) if n["NodeID"] in on else by_task(n)
            for n in alive}

    nodes = []
    for n in alive:
        node_id = n["NodeID"]
        where = f"node {node_id[:12]} ({n.get('NodeManagerAddress', '?')})"
        try:
            try:
                result = ray.get(refs[node_id], timeout=ON_WORKER_TIMEOUT_S if node_id in on else PROBE_TIMEOUT_S)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                if node_id not in on:
                    raise
                result = ray.get(by_task(n), timeout=PROBE_TIMEOUT_S)  # the worker did not start: as any node
        except ray.exceptions.GetTimeoutError:
            raise TopologyError(f"{where}: the topology probe did not answer within {PROBE_TIMEOUT_S:.0f} s") from None
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, UserError):
                raise type(cause)(f"{where}: {cause}") from None
            raise
        except ray.exceptions.RayError:
            # A node that died between listing and probing (the failure a re-probe follows)
            # is simply not part of the cluster any more.
            if any(m["NodeID"] == node_id and m.get("Alive") for m in ray.nodes()):
                raise
            log.warning("%s died during the topology probe; leaving it out", where)
            continue
        node = NodeTopology.from_dict(result)
        node.node_id = node_id
        node.hostname = node.hostname or n.get("NodeManagerHostname", "")
        node.ray_gpus = int(n.get("Resources", {}).get("GPU", 0))
        _count_cpu_slots(node, cpus_of(n), cpus_per_worker, num_cpu_slots)
        nodes.append(node)

    if not nodes:
        raise TopologyError("every node of the Ray cluster died during the topology probe")
    if not any(node.devices for node in nodes):
        largest = max(alive, key=cpus_of)
        raise TopologyError(
            f"key 'cluster.cpus_per_worker': no node of the cluster holds one worker of {cpus_per_worker:g} CPUs; "
            f"the largest, node {largest['NodeID'][:12]} ({largest.get('NodeManagerHostname', '?')}), "
            f"has {cpus_of(largest):g}")
    cluster = ClusterTopology(nodes=nodes, network=network_from_nodes(nodes))
    if measure:
        cluster = measure_cluster(cluster)
    return cluster


def _count_cpu_slots(node: NodeTopology, node_cpus: float, cpus_per_worker: float, num_workers: int) -> None:
    """Size a node that runs CPU workers by what it holds (`cpu_slots`), and say where Ray's
    GPUs are not ones a rank can use (no NVML or CUDA on the node sees them)."""
    if any(d.kind != "cpu" for d in node.devices):
        return
    if node.ray_gpus:
        node.warnings.append(f"Ray offers {node.ray_gpus} GPU(s) on this node {RAY_GPUS_UNSEEN}")
    slots = cpu_slots(node_cpus, cpus_per_worker, num_workers)
    if slots == 0:
        node.warnings.append(f"its {node_cpus:g} CPU(s) {HOLDS_NO_WORKER}={cpus_per_worker:g}")
        node.devices, node.links = [], []
