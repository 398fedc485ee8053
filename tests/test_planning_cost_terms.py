"""Each cost term on its own, against a figure worked out by hand from its formula.

The contexts are small and round so that the arithmetic fits in a comment: a 1000-wide model,
1000-token sequences, links of 10 or 12.5 GB/s. Each term reads a context, a laid-out group and
a candidate, and nothing else, so the layout and the candidate are given here as plain records.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from orchestrator.choices import Compression, CpAttention, Recompute, Strategy, SyncAlgorithm
from orchestrator.planning.calibration import Calibration
from orchestrator.planning.compute import DeviceSpeed
from orchestrator.planning.cost import (
    Candidate,
    ComputeTerm,
    Estimate,
    JobContext,
    calibrated,
    compute_term,
    data_parallel_terms,
    ddp_sync_term,
    held_gradient_seconds,
    pipeline_term,
    sharded_sync_term,
    tensor_parallel_term,
)
from orchestrator.planning.layout import RingStats
from orchestrator.planning.memory import ByteLayout, MemoryBreakdown
from orchestrator.planning.mesh import Mesh
from orchestrator.planning.model_math import ModelShape
from orchestrator.planning.sync import SyncPlan

SHAPE = ModelShape(layers=3, hidden=1000, heads=10, vocab=1000, seq=1000)
FP32 = ByteLayout("fp32", weights=4, grads=4, optimizer=8, activation=4, compute=4)
BF16 = ByteLayout("bf16 autocast", weights=4, grads=4, optimizer=8, activation=2, compute=2, half="bf16")


def context(on_gpu: bool, layout: ByteLayout = FP32) -> JobContext:
    speed = DeviceSpeed("test", peak_tflops=100.0, mem_gbps=20.0 if not on_gpu else 2000.0, memory_bytes=10**11)
    return JobContext(shape=SHAPE, params=10**6, global_batch=8, layout=layout, speed=speed, on_gpu=on_gpu,
                      usable_bytes=10**11, net_gbps=100.0, net_lat_us=5.0, gpus_per_node=8, powersgd_ratio=0.1)


def laid_out(mesh: Mesh, per_node: dict[str, int], gbps: float = 10.0, lat_us: float = 1.0) -> SimpleNamespace:
    """A cluster layout as `group_links` reads it: the mesh, each axis's members per node and
    the ring inside a node (none for an axis with one member per node)."""
    return SimpleNamespace(mesh=mesh, per_node=per_node,
                           rings={axis: RingStats(gbps, lat_us) if members > 1 else RingStats(math.inf, 0.0)
                                  for axis, members in per_node.items()})


def candidate(mesh: Mesh, strategy: Strategy = Strategy.ddp, *, accum: int = 1, blocks: int = 3,
              params_per_rank: float = 10**6, pipeline=None, **execution) -> Candidate:
    runs = SimpleNamespace(strategy=strategy, mesh=mesh, wrapping=strategy, shard_group=1, ddp_reduces=True,
                           fsdp_replicates=False, reshard_after_forward=False, compression=Compression.none,
                           compression_warmup_steps=0, sync_algorithm=SyncAlgorithm.flat, flat_reason="",
                           reduce_every_micro_step=False, pipeline=pipeline, cp_attention=CpAttention.allgather_kv)
    for key, value in execution.items():
        setattr(runs, key, value)
    choice = SimpleNamespace(strategy=strategy, mesh=mesh, micro_batch=1, recompute=Recompute.none,
                             algorithm=SyncAlgorithm.flat, bucket_mb=25.0)
    return Candidate(choice=choice, execution=runs, accum=accum, syncs=1, held=None, share=None, work=1.0,
                     params_per_rank=params_per_rank, blocks=blocks, block_params=params_per_rank / blocks)


def test_tensor_parallel_term_on_cpu_is_four_gloo_all_reduces_per_block_and_micro_batch():
    mesh = Mesh(1, 1, 2)
    cand = candidate(mesh, accum=2)
    term = tensor_parallel_term(context(on_gpu=False), laid_out(mesh, {"tp": 2}), cand)
    # One activation: 1 x 1000 x 1000 x 4 B = 4e6 B. gloo's all-reduce over 2 ranks in a node
    # (10 GB/s, 1 us): launch 150 us + 2 steps x (1 + 25) us = 52 us + 2(2-1)/2 x 4e6 x 2.0 slowdown
    # / 10e9 = 800 us + the CPU's sum of 2e6 B read and written at 20 GB/s = 200 us: 1202 us.
    # The GPT's block: 2 forward + 2 backward all-reduces; 2 micro-steps x 3 blocks x 4 = 24.
    assert term.parts == {"tp": pytest.approx(24 * 1202e-6)}
    assert term.exposed_s == pytest.approx((24 * 1202e-6,))


def test_tensor_parallel_term_is_nothing_without_tensor_parallelism():
    mesh = Mesh(2, 1, 1)
    term = tensor_parallel_term(context(on_gpu=False), laid_out(mesh, {"tp": 1}), candidate(mesh))
    assert term.parts == {} and term.exposed_s == ()


def test_pipeline_term_sends_every_micro_batch_across_the_boundary_and_exposes_the_first_trip():
    mesh = Mesh(1, 1, 1, pp=2)
    pipeline = SimpleNamespace(stages=2, virtual=1, microbatches=4, bubble=0.2)
    cand = candidate(mesh, pipeline=pipeline)
    term = pipeline_term(context(on_gpu=True, layout=BF16), laid_out(mesh, {"pp": 1}), cand)
    # One stage per node: the pp group's share of the network is 100 GB/s x 1 / 8 = 12.5 GB/s at
    # 5 us. One send of a bf16 activation (1 x 1000 x 1000 x 2 B = 2e6 B): 8 us launch + 5 us +
    # 2e6 / 12.5e9 = 160 us: 173 us. Forward and backward, 1 chunk, 4 micro-batches: 8 sends =
    # 1384 us; the first micro-batch's trip out and back, 2 x (2 x 1 - 1) = 2 sends = 346 us.
    # The tied head's gradient, 1000 x 1000 x 4 B / 1 = 4e6 B: 13 us + 320 us = 333 us, unhidden.
    assert term.parts == {"pipeline p2p": pytest.approx(1384e-6), "tied embedding sync": pytest.approx(333e-6)}
    assert term.exposed_s == pytest.approx((346e-6 + 333e-6,))


def test_ddp_sync_term_on_cpu_is_one_unhidden_gloo_all_reduce_of_the_gradients():
    mesh = Mesh(2, 1, 1)
    compute = ComputeTerm(matmul_s=1.0, compute_s=1.0, forward_s=0.3, backward_s=0.7, bubble_s=0.0)
    term = ddp_sync_term(context(on_gpu=False), laid_out(mesh, {"dp_replicate": 2}), candidate(mesh), compute)
    # 1e6 fp32 gradients = 4e6 B; gloo's all-reduce over 2 ranks (10 GB/s, 1 us), as above:
    # 1202 us. gloo shares the cores with compute, so nothing hides it. The bucket is the
    # forced 25 MB.
    assert term.parts == {"grad all-reduce": pytest.approx(1202e-6)}
    assert term.exposed_s == pytest.approx((1202e-6,))
    assert term.bucket_mb == 25.0 and term.schedule == "flat gloo ring"


def test_hsdp_adds_the_replica_all_reduce_of_a_shard_after_the_sharded_sync():
    mesh = Mesh(2, 2, 1)
    cand = candidate(mesh, Strategy.hsdp, ddp_reduces=False, fsdp_replicates=True, shard_group=2)
    compute = ComputeTerm(matmul_s=1.0, compute_s=1.0, forward_s=0.3, backward_s=0.7, bubble_s=0.0)
    sharded, replicas = data_parallel_terms(context(on_gpu=False), laid_out(mesh, {"dp_shard": 2,
                                                                                  "dp_replicate": 2}), cand, compute)
    assert set(sharded.parts) == {"grad reduce-scatter", "param all-gather"}
    # Each replica all-reduces its shard, 4e6 B / 2 = 2e6 B, over 2 ranks (10 GB/s, 1 us): 150 us
    # + 52 us + 1 x 2e6 x 2.0 / 10e9 = 400 us + 1e6 B read and written at 20 GB/s = 100 us: 702 us.
    assert replicas.parts == {"replica all-reduce": pytest.approx(702e-6)}
    assert replicas.exposed_s == pytest.approx((702e-6,))


def test_held_gradients_cost_a_read_and_write_per_micro_step_after_the_first():
    cand = candidate(Mesh(1, 8, 1), Strategy.zero2, accum=4)
    cand.held = 4
    # 3 micro-steps x 1e6 parameters x (2 B read of the new gradient + 2 x 4 B of the kept one)
    # / 2000 GB/s = 3e6 x 10 / 2e12 = 15 us.
    assert held_gradient_seconds(context(on_gpu=True, layout=BF16), cand) == pytest.approx(15e-6)
    cand.held = None
    assert held_gradient_seconds(context(on_gpu=True, layout=BF16), cand) == 0.0


def test_calibration_scales_compute_and_the_bubble_by_one_factor_and_communication_by_the_other():
    raw = Estimate(choice=None, execution=None, memory=MemoryBreakdown(1, 0, 0, 0, 0, 1), compute_s=1.0, comm_s=0.4,
                   exposed_comm_s=0.2, sync=SyncPlan(bucket_mb=25.0, algorithm=SyncAlgorithm.flat,
                                                      compression=Compression.none, grad_accum_steps=1),
                   comm_parts={"grad all-reduce": 0.4}, bubble_s=0.1)
    scaled = calibrated(Calibration(compute=2.0, communication=0.5), raw)
    # compute 1.0 x 2 = 2.0, bubble 0.1 x 2 = 0.2; communication 0.4 x 0.5 = 0.2, exposed 0.1.
    assert (scaled.compute_s, scaled.bubble_s) == pytest.approx((2.0, 0.2))
    assert (scaled.comm_s, scaled.exposed_comm_s) == pytest.approx((0.2, 0.1))
    assert scaled.comm_parts == {"grad all-reduce": pytest.approx(0.2)}
    assert calibrated(Calibration(), raw) is raw


def test_zero2_on_cpu_reduce_scatters_and_gathers_once_per_unit_unhidden():
    mesh = Mesh(1, 2, 1)
    cand = candidate(mesh, Strategy.zero2, ddp_reduces=False, shard_group=2)
    compute = ComputeTerm(matmul_s=1.0, compute_s=1.0, forward_s=0.3, backward_s=0.7, bubble_s=0.0)
    term = sharded_sync_term(context(on_gpu=False), laid_out(mesh, {"dp_shard": 2}), cand, compute)
    # 4 units (3 blocks and the root), each 1e6 B of the 4e6 B of fp32 gradients, 2 ranks at
    # 10 GB/s, 1 us. One gloo reduce-scatter: a clone into a fresh buffer (3 passes, read and
    # written: 6 x 1e6 / 20e9 = 300 us), the all-reduce of it (150 + 2 x 26 + 1 x 1e6 x 2.0 / 10e9
    # = 200 + 0.5e6 x 2 / 20e9 = 50: 452 us) and the rank's half copied out (50 us): 802 us, x 4
    # = 3208 us. One all-gather of a 1e6 B unit: 150 + 52 + 0.5 x 1e6 x 2.8 / 10e9 = 140 +
    # (0.5e6 + 1e6) x 2 / 20e9 = 150: 492 us, x 4 = 1968 us. On CPU nothing hides either, and
    # FSDP2's device-memory copies are not priced.
    assert term.parts == {"grad reduce-scatter": pytest.approx(3208e-6), "param all-gather": pytest.approx(1968e-6)}
    assert term.exposed_s == pytest.approx((3208e-6 + 1968e-6,))
    assert term.compute_s == (0.0,)
    assert term.schedule == "flat ring reduce-scatter / all-gather"


def test_zero3_gathers_again_for_backward_on_every_micro_step():
    mesh = Mesh(1, 2, 1)
    cand = candidate(mesh, Strategy.zero3, accum=2, ddp_reduces=False, shard_group=2, reshard_after_forward=True)
    compute = ComputeTerm(matmul_s=1.0, compute_s=1.0, forward_s=0.3, backward_s=0.7, bubble_s=0.0)
    term = sharded_sync_term(context(on_gpu=False), laid_out(mesh, {"dp_shard": 2}), cand, compute)
    # As zero2's above, but the weights are gathered forward and backward on each of the 2
    # micro-steps: 4 x 1968 us = 7872 us; gradients reduce-scattered once (the last micro-step).
    assert term.parts == {"param all-gather": pytest.approx(7872e-6), "grad reduce-scatter": pytest.approx(3208e-6)}
    assert term.exposed_s == pytest.approx((7872e-6 + 3208e-6,))


def test_compute_term_on_cpu_splits_the_steps_flops_over_the_data_parallel_ranks():
    mesh = Mesh(2, 1, 1)
    cand = candidate(mesh, accum=4)
    term = compute_term(context(on_gpu=False), cand)
    # The GPT's step: 3 x (blocks' forward + the head's) = 3 x (8000 tokens x 3 x (24 x 1000^2 +
    # 4 x 1000 x 1000) + 2 x 8000 x 1000 x 1000) = 3 x (6.72e11 + 1.6e10) = 2.064e12 FLOPs, half
    # on each of 2 ranks: 1.032e12. A CPU slot's efficiency at 1000 tokens and 1000 wide:
    # 0.6 x 1000 / (1000 + 64) x 1000 / (1000 + 32); at 100 TFLOP/s peak.
    matmul_s = 1.032e12 / (100e12 * 0.6 * (1000 / 1064) * (1000 / 1032))
    assert term.matmul_s == pytest.approx(matmul_s)
    # Forward is a third of a micro-step's (no recomputation), backward two thirds; 4 micro-steps.
    assert (term.forward_s, term.backward_s) == pytest.approx((matmul_s / 4 / 3, matmul_s / 4 * 2 / 3))
    assert term.compute_s > term.matmul_s and term.bubble_s == 0.0
