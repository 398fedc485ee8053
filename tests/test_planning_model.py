"""Model arithmetic and memory model against the papers' published figures."""

from __future__ import annotations

import pytest

from orchestrator.planning.comm import all_gather, bus_factor, reduce_scatter, ring_all_reduce, tree_all_reduce
from orchestrator.planning.memory import ZERO_MIXED_PRECISION, byte_layout, model_states, rank_memory
from orchestrator.planning.model_math import (
    ModelShape,
    activation_bytes_per_layer,
    flops_per_step,
    narayanan_params,
    param_count,
)
from orchestrator.planning.sync import auto_bucket_mb, powersgd_ratio

# Narayanan et al. 2021, Table 1: (printed billions, heads, hidden, layers); V=51200, s=2048.
NARAYANAN_TABLE_1 = [
    (1.7, 24, 2304, 24), (3.6, 32, 3072, 30), (7.5, 32, 4096, 36), (18.4, 48, 6144, 40),
    (39.1, 64, 8192, 48), (76.1, 80, 10240, 60), (145.6, 96, 12288, 80), (310.1, 128, 16384, 96),
    (529.6, 128, 20480, 105), (1008.0, 160, 25600, 128),
]


@pytest.mark.parametrize("billions,heads,hidden,layers", NARAYANAN_TABLE_1)
def test_narayanan_table_1_parameter_counts(billions, heads, hidden, layers):
    shape = ModelShape(layers=layers, hidden=hidden, heads=heads, vocab=51200, seq=2048)
    count = param_count(shape)
    # The paper prints one decimal: every row must round to it; rows whose rounding step is
    # finer than 0.5% must also be within 0.5%.
    assert round(count / 1e9, 1) == billions
    if 0.05 / billions < 0.005:
        assert abs(count / 1e9 / billions - 1) < 0.005
    # Eq. 2 counts everything but the final LayerNorm's weight and bias.
    assert count - narayanan_params(shape) == pytest.approx(2 * hidden, abs=1e-3 * hidden)


def test_param_count_matches_the_torch_model():
    torch = pytest.importorskip("torch")
    from orchestrator.workloads.gpt import GPT, GPTConfig

    for bias in (True, False):
        cfg = GPTConfig(n_layer=3, n_head=4, n_embd=64, vocab_size=97, block_size=32, bias=bias)
        torch.manual_seed(0)
        shape = ModelShape(layers=3, hidden=64, heads=4, vocab=97, seq=32, bias=bias)
        assert param_count(shape) == GPT(cfg).num_params()


def test_flops_match_narayanan_eq_3():
    shape = ModelShape(layers=36, hidden=4096, heads=32, vocab=51200, seq=2048)
    B, s, l, h, V = 512, 2048, 36, 4096, 51200
    full = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    assert flops_per_step(shape, B, "full") == pytest.approx(full, rel=1e-12)
    none = 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))
    assert flops_per_step(shape, B, "none") == pytest.approx(none, rel=1e-12)
    assert flops_per_step(shape, B, "none") < flops_per_step(shape, B, "selective") < flops_per_step(shape, B, "full")


def test_activation_bytes_follow_korthikanti():
    # GPT-3 175B of the paper: s=2048, b=1, h=12288, a=96, t=8.
    shape = ModelShape(layers=96, hidden=12288, heads=96, vocab=51200, seq=2048)
    sbh = 2048 * 12288
    assert activation_bytes_per_layer(shape, 1) == pytest.approx(sbh * (34 + 5 * 96 * 2048 / 12288))
    assert activation_bytes_per_layer(shape, 1, tp=8) == \
        pytest.approx(sbh * (10 + 24 / 8 + 5 * 96 * 2048 / (12288 * 8)))
    assert activation_bytes_per_layer(shape, 1, tp=8, sequence_parallel=True) == \
        pytest.approx(sbh * (34 / 8 + 5 * 96 * 2048 / (12288 * 8)))
    assert activation_bytes_per_layer(shape, 1, tp=8, sequence_parallel=True, recompute="selective") == \
        pytest.approx(sbh * 34 / 8)
    assert activation_bytes_per_layer(shape, 1, tp=8, recompute="full") == pytest.approx(2 * sbh)


@pytest.mark.parametrize("strategy,gb", [("ddp", 120.0), ("zero1", 31.4), ("zero2", 16.6), ("zero3", 1.88)])
def test_zero_table_1(strategy, gb):
    # Rajbhandari et al. 2020, Table 1: 7.5B parameters, 64 GPUs, fp16 mixed precision (K=12).
    w, g, k = model_states(strategy, 7.5e9, 64, ZERO_MIXED_PRECISION)
    assert (w + g + k) / 1e9 == pytest.approx(gb, rel=0.01)


