"""Context parallelism (cp) and a Mixture of Experts' expert parallelism (ep) in the planner.

Each cost term is checked against a figure worked out by hand from its formula, on the small
round context of test_planning_cost_terms.py (a 1000-wide model, 1000-token sequences, links of
10 GB/s inside a node, 100 GB/s out of it); then the search and the layout on captured clusters:
Llama 3 8B at 131,072 tokens on 4 DGX H100 nodes, Qwen3-30B-A3B on two 8-GPU NVSwitch nodes, and
a small Mixtral-shaped model on a PCIe-only box, where the FSDP-only experts are cheaper.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_planning_cost_terms import FP32, candidate, laid_out
from test_planning_cost_terms import context as dense_context

from orchestrator.choices import CpAttention, Recompute, Strategy
from orchestrator.config import load_config
from orchestrator.control.preflight import measure_model
from orchestrator.errors import ConfigError, PlanError
from orchestrator.planning import Plan, plan_job
from orchestrator.planning.activations import (
    context_shard,
    gathered_kv_bytes,
    routed_activation_bytes,
    ulysses_kept_bytes,
    ulysses_tensor_bytes,
)
from orchestrator.planning.comm import GroupLinks, group_all_to_all
from orchestrator.planning.cost import (
    ComputeTerm,
    ExpertRouting,
    context_parallel_term,
    expert_parallel_term,
    expert_routing,
    expert_sync_term,
)
from orchestrator.planning.describe import describe_cluster
from orchestrator.planning.flow import job_context
from orchestrator.planning.layout import NodeWiring, Wirings, cluster_layout, expert_in_node, in_node_shape
from orchestrator.planning.memory import expert_states
from orchestrator.planning.mesh import Mesh
from orchestrator.planning.model_math import ModelShape, block_params, routed_params, tp_param_split
from orchestrator.planning.model_spec import ExpertSpec, ModelSpec
from orchestrator.planning.traffic import predicted_traffic
from orchestrator.sequence_split import ulysses_problem
from orchestrator.topology.files import load_topology_file
from orchestrator.topology.model import ClusterTopology, Network, cpu_node

ROOT = Path(__file__).resolve().parent.parent
NVSWITCH = ROOT / "conf" / "topologies" / "h100-8gpu-nvswitch.txt"
PCIE = ROOT / "tests" / "fixtures" / "topology" / "topo_8x4090_pcie_gpuallocator17.txt"


def moe_spec(name: str, *, hidden: int, blocks: int, heads: int, kv_heads: int, vocab: int, seq: int, experts: int,
             top_k: int, expert_hidden: int, attention: int) -> ModelSpec:
    """A spec from a model card's shape (`attention`: one block's attention parameters), priced
    as a measured pre-norm block keeps its activations in fp32: about 24 values of hidden per
    token, each routed row's 2 d + 3 F, and a vocab-wide fp32 loss."""
    routed = experts * 3 * hidden * expert_hidden
    block = attention + routed + hidden * experts + 2 * hidden
    root = 2 * vocab * hidden + hidden
    params = blocks * block + root
    active = params - blocks * (experts - top_k) * 3 * hidden * expert_hidden
    per_token = 2.0 * (active - vocab * hidden) + 4 * seq * hidden * blocks
    none = 4.0 * seq * (24 * hidden + top_k * (2 * hidden + 3 * expert_hidden))
    return ModelSpec(name=name, params=params, blocks=blocks, block_class="MoEBlock", block_params=block,
                     root_params=root, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab, seq=seq,
                     forward_flops_per_token=per_token, block_forward_flops_per_token=per_token / blocks,
                     block_activation_bytes={"none": none, "selective": 0.9 * none, "full": 4.0 * seq * hidden},
                     root_activation_bytes=8.0 * seq * vocab,
                     backward_transient_bytes={k: 8.0 * seq * vocab for k in ("none", "selective", "full")},
                     tp_sharded_activation_fraction=None, tp_sharded_params=blocks * attention, tp_plan=True,
                     tied_embeddings=False, pipeline_ends=True,
                     experts=ExpertSpec(experts=experts, top_k=top_k, expert_hidden=expert_hidden, moe_blocks=blocks))


