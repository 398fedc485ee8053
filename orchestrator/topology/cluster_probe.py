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
from .model import ClusterTopology, Network, Nic, NodeTopology

PROBE_TIMEOUT_S = 120.0
# NIC-to-GPU paths that put a NIC on the GPU's side of the host (GPUDirect RDMA distance).
_CLOSE_PATHS = ("pix", "pxb", "phb")
_RDMA_KINDS = ("infiniband", "roce", "efa")

log = logging.getLogger(__name__)


def _probe_on_node(num_cpu_slots: int) -> dict[str, Any]:
    from .local import probe_local

    return probe_local(num_cpu_slots).to_dict()


def scale_out_nics(node: NodeTopology) -> list[Nic]:
    """The NICs that carry a node's traffic to other nodes.

    On a GPU node those near a GPU (NCCL picks the NIC closest to each GPU and leaves the
    storage or management ports alone); without path information the RDMA NICs; failing
    that every NIC.
    """
    close = [n for n in node.nics if any(p in _CLOSE_PATHS for p in n.gpu_paths.values())]
    if close:
        return close
    rdma = [n for n in node.nics if n.kind in _RDMA_KINDS]
    return rdma or list(node.nics)


def network_from_nodes(nodes: list[NodeTopology]) -> Network:
    """Per-node scale-out bandwidth: the slowest node's summed NIC line rate, in GB/s.

    The Network default stands when any node's NIC speeds are unknown: one unknown node could
    be the slowest, and a figure that overstates the network misleads the planner more than
    the conservative default.
    """
    totals = []
    for node in nodes:
        speeds = [n.speed_gbps for n in scale_out_nics(node)]
        if not speeds or any(s is None for s in speeds):
            return Network()
        totals.append(sum(s for s in speeds if s is not None) / 8)  # Gbit/s -> GB/s
    if not totals:
        return Network()
    return Network(bandwidth_gbps=round(min(totals), 3), latency_us=Network().latency_us, source="nics")


def probe_cluster(measure: bool = False, num_cpu_slots: int = 0) -> ClusterTopology:
    """The topology of every alive node of the connected Ray cluster (ray.init must have run).

    `num_cpu_slots` sizes GPU-less nodes (the job's workers per node); 0 takes each node's
    Ray CPU count. With `measure`, links are then measured (see :mod:`.measure`).
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if not ray.is_initialized():
        raise RuntimeError("probe_cluster needs a connected Ray cluster (orchestrator.cluster.connect)")
    alive = [n for n in ray.nodes() if n.get("Alive")]
    if not alive:
        raise TopologyError("the Ray cluster has no alive node to probe")
    task = ray.remote(_probe_on_node)
    refs = {}
    for n in alive:
        slots = num_cpu_slots or max(1, int(n.get("Resources", {}).get("CPU", 1)))
        refs[n["NodeID"]] = task.options(
            # The probe uses no slot a training worker could use, so it runs on a full node too.
            num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n["NodeID"], soft=False),
            max_retries=0,
        ).remote(slots)

    nodes = []
    for n in alive:
        node_id = n["NodeID"]
        where = f"node {node_id[:12]} ({n.get('NodeManagerAddress', '?')})"
        try:
            result = ray.get(refs[node_id], timeout=PROBE_TIMEOUT_S)
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
        nodes.append(node)

    if not nodes:
        raise TopologyError("every node of the Ray cluster died during the topology probe")
    cluster = ClusterTopology(nodes=nodes, network=network_from_nodes(nodes))
    if measure:
        from .measure import measure_cluster

        cluster = measure_cluster(cluster)
    return cluster
