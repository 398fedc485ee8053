"""NVLink domains across nodes (GB200 NVL72-like fake nodes): tensor parallelism spans the
nodes of a domain and never leaves it, and placement selects on the domain label."""

from __future__ import annotations

import json

import pytest

from orchestrator.config import load_config
from orchestrator.errors import PlacementError, PlanError
from orchestrator.planning import Plan, plan_job
from orchestrator.topology.bandwidth import estimate
from orchestrator.topology.files import load_cluster_file
from orchestrator.topology.model import ClusterTopology, Device, Link, Network, Nic, NodeTopology, all_pairs

UUID = "8f0e2a6c-1d2b-4c1e-9a8e-0b4b1c1d2e3f"
MODEL = ["model.n_layer=2", "model.n_head=16", "model.n_embd=512", "train.global_batch_size=32"]


def nvl72_tray(node_id: str, clique: str | None, gpus: int = 4) -> NodeTopology:
    """One compute tray of a GB200 NVL72: 4 GPUs, 18 NVLink-5 lanes each into the rack's
    NVSwitches, one ConnectX NIC beside each GPU."""
    bw, lat = estimate("nvlink", nvlinks=18, nvlink_gen=5, name="NVIDIA GB200")
    devices = [Device(index=i, name="NVIDIA GB200", memory_bytes=186 * 2**30, fabric_clique=clique,
                      pci_bus_id=f"0000:{0x10 * (i + 1):02x}:00.0") for i in range(gpus)]
    links = [Link(a=a, b=b, kind="nvlink", nvlinks=18, nvlink_gen=5, bandwidth_gbps=bw, latency_us=lat, via_switch=True)
             for a, b in all_pairs(range(gpus))]
    nics = [Nic(name=f"mlx5_{i}", kind="infiniband", speed_gbps=400.0,
                gpu_paths={g: "pix" if g == i else "sys" for g in range(gpus)}) for i in range(gpus)]
    return NodeTopology(hostname=node_id, node_id=node_id, source="declared:tray.json", devices=devices, links=links,
                        nics=nics, nvlink_domains=[list(range(gpus))])


def _cluster(tmp_path) -> ClusterTopology:
    # Two racks' worth of domains, two trays each: A,B in clique 1 and C,D in clique 2.
    nodes = [nvl72_tray(n, f"{UUID}/{1 if n in 'AB' else 2}") for n in "ABCD"]
    path = tmp_path / "nvl.json"  # declared as a file, as fake nodes declare their wiring
    path.write_text(json.dumps(ClusterTopology(nodes=nodes, network=Network(50.0, 5.0)).to_dict()))
    return load_cluster_file(path)


def test_tp_spans_the_nodes_of_a_domain_and_never_leaves_it(tmp_path):
    topo = _cluster(tmp_path)
    plan = plan_job(load_config(None, [*MODEL, "parallel.tp=8"]), topo)
    domain = {"A": 1, "B": 1, "C": 2, "D": 2}
    for group in plan.groups["tp"]:
        nodes = {plan.ranks[r].node for r in group}
        assert len(nodes) == 2, group  # 8 ranks on two trays of 4
        assert len({domain[n] for n in nodes}) == 1, (group, nodes)
    assert {r.node: r.nvlink_domain for r in plan.ranks} == {n: f"{UUID}/{d}" for n, d in domain.items()}
    assert any(l.startswith("NVLink domains across nodes") and "A, B" in l and "C, D" in l for l in plan.explanation)
    assert all(r.nic == f"mlx5_{r.gpu}" for r in plan.ranks)
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again.ranks == plan.ranks
    # Larger than a domain: refused, tensor parallelism never crosses between domains.
    with pytest.raises(PlanError):
        plan_job(load_config(None, [*MODEL, "parallel.tp=16"]), topo)


def test_nodes_without_a_shared_clique_keep_tp_inside_each_node(tmp_path):
    nodes = [nvl72_tray(n, None) for n in "AB"]
    topo = ClusterTopology(nodes=nodes, network=Network(50.0, 5.0))
    with pytest.raises(PlanError):
        plan_job(load_config(None, [*MODEL, "parallel.tp=8"]), topo)
    plan = plan_job(load_config(None, [*MODEL, "parallel.tp=4"]), topo)
    assert all(len({plan.ranks[r].node for r in g}) == 1 for g in plan.groups["tp"])
    assert all(r.nvlink_domain is None for r in plan.ranks)


def test_placement_selects_on_the_domain_label_its_nodes_advertise(tmp_path):
    from orchestrator.control.labels import NVLINK_DOMAIN_LABEL, node_labels
    from orchestrator.control.placement import NODE_ID_LABEL, _bundles

    topo = _cluster(tmp_path)
    plan = plan_job(load_config(None, [*MODEL, "parallel.tp=8"]), topo)
    labels = {n.node_id: node_labels(n) for n in topo.nodes}  # what `ray start --labels` gave each node
    _, selectors = _bundles(plan, True, 1.0, True, labels)
    for r, sel in zip(plan.ranks, selectors):
        assert sel == {NODE_ID_LABEL: r.node, NVLINK_DOMAIN_LABEL: labels[r.node][NVLINK_DOMAIN_LABEL]}
    assert {s[NVLINK_DOMAIN_LABEL] for s in selectors} == {f"{UUID}.1", f"{UUID}.2"}
    # A node started without the labels is pinned by its id alone.
    _, selectors = _bundles(plan, True, 1.0, True, {})
    assert all(set(s) == {NODE_ID_LABEL} for s in selectors)
    # A node that advertises another domain than its GPUs report is refused before anything is held.
    labels["C"] = {**labels["C"], NVLINK_DOMAIN_LABEL: f"{UUID}.1"}
    with pytest.raises(PlacementError, match="node C advertises orchestrator.io/nvlink-domain="):
        _bundles(plan, True, 1.0, True, labels)


@pytest.mark.ray
@pytest.mark.slow
def test_live_domain_spans_two_labelled_nodes_behind_a_gpu_less_head(tmp_path):
    """Two fake trays declared as one NVLink domain and started with their `node-labels`:
    a tp=4 group spans both, and placement holds them through the domain label selector.
    (Trays of 2 GPUs rather than 4: each rank is a process importing torch on a small CI box.)"""
    import ray
    from ray.cluster_utils import Cluster

    from orchestrator.control.labels import node_labels
    from orchestrator.control.placement import place
    from orchestrator.topology.cluster_probe import probe_cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    try:
        for n in "AB":
            tray = nvl72_tray(n, f"{UUID}/1", gpus=2)
            tray.node_id = None
            path = tmp_path / f"{n}.json"
            path.write_text(json.dumps(tray.to_dict()))
            cluster.add_node(num_cpus=2, num_gpus=2, env_vars={"ORCHESTRATOR_TOPOLOGY_FILE": str(path)},
                             labels=node_labels(tray))
        ray.init(address=cluster.address)
        cluster.wait_for_nodes()
        plan = plan_job(load_config(None, [*MODEL, "parallel.tp=4"]), probe_cluster())
        assert len(plan.left_out) == 1  # the head
        assert [len({plan.ranks[r].node for r in g}) for g in plan.groups["tp"]] == [2]
        placement = place(plan, job="nvl", use_gpu=True, cpus_per_worker=0.25, threads_per_worker=1, timeout_s=120)
        try:
            assert [(p["node_id"], p["gpu"]) for p in placement.reports] == [(r.node, r.gpu) for r in plan.ranks]
        finally:
            placement.release()
    finally:
        ray.shutdown()
        cluster.shutdown()