# The cost-term context's model with 4 experts of width 500 and top-2 routing in each of its 3 blocks.
SMALL_MOE = moe_spec("small-moe", hidden=1000, blocks=3, heads=10, kv_heads=10, vocab=1000, seq=1000, experts=4,
                     top_k=2, expert_hidden=500, attention=4 * 1000 * 1000)
MOE_SHAPE = ModelShape.from_spec(SMALL_MOE)


def qwen3_30b_a3b(seq: int = 4096) -> ModelSpec:
    """Qwen3-30B-A3B's published shape: 48 blocks of hidden 2048, 32 query and 4 K/V heads of 128,
    128 experts of width 768, top 8."""
    return moe_spec("qwen3-30b-a3b", hidden=2048, blocks=48, heads=32, kv_heads=4, vocab=151936, seq=seq,
                    experts=128, top_k=8, expert_hidden=768, attention=2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048)


def moe_context(on_gpu: bool = True):
    return replace(dense_context(on_gpu), shape=MOE_SHAPE)


def test_routed_experts_leave_the_dense_mesh_s_parameters():
    # 3 blocks x 4 experts x 3 x 1000 x 500 = 18e6 routed parameters, off the tp split and the FSDP unit.
    assert routed_params(MOE_SHAPE) == 18_000_000
    sharded, replicated = tp_param_split(MOE_SHAPE)
    assert sharded == 3 * 4_000_000 and sharded + replicated == SMALL_MOE.params - 18_000_000
    assert block_params(MOE_SHAPE) == SMALL_MOE.block_params - 6_000_000


def test_expert_states_shard_over_ep_and_efsdp_and_gather_two_layers_of_the_rank_s_experts():
    # One layer's 6e6 routed parameters over ep=2: 3e6 per rank, 9e6 over the 3 layers; zero3 shards
    # them over efsdp=2: fp32 weights and gradients 9e6 x 4 / 2 = 18e6 B each, Adam 9e6 x 8 / 2 = 36e6 B;
    # it gathers the layer computed and the one prefetched (2 x 3e6 x 4 B) and holds one layer's
    # unsharded gradient (3e6 x 4 B).
    states = expert_states("zero3", MOE_SHAPE, 1, 2, 2, FP32)
    assert (states.params, states.grads, states.optimizer) == (18e6, 18e6, 36e6)
    assert (states.gathered, states.unsharded_grads) == (24e6, 12e6)
    # Nothing left to shard (ep takes all the ranks it borrows): nothing gathered.
    alone = expert_states("zero3", MOE_SHAPE, 1, 4, 1, FP32)
    assert (alone.params, alone.gathered) == (4.5e6 * 4, 0.0)


def test_context_parallelism_divides_the_activations_and_brings_the_gathered_kv_back():
    shape = ModelShape.from_spec(replace(SMALL_MOE, experts=None, params=SMALL_MOE.params - 18_000_000,
                                         block_params=SMALL_MOE.block_params - 6_000_000))
    shard = context_shard(shape, 4)
    assert shard.seq == 250 and shard.spec.block_activation_bytes["none"] == shape.spec.block_activation_bytes[
        "none"] / 4
    # K and V of the whole sequence: 2 x 1000 tokens x 10 heads x 100 wide x 2 B = 4e6 B a layer; kept for
    # backward without recomputation, beyond the rank's own quarter: 3 layers x 4e6 x 3/4 = 9e6 B; one
    # layer's is the transient; recomputed attention keeps none.
    assert gathered_kv_bytes(shape, 1, 4, "none", 2, 3) == (9e6, 4e6)
    assert gathered_kv_bytes(shape, 1, 4, "full", 2, 3) == (0.0, 4e6)
    assert gathered_kv_bytes(shape, 1, 1, "none", 2, 3) == (0.0, 0.0)


