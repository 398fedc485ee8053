"""`resolve`: the one statement of what runs, as behaviour; and the memory model, the cost
model, the plan and the runtime agreeing with it."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from orchestrator.choices import Compression, Precision, Recompute, Strategy, SyncAlgorithm
from orchestrator.config import load_config
from orchestrator.errors import PlanError
from orchestrator.planning import Plan, job_context, plan_job
from orchestrator.planning.cost import Choice, estimate, execution
from orchestrator.planning.describe import describe_cluster
from orchestrator.planning.layout import Wirings, cluster_layout
from orchestrator.planning.memory import rank_memory
from orchestrator.planning.mesh import Mesh
from orchestrator.planning.model_math import ModelShape
from orchestrator.planning.resolve import (
    POWERSGD_MIN_WARMUP,
    Unsupported,
    on_device,
    powersgd_warmup,
    resolve,
    resolve_precision,
    wrapping_of,
)
from orchestrator.topology.files import load_topology_file
from orchestrator.topology.model import ClusterTopology, Network, cpu_node

ROOT = Path(__file__).resolve().parent.parent
H100 = load_topology_file(ROOT / "tests" / "fixtures" / "topology" / "topo_h100_8gpu_mlengineering.txt", "H100")
GPT_1B = ["model.n_layer=24", "model.n_head=16", "model.n_embd=2048", "model.vocab_size=50304", "model.block_size=2048",
          "train.global_batch_size=64"]
FSDP2_STRATEGIES = ("zero2", "zero3", "hsdp")


def _gpu(strategy: str, mesh: Mesh, **kwargs):
    return resolve(strategy, mesh, **{"precision": "auto", "device": "gpu", **kwargs})


def _h100(nodes: int = 1):
    return describe_cluster(H100, nodes, Network(bandwidth_gbps=50.0, latency_us=10.0), "H100")


# --- the rules -------------------------------------------------------------------------------


def test_strategies_without_tensor_parallelism_run_as_named():
    mesh = Mesh(dp_replicate=2, dp_shard=4)
    cases = {  # strategy: (mesh, ddp_reduces, zero_optimizer, reshard_after_forward, shard_group, fsdp_replicates)
        "ddp": (Mesh(dp_replicate=8), True, False, False, 1, False),
        "zero1": (mesh, True, True, False, 8, False),
        "zero2": (mesh, False, False, False, 8, False),
        "zero3": (mesh, False, False, True, 8, False),
        "hsdp": (mesh, False, False, True, 4, True),
    }
    for strategy, (m, ddp, zero, reshard, shard, replicates) in cases.items():
        ex = _gpu(strategy, m)
        assert ex.strategy == ex.wrapping == strategy and ex.mesh == m and ex.world_size == 8, strategy
        assert (ex.ddp_reduces, ex.zero_optimizer, ex.reshard_after_forward, ex.shard_group, ex.fsdp_replicates) == \
            (ddp, zero, reshard, shard, replicates), strategy
        # Only DDP's own reducer could run a hierarchical all-reduce.
        assert ex.notes == () and (ex.flat_reason == "") == (strategy == "ddp"), strategy


def test_fsdp_is_an_alias_of_zero3():
    # The alias is a config name: `parallel.strategy=fsdp` plans and runs zero3.
    assert Strategy["fsdp"] is Strategy.zero3 and str(Strategy.fsdp) == "zero3"
    cfg = load_config(None, [*GPT_1B, "parallel.strategy=fsdp", "parallel.tp=1"])
    assert cfg.parallel.strategy is Strategy.zero3
    plan = plan_job(cfg, _h100())
    assert plan.strategy == "zero3" and plan.to_dict()["strategy"] == "zero3"
    assert _gpu(Strategy.fsdp, Mesh(dp_shard=8)) == _gpu("zero3", Mesh(dp_shard=8))


def test_ddp_and_zero1_with_tensor_parallelism_run_as_zero2_wrapping():
    ddp = _gpu("ddp", Mesh(dp_replicate=4, tp=2))
    # FSDP2 over the 2-D (dp_replicate, dp_shard) mesh with a shard group of one: replicated.
    assert (ddp.strategy, ddp.wrapping, ddp.shard_group, ddp.fsdp_replicates) == ("ddp", "zero2", 1, True)
    assert not ddp.ddp_reduces and not ddp.zero_optimizer and not ddp.reshard_after_forward
    assert ddp.notes == ("ddp with tp=2 runs as FSDP2 (zero2's wrapping, nothing sharded): DDP and "
                         "ZeroRedundancyOptimizer cannot handle DTensor parameters",)
    zero1 = _gpu("zero1", Mesh(dp_shard=4, tp=2))
    # zero1 shards over all data-parallel ranks as zero2 does.
    assert (zero1.strategy, zero1.wrapping, zero1.shard_group, zero1.fsdp_replicates) == ("zero1", "zero2", 4, False)
    assert not zero1.ddp_reduces and not zero1.zero_optimizer
    assert zero1.notes == ("zero1 with tp=2 runs as FSDP2 (zero2's wrapping): DDP and ZeroRedundancyOptimizer "
                           "cannot handle DTensor parameters",)
    for strategy in ("ddp", "zero1"):
        assert wrapping_of(strategy, 1) == strategy and wrapping_of(strategy, 2) == "zero2"
    for strategy in FSDP2_STRATEGIES:
        assert wrapping_of(strategy, 4) == strategy


def test_ddp_does_not_shard():
    for tp in (1, 2):
        with pytest.raises(Unsupported, match=re.escape("ddp does not shard: dp_shard must be 1, got 2")):
            _gpu("ddp", Mesh(dp_shard=2, tp=tp))


def test_fp16_runs_with_ddp_and_tp_1_only():
    assert issubclass(Unsupported, PlanError)
    for device in ("gpu", "cpu"):
        ex = resolve("ddp", Mesh(dp_replicate=4), precision="fp16", device=device)
        assert ex.loss_scaling and ex.autocast == ex.param_dtype == "fp16"
    refused = [("ddp", Mesh(dp_replicate=2, tp=2))] + [(s, Mesh(dp_replicate=2, dp_shard=2)) for s in
                                                        ("zero1", *FSDP2_STRATEGIES)]
    for strategy, mesh in refused:
        with pytest.raises(Unsupported, match=re.escape(f"train.precision=fp16 needs loss scaling, which runs with "
                                                        f"DDP only (tp=1), not {strategy} with tp={mesh.tp}")):
            _gpu(strategy, mesh, precision="fp16")
    for precision in ("bf16", "fp32", "auto"):
        assert not _gpu("zero3", Mesh(dp_shard=4), precision=precision).loss_scaling


def test_auto_precision_is_bf16_on_gpu_and_fp32_on_cpu():
    assert resolve_precision("auto", "gpu") == Precision.bf16
    assert resolve_precision("auto", "cpu") is None
    assert resolve_precision("fp32", "gpu") is None
    assert resolve_precision("bf16", "cpu") == resolve_precision("bf16", "gpu") == Precision.bf16
    assert resolve_precision("fp16", "cpu") == Precision.fp16
    gpu, cpu = (resolve("zero3", Mesh(dp_shard=4), precision="auto", device=d) for d in ("gpu", "cpu"))
    assert (gpu.autocast, gpu.param_dtype) == ("bf16", "bf16")
    assert (cpu.autocast, cpu.param_dtype) == (None, "fp32")
    with pytest.raises(ValueError, match="device kind must be one of gpu, cpu"):
        resolve_precision("auto", "tpu")


def test_bf16_compression_is_dropped_on_cpu_with_a_note():
    for strategy, mesh in (("ddp", Mesh(dp_replicate=4)), ("zero3", Mesh(dp_shard=4))):
        cpu = resolve(strategy, mesh, precision="auto", device="cpu", compression="bf16")
        assert cpu.compression == "none"
        assert cpu.notes == ("bf16 gradient compression skipped: it needs the NCCL backend, CPU ranks use gloo",)
        gpu = _gpu(strategy, mesh, compression="bf16")
        assert gpu.compression == "bf16" and gpu.notes == ()
    # fp16 compression runs on gloo too.
    gloo = resolve("ddp", Mesh(dp_replicate=4), precision="auto", device="cpu", compression="fp16")
    assert gloo.compression == "fp16" and gloo.notes == ()


def test_powersgd_is_dropped_where_fsdp2_reduces_with_a_note():
    note = ("powersgd compression skipped: it is a DDP comm hook and FSDP2 reduce-scatters sharded gradients, "
            "which a low-rank all-reduce cannot express")
    dropped = [("ddp", Mesh(dp_replicate=4, tp=2)), ("zero1", Mesh(dp_shard=4, tp=2)), ("zero2", Mesh(dp_shard=8)),
               ("zero3", Mesh(dp_shard=8)), ("hsdp", Mesh(dp_replicate=2, dp_shard=4))]
    for strategy, mesh in dropped:
        ex = _gpu(strategy, mesh, compression="powersgd", max_steps=1000)
        assert ex.compression == "none" and ex.compression_warmup_steps == 0, strategy
        assert note in ex.notes, strategy
    for strategy in ("ddp", "zero1"):
        ex = _gpu(strategy, Mesh(dp_replicate=8), compression="powersgd", max_steps=1000)
        assert ex.ddp_reduces and ex.compression == "powersgd" and ex.compression_warmup_steps == 100
        assert note not in ex.notes


def test_powersgd_warm_up_is_a_tenth_of_the_run_and_at_least_two_steps():
    # torch's PowerSGD docs suggest starting compression after 10% of the training steps; a
    # tenth to the nearest step, worked by hand:
    assert [powersgd_warmup(n) for n in (0, 1, 10, 20, 30, 299, 300, 1000, 1001, 5000, 12346)] == \
        [2, 2, 2, 2, 3, 30, 30, 100, 100, 500, 1235]
    # ...and never below what torch's PowerSGDState accepts with error feedback and warm start
    # on (its defaults, as the runtime builds it): it refuses start_powerSGD_iter <= 1. That
    # holds for every run length and for the runtime's own floor.
    hook = pytest.importorskip("torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook")
    for start in {powersgd_warmup(n) for n in range(0, 40)} | {POWERSGD_MIN_WARMUP}:
        hook.PowerSGDState(process_group=None, start_powerSGD_iter=start)
    with pytest.raises(ValueError, match="start_powerSGD_iter"):
        hook.PowerSGDState(process_group=None, start_powerSGD_iter=1)
    assert _gpu("ddp", Mesh(dp_replicate=8), compression="powersgd", max_steps=300).compression_warmup_steps == 30
    for compression in ("none", "fp16", "bf16"):
        assert _gpu("ddp", Mesh(dp_replicate=8), compression=compression, max_steps=300).compression_warmup_steps == 0


@pytest.mark.parametrize(
    ("strategy", "mesh", "compression", "reason"),
    [
        ("zero3", Mesh(dp_shard=8), "none", "zero3 reduces gradients through FSDP2, which has no comm hook"),
        ("zero2", Mesh(dp_shard=8), "none", "zero2 reduces gradients through FSDP2, which has no comm hook"),
        ("ddp", Mesh(dp_replicate=4, tp=2), "none",
         "ddp with tp=2 reduces gradients through FSDP2, which has no comm hook"),
        ("hsdp", Mesh(dp_replicate=2, dp_shard=4), "none", "hsdp's mesh already is the hierarchy"),
        ("zero1", Mesh(dp_replicate=8), "none", "zero1 reduce-scatters and all-gathers in flat rings"),
        ("ddp", Mesh(dp_replicate=8), "powersgd", "powersgd compression is its own all-reduce scheme"),
    ],
)
def test_hierarchical_runs_flat_with_the_reason_where_it_cannot_run(strategy, mesh, compression, reason):
    forced = _gpu(strategy, mesh, compression=compression, algorithm="hierarchical")
    assert forced.sync_algorithm == "flat" and reason in forced.flat_reason
    assert any(n.startswith("hierarchical all-reduce runs flat: ") and reason in n for n in forced.notes)
    # Left to the planner it is flat too, with nothing to note: nobody asked for it.
    auto = _gpu(strategy, mesh, compression=compression, algorithm="auto")
    assert auto.sync_algorithm == "flat" and reason in auto.flat_reason
    assert not any(n.startswith("hierarchical") for n in auto.notes)


def test_hierarchical_runs_where_ddp_reduces_uncompressed_or_16_bit():
    for compression in ("none", "fp16", "bf16"):
        ex = _gpu("ddp", Mesh(dp_replicate=16), compression=compression, algorithm="hierarchical")
        assert ex.sync_algorithm == "hierarchical" and ex.flat_reason == "" and ex.notes == ()
        # auto stays open: the cost model chooses between flat and hierarchical.
        assert _gpu("ddp", Mesh(dp_replicate=16), compression=compression, algorithm="auto").sync_algorithm == "auto"


def test_resolve_takes_concrete_choices_only():
    with pytest.raises(ValueError, match="resolve takes concrete choices"):
        _gpu("auto", Mesh(dp_replicate=8))
    with pytest.raises(ValueError, match="resolve takes concrete choices"):
        _gpu("ddp", Mesh(dp_replicate=8), recompute="auto")
    with pytest.raises(ValueError, match="resolve takes concrete choices"):
        _gpu("ddp", Mesh(dp_replicate=8), compression="auto")
    with pytest.raises(ValueError, match="bucket_mb must be positive"):
        _gpu("ddp", Mesh(dp_replicate=8), bucket_mb=0)


def test_a_rank_on_another_device_kind_is_resolved_again_with_a_note():
    planned = _gpu("ddp", Mesh(dp_replicate=2), compression="bf16", max_steps=100)
    assert on_device(planned, "gpu", "auto", "bf16", 100) is planned
    cpu = on_device(planned, "cpu", "auto", "bf16", 100)
    assert (cpu.device, cpu.autocast, cpu.compression) == ("cpu", None, "none")
    assert cpu.notes == ("bf16 gradient compression skipped: it needs the NCCL backend, CPU ranks use gloo",
                         "planned for gpu ranks, running on cpu")


def test_choices_compare_equal_to_their_plain_names():
    assert Strategy.zero3 == "zero3" and str(Strategy.zero3) == "zero3" and f"{Compression.powersgd}" == "powersgd"
    assert json.dumps({"s": Recompute.full}) == '{"s": "full"}'
    assert [str(s) for s in Strategy.concrete()] == ["ddp", "zero1", "zero2", "zero3", "hsdp"]
    assert SyncAlgorithm.concrete() == (SyncAlgorithm.flat, SyncAlgorithm.hierarchical)


# --- the memory model, the cost model, the plan and the runtime agree with it ------------------


def _plan_and_request(overrides: list[str], topo):
    cfg = load_config(None, overrides)
    return cfg, plan_job(cfg, topo)


def _requested(cfg, plan: Plan) -> Compression:
    return plan.sync.compression if cfg.parallel.compression == "auto" else cfg.parallel.compression


@pytest.mark.parametrize(
    ("overrides", "nodes"),
    [
        ([*GPT_1B], 2),
        ([*GPT_1B, "parallel.strategy=ddp", "parallel.tp=2", "parallel.compression=powersgd"], 1),
        ([*GPT_1B, "parallel.strategy=ddp", "parallel.tp=1", "parallel.compression=powersgd",
          "train.max_steps=500"], 2),
        ([*GPT_1B, "parallel.strategy=zero1", "parallel.tp=1"], 2),
        ([*GPT_1B, "parallel.strategy=hsdp", "parallel.tp=1", "train.precision=fp32"], 2),
        ([*GPT_1B, "parallel.strategy=ddp", "parallel.tp=1", "train.precision=fp16", "parallel.compression=fp16"], 1),
    ],
)
def test_a_plans_execution_is_resolve_of_its_own_choices(overrides, nodes):
    cfg, plan = _plan_and_request(overrides, _h100(nodes))
    again = resolve(plan.strategy, plan.mesh, precision=cfg.train.precision, device="gpu", recompute=plan.recompute,
                    compression=_requested(cfg, plan), algorithm=plan.sync.algorithm, bucket_mb=plan.sync.bucket_mb,
                    max_steps=cfg.train.max_steps, pipeline=plan.execution.pipeline)
    assert plan.execution == again
    # What the plan says about sync is what runs.
    assert plan.sync.compression == plan.execution.compression
    assert plan.sync.algorithm == plan.execution.sync_algorithm
    # Every note of what runs differently is in the explanation a person reads.
    for note in plan.execution.notes:
        assert f"runs as: {note}" in plan.explanation


@pytest.mark.parametrize("overrides", [
    [*GPT_1B, "parallel.strategy=ddp", "parallel.tp=2", "parallel.compression=powersgd"],
    [*GPT_1B, "parallel.strategy=zero3", "parallel.tp=1", "parallel.sync=hierarchical"],
    [*GPT_1B, "parallel.strategy=ddp", "parallel.tp=1", "parallel.compression=powersgd", "parallel.sync=hierarchical"],
])
def test_what_the_explanation_says_runs_differently_is_what_the_runtime_is_told(overrides):
    # The runtime reports plan.execution.notes; a person reads the explanation's "runs as:" lines.
    _, plan = _plan_and_request(overrides, _h100(2))
    runs_as = [line.removeprefix("runs as: ") for line in plan.explanation if line.startswith("runs as: ")]
    assert runs_as, plan.explanation
    assert runs_as == list(plan.execution.notes)


def test_a_plan_on_cpu_slots_runs_fp32_on_gloo():
    cfg = load_config(ROOT / "jobs" / "llm.yaml", ["parallel.compression=bf16"])
    plan = plan_job(cfg, ClusterTopology(nodes=[cpu_node(2)]))
    ex = plan.execution
    assert (ex.device, ex.autocast, ex.param_dtype, ex.compression) == ("cpu", None, "fp32", "none")
    assert plan.sync.compression == "none"
    assert "runs as: bf16 gradient compression skipped: it needs the NCCL backend, CPU ranks use gloo" in \
        plan.explanation


@pytest.mark.parametrize("overrides", [
    GPT_1B,
    [*GPT_1B, "parallel.strategy=ddp", "parallel.tp=2", "parallel.compression=powersgd"],
    [*GPT_1B, "parallel.strategy=hsdp", "parallel.tp=1", "parallel.sync=hierarchical"],
])
def test_plan_to_dict_round_trips_through_from_dict(overrides):
    _, plan = _plan_and_request(overrides, _h100(2))
    d = json.loads(json.dumps(plan.to_dict()))
    back = Plan.from_dict(d)
    assert back == plan and back.to_dict() == d
    assert d["execution"]["wrapping"] == str(plan.execution.wrapping)
    assert d["execution"]["mesh"] == d["mesh"] and d["execution"]["strategy"] == d["strategy"]


def _context(*overrides: str):
    cfg = load_config(None, [*GPT_1B, *overrides])
    topo = _h100(2)
    return job_context(cfg, topo), Wirings.of(topo)


@pytest.mark.parametrize(("strategy", "mesh"), [
    ("ddp", Mesh(dp_replicate=16)), ("ddp", Mesh(dp_replicate=8, tp=2)), ("zero1", Mesh(dp_shard=16)),
    ("zero1", Mesh(dp_shard=8, tp=2)), ("zero2", Mesh(dp_shard=16)), ("zero3", Mesh(dp_shard=8, tp=2)),
    ("hsdp", Mesh(dp_replicate=2, dp_shard=8)),
])
@pytest.mark.parametrize("compression", ["none", "powersgd"])
def test_the_cost_and_memory_models_price_what_resolve_says_runs(strategy, mesh, compression):
    ctx, wirings = _context("train.max_steps=200")
    choice = Choice(Strategy(strategy), mesh, micro_batch=1, recompute=Recompute.selective,
                    compression=Compression(compression))
    est = estimate(ctx, cluster_layout(wirings, mesh), choice)
    ex = resolve(strategy, mesh, precision=ctx.precision, device="gpu", recompute="selective", compression=compression,
                 algorithm="auto", max_steps=200)
    assert est.execution == execution(ctx, choice) == ex
    assert est.sync.compression == ex.compression
    # Memory: the model states of the wrapping that runs, sharded over resolve's shard group;
    # reducing on the last of several micro-steps (the default), FSDP2 keeps whole fp32 gradients.
    bucket = est.sync.bucket_mb * 2**20 if ex.ddp_reduces else 0.0
    shape = ModelShape.from_config(load_config(None, GPT_1B).model)
    assert est.sync.grad_accum_steps > 1 and est.sync.accum_sync == "last_micro_step"
    held = None if ex.ddp_reduces else 4
    for priced_as in (strategy, ex.wrapping):
        assert est.memory == rank_memory(priced_as, shape, mesh.tp, ex.shard_group, 1, "selective", ctx.layout, bucket,
                                         ctx.on_gpu, held_grad_bytes=held, micro_steps=est.sync.grad_accum_steps)


@pytest.mark.parametrize(("strategy", "mesh"), [
    ("ddp", Mesh(dp_replicate=8, tp=2)), ("zero1", Mesh(dp_shard=8, tp=2)), ("zero3", Mesh(dp_shard=16)),
    ("hsdp", Mesh(dp_replicate=2, dp_shard=8)),
])
def test_powersgd_costs_nothing_less_where_fsdp2_reduces(strategy, mesh):
    ctx, wirings = _context("train.max_steps=200")
    cl = cluster_layout(wirings, mesh)
    plain, psgd = (estimate(ctx, cl, Choice(Strategy(strategy), mesh, 1, Recompute.none, Compression(c)))
                   for c in ("none", "powersgd"))
    assert psgd.comm_parts == plain.comm_parts and psgd.total_s == plain.total_s and psgd.memory == plain.memory


def test_powersgd_is_priced_with_its_warm_up_where_ddp_reduces():
    mesh = Mesh(dp_replicate=16)
    ctx, wirings = _context()
    cl = cluster_layout(wirings, mesh)

    def grad_comm(compression: str, max_steps: int) -> float:
        c = dataclasses.replace(ctx, max_steps=max_steps)
        e = estimate(c, cl, Choice(Strategy.ddp, mesh, 1, Recompute.none, Compression(compression), SyncAlgorithm.flat))
        return e.comm_parts["grad all-reduce"]

    plain = grad_comm("none", 1000)
    # A longer run spends a smaller share of its steps in the plain warm-up: 20% of 10 steps
    # (the 2-step minimum), 10% of 1000; compressed steps send a few percent of the bytes.
    short, long = grad_comm("powersgd", 10), grad_comm("powersgd", 1000)
    assert plain > short > long
    assert long > 0.1 * plain * 0.9
    assert short > 0.2 * plain * 0.9 and short < 0.3 * plain


# --- the runtime -------------------------------------------------------------------------------


@pytest.fixture
def one_rank_group(tmp_path):
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        yield torch
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3", "hsdp"])
def test_the_runtime_wraps_as_resolve_says(one_rank_group, strategy):
    torch = one_rank_group
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    from orchestrator.runtime.parallelize import build_mesh, parallelize
    from orchestrator.workloads.gpt import GPT, GPTConfig

    ex = resolve(strategy, Mesh(), precision="auto", device="cpu", compression="bf16")
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=32, block_size=8))
    par = parallelize(model, ex, build_mesh(ex.mesh, "cpu"), lambda m: torch.optim.AdamW(m.parameters()),
                      torch.device("cpu"))
    assert isinstance(par.model, DistributedDataParallel) == ex.ddp_reduces
    assert isinstance(par.model, FSDPModule) == (not ex.ddp_reduces)
    assert isinstance(par.optimizer, ZeroRedundancyOptimizer) == ex.zero_optimizer
    # The runtime reports what resolve said runs differently, and nothing else.
    assert par.notes == list(ex.notes) == ["bf16 gradient compression skipped: it needs the NCCL backend, "
                                           "CPU ranks use gloo"]
    x = torch.randint(0, 32, (2, 8))
    par.model(x, x).backward()
    assert all(p.grad is not None for p in par.model.parameters())
