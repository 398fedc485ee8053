"""Rank layout on real captures: the most talkative axis on the fastest links."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from orchestrator.config import load_config
from orchestrator.planning import plan_job
from orchestrator.planning.describe import describe_cluster
from orchestrator.planning.layout import NodeWiring, in_node_shape, node_layout
from orchestrator.planning.mesh import Mesh
from orchestrator.topology.files import load_topology_file
from orchestrator.topology.model import Link, Network, NodeTopology

FIX = Path(__file__).parent / "fixtures" / "topology"
MODEL = ["model.n_layer=4", "model.n_head=8", "model.n_embd=512", "train.global_batch_size=32"]


def _tp_pairs(plan) -> list[set[int]]:
    gpu = {r.rank: r.gpu for r in plan.ranks}
    return [{gpu[r] for r in g} for g in plan.groups["tp"]]


def _plan(node: NodeTopology, *overrides: str, gpu: str | None = None, nodes: int = 1):
    cfg = load_config(None, [*MODEL, *overrides])
    cfg.cluster.gpu = gpu
    return plan_job(cfg, describe_cluster(node, nodes, Network(), gpu))


def _relabel(node: NodeTopology, perm: dict[int, int]) -> NodeTopology:
    """The same machine with its GPUs numbered differently."""
    out = NodeTopology.from_dict(node.to_dict())
    for d in out.devices:
        d.index = perm[d.index]
    out.links = [Link(**{**l.__dict__, "a": perm[l.a], "b": perm[l.b]}) for l in out.links]
    return out


def test_a6000_tp_pairs_sit_on_nvlink_bridges():
    node = load_topology_file(FIX / "topo_8x_rtxa6000_nvlink_pairs_unige3741.txt", "RTX A6000")
    for n in (node, _relabel(node, {0: 0, 1: 4, 2: 1, 3: 5, 4: 2, 5: 6, 6: 3, 7: 7})):
        plan = _plan(n, "parallel.tp=2", gpu="RTX A6000")
        for pair in _tp_pairs(plan):
            a, b = sorted(pair)
            assert n.link(a, b).kind == "nvlink" and n.link(a, b).nvlinks == 4
        assert sorted(r.gpu for r in plan.ranks) == list(range(8))


def test_pcie_switch_pairs_form_the_tp_pairs():
    node = load_topology_file(FIX / "topo_4gpu_pcie_pxb_pix_nccl667.txt", "A10")
    plan = _plan(node, "parallel.tp=2", gpu="A10")
    assert sorted(map(sorted, _tp_pairs(plan))) == [[0, 1], [2, 3]]
    # Numbered the other way round, the pairs follow the wiring, not the numbers.
    swapped = _relabel(node, {0: 0, 1: 2, 2: 1, 3: 3})
    plan = _plan(swapped, "parallel.tp=2", gpu="A10")
    assert sorted(map(sorted, _tp_pairs(plan))) == [[0, 2], [1, 3]]


@pytest.mark.parametrize("capture,gpu", [("topo_h100_8gpu_mlengineering.txt", "H100"),
                                         ("topo_a100_8gpu_mlengineering.txt", "A100")])
def test_nvswitch_any_layout_is_equal_and_the_plan_says_so(capture, gpu):
    node = load_topology_file(FIX / capture, gpu)
    plan = _plan(node, "parallel.tp=2", gpu=gpu)
    assert [r.gpu for r in plan.ranks] == list(range(8))
    assert any("any layout is equal" in line for line in plan.explanation)


def _cube_mesh() -> tuple[NodeTopology, dict[int, int], list[set[int]]]:
    """DGX-1 style hybrid cube mesh: two NVLink quads {0,1,2,3}, {4,5,6,7} joined i <-> i+4
    by two lanes (one lane inside a quad), with the GPUs numbered so that the quads are
    interleaved (the identity layout is wrong)."""
    quads = [{0, 1, 2, 3}, {4, 5, 6, 7}]
    links = []
    for a in range(8):
        for b in range(a + 1, 8):
            same = any({a, b} <= q for q in quads)
            if same or b == a + 4:
                links.append(Link(a=a, b=b, kind="nvlink", nvlinks=1 if same else 2, nvlink_gen=2,
                                  bandwidth_gbps=25.0 if same else 50.0, latency_us=1.0))
            else:
                links.append(Link(a=a, b=b, kind="sys", bandwidth_gbps=6.3, latency_us=6.0))
    from orchestrator.topology.model import Device
    perm = {0: 0, 1: 2, 2: 4, 3: 6, 4: 1, 5: 3, 6: 5, 7: 7}
    return _relabel(NodeTopology(devices=[Device(index=i, name="V100") for i in range(8)], links=links), perm), \
        perm, quads


def test_cube_mesh_splits_into_fully_connected_quads():
    node, perm, quads = _cube_mesh()
    plan = _plan(node, "parallel.tp=4", gpu="V100")
    assert sorted(map(sorted, _tp_pairs(plan))) == [sorted(perm[i] for i in q) for q in quads]


def _ring_seconds(gpus: tuple[int, ...], node: NodeTopology) -> float:
    """A 1 GB ring all-reduce over a set of GPUs, alpha-beta on the capture's links alone:
    2(k-1)/k of the buffer over the slowest link of the best ring through them (NCCL searches
    the ring order itself, so only the set matters)."""
    k = len(gpus)
    if k == 1:
        return 0.0
    first, rest = gpus[0], gpus[1:]
    best = max(min(node.link(a, b).bandwidth_gbps for a, b in zip((first, *order), (*order, first)))
               for order in itertools.permutations(rest))
    return 2 * (k - 1) / k * 1e9 / (best * 1e9)


@pytest.mark.parametrize("case", ["a6000-tp2", "a6000-tp4", "pcie4-tp2", "cube-tp4", "cube-tp2"])
@pytest.mark.parametrize("numbering", ["as captured", "shuffled"])
def test_layout_is_the_best_of_every_gpu_order_by_brute_force(case, numbering):
    """Every assignment of the node's GPUs to its local ranks (40320 on 8 GPUs), priced by a
    cost of its own: the slowest tensor-parallel group's ring all-reduce first (the most
    talkative axis), then the slowest data-parallel group's. The planner's layout must be one
    of the cheapest."""
    node, gpu, tp = {
        "a6000-tp2": (load_topology_file(FIX / "topo_8x_rtxa6000_nvlink_pairs_unige3741.txt", "RTX A6000"),
                      "RTX A6000", 2),
        "a6000-tp4": (load_topology_file(FIX / "topo_8x_rtxa6000_nvlink_pairs_unige3741.txt", "RTX A6000"),
                      "RTX A6000", 4),
        "pcie4-tp2": (load_topology_file(FIX / "topo_4gpu_pcie_pxb_pix_nccl667.txt", "A10"), "A10", 2),
        "cube-tp4": (_cube_mesh()[0], "V100", 4),
        "cube-tp2": (_cube_mesh()[0], "V100", 2),
    }[case]
    if numbering == "shuffled":  # the same machine, its GPUs numbered against the wiring
        n = len(node.devices)
        node = _relabel(node, {i: (3 * i + 1) % n for i in range(n)})
    plan = _plan(node, f"parallel.tp={tp}", "parallel.strategy=zero2", gpu=gpu)
    axes = [[tuple(g) for g in plan.groups[a]] for a in ("tp", "dp_shard")]
    cache: dict[frozenset, float] = {}

    def cost(order: tuple[int, ...]) -> tuple[float, ...]:
        out = []
        for groups in axes:
            worst = 0.0
            for g in groups:
                key = frozenset(order[r] for r in g)
                if key not in cache:
                    cache[key] = _ring_seconds(tuple(sorted(key)), node)
                worst = max(worst, cache[key])
            out.append(worst)
        return tuple(out)

    devices = sorted(d.index for d in node.devices)
    best = min(cost(order) for order in itertools.permutations(devices))
    chosen = cost(tuple(r.gpu for r in sorted(plan.ranks, key=lambda r: r.rank)))
    assert chosen == pytest.approx(best), (chosen, best, [r.gpu for r in plan.ranks])


def test_hsdp_shard_groups_stay_inside_a_node():
    node = load_topology_file(FIX / "topo_h100_8gpu_mlengineering.txt", "H100")
    plan = _plan(node, "parallel.strategy=hsdp", "parallel.dp_shard=8", "parallel.tp=1", "parallel.pp=1", gpu="H100",
                 nodes=4)
    node_of = dict(enumerate(plan.node_of_rank))
    for g in plan.groups["dp_shard"]:
        assert len({node_of[r] for r in g}) == 1
    for g in plan.groups["dp_replicate"]:
        assert len({node_of[r] for r in g}) == 4


def test_mesh_groups_follow_init_device_mesh_numbering():
    groups = Mesh(dp_replicate=2, dp_shard=3, tp=2).groups()
    assert groups["tp"][0] == [0, 1] and groups["dp_shard"][0] == [0, 2, 4] and groups["dp_replicate"][0] == [0, 6]
    with pytest.raises(ValueError, match="must divide"):
        in_node_shape(Mesh(1, 3, 3), 8)


def test_equal_nodes_share_one_layout():
    node = load_topology_file(FIX / "topo_8x_rtxa6000_nvlink_pairs_unige3741.txt", "RTX A6000")
    w = NodeWiring.of(node)
    spans = (True, True, False)
    assert node_layout(w, (1, 4, 2), spans) is node_layout(NodeWiring.of(node), (1, 4, 2), spans)