def test_routed_rows_imbalance_is_kept_by_every_moe_layer():
    # 1000 tokens x top 2 = 2000 rows, each 2 x 1000 + 3 x 500 = 3500 values of 2 B; the allowance adds a
    # quarter: 0.25 x 2000 x 3500 x 2 = 3.5e6 B a layer, 3 layers kept; none at ep=1.
    assert routed_activation_bytes(MOE_SHAPE, 1, 1, 1, 4, "none", 2, 3) == pytest.approx((10.5e6, 0.0))
    assert routed_activation_bytes(MOE_SHAPE, 1, 1, 1, 4, "full", 2, 3) == pytest.approx((0.0, 3.5e6))
    assert routed_activation_bytes(MOE_SHAPE, 1, 1, 1, 1, "none", 2, 3) == (0.0, 0.0)


def test_all_to_all_runs_its_in_node_and_network_flows_at_once():
    links = GroupLinks(size=8, per_node=4, intra_gbps=100.0, intra_lat_us=1.0, inter_gbps=50.0, inter_lat_us=5.0)
    # 1e8 B over the island at 100 GB/s: 1 ms; 1e8 B over the rank's share of the group's 50 GB/s
    # (4 members): 12.5 GB/s, 8 ms, the slower; launch 8 us and 1 + 5 us of latency.
    assert group_all_to_all(1e8, 1e8, links) == pytest.approx(8e-6 + 6e-6 + 8e-3)
    assert group_all_to_all(0.0, 0.0, links) == 0.0


def test_context_parallel_term_gathers_kv_forward_and_reduce_scatters_it_backward_per_layer():
    mesh = Mesh(1, 1, 1, cp=2)
    ctx = dense_context(on_gpu=True)
    term = context_parallel_term(ctx, laid_out(mesh, {"cp": 2}), candidate(mesh, Strategy.zero3))
    # K/V of a micro-batch: 2 x 1000 x 10 heads x 100 x 4 B = 8e6 B. A 2-rank NCCL ring all-gather
    # of it inside a node (10 GB/s, 1 us): 1/2 x 8e6 / 10e9 = 400 us, plus Simple's latency 8 + 8.4 +
    # 3.4 us = 19.8 us (LL128 pays 23.9 us but 1/0.9375 of the bytes); the reduce-scatter the same.
    # 3 blocks x (gather + reduce-scatter) = 6 x 419.8 us, unhidden.
    assert term.parts == {"cp K/V all-gather": pytest.approx(6 * 419.8e-6)}
    assert term.exposed_s == pytest.approx((6 * 419.8e-6,))
    assert context_parallel_term(ctx, laid_out(Mesh(1, 2, 1), {"dp_shard": 2}), candidate(Mesh(1, 2, 1))).parts == {}


def test_expert_all_to_all_inside_an_island_moves_top_k_rows_four_times_per_layer():
    mesh = Mesh(1, 4, 1, ep=4)
    term = expert_parallel_term(moe_context(), laid_out(mesh, {"ep": 4}), candidate(mesh, Strategy.zero3))
    # 1000 tokens x top 2 = 2000 rows of 1000 x 4 B; 3/4 of them leave the rank: 6e6 B at 10 GB/s =
    # 600 us + 1 us + 8 us launch = 609 us, x 1.25 for the busiest rank = 761.25 us; dispatch and combine
    # forward and backward: 4 per layer, 3 layers.
    assert term.parts == {"ep all-to-all": pytest.approx(12 * 761.25e-6)}


def test_an_expert_group_across_islands_routes_node_limited_and_sends_once_per_island():
    mesh = Mesh(1, 16, 1, ep=16)
    layout = laid_out(mesh, {"ep": 8})
    ctx = moe_context()
    assert expert_routing(ctx, layout) == ExpertRouting(groups=2, top_groups=2)
    term = expert_parallel_term(ctx, layout, candidate(mesh, Strategy.zero3))
    # In the island: 2000 rows x 4000 B x 7/16 = 3.5e6 B at 10 GB/s = 350 us. Across: 1000 tokens x 2
    # islands at most x 4000 B x 1/2 = 4e6 B at the rank's 100 GB/s x 8/8 / 8 = 12.5 GB/s = 320 us.
    # The slower, 350 us, + 8 us launch + 1 + 5 us latency = 364 us; x 1.25, x 4 passes, x 3 layers.
    assert term.parts == {"ep all-to-all": pytest.approx(12 * 1.25 * 364e-6)}