@pytest.mark.parametrize(
    "precision,device,half,activation,gathered",
    [("auto", "gpu", "bf16", 2, 2), ("bf16", "gpu", "bf16", 2, 2), ("fp16", "gpu", "fp16", 2, 2),
     ("fp32", "gpu", None, 4, 4), ("auto", "cpu", None, 4, 4), ("fp32", "cpu", None, 4, 4),
     ("bf16", "cpu", "bf16", 2, 2)],
)
def test_runtime_byte_layouts(precision, device, half, activation, gathered):
    # fp32 master weights, gradients and Adam moments always; 16-bit autocast (bf16/fp16, or
    # auto on GPU, as the runtime's resolve_precision) makes the activations and FSDP2's
    # gathered weights (its param_dtype) 2 bytes.
    lay = byte_layout(precision, device)
    assert (lay.weights, lay.grads, lay.optimizer) == (4, 4, 8)
    assert (lay.half, lay.activation, lay.compute) == (half, activation, gathered)


def test_unknown_precision_is_rejected():
    with pytest.raises(ValueError, match="precision must be one of auto, bf16, fp16, fp32, got 'fp8'"):
        byte_layout("fp8", "cpu")


def test_bf16_fsdp_gathers_and_holds_half_the_bytes_of_fp32():
    from orchestrator.planning.memory import runtime_states
    from orchestrator.planning.model_math import param_count

    shape = ModelShape(layers=12, hidden=768, heads=12, vocab=50304, seq=1024)
    psi, n = param_count(shape), 8
    bf16, fp32 = byte_layout("bf16"), byte_layout("fp32")
    for strategy in ("zero2", "zero3", "hsdp"):
        half, full = runtime_states(strategy, shape, 1, n, bf16), runtime_states(strategy, shape, 1, n, fp32)
        # The fp32 shards (master weights, gradients, Adam) are the same bytes...
        assert (half.params, half.grads, half.optimizer) == (full.params, full.grads, full.optimizer)
        assert half.params + half.grads + half.optimizer == pytest.approx(16 * psi / n)
        # ...while what FSDP2 gathers, and the gradients autograd computes for it, halve.
        assert half.gathered == pytest.approx(full.gathered / 2)
        assert half.unsharded_grads == pytest.approx(full.unsharded_grads / 2)
    assert runtime_states("zero2", shape, 1, n, bf16).gathered == pytest.approx(2 * psi)
    # DDP and ZeRO-1 keep fp32 weights under autocast and gather nothing.
    assert runtime_states("ddp", shape, 1, n, bf16) == runtime_states("ddp", shape, 1, n, fp32)


def test_rank_memory_shrinks_with_sharding_and_recompute():
    shape = ModelShape(layers=24, hidden=2048, heads=16, vocab=50304, seq=2048)
    lay = byte_layout("bf16")
    totals = [rank_memory(s, shape, 1, 8, 4, "none", lay, 25 * 2**20).total for s in ("ddp", "zero1", "zero2", "zero3")]
    assert totals == sorted(totals, reverse=True)
    acts = [rank_memory("zero3", shape, 1, 8, 4, rc, lay, 0).activations for rc in ("none", "selective", "full")]
    assert acts == sorted(acts, reverse=True)


def test_collective_costs():
    n, bw = 1e9, 100.0
    assert bus_factor("all_reduce", 8) == pytest.approx(1.75)
    ar = ring_all_reduce(n, 8, bw, 0.0)
    assert ar == pytest.approx(1.75 * n / 100e9, rel=1e-3)
    assert reduce_scatter(n, 8, bw, 0.0) + all_gather(n, 8, bw, 0.0) == pytest.approx(ar, rel=1e-3)
    # Tree wins for small messages on many ranks (latency), ring for large ones (bandwidth).
    assert tree_all_reduce(1e3, 1024, bw, 5.0) < ring_all_reduce(1e3, 1024, bw, 5.0)
    assert ring_all_reduce(1e10, 8, bw, 5.0) < tree_all_reduce(1e10, 8, bw, 5.0)
    assert ring_all_reduce(n, 1, bw, 5.0) == 0.0


def test_bucket_and_powersgd():
    # A faster link needs a bigger bucket to amortise the same latency.
    assert auto_bucket_mb(4e9, 64, 400.0, 5.0) > auto_bucket_mb(4e9, 64, 10.0, 5.0)
    assert 1.0 <= auto_bucket_mb(1e6, 2, 10.0, 2.0) <= 256.0
    shape = ModelShape(layers=12, hidden=768, heads=12, vocab=50304, seq=1024)
    assert 0 < powersgd_ratio(shape) < 0.05


