"""Which part of the cluster a (re-)plan uses, so every step still covers exactly
`train.global_batch_size` sequences in the same order.

The planner already searches micro-batch x accumulation x mesh for the world it is given; what
it cannot do is change the world. When the survivors of a failure admit no data-parallel size
that divides the global batch (or no longer have equal devices per node), the driver plans for
the largest uniform sub-world that does: whole nodes first, then fewer devices per node. The data
order is a function of the step and the global batch alone (`data/stream.py`), so a smaller
data-parallel size sees the same sequences per step, only split differently.
"""

from __future__ import annotations

from dataclasses import replace

from ..config import JobConfig
from ..errors import ModelTooLarge, PlanError
from ..planning import Plan, plan_job
from ..planning.calibration import UNCALIBRATED, Calibration
from ..planning.cluster_view import LeftOut
from ..planning.model_spec import ModelSpec
from ..topology.model import ClusterTopology, NodeTopology


def _keep(node: NodeTopology, keep: set[int]) -> NodeTopology:
    return replace(
        node,
        devices=[d for d in node.devices if d.index in keep],
        links=[lk for lk in node.links if lk.a in keep and lk.b in keep],
        nvlink_domains=[g for g in ([i for i in dom if i in keep] for dom in node.nvlink_domains) if len(g) > 1],
    )


def uniform_subworlds(topology: ClusterTopology) -> list[ClusterTopology]:
    """Every sub-cluster with the same number of devices on each node (the lowest device
    indices of the nodes with the most devices), largest first; ties keep more devices per
    node (fewer nodes, less inter-node traffic)."""
    nodes = sorted(topology.nodes, key=lambda n: -n.num_devices)
    out = []
    for k in range(len(nodes), 0, -1):
        for per_node in range(nodes[k - 1].num_devices, 0, -1):
            chosen = [n if n.num_devices == per_node else
                      _keep(n, {d.index for d in sorted(n.devices, key=lambda d: d.index)[:per_node]})
                      for n in nodes[:k]]
            out.append(ClusterTopology(nodes=chosen, network=topology.network))
    out.sort(key=lambda t: (-t.num_devices, len(t.nodes)))
    return out


def plan_keeping_batch(cfg: JobConfig, topology: ClusterTopology, spec: ModelSpec | None = None,
                       left_out: tuple[LeftOut, ...] = (),
                       calibration: Calibration = UNCALIBRATED) -> tuple[Plan, ClusterTopology, str | None]:
    """The plan for `topology` (the plannable nodes, already cut to elastic.max_workers) that
    keeps the global batch:
    the planner's own choice when the whole world admits one, otherwise the plan for the
    largest uniform sub-world that does, with a note saying how many devices stay idle. Below
    elastic.min_workers, PlanError in one line."""
    min_w, gb = cfg.elastic.min_workers, cfg.train.global_batch_size
    try:
        plan = plan_job(cfg, topology, spec, left_out=left_out, calibration=calibration)
        if plan.fits:
            return plan, topology, None
        first = PlanError(f"the plan does not fit: {plan.reason}")
    except ModelTooLarge:
        raise  # fewer devices only make it larger per device
    except PlanError as e:
        first = e
    others: set[str] = set()  # why each smaller world failed
    for sub in uniform_subworlds(topology):
        if sub.num_devices >= topology.num_devices:
            continue  # the whole world (or the same size) was tried above
        if sub.num_devices < min_w:
            break
        try:
            plan = plan_job(cfg, sub, spec, left_out=left_out, calibration=calibration)
        except PlanError as e:
            others.add(str(e))
            continue
        if plan.fits:
            note = (f"{plan.world_size} of {topology.num_devices} devices used: with all of them no plan keeps "
                    f"train.global_batch_size={gb} ({first})")
            return plan, sub, note
        others.add(f"the plan does not fit: {plan.reason}")
    if others == {str(first)}:
        raise first  # a cause no world size changes (a model that cannot be split as forced)
    raise PlanError(f"no world of at least elastic.min_workers={min_w} devices keeps train.global_batch_size={gb}: "
                    f"with all {topology.num_devices} devices, {first}")


def uses_gpus(topology: ClusterTopology) -> bool:
    """Whether the plan's ranks run on GPUs: every planned device is one and Ray has GPUs."""
    import ray

    kinds = {d.kind for n in topology.nodes for d in n.devices}
    return kinds == {"gpu"} and ray.cluster_resources().get("GPU", 0) >= 1


def limit_world(cfg: JobConfig, topology: ClusterTopology) -> ClusterTopology:
    """The part of the cluster this job may use: at most elastic.max_workers devices (whole
    nodes first, then the lowest device indices of the next node), at least min_workers."""
    devices = topology.num_devices
    if devices < cfg.elastic.min_workers:
        raise PlanError(
            f"the cluster has {devices} devices, fewer than elastic.min_workers={cfg.elastic.min_workers}"
        )
    if not cfg.elastic.max_workers or devices <= cfg.elastic.max_workers:
        return topology
    return topology.limit(cfg.elastic.max_workers)


def devices_now(cfg: JobConfig) -> int:
    """GPUs on the cluster's alive nodes now, up to elastic.max_workers."""
    import ray

    gpus = int(sum(n.get("Resources", {}).get("GPU", 0) for n in ray.nodes() if n.get("Alive")))
    return min(gpus, cfg.elastic.max_workers) if cfg.elastic.max_workers else gpus