def test_fsdp_only_experts_gather_the_whole_expert_set_per_layer_forward_and_backward():
    mesh = Mesh(1, 4, 1)  # ep=1: efsdp = 4
    cand = candidate(mesh, Strategy.zero3, ddp_reduces=False, reshard_after_forward=True)
    compute = ComputeTerm(matmul_s=0.0, compute_s=0.0, forward_s=0.0, backward_s=0.0, bubble_s=0.0)
    term = expert_sync_term(moe_context(), laid_out(mesh, {"efsdp": 4}), cand, compute, 0.0)
    # One layer's 4 experts, 6e6 parameters of 4 B: a 4-rank ring all-gather of 24e6 B, 3/4 of it at
    # 10 GB/s = 1800 us + Simple's 8 + 8.4 + 3 x 3.4 = 26.6 us; forward and again backward, 3 layers.
    # The fp32 gradients (24e6 B) reduce-scatter once a layer at the same 1826.6 us. Nothing hides it.
    assert term.parts == {"expert all-gather": pytest.approx(6 * 1826.6e-6),
                          "expert reduce-scatter": pytest.approx(3 * 1826.6e-6)}
    assert term.exposed_s == pytest.approx((9 * 1826.6e-6,))


def test_cp_and_ep_are_config_keys_with_one_line_errors():
    assert load_config(None, ["parallel.cp=4", "model.block_size=1024"]).parallel.cp == 4
    with pytest.raises(ConfigError, match=r"key 'parallel.cp'.*2 x cp.*allowed up to 64: 1, 2, 4"):
        load_config(None, ["parallel.cp=3", "model.block_size=1000"])
    with pytest.raises(ConfigError, match=r"key 'parallel.ep': the built-in GPT is dense"):
        load_config(None, ["parallel.ep=2"])
    with pytest.raises(ConfigError, match=r"key 'parallel.ep': expected 'auto' or a positive integer"):
        load_config(None, ["parallel.ep=0"])


def test_cp_and_ep_lay_out_inside_a_node_first():
    assert in_node_shape(Mesh(1, 4, 1, cp=8), 8) == Mesh(1, 1, 1, cp=8)
    assert in_node_shape(Mesh(2, 2, 2, cp=2), 8) == Mesh(1, 2, 2, cp=2)
    with pytest.raises(ValueError, match="cp=3 must divide"):
        in_node_shape(Mesh(1, 1, 2, cp=3), 8)
    assert expert_in_node(Mesh(1, 16, 1, ep=16), Mesh(1, 8, 1)) == (8, 1)
    assert expert_in_node(Mesh(1, 16, 1, ep=4), Mesh(1, 8, 1)) == (4, 2)
    node = load_topology_file(NVSWITCH, "H100")
    wirings = Wirings.of(describe_cluster(node, 2, Network(400.0, 3.0), "H100"))
    layout = cluster_layout(wirings, Mesh(1, 4, 1, cp=4), routes_experts=True)
    assert layout.per_node["cp"] == 4 and layout.per_node["dp_shard_cp"] == 8 and layout.per_node["ep"] == 1
    assert math.isfinite(layout.rings["cp"].gbps) and layout.rings["efsdp"].gbps == layout.rings["cp"].gbps


def _dgx(nodes: int):
    node = load_topology_file(NVSWITCH, "H100")
    return describe_cluster(node, nodes, Network(bandwidth_gbps=400.0, latency_us=3.0, source="config"), "H100")