def test_runtime_zero2_keeps_a_weight_shard_at_rest_and_the_gathered_weights_as_buffers():
    from orchestrator.planning.memory import runtime_states
    from orchestrator.planning.model_math import param_count

    shape = ModelShape(layers=12, hidden=768, heads=12, vocab=50304, seq=1024)
    lay, n = byte_layout("fp32"), 8
    psi = param_count(shape)
    z2, z3 = runtime_states("zero2", shape, 1, n, lay), runtime_states("zero3", shape, 1, n, lay)
    # At rest FSDP2 holds shards only, under zero2 as under zero3.
    assert (z2.params, z2.grads, z2.optimizer) == pytest.approx((4 * psi / n, 4 * psi / n, 8 * psi / n))
    assert (z3.params, z3.grads, z3.optimizer) == pytest.approx((z2.params, z2.grads, z2.optimizer))
    # zero2 holds every unit gathered between forward and backward; zero3 the root and two blocks.
    assert z2.gathered == pytest.approx(4 * psi)
    assert z3.gathered == pytest.approx(4 * (psi - 10 * (psi - (50304 + 1024) * 768 - 2 * 768) / 12))
    m2 = rank_memory("zero2", shape, 1, n, 1, "none", lay, 0, on_gpu=False)
    assert m2.params == round(4 * psi / n) and m2.buffers >= round(4 * psi)
    # The ZeRO paper's ZeRO-2 (DeepSpeed) keeps the full 16-bit weights at rest instead.
    w, _, _ = model_states("zero2", psi, n, lay)
    assert w == 4 * psi


@pytest.fixture
def fake_world_of_4():
    """A 4-rank process group in this one process (torch's fake backend): DTensor shards a
    model as it would on 4 GPUs, and rank 0's local shards are what one rank holds."""
    pytest.importorskip("torch")
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("bias", [True, False])
def test_tensor_parallelism_replicates_the_vocabulary_embedding_as_the_runtime_does(fake_world_of_4, bias):
    # What one tensor-parallel rank holds is counted off the runtime's own sharding of the
    # model (apply_tensor_parallel, DTensor local shards), not off the planner's formula.
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from orchestrator.planning.memory import params_per_tp_rank
    from orchestrator.runtime.tensor_parallel import apply_tensor_parallel
    from orchestrator.workloads.gpt import GPT, GPTConfig

    shape = ModelShape(layers=2, hidden=128, heads=4, vocab=50304, seq=64, bias=bias)
    for tp, mesh in ((2, init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"]),
                     (4, init_device_mesh("cpu", (4,)))):
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=128, vocab_size=50304, block_size=64, bias=bias))
        whole = sum(p.numel() for p in model.parameters())
        apply_tensor_parallel(model, mesh)
        held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
        assert params_per_tp_rank(shape, tp) == held, tp
        # The tied 50304 x 128 embedding is not split: every rank keeps it whole.
        assert held > 50304 * 128 + (whole - 50304 * 128) / tp


def test_gloo_collectives_follow_torch_process_group_gloo():
    from orchestrator.planning.comm import gloo_all_gather, gloo_all_reduce, gloo_reduce_scatter

    n, bw, lat, mem = 16e6, 3.0, 50.0, 20.0
    ar = gloo_all_reduce(n, 2, bw, lat, mem)
    # reduce_scatter_tensor is a clone plus a whole all-reduce: never cheaper than the all-reduce.
    assert gloo_reduce_scatter(n, 2, bw, lat, mem) > ar
    assert gloo_all_gather(n, 2, bw, lat, mem) > 0
    # The CPU's reduction is part of the cost: slower memory, slower all-reduce.
    assert gloo_all_reduce(n, 2, bw, lat, 5.0) > ar
    assert gloo_all_reduce(n, 1, bw, lat, mem) == 0.0 == gloo_all_gather(0, 4, bw, lat, mem)


