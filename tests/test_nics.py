"""A NIC per rank on real captures, rail alignment across nodes, and GPU-less nodes left out."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from orchestrator.config import load_config
from orchestrator.planning import Plan, plan_job
from orchestrator.planning.cluster_view import plannable
from orchestrator.planning.describe import describe_cluster
from orchestrator.topology.files import load_topology_file
from orchestrator.topology.model import ClusterTopology, Network, NodeTopology, cpu_node

FIX = Path(__file__).parent / "fixtures" / "topology"
MODEL = ["model.n_layer=2", "model.n_head=8", "model.n_embd=256", "train.global_batch_size=32", "cluster.gpu=A100"]
ORDER = ["PIX", "PXB", "PHB", "NODE", "SYS"]


def _nic_captures() -> list[Path]:
    return sorted(p for p in FIX.glob("*") if p.suffix in (".txt", ".xml") and not p.name.startswith(("nvlink_", "p2p"))
                  and load_topology_file(p).nics)


def _nearest_by_matrix(text: str) -> dict[int, set[str]]:
    """GPU -> names of its nearest NICs, read straight from `nvidia-smi topo -m` text and its legend."""
    lines = text.splitlines()
    header = next(l.split() for l in lines if l.split()[:1] == ["GPU0"] and "X" not in l.split())
    cols = [c for c in header if re.fullmatch(r"GPU\d+|NIC\d+|mlx\S+", c)]
    legend = dict(re.findall(r"^\s*(NIC\d+):\s*(\S+)\s*$", text, re.M))
    out = {}
    for l in lines:
        t = l.split()
        if not t or not re.fullmatch(r"GPU\d+", t[0]) or len(t) < len(cols) + 1:
            continue
        cells = dict(zip(cols, t[1:]))
        dist = {legend.get(c, c): ORDER.index(v) for c, v in cells.items() if not c.startswith("GPU") and v in ORDER}
        if dist:
            best = min(dist.values())
            out[int(t[0][3:])] = {n for n, d in dist.items() if d == best}
    return out


def _nearest_by_xml(node: NodeTopology) -> dict[int, set[str]]:
    order = [o.lower() for o in ORDER]
    out = {}
    for d in node.devices:
        dist = {n.name: order.index(n.gpu_paths[d.index]) for n in node.nics if d.index in n.gpu_paths}
        out[d.index] = {n for n, v in dist.items() if v == min(dist.values())}
    return out


def _plan(node: NodeTopology, nodes: int = 1, *overrides: str) -> Plan:
    cfg = load_config(None, [*MODEL, *overrides])
    return plan_job(cfg, describe_cluster(node, nodes, Network(), "A100"))


@pytest.mark.parametrize("capture", _nic_captures(), ids=lambda p: p.name)
def test_every_rank_gets_a_nic_nearest_its_gpu_by_the_capture_itself(capture):
    node = load_topology_file(capture)
    text = capture.read_text()
    nearest = _nearest_by_xml(node) if capture.suffix == ".xml" else _nearest_by_matrix(text)
    plan = _plan(node, 2)
    data = json.loads(json.dumps(plan.to_dict()))  # what plan.json holds
    assert len(data["ranks"]) == 2 * len(node.devices)
    for r in data["ranks"]:
        assert r["nic"] in nearest[r["gpu"]], (r, nearest[r["gpu"]])
    # Identical nodes: ranks that talk across nodes (same local rank) share a rail.
    g = len(node.devices)
    assert [r["nic"] for r in data["ranks"][:g]] == [r["nic"] for r in data["ranks"][g:]]
    assert any(line.startswith("rails: aligned") for line in data["explanation"])
    assert Plan.from_dict(data).ranks == plan.ranks


def test_legend_names_devices_and_shared_nics_are_spread():
    # DGX A100: GPU0 and GPU1 both reach NIC0 and NIC1 through one switch (PXB).
    plan = _plan(load_topology_file(FIX / "topo_dgx_a100_40gb_nics_nccl1505_PARTIAL.txt"))
    assert {r.gpu: r.nic for r in plan.ranks} == {0: "NIC0", 1: "NIC1", 2: "NIC2", 3: "NIC3"}
    # The 4x A100 capture's legend names two of its four NICs: the names where given, the column else.
    plan = _plan(load_topology_file(FIX / "topo_4x_a100_nv4_nccltests331.txt"))
    assert {r.gpu: r.nic for r in plan.ranks} == {0: "mlx5_0", 1: "mlx5_1", 2: "NIC2", 3: "NIC3"}
    from orchestrator.planning.render import render_text

    assert "r0:0/mlx5_0" in render_text(plan)


def test_rails_align_where_the_wiring_allows_and_the_plan_says_where_not():
    a = load_topology_file(FIX / "topo_dgx_a100_40gb_nics_nccl1505_PARTIAL.txt", "A100")
    b = NodeTopology.from_dict(a.to_dict())
    # Node b: NIC1 is gone, so GPU1's only nearest NIC there is NIC0 (GPU0 then shares it).
    b.nics = [n for n in b.nics if n.name != "NIC1"]
    a.node_id, b.node_id = "A", "B"
    cfg = load_config(None, MODEL)
    plan = plan_job(cfg, ClusterTopology(nodes=[a, b], network=Network()))
    nic = {(r.node, r.gpu): r.nic for r in plan.ranks}
    assert nic[("A", 0)] == "NIC0" and nic[("A", 1)] == "NIC1"
    assert nic[("B", 0)] == "NIC0" and nic[("B", 1)] == "NIC0"  # the only near NIC left
    assert nic[("B", 2)] == "NIC2" and nic[("B", 3)] == "NIC3"  # aligned with node A
    note = next(l for l in plan.explanation if l.startswith("rails:"))
    assert "local rank 1 uses NIC1 on A but NIC0 on B" in note


def test_no_nics_leaves_nic_empty_and_says_so():
    plan = _plan(load_topology_file(FIX / "topo_4gpu_pcie_pxb_pix_nccl667.txt"))
    assert all(r.nic is None for r in plan.ranks)
    assert any("NCCL chooses the network ports itself" in l for l in plan.explanation)


def test_gpu_less_head_is_left_out_by_name_and_cpu_plans_only_without_gpus():
    gpu = load_topology_file(FIX / "topo_4gpu_pcie_pxb_pix_nccl667.txt", "A100")
    nodes = [cpu_node(2, hostname="head", node_id="H")]
    for i in range(2):
        n = NodeTopology.from_dict(gpu.to_dict())
        n.node_id = f"W{i}"
        nodes.append(n)
    topo = ClusterTopology(nodes=nodes, network=Network())
    view, left = plannable(topo)
    assert [n.node_id for n in view.nodes] == ["W0", "W1"]
    assert [x.node for x in left] == ["H"] and "no GPU" in left[0].reason
    plan = plan_job(load_config(None, [*MODEL, "parallel.tp=2"]), topo)
    assert {r.node for r in plan.ranks} == {"W0", "W1"} and plan.world_size == 8
    # TP pairs sit on the PCIe-switch pairs of each GPU node.
    for group in plan.groups["tp"]:
        assert {plan.ranks[r].gpu for r in group} in ({0, 1}, {2, 3})
    d = plan.to_dict()
    assert d["left_out"] == [{"node": "H", "hostname": "head", "reason": left[0].reason}]
    assert any(l.startswith("left out: H (head): no GPU") for l in d["explanation"])
    assert Plan.from_dict(d).left_out == plan.left_out
    # No GPU anywhere: every node's CPU slots are planned.
    cpus = ClusterTopology(nodes=[cpu_node(2, node_id="A"), cpu_node(2, node_id="B")])
    assert plannable(cpus) == (cpus, ())