# Llama 3 8B at 131,072 tokens as `workloads.inspect.model_spec` measures it on the meta device.
LLAMA3_8B_131K = ModelSpec(
    name="orchestrator.workloads.llama:build", params=8030261248, blocks=32, block_class="DecoderLayer",
    block_params=218112000, root_params=1050677248, hidden=4096, heads=32, kv_heads=8, vocab=128256, seq=131072,
    forward_flops_per_token=83728793600.0, block_forward_flops_per_token=2583691264.0,
    block_activation_bytes={"none": 48604643328.0, "selective": 46456635392.0, "full": 2147483648.0},
    root_activation_bytes=73687105544.0,
    backward_transient_bytes={"none": 134486163456.0, "selective": 134486163456.0, "full": 134486163456.0},
    tp_sharded_activation_fraction=0.7293594805082735, tp_sharded_params=6979321856, tp_plan=True,
    tied_embeddings=False, pipeline_ends=True, tp_colwise_per_block=5, fp32_norms_per_block=2,
    tp_rowwise_per_block=2)


@pytest.mark.slow
def test_llama3_8b_at_131k_tokens_on_four_dgx_nodes_plans_cp_inside_the_nodes():
    cfg = load_config(ROOT / "jobs" / "llama3-8b-dgx-h100.yaml", ["model.block_size=131072"])
    plan = plan_job(cfg, _dgx(4), LLAMA3_8B_131K)
    assert plan.fits and plan.mesh.cp > 1
    for group in plan.mesh.groups()["cp"]:
        assert len({plan.ranks[rank].node for rank in group}) == 1, group
    assert plan.to_dict()["mesh"]["cp"] == plan.mesh.cp and "cp" in plan.to_dict()["groups"]
    text = "\n".join(plan.explanation)
    assert "cp: NVLink island (node 0)" in text
    assert f"context parallelism: cp={plan.mesh.cp}, because nothing fits without it" in text
    # Forced to cp=1 it does not fit (it needs about 245 GB a rank), and the plan says what would.
    forced = plan_job(load_config(ROOT / "jobs" / "llama3-8b-dgx-h100.yaml",
                                  ["model.block_size=131072", "parallel.cp=1"]), _dgx(4), LLAMA3_8B_131K)
    assert not forced.fits and forced.memory_per_rank.total > 200e9 and forced.mesh.cp == 1
    assert "without the forced choices" in forced.reason and "cp=" in forced.reason
    # What a rehearsal compares: each attention layer gathers K and V, one call each of 131,072 x 8 K/V
    # heads x 128 x 2 B (268,435,456 B) per micro-batch, twice under recomputation, and reduce-scatters
    # their gradients once.
    rows = {(t.op, t.axis): t for t in predicted_traffic(job_context(cfg, _dgx(4), LLAMA3_8B_131K), plan)}
    gathers = rows[("all_gather", "cp")]
    assert gathers.bytes == gathers.count * 268435456 * plan.micro_batch_size
    assert gathers.count == 2 * plan.grad_accum_steps * 32 * (1 if plan.recompute == Recompute.none else 2)
    assert rows[("reduce_scatter", "cp")].count == 2 * plan.grad_accum_steps * 32
    assert ("reduce_scatter", "dp_shard_cp") in rows


@pytest.mark.slow
def test_qwen3_moe_on_nvswitch_nodes_keeps_every_expert_group_inside_one_island():
    cfg = load_config(None, ["model.factory=orchestrator.workloads.llama:build", "model.block_size=4096",
                             "train.global_batch_size=64"])
    plan = plan_job(cfg, _dgx(2), qwen3_30b_a3b())
    assert plan.fits and plan.mesh.ep > 1
    for group in plan.mesh.groups()["ep"]:
        assert len({plan.ranks[rank].node for rank in group}) == 1, group
    text = "\n".join(plan.explanation)
    assert "ep: NVLink island (node 0)" in text and "factorisations: dense pp=1 x dp_replicate=" in text
    assert f"experts: ep={plan.mesh.ep}, faster: the best FSDP-only experts (ep=1) plan" in text
    # Each all-to-all sends the rank's rows: micro-batch x 4096 tokens x top 8 x 2048 x 2 B, four per layer.
    rows = {(t.op, t.axis): t for t in predicted_traffic(job_context(cfg, _dgx(2), qwen3_30b_a3b()), plan)}
    sent = plan.micro_batch_size * 4096 * 8 // plan.mesh.tp * 2048 * 2
    assert rows[("all_to_all", "ep")].bytes == rows[("all_to_all", "ep")].count * sent
    assert rows[("all_to_all", "ep")].count == plan.grad_accum_steps * 48 * (
        6 if plan.recompute == Recompute.full else 4)
    # Forced across the two nodes, the routing is node-limited: one group per island.
    wide = plan_job(load_config(None, ["model.factory=orchestrator.workloads.llama:build", "model.block_size=4096",
                                       "train.global_batch_size=64", "parallel.ep=16"]), _dgx(2), qwen3_30b_a3b())
    assert wide.mesh.ep == 16
    assert "routing is node-limited: 2 groups (one per island), each token to at most 2" in "\n".join(
        wide.explanation)
    with pytest.raises(PlanError, match=r"key 'parallel.ep': must divide the 128 routed experts.*got 3"):
        plan_job(replace(cfg, parallel=replace(cfg.parallel, ep=3)), _dgx(2), qwen3_30b_a3b())
    with pytest.raises(PlanError, match=r"key 'parallel.ep': .* is dense"):
        plan_job(replace(cfg, parallel=replace(cfg.parallel, ep=2)), _dgx(4), LLAMA3_8B_131K)