def _h100_job(precision: str):
    """(JobContext, topology) of a 1.3B GPT with 64 sequences per step on one 8-GPU H100 node."""
    from pathlib import Path

    from orchestrator.config import load_config
    from orchestrator.planning import job_context
    from orchestrator.planning.describe import describe_cluster
    from orchestrator.topology.files import load_topology_file
    from orchestrator.topology.model import Network

    fixture = Path(__file__).resolve().parent / "fixtures" / "topology" / "topo_h100_8gpu_mlengineering.txt"
    node = load_topology_file(fixture, "H100")
    topo = describe_cluster(node, 1, Network(bandwidth_gbps=50.0, latency_us=10.0), "H100")
    model = ["model.n_layer=24", "model.n_head=16", "model.n_embd=2048", "model.vocab_size=50304",
             "model.block_size=2048", "train.global_batch_size=64", f"train.precision={precision}"]
    return job_context(load_config(None, model), topo), topo


def test_zero1_with_tensor_parallelism_is_priced_as_the_zero2_it_runs_as():
    from orchestrator.planning.cost import Choice, estimate
    from orchestrator.planning.layout import Wirings, cluster_layout
    from orchestrator.planning.mesh import Mesh

    ctx, topo = _h100_job("bf16")
    mesh = Mesh(dp_replicate=1, dp_shard=4, tp=2)
    cl = cluster_layout(Wirings.of(topo), mesh)
    z1, z2 = (estimate(ctx, cl, Choice(s, mesh, micro_batch=1, recompute="none")) for s in ("zero1", "zero2"))
    assert z1.comm_parts == z2.comm_parts and z1.memory == z2.memory
    assert z1.comm_parts["param all-gather"] > 0


# All-gathers of the whole model and reduce-scatters of all gradients per step, for 8
# micro-steps reducing every one: zero2 gathers once and keeps the weights; zero3 gathers for
# forward and backward.
@pytest.mark.parametrize("strategy,gathers,scatters", [("zero2", 1, 8), ("zero3", 16, 8)])
def test_fsdp_all_gather_moves_bf16_weights_and_reduce_scatter_fp32_gradients(strategy, gathers, scatters):
    from orchestrator.choices import AccumSync
    from orchestrator.planning.cost import Choice, estimate
    from orchestrator.planning.layout import Wirings, cluster_layout
    from orchestrator.planning.mesh import Mesh

    jobs = {p: _h100_job(p) for p in ("bf16", "fp32")}
    mesh = Mesh(dp_replicate=1, dp_shard=8, tp=1)
    cl = cluster_layout(Wirings.of(jobs["fp32"][1]), mesh)
    choice = Choice(strategy, mesh, micro_batch=1, recompute="none", accum_sync=AccumSync.per_micro_step)
    est = {p: estimate(ctx, cl, choice) for p, (ctx, _) in jobs.items()}
    # Weights cross the wire in FSDP2's param_dtype: half the all-gather bytes under bf16...
    assert est["bf16"].comm_parts["param all-gather"] < 0.55 * est["fp32"].comm_parts["param all-gather"]
    # ...and the same (fp32) gradient reduce-scatter.
    rs, ag = est["bf16"].comm_parts["grad reduce-scatter"], est["bf16"].comm_parts["param all-gather"]
    assert rs == pytest.approx(est["fp32"].comm_parts["grad reduce-scatter"])
    # One collective per FSDP unit (24 blocks and the root), each a ring over the 8 GPUs of the
    # NVSwitch node: 450 GB/s a direction per H100 (NVLink 4, 900 GB/s bidirectional), and
    # (n-1)/n of the buffer for an all-gather or a reduce-scatter alike (nccl-tests' busbw).
    psi = jobs["bf16"][0].params
    per_unit = {bytes_: 7 / 8 * bytes_ * psi / 25 / 450e9 for bytes_ in (2, 4)}
    rs_one, ag_one = rs / scatters / 25, ag / gathers / 25
    fp32_ag_one = est["fp32"].comm_parts["param all-gather"] / gathers / 25
    # The same fp32 bytes cost the same gathered or scattered, and a bf16 gather saves exactly
    # the transfer of the 2 bytes per parameter it does not send (the latency is the same).
    assert fp32_ag_one == pytest.approx(rs_one, rel=1e-6)
    assert rs_one - ag_one == pytest.approx(per_unit[4] - per_unit[2], rel=0.01)
    # What is left over the transfer is one ring's latency: tens of microseconds on NVLink.
    assert 0 < rs_one - per_unit[4] < 100e-6
    # Memory: fp32 shards of 16 bytes per parameter either way; bf16 gathers make the buffers smaller.
    for p in ("bf16", "fp32"):
        m = est[p].memory
        assert m.params + m.grads + m.optimizer == pytest.approx(16 * psi / 8, rel=1e-6)
    assert est["bf16"].memory.buffers < est["fp32"].memory.buffers