@pytest.mark.slow
def test_a_pcie_box_chooses_the_fsdp_only_experts_where_they_move_fewer_bytes():
    # A small Mixtral-shaped model: 8 experts of width 512 at hidden 1024, top 2, 8 blocks, on 8 RTX 4090
    # joined by PCIe alone. By hand, per layer and step at micro-batch 8 (one micro-step under zero2):
    # FSDP-only gathers the 8 x 3 x 1024 x 512 = 12.6e6 expert parameters once (25 MB in bf16) and
    # reduce-scatters their fp32 gradients (50 MB), 7/8 of 75.5 MB = 66 MB on the wire; ep=2 sends
    # 8 x 2048 tokens x top 2 x 1024 x 2 B x 1/2 = 33.5 MB in each of 4 all-to-alls, 134 MB, twice as
    # much, and its busiest rank computes a quarter more of the routed rows.
    spec = moe_spec("mini-mixtral", hidden=1024, blocks=8, heads=16, kv_heads=4, vocab=32000, seq=2048, experts=8,
                    top_k=2, expert_hidden=512, attention=2 * 1024 * 1024 + 2 * 1024 * 256)
    cfg = load_config(None, ["model.factory=orchestrator.workloads.llama:build", "model.block_size=2048",
                             "train.global_batch_size=64"])
    node = load_topology_file(PCIE, "RTX 4090")
    topo = describe_cluster(node, 1, Network(25.0, 5.0), "RTX 4090")
    plan = plan_job(cfg, topo, spec)
    assert plan.fits and plan.mesh.ep == 1
    assert "experts: FSDP-only (ep=1), faster: the best ep>1 plan" in "\n".join(plan.explanation)
    forced = plan_job(replace(cfg, parallel=replace(cfg.parallel, ep=2, strategy=Strategy.zero2,
                                                    recompute=Recompute.none, dp_shard="auto")), topo, spec)
    assert forced.step_time.total_s > plan.step_time.total_s


def test_expert_groups_take_the_nvlink_pairs_a_blind_layout_misses():
    # Four GPUs: NVLink joins 0-2 and 1-3 (50 GB/s), PCIe the rest (10 GB/s). ep=2 over dp_shard=4:
    # the aware layout makes each expert group an NVLink pair; device order pairs 0-1 over PCIe.
    links = tuple((a, b, 50.0 if (a, b) in ((0, 2), (1, 3)) else 10.0, 1.0, "nvlink" if (a, b) in ((0, 2), (1, 3))
                   else "pcie") for a in range(4) for b in range(a + 1, 4))
    wirings = Wirings(unique=(NodeWiring(devices=(0, 1, 2, 3), links=links),), node_index=(0,), devices_per_node=4)
    aware = cluster_layout(wirings, Mesh(1, 4, 1, ep=2), True, routes_experts=True)
    blind = cluster_layout(wirings, Mesh(1, 4, 1, ep=2), False, routes_experts=True)
    assert {frozenset(aware.layouts[0].order[i:i + 2]) for i in (0, 2)} == {frozenset((0, 2)), frozenset((1, 3))}
    assert aware.rings["ep"].gbps == 50.0 and blind.rings["ep"].gbps == 10.0


@pytest.mark.slow
def test_cp_crosses_islands_only_where_nothing_inside_one_fits_and_says_why():
    # Nodes of 4 A100 40GB: cp=4 inside a node still needs 65 GB a rank, so cp spans nodes.
    node = load_topology_file(ROOT / "tests" / "fixtures" / "topology" / "topo_4x_a100_nv4_nccltests331.txt",
                              "A100-40GB")
    cfg = load_config(ROOT / "jobs" / "llama3-8b-dgx-h100.yaml", ["model.block_size=131072", "cluster.gpu=A100-40GB"])
    plan = plan_job(cfg, describe_cluster(node, 8, Network(200.0, 3.0), "A100-40GB"), LLAMA3_8B_131K)
    assert plan.fits and plan.mesh.cp > 4
    text = "\n".join(plan.explanation)
    assert "cp across NVLink islands: no plan with its groups inside one island of 4 devices fits" in text
    assert "cp: NVLink island (4 per node) and NIC across" in text


def test_ulysses_term_trades_q_k_v_and_the_output_forward_and_backward_per_layer():
    mesh = Mesh(1, 1, 1, cp=2)
    ctx = dense_context(on_gpu=True)
    term = context_parallel_term(ctx, laid_out(mesh, {"cp": 2}),
                                 candidate(mesh, Strategy.zero3, cp_attention=CpAttention.ulysses))
    # A rank's q (and k, v, output): 1 x 500 tokens x 10 heads x 100 x 4 B = 2e6 B; each all-to-all
    # sends half of it to the other rank inside the node (10 GB/s, 1 us): 8 us launch + 1 us + 1e6 B /
    # 10e9 = 109 us. Four forward and four backward per block, 3 blocks: 24 x 109 us, unhidden.
    assert term.parts == {"cp head all-to-all": pytest.approx(24 * 109e-6)}
    assert term.exposed_s == pytest.approx((24 * 109e-6,))
    # Recomputed attention trades the forward four again.
    again = context_parallel_term(ctx, laid_out(mesh, {"cp": 2}), replace(
        candidate(mesh, Strategy.zero3, cp_attention=CpAttention.ulysses),
        choice=SimpleNamespace(mesh=mesh, micro_batch=1, recompute=Recompute.selective)))
    assert again.parts == {"cp head all-to-all": pytest.approx(36 * 109e-6)}


def test_ulysses_repeats_k_v_heads_that_do_not_divide_by_cp_and_keeps_no_gathered_kv():
    shape = dense_context(on_gpu=True).shape
    assert ulysses_tensor_bytes(shape, 1, 1, 2, 4) == (2e6, 2e6)
    # The kernel keeps the head-layout tensors, the sizes of the sequence-layout ones: nothing
    # more kept; one layer's send and receive copies of q, k, v and the output are the transient.
    assert ulysses_kept_bytes(shape, 1, 1, 2, "none", 4, 3) == (0.0, 8e6)
    # 2 K/V heads at cp=5 are repeated to the 10 query heads: 200 tokens x 8 more heads x 100 x 4 B
    # for each of k and v, kept by each of 3 blocks without recomputation.
    gqa = ModelShape.from_spec(replace(SMALL_MOE, experts=None, kv_heads=2))
    assert ulysses_tensor_bytes(gqa, 1, 1, 5, 4) == (8e5, 8e5)
    assert ulysses_kept_bytes(gqa, 1, 1, 5, "none", 4, 3) == (3 * 2 * 200 * 8 * 100 * 4, 4 * 8e5)
    assert ulysses_kept_bytes(gqa, 1, 1, 5, "full", 4, 3)[0] == 0.0
    assert ulysses_problem(10, 2, 4) == "ulysses attention needs the rank's 10 attention heads to divide by cp=4"
    assert ulysses_problem(10, 2, 5) is None and ulysses_problem(8, 3, 2) is not None