def _dgx_a100_group(nodes: int, per_node: int = 8):
    from orchestrator.planning.comm import GroupLinks

    # One data-parallel group of `per_node` ranks on each of `nodes` DGX A100s (NVSwitch ring,
    # 25 GB/s of the node's 200 GB/s network per GPU).
    return GroupLinks(size=nodes * per_node, per_node=per_node, intra_gbps=230.0, intra_lat_us=1.0,
                      inter_gbps=25.0 * per_node, inter_lat_us=3.0)


def test_nccl_ring_latency_follows_nccls_tuner():
    from orchestrator.planning.comm import NCCL_RING_PROTOCOLS, nccl_ring_seconds

    simple, ll128 = NCCL_RING_PROTOCOLS
    g = _dgx_a100_group(nodes=2)

    def tuner_us(base, nvlink_step, net_step, ranks, nodes):
        # NCCL's ring model for an all-gather or reduce-scatter (src/graph/tuning.cc,
        # ncclTopoTuneModel): baseLat + (nRanks-1 - (nNodes-1)) intra steps + (nNodes-1) network steps.
        return base + (ranks - 1 - (nodes - 1)) * nvlink_step + (nodes - 1) * net_step

    # tuning.cc's figures, Ring row: Simple baseLat 8.4 us, NVLink 3.4 us, network 14 us a step;
    # LL128 14 us, 1.9 us, 4 us. A 16-rank ring over two nodes: 14 steps inside them, one across.
    nccl = {"simple": tuner_us(8.4, 3.4, 14.0, 16, 2), "ll128": tuner_us(14.0, 1.9, 4.0, 16, 2)}
    # On top of the tuner's figures the planner charges one fixed cost per collective (kernel
    # launch, proxy hand-off): the same offset for both protocols and every ring, microseconds.
    launch = simple.latency_s(g) - nccl["simple"] * 1e-6
    assert ll128.latency_s(g) - nccl["ll128"] * 1e-6 == pytest.approx(launch, abs=1e-9)
    assert 0 <= launch <= 10e-6
    # A small message goes at LL128's shorter steps, a large one at Simple's full bandwidth.
    wire = lambda n: 15 / 16 * n / (200.0 * 1e9)  # noqa: E731
    assert nccl_ring_seconds(64e3, g) == pytest.approx(ll128.latency_s(g) + wire(64e3) * 128 / 120)
    assert nccl_ring_seconds(1e9, g) == pytest.approx(simple.latency_s(g) + wire(1e9))
    # The same bytes in FSDP's per-unit collectives pay the latency once per unit.
    assert nccl_ring_seconds(1e9, g, units=80) == pytest.approx(80 * nccl_ring_seconds(1e9 / 80, g))
    # At hundreds of nodes a ring's latency is milliseconds: 1535 steps, 191 across the network.
    wide = _dgx_a100_group(nodes=192)
    assert simple.latency_s(wide) == pytest.approx(launch + tuner_us(8.4, 3.4, 14.0, 1536, 192) * 1e-6)
    assert tuner_us(8.4, 3.4, 14.0, 1536, 192) == pytest.approx(8.4 + 1344 * 3.4 + 191 * 14.0)
    assert simple.latency_s(wide) > 7e-3


def test_overlapped_collective_slows_the_compute_beside_it():
    from orchestrator.planning.cost import overlapped

    # The published figure, not the module's copy of it: training kernels measured 18.9% slower
    # on average while a collective overlaps them (arXiv 2507.03114, A100 and H100). Compute of
    # c seconds then takes 1.189 c; while a collective of x runs beside it, x / 1.189 of compute
    # gets done, so hiding x costs x - x / 1.189 = 0.189 / 1.189 x.
    slowed = 1.189
    # Hidden under compute, a collective still costs the slowdown it causes while it runs...
    assert overlapped(1.0, 10.0) == pytest.approx(0.189 / slowed, rel=1e-3)
    assert overlapped(2.0, 10.0) == pytest.approx(2 * 0.189 / slowed, rel=1e-3)
    # ...one that outlasts the compute is exposed by the difference...
    assert overlapped(10.0, 1.0) == pytest.approx(9.0)
    # ...and the two meet where the slowed compute ends with the collective: 1 s of compute
    # slowed to 1.189 s alongside a 1.189 s collective adds 0.189 s either way.
    assert overlapped(slowed, 1.0) == pytest.approx(0.189, rel=1e-3)
    # Never more than running the two one after the other, never less than the longer alone.
    for comm, compute in ((0.5, 1.0), (1.0, 1.0), (3.0, 1.0), (1e-4, 1.0)):
        assert max(comm, compute) <= compute + overlapped(comm, compute) <= comm + compute
    assert overlapped(0.0, 5.0) == 0.0


def test_wide_zero3_pays_per_unit_latency_copies_and_overlap():
    """FSDP2 across hundreds of nodes: one ring per unit and per phase, each with NCCL's latency;
    the copies out of each gathered unit; and compute slowed under the collectives it hides."""
    from orchestrator.planning.cost import Choice, estimate
    from orchestrator.planning.layout import Wirings, cluster_layout
    from orchestrator.planning.mesh import Mesh

    ctx, topo = _dgx_a100_job(nodes=64, layers=48)
    mesh = Mesh(dp_replicate=1, dp_shard=512, tp=1)
    cl = cluster_layout(Wirings.of(topo), mesh)
    est = estimate(ctx, cl, Choice("zero3", mesh, micro_batch=1, recompute="none"))
    # Two gathers and a reduce-scatter per micro-step, each in 49 rings (48 blocks, the root).
    # NCCL's tuner (tuning.cc) prices a 512-rank ring over 64 nodes at no less than LL128's
    # 14 us base, 448 NVLink steps of 1.9 us and 63 network steps of 4 us (Simple's are longer).
    accum = ctx.global_batch // 512
    latency = (14.0 + 448 * 1.9 + 63 * 4.0) * 1e-6
    assert est.comm_parts["param all-gather"] >= 2 * accum * 49 * latency
    assert est.comm_parts["grad reduce-scatter"] >= accum * 49 * latency
    # All of it hides under compute in bandwidth terms, yet the step is not free of it.
    comm = est.comm_parts["param all-gather"] + est.comm_parts["grad reduce-scatter"]
    assert comm < est.compute_s
    assert est.exposed_comm_s > 0.1 * comm


def _dgx_a100_job(nodes: int, layers: int):
    """(JobContext, topology) of a 39B-wide GPT with `layers` blocks, 16 sequences per node, on
    DGX A100 nodes."""
    from clusters import dgx_a100

    from orchestrator.config import load_config
    from orchestrator.planning import job_context

    topo = dgx_a100(nodes)
    model = [f"model.n_layer={layers}", "model.n_head=64", "model.n_embd=8192", "model.vocab_size=51200",
             "model.block_size=2048", f"train.global_batch_size={nodes * 16}", "train.precision=bf16"]
    return job_context(load_config(None, model), topo), topo


def test_gemm_efficiency_pays_for_partial_waves_and_low_intensity():
    from orchestrator.planning.compute import gemm_efficiency

    # 108 tiles of 256x128 fill one wave on an A100's 108 SMs; one tile more needs a second.
    full = gemm_efficiency(256 * 12, 128 * 9, 8192, sms=108, ridge_flop_per_byte=153)
    assert full == pytest.approx(1.0)
    over = gemm_efficiency(256, 128 * 109, 8192, sms=108, ridge_flop_per_byte=153)
    assert over == pytest.approx(109 / 216, rel=1e-3)
    # A matrix that hangs over its tiles pays for the whole tiles.
    assert gemm_efficiency(129, 128 * 108, 8192, sms=0, ridge_flop_per_byte=1) == pytest.approx(129 / 256)
    # A GEMM whose FLOPs per byte fall below the ridge point runs at the memory's pace.
    skinny = gemm_efficiency(256 * 108, 128, 16, sms=0, ridge_flop_per_byte=153)
    intensity = 2 * (256 * 108) * 128 * 16 / (2 * (256 * 108 * 16 + 16 * 128 + 256 * 108 * 128))
    assert skinny == pytest.approx(intensity / 153)


def test_a_large_models_gemms_stay_efficient_at_one_sequence_per_micro_batch():
    """Tensor parallelism over 8 and one 2048-token sequence leave a 145.6B GPT's GEMMs large:
    within 10% of what 8 sequences reach. A small model's GEMMs shrink into partial waves."""
    from orchestrator.planning.compute import DeviceSpeed, efficiency
    from orchestrator.planning.gpus import lookup

    a100 = lookup("A100")
    speed = DeviceSpeed(a100.name, a100.peak_tflops, a100.mem_gbps, a100.memory_bytes, a100.sms)
    big = [efficiency(2048 * b, 12288, 8, speed) for b in (1, 8)]
    assert big[0] > 0.9 * big[1]
    assert efficiency(256, 1024, 8, speed) < 0.3 * efficiency(2048, 1024, 1, speed)
    # A CPU slot keeps its saturating curve; a GPU without its speed cannot be priced.
    assert 0 < efficiency(256, 1024, 8, None, on_gpu=False) < 0.6
    with pytest.raises(ValueError, match="speed"):
        efficiency(2048, 1024, 1, None)