def test_the_search_prices_both_attentions_and_keeps_ulysses_where_k_v_heads_are_many():
    cfg = load_config(ROOT / "jobs" / "llama3-8b-dgx-h100.yaml", ["model.block_size=131072"])
    mha = replace(LLAMA3_8B_131K, kv_heads=32)  # Llama 2's multi-head attention at Llama 3's size
    plan = plan_job(cfg, _dgx(4), mha)
    assert plan.fits and plan.mesh.cp > 1 and plan.execution.cp_attention == CpAttention.ulysses
    line = next(line for line in plan.explanation if line.startswith("context-parallel attention"))
    assert re.fullmatch(r"context-parallel attention: ulysses \([\d.]+ ms per step\), faster than allgather_kv "
                        r"\([\d.]+ ms per step\) on the cp group's links", line), line
    assert plan.to_dict()["execution"]["cp_attention"] == "ulysses"
    # The runners-up with cp name their attention too (the text's alternatives and plan.json).
    priced = [a for a in plan.alternatives if a.step_time_s is not None]
    assert priced and all((a.cp_attention is not None) == (a.mesh.cp > 1) for a in priced)
    assert Plan.from_dict(plan.to_dict()).alternatives == plan.alternatives
    assert all("cp_attention" not in a for a in plan.to_dict()["alternatives"] if a["mesh"].get("cp", 1) == 1)
    # What a rehearsal compares: 8 all-to-alls per attention layer and micro-batch (12 recomputed), of
    # the rank's q, k, v and output: 131,072 / cp tokens x 32 heads x 128 x 2 B each; no K/V gather.
    rows = {(t.op, t.axis): t for t in predicted_traffic(job_context(cfg, _dgx(4), mha), plan)}
    passes = plan.grad_accum_steps * 32 * (2 if plan.recompute == Recompute.none else 3)
    trades = rows[("all_to_all", "cp")]
    assert trades.count == 4 * passes
    assert trades.bytes == passes * 4 * plan.micro_batch_size * 131072 // plan.mesh.cp * 32 * 128 * 2
    assert ("all_gather", "cp") not in rows
    # Llama 3's 8 K/V heads: the all-gather moves little more, is simpler, and is kept; the line says
    # what each costs. Forced, Ulysses is planned and said so.
    gqa = plan_job(cfg, _dgx(4), LLAMA3_8B_131K)
    assert gqa.execution.cp_attention == CpAttention.allgather_kv and "cp_attention" not in gqa.to_dict()["execution"]
    assert any(re.fullmatch(r"context-parallel attention: allgather_kv \([\d.]+ ms per step\)(, faster than| over) "
                            r"ulysses .*", line) for line in gqa.explanation), gqa.explanation
    forced = plan_job(load_config(ROOT / "jobs" / "llama3-8b-dgx-h100.yaml",
                                  ["model.block_size=131072", "parallel.cp_attention=ulysses"]), _dgx(4),
                      LLAMA3_8B_131K)
    assert forced.execution.cp_attention == CpAttention.ulysses
    assert any(line.startswith("context-parallel attention: ulysses (parallel.cp_attention=ulysses; ")
               for line in forced.explanation)


def test_ulysses_that_cannot_split_the_heads_and_a_typo_are_one_line():
    cfg = load_config(None, ["parallel.cp=2", "parallel.cp_attention=ulysses", "model.n_head=3", "model.n_embd=96",
                             "cluster.num_workers=2"])
    with pytest.raises(PlanError, match=re.escape(
            "under parallel.cp=2, parallel.cp_attention=ulysses: ulysses attention needs the rank's 3 attention "
            "heads to divide by cp=2")):
        plan_job(cfg, ClusterTopology(nodes=[cpu_node(2)]), measure_model(cfg))
    with pytest.raises(ConfigError, match=re.escape(
            "key 'parallel.cp_attention': expected one of auto, allgather_kv, ulysses, got 'ulyses'")):
        load_config(None, ["parallel.cp_attention=ulyses"])