def test_elementwise_work_is_a_larger_share_of_a_narrow_model():
    from orchestrator.planning.compute import DeviceSpeed, elementwise_seconds, matmul_seconds

    speed = DeviceSpeed("A100", 312.0, 2039.0, 80 * 2**30, 108)
    share = {}
    for h in (2304, 12288):
        gemm = matmul_seconds(72 * h * h * 2048, speed, 0.6)  # one token-block's GEMMs, fwd and bwd
        share[h] = elementwise_seconds(2048, h, 1, 1, "none", 2, speed) / gemm
    # Bytes grow as h, FLOPs as h squared.
    assert share[2304] == pytest.approx(share[12288] * 12288 / 2304, rel=1e-9)
    assert 0.03 < share[2304] < 0.1
    # Tensor parallelism splits the GEMMs but not the norms and residual adds.
    assert elementwise_seconds(2048, 4096, 8, 1, "none", 2, speed) > \
        elementwise_seconds(2048, 4096, 1, 1, "none", 2, speed) / 8 * 4
    # Full recomputation runs forward's elementwise work twice.
    one, two = (elementwise_seconds(2048, 4096, 1, 1, r, 2, speed) for r in ("none", "full"))
    assert two == pytest.approx(one * 4 / 3)


def test_hierarchical_all_reduce_needs_two_levels():
    from orchestrator.planning.comm import GroupLinks, group_all_reduce

    n = 1e9
    inf = float("inf")
    one_node = GroupLinks(size=8, per_node=8, intra_gbps=400.0, intra_lat_us=2.0, inter_gbps=inf, inter_lat_us=0.0)
    flat, sched = group_all_reduce(n, one_node, "flat")
    # Nothing to split on one node or with one rank per node: the flat ring, and the schedule says why.
    assert group_all_reduce(n, one_node, "hierarchical") == (flat, f"{sched} (hierarchical degenerates to flat: "
                                                                    "the group is on one node)")
    spread = GroupLinks(size=4, per_node=1, intra_gbps=inf, intra_lat_us=0.0, inter_gbps=50.0, inter_lat_us=10.0)
    assert group_all_reduce(n, spread, "hierarchical")[1].endswith("(hierarchical degenerates to flat: "
                                                                  "the group has one member per node)")
    # Two nodes of 8 on a slow network, 10 GB: large enough that latency is under 0.1%.
    # Worked by hand from nccl-tests' bus factors: the flat ring moves 2(16-1)/16 of the buffer
    # over its slowest link, the 50 GB/s network: 375 ms. Hierarchical reduce-scatters and
    # all-gathers inside each node, 2 x 7/8 of it at 400 GB/s (43.75 ms), and all-reduces an
    # eighth between the nodes on 8 rings that share the network, 2 x 1/2 x 1.25 GB at
    # 6.25 GB/s each (200 ms): 243.75 ms.
    n = 1e10
    two = GroupLinks(size=16, per_node=8, intra_gbps=400.0, intra_lat_us=2.0, inter_gbps=50.0, inter_lat_us=10.0)
    hier, hsched = group_all_reduce(n, two, "hierarchical")
    assert hsched.startswith("hierarchical")
    assert hier == pytest.approx(0.24375, rel=0.01)
    assert group_all_reduce(n, two, "flat")[0] == pytest.approx(0.375, rel=0.01)
    auto, asched = group_all_reduce(n, two, "auto")
    assert asched.startswith("hierarchical") and auto == pytest.approx(0.24375, rel=0.01)
    # On a network as fast as NVLink the split costs more than it saves: flat 2 x 15/16 of
    # 10 GB at 400 GB/s is 46.9 ms; hierarchical 43.75 ms + 2 x 1/2 x 1.25 GB at 50 GB/s = 68.75 ms.
    fast = GroupLinks(size=16, per_node=8, intra_gbps=400.0, intra_lat_us=2.0, inter_gbps=400.0, inter_lat_us=10.0)
    auto, asched = group_all_reduce(n, fast, "auto")
    assert asched.startswith("flat") and auto == pytest.approx(0.046875, rel=0.01)
    assert group_all_reduce(n, fast, "hierarchical")[0] == pytest.approx(0.06875, rel=0.01)


def test_gloo_hierarchical_all_reduce_is_priced_from_gloo_collectives():
    from orchestrator.planning.comm import GroupLinks, gloo_all_reduce, group_all_reduce

    n, mem = 16e6, 20.0
    g = GroupLinks(size=4, per_node=2, intra_gbps=5.0, intra_lat_us=20.0, inter_gbps=1.0, inter_lat_us=50.0,
                   gloo_mem_gbps=mem)
    hier, sched = group_all_reduce(n, g, "hierarchical")
    assert sched == "hierarchical (gloo ring between nodes)"
    flat, fsched = group_all_reduce(n, g, "flat")
    assert fsched == "flat gloo ring"
    # the flat ring's bottleneck is the network: priced as a full-duplex wire, not one host's TCP
    assert flat < gloo_all_reduce(n, 4, 1.0, 50.0, mem)
    # On a 1 MB/s wire the wire is all that counts, and the two schedules' costs follow from
    # ring arithmetic alone: the flat ring of 4 moves 2 x 3/4 of the 16 MB over it (24 s); the
    # hierarchical one all-reduces half the buffer between 2 nodes on 2 rings that share the
    # wire, 2 x 1/2 x 8 MB at 0.5 MB/s each (16 s), plus gloo's in-node steps at 5 GB/s (ms).
    slow = GroupLinks(size=4, per_node=2, intra_gbps=5.0, intra_lat_us=20.0, inter_gbps=0.001, inter_lat_us=50.0,
                      gloo_mem_gbps=mem)
    flat, _ = group_all_reduce(n, slow, "flat")
    hier, _ = group_all_reduce(n, slow, "hierarchical")
    assert flat == pytest.approx(24.0, rel=0.01)
    assert hier == pytest.approx(16.0, rel=0.01)
    auto, asched = group_all_reduce(n, slow, "auto")
    assert asched.startswith("hierarchical") and auto == pytest.approx(16.0, rel=0.01)
    # With a wire as fast as the host's links, gloo's in-node reduce-scatter (a clone and a
    # whole all-reduce) and all-gather cost more than the flat ring saves: auto runs flat.
    even = GroupLinks(size=4, per_node=2, intra_gbps=5.0, intra_lat_us=20.0, inter_gbps=5.0, inter_lat_us=20.0,
                      gloo_mem_gbps=mem)
    auto, asched = group_all_reduce(n, even, "auto")
    assert asched == "flat gloo ring" and auto < group_all_reduce(n, even, "hierarchical")[0]


def _ddp_plan(nodes: int, *extra: str):
    from pathlib import Path

    from orchestrator.config import load_config
    from orchestrator.planning import plan_job
    from orchestrator.planning.describe import describe_cluster
    from orchestrator.topology.files import load_topology_file
    from orchestrator.topology.model import Network

    fixture = Path(__file__).resolve().parent / "fixtures" / "topology" / "topo_h100_8gpu_mlengineering.txt"
    topo = describe_cluster(load_topology_file(fixture, "H100"), nodes, Network(bandwidth_gbps=50.0, latency_us=10.0),
                            "H100")
    cfg = load_config(None, ["model.n_layer=12", "model.n_head=12", "model.n_embd=768", "model.block_size=1024",
                             f"train.global_batch_size={16 * nodes}", "parallel.strategy=ddp", "parallel.tp=1",
                             "parallel.sync=hierarchical", *extra])
    return plan_job(cfg, topo)


def test_forced_hierarchical_sync_says_what_runs():
    # Across two nodes the runtime's DDP hook runs it: the plan says hierarchical.
    two = _ddp_plan(2)
    assert two.sync.algorithm == "hierarchical"
    assert any(line.startswith("gradient sync: hierarchical") for line in two.explanation)
    # On one node it has no second level: the plan says flat, and why.
    one = _ddp_plan(1)
    assert one.sync.algorithm == "flat"
    assert any("hierarchical degenerates to flat: the group is on one node" in line for line in one.explanation)


def test_forced_hierarchical_sync_under_fsdp2_runs_flat():
    # FSDP2 has no comm hook: zero3's reduce-scatter is one flat group, and the plan says so.
    plan = _ddp_plan(2, "parallel.strategy=zero3")
    assert plan.sync.algorithm == "flat"
    assert any("parallel.sync=hierarchical runs flat: zero3 reduces gradients through FSDP2" in line
               for line in plan.explanation)


def test_forced_hierarchical_sync_with_powersgd_runs_flat():
    # PowerSGD's DDP hook is a low-rank all-reduce of its own; the hierarchical hook cannot wrap it.
    plan = _ddp_plan(2, "parallel.compression=powersgd")
    assert plan.sync.algorithm == "flat"
    assert any("parallel.sync=hierarchical runs flat: powersgd compression is its own all-reduce scheme" in line
               for line in plan.explanation)
