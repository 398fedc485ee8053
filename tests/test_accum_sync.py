"""Gradient accumulation that matches the plan: when FSDP2 reduces gradients (every micro-step
or the last), what each costs in memory and time, which the search picks, and how it travels
in plan.json; and the one line a model too large for the cluster gets."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.choices import AccumSync, Compression, Recompute, Strategy
from orchestrator.config import load_config
from orchestrator.errors import ConfigError, PlanError
from orchestrator.planning import Plan, job_context, plan_job
from orchestrator.planning.activations import activation_profile
from orchestrator.planning.cost import Choice, estimate
from orchestrator.planning.describe import describe_cluster
from orchestrator.planning.layout import Wirings, cluster_layout
from orchestrator.planning.memory import byte_layout, forward_values, runtime_states
from orchestrator.planning.mesh import Mesh
from orchestrator.planning.model_math import ModelShape
from orchestrator.planning.pipeline import resolve_pipeline
from orchestrator.planning.resolve import resolve
from orchestrator.topology.files import load_topology_file
from orchestrator.topology.model import Network

ROOT = Path(__file__).resolve().parent.parent
H100 = load_topology_file(ROOT / "tests" / "fixtures" / "topology" / "topo_h100_8gpu_mlengineering.txt", "H100")

# A GPT without biases: 4 blocks of 12 h^2 + 2 h = 12,584,960 parameters (h = 1024), and a root
# of (V + s) h + h = (32000 + 1024) * 1024 + 1024 = 33,817,600: P = 84,157,440 in all.
SMALL = ["model.n_layer=4", "model.n_head=16", "model.n_embd=1024", "model.vocab_size=32000", "model.block_size=1024",
         "model.bias=false"]
SMALL_SHAPE = ModelShape(layers=4, hidden=1024, heads=16, vocab=32000, seq=1024, bias=False)
P = 84_157_440
GPT_1B = ["model.n_layer=24", "model.n_head=16", "model.n_embd=2048", "model.vocab_size=50304", "model.block_size=2048"]
# 12.9B parameters: ZeRO-3 over 8 H100s holds it, but not with its whole fp32 gradient besides.
GPT_13B = ["model.n_layer=40", "model.n_head=40", "model.n_embd=5120", "model.vocab_size=50304",
           "model.block_size=2048", "train.global_batch_size=64"]
# 174B parameters (GPT-3's shape): no plan on a few H100 nodes holds it.
GPT_175B = ["model.n_layer=96", "model.n_head=96", "model.n_embd=12288", "model.block_size=2048",
            "train.global_batch_size=96"]


def _cluster(nodes: int = 1):
    return describe_cluster(H100, nodes, Network(bandwidth_gbps=50.0, latency_us=10.0), "H100")


def _priced(overrides: list[str], nodes: int = 1):
    cfg = load_config(None, overrides)
    topo = _cluster(nodes)
    return job_context(cfg, topo), Wirings.of(topo)


def _both(ctx, wirings, strategy: str, mesh: Mesh, micro_batch: int = 1, **kw):
    """(last_micro_step, per_micro_step) estimates of one choice."""
    cl = cluster_layout(wirings, mesh)
    return tuple(estimate(ctx, cl, Choice(Strategy(strategy), mesh, micro_batch, Recompute.none, accum_sync=a, **kw))
                 for a in (AccumSync.last_micro_step, AccumSync.per_micro_step))


# --- memory ----------------------------------------------------------------------------------


def test_the_kept_unsharded_gradient_is_the_whole_model_in_the_reduce_dtype():
    bf16 = byte_layout("bf16")
    # zero2 over 8 ranks: fp32 weights 4P/8 and Adam 8P/8 either way; gradients 4P/8 reduced
    # every micro-step, 4P (fp32, FSDP2's reduce dtype) kept unsharded, 2P when it reduces in bf16.
    per = runtime_states("zero2", SMALL_SHAPE, 1, 8, bf16)
    last = runtime_states("zero2", SMALL_SHAPE, 1, 8, bf16, held_grad_bytes=4)
    last_bf16 = runtime_states("zero2", SMALL_SHAPE, 1, 8, bf16, held_grad_bytes=2)
    assert (per.params, per.grads, per.optimizer) == (42_078_720, 42_078_720, 84_157_440)
    assert (last.params, last.grads, last.optimizer) == (42_078_720, 336_629_760, 84_157_440)
    assert last_bf16.grads == 168_314_880
    # DDP keeps the whole fp32 gradient whatever it is told: 4P.
    assert runtime_states("ddp", SMALL_SHAPE, 1, 1, bf16, held_grad_bytes=4).grads == 336_629_760


def test_the_cost_model_prices_each_way_by_hand():
    # 64 sequences over 8 ranks at micro-batch 1: 8 micro-steps.
    ctx, wirings = _priced([*SMALL, "train.global_batch_size=64"])
    last, per = _both(ctx, wirings, "zero2", Mesh(dp_shard=8))
    assert per.memory.grads == 42_078_720 and last.memory.grads == 336_629_760
    assert last.memory.total - per.memory.total == 336_629_760 - 42_078_720
    assert (last.memory.params, last.memory.optimizer, last.memory.activations, last.memory.buffers) == \
        (per.memory.params, per.memory.optimizer, per.memory.activations, per.memory.buffers)
    assert last.sync.accum_sync == "last_micro_step" and not last.execution.reduce_every_micro_step
    assert per.sync.accum_sync == "per_micro_step" and per.execution.reduce_every_micro_step
    # Reducing in bf16, the kept gradient is 2P.
    last16, _ = _both(ctx, wirings, "zero2", Mesh(dp_shard=8), compression=Compression.bf16)
    assert last16.memory.grads == 168_314_880
    # One micro-step (8 sequences on 8 ranks) keeps nothing between micro-steps, and at its peak,
    # the loss's backward, FSDP2 has made no gradient yet.
    one_ctx, _ = _priced([*SMALL, "train.global_batch_size=8"])
    one, _ = _both(one_ctx, wirings, "zero2", Mesh(dp_shard=8))
    assert one.sync.grad_accum_steps == 1 and one.memory.grads == 0


def test_with_nothing_to_shard_both_ways_keep_the_same_gradient():
    # ddp with tp=2 runs as FSDP2 over shard groups of one: the tensor-parallel rank's 12 l h^2 / 2
    # = 25,165,824 matrix parameters and the 33,825,792 it replicates, 58,991,616 at 4 bytes.
    ctx, wirings = _priced([*SMALL, "train.global_batch_size=64"])
    last, per = _both(ctx, wirings, "ddp", Mesh(dp_replicate=4, tp=2))
    assert last.memory.grads == per.memory.grads == 235_966_464
    assert last.total_s < per.total_s


def test_a_pipeline_keeps_its_stages_unsharded_gradients():
    ctx, wirings = _priced([*GPT_1B, "train.global_batch_size=64"], nodes=2)
    mesh = Mesh(dp_shard=8, pp=2)
    est = estimate(ctx, cluster_layout(wirings, mesh), Choice(Strategy.zero2, mesh, 1, Recompute.none))
    m = est.memory
    # fp32 gradients whole and fp32 weights sharded over 8: exactly 8 times as many bytes.
    assert est.sync.accum_sync == "last_micro_step" and m.grads == pytest.approx(8 * m.params, abs=8)


# --- time ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("strategy", "mesh", "part"), [
    ("zero2", Mesh(dp_shard=16), "grad reduce-scatter"),
    ("zero3", Mesh(dp_shard=16), "grad reduce-scatter"),
    ("hsdp", Mesh(dp_replicate=2, dp_shard=8), "replica all-reduce"),
    ("ddp", Mesh(dp_replicate=8, tp=2), "grad all-reduce"),
])
def test_reducing_every_micro_step_moves_the_gradients_accum_times(strategy, mesh, part):
    ctx, wirings = _priced([*GPT_1B, "train.global_batch_size=64"], nodes=2)
    last, per = _both(ctx, wirings, strategy, mesh)
    accum = last.sync.grad_accum_steps
    assert accum == 64 // mesh.dp > 1
    assert per.comm_parts[part] == pytest.approx(accum * last.comm_parts[part])
    # Weights are gathered as often either way.
    assert per.comm_parts.get("param all-gather") == last.comm_parts.get("param all-gather")
    assert per.exposed_comm_s > last.exposed_comm_s and per.total_s > last.total_s


# --- the search ------------------------------------------------------------------------------


def test_the_search_keeps_gradients_until_the_last_micro_step_when_they_fit():
    cfg = load_config(None, [*GPT_1B, "train.global_batch_size=256", "parallel.pp=1", "parallel.strategy=zero3",
                             "train.micro_batch_size=4"])
    plan = plan_job(cfg, _cluster(2))
    assert plan.sync.grad_accum_steps == 4 and plan.fits
    assert plan.sync.accum_sync == "last_micro_step" and plan.execution.reduce_every_micro_step is False
    # Both fit; reducing every micro-step moves 3 more reduce-scatters and is slower.
    ctx, wirings = _priced([*GPT_1B, "train.global_batch_size=256"], nodes=2)
    last, per = _both(ctx, wirings, "zero3", plan.mesh, 4)
    assert last.fits(ctx.usable_bytes) and per.fits(ctx.usable_bytes) and last.total_s < per.total_s
    assert plan.step_time.total_s == pytest.approx(last.total_s)
    line = next(x for x in plan.explanation if x.startswith("gradient accumulation:"))
    assert line.startswith("gradient accumulation: last_micro_step: FSDP2 keeps the unsharded fp32 gradients")
    saved = (per.comm_parts["grad reduce-scatter"] - last.comm_parts["grad reduce-scatter"]) * 1e3
    assert f"{saved:.2f} ms less gradient traffic" in line and "ms per step faster than per_micro_step" in line


def test_the_search_reduces_every_micro_step_when_only_that_fits():
    plan = plan_job(load_config(None, GPT_13B), _cluster(1))
    assert plan.fits and plan.sync.grad_accum_steps > 1
    assert plan.sync.accum_sync == "per_micro_step" and plan.execution.reduce_every_micro_step is True
    ctx, wirings = _priced(GPT_13B)
    cl = cluster_layout(wirings, plan.mesh)
    ch = Choice(plan.strategy, plan.mesh, plan.micro_batch_size, plan.recompute)
    last = estimate(ctx, cl, dataclasses.replace(ch, accum_sync=AccumSync.last_micro_step))
    assert not last.fits(ctx.usable_bytes)
    line = next(x for x in plan.explanation if x.startswith("gradient accumulation:"))
    assert line.startswith("gradient accumulation: per_micro_step: FSDP2 reduce-scatters after each of the")
    assert f"need {last.memory.total / 1e9:.2f} GB per rank, over the {ctx.usable_bytes / 1e9:.2f} GB usable" in line


def test_one_micro_step_says_nothing_about_it():
    plan = plan_job(load_config(None, [*GPT_1B, "train.global_batch_size=8", "parallel.pp=1"]), _cluster(1))
    assert plan.sync.grad_accum_steps == 1 and plan.sync.accum_sync == "last_micro_step"
    assert not any(x.startswith("gradient accumulation:") for x in plan.explanation)


def test_a_forced_choice_is_planned_and_named():
    base = [*GPT_1B, "train.global_batch_size=256", "parallel.pp=1", "parallel.strategy=zero3",
            "train.micro_batch_size=4"]
    plan = plan_job(load_config(None, [*base, "parallel.accum_sync=per_micro_step"]), _cluster(2))
    assert plan.sync.accum_sync == "per_micro_step" and plan.execution.reduce_every_micro_step
    line = next(x for x in plan.explanation if x.startswith("gradient accumulation:"))
    assert "(forced: parallel.accum_sync=per_micro_step)" in line and "ms per step faster, for" in line


def test_a_forced_last_micro_step_that_does_not_fit_is_one_line_naming_the_key():
    # Without tensor parallelism the whole fp32 gradient of the 12.9B model is 51.6 GB per rank,
    # kept over the 8 micro-steps of micro-batch 1.
    forced = [*GPT_13B, "parallel.tp=1", "train.micro_batch_size=1", "parallel.accum_sync=last_micro_step"]
    with pytest.raises(PlanError, match=r"^key 'parallel.accum_sync': last_micro_step does not fit: .* per_micro_step "
                                        r"fits .*: use parallel.accum_sync=per_micro_step or auto$") as err:
        plan_job(load_config(None, forced), _cluster(1))
    assert "\n" not in str(err.value)


def test_the_config_key_takes_the_choices_only():
    assert load_config(None, []).parallel.accum_sync == "auto"
    assert load_config(None, ["parallel.accum_sync=last_micro_step"]).parallel.accum_sync == "last_micro_step"
    with pytest.raises(ConfigError, match="parallel.accum_sync"):
        load_config(None, ["parallel.accum_sync=sometimes"])


def test_only_fsdp2_without_a_pipeline_reduces_every_micro_step():
    kw = {"precision": "bf16", "device": "gpu", "accum_sync": "per_micro_step"}
    assert resolve("zero3", Mesh(dp_shard=8), **kw).reduce_every_micro_step
    assert resolve("ddp", Mesh(dp_replicate=4, tp=2), **kw).reduce_every_micro_step  # FSDP2 over groups of one
    ddp = resolve("ddp", Mesh(dp_replicate=8), **kw)
    assert not ddp.reduce_every_micro_step and any("last micro-step only" in n for n in ddp.notes)
    pl = resolve_pipeline(SMALL_SHAPE, 2, "1f1b", 8)
    piped = resolve("zero2", Mesh(dp_shard=4, pp=2), pipeline=pl, **kw)
    assert not piped.reduce_every_micro_step and any("pipeline stages" in n for n in piped.notes)
    assert not resolve("zero3", Mesh(dp_shard=8), precision="bf16", device="gpu").reduce_every_micro_step
    with pytest.raises(ValueError, match="auto"):
        resolve("zero3", Mesh(dp_shard=8), precision="bf16", device="gpu", accum_sync="auto")


# --- plan.json -------------------------------------------------------------------------------


def test_plan_json_carries_the_choice_and_old_plans_load():
    plan = plan_job(load_config(None, GPT_13B), _cluster(1))
    d = json.loads(json.dumps(plan.to_dict()))
    assert d["sync"]["accum_sync"] == "per_micro_step" and d["execution"]["reduce_every_micro_step"] is True
    assert Plan.from_dict(d) == plan
    # A plan.json written before the choice existed ran every micro-step but the last in no_sync().
    del d["sync"]["accum_sync"], d["execution"]["reduce_every_micro_step"]
    old = Plan.from_dict(d)
    assert old.sync.accum_sync == "last_micro_step" and old.execution.reduce_every_micro_step is False


# --- a model too large for the cluster -------------------------------------------------------


def test_a_model_no_plan_fits_is_one_line_with_the_least_it_needs_and_what_would_help():
    with pytest.raises(PlanError) as err:
        plan_job(load_config(None, GPT_175B), _cluster(1))
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("the GPT (173.99B parameters) does not fit 8 H100 at any plan: the most memory-frugal one "
                          "(zero3 on ")
    assert "micro-batch 1, recompute full, gradients reduce-scattered every micro-step) needs " in msg
    assert "70.93 GB usable of 80.00 GB" in msg
    assert "it already runs full recomputation, micro-batch 1" in msg
    assert "pipelines are searched on 2 nodes or more" in msg
    # About 350 GB of model states per device over 8 devices, less than 10 GB that does not shard.
    need = re.search(r"so at least (\d+) devices \((\d+) nodes of 8\)$", msg)
    assert need and 40 < int(need[1]) <= 48 and int(need[2]) == 6
    # The count is a real lower bound: 3 nodes still fit no plan; 6 nodes (48 devices, and 96
    # sequences over 6 data-parallel ranks at tp=8) do.
    with pytest.raises(PlanError, match="does not fit 24 H100 at any plan"):
        plan_job(load_config(None, GPT_175B), _cluster(3))
    assert plan_job(load_config(None, GPT_175B), _cluster(6)).fits


def test_forced_choices_on_a_model_no_plan_fits_say_so_too():
    with pytest.raises(PlanError, match="does not fit 8 H100 at any plan"):
        plan_job(load_config(None, [*GPT_175B, "parallel.strategy=ddp"]), _cluster(1))


def test_the_cli_prints_it_as_one_line_and_exits_2():
    out = subprocess.run([sys.executable, "-m", "orchestrator", "plan", "--topology",
                          str(ROOT / "conf" / "topologies" / "h100-8gpu-nvswitch.txt"), "--nodes", "1", "--gpu", "H100",
                          *GPT_175B], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "does not fit 8 H100 at any plan" in lines[0] and "at least" in lines[0]


def test_an_elastic_run_of_a_model_no_plan_fits_says_why_not_which_worlds_it_tried():
    """Fewer devices only make a model larger per device: the elastic sub-world search passes
    the line on as it is, not as a batch-size problem."""
    from orchestrator.control.elastic import plan_keeping_batch
    from orchestrator.errors import ModelTooLarge

    with pytest.raises(ModelTooLarge) as err:
        plan_keeping_batch(load_config(None, GPT_175B), _cluster(1))
    assert str(err.value).startswith("the GPT (173.99B parameters) does not fit 8 H100 at any plan")



def test_fsdp2_holds_no_gradient_while_the_loss_runs_backward_and_ddp_holds_all_of_them():
    """Found by rehearsal (an 8B hsdp plan 22% over): FSDP2 makes its gradients in backward, so
    with one micro-step none exist while the loss's backward holds the logits' gradients, and a
    block's unsharded gradients only once the loss's are gone; the peak is the fuller of the two
    moments, never the sum of both. With accumulation the earlier micro-steps' gradients are held
    through the loss's backward. DDP's gradients are its buckets, held all step."""
    from orchestrator.planning.memory import rank_memory

    shape = ModelShape(layers=8, hidden=1024, heads=16, vocab=128_000, seq=4096, bias=False)
    layout = byte_layout("bf16")
    one = rank_memory("zero3", shape, 1, 8, 2, "none", layout, 0.0, micro_steps=1)
    two = rank_memory("zero3", shape, 1, 8, 2, "none", layout, 0.0, micro_steps=2)
    sharded = runtime_states("zero3", shape, 1, 8, layout).grads
    # A large vocabulary: the loss's backward is the peak, before any gradient exists.
    assert one.grads == 0 and two.grads == sharded
    assert two.total - one.total == sharded and one.activations == two.activations
    ddp = rank_memory("ddp", shape, 1, 8, 2, "none", layout, 25e6, micro_steps=1)
    assert ddp.grads == runtime_states("ddp", shape, 1, 8, layout).grads > 0
    # A small vocabulary and long blocks: the blocks' backward is the peak as it starts, every
    # block's values kept and none of its gradients made yet (a 13B hsdp plan 17% over when
    # both were counted at once).
    deep = ModelShape(layers=48, hidden=1024, heads=16, vocab=512, seq=4096, bias=False)
    blocks = rank_memory("zero3", deep, 1, 8, 2, "none", layout, 0.0, micro_steps=1)
    profile = activation_profile(deep, 2, 1, "none", forward_values("zero3", 1, layout, True))
    assert blocks.grads == 0 and blocks.activations == round(profile.in_blocks)
    # Short sequences, wide blocks, one shard: the gradients outweigh the activations, and the
    # peak is as the blocks' backward ends, every gradient made, one block's values left.
    wide = ModelShape(layers=48, hidden=8192, heads=64, vocab=512, seq=128, bias=False)
    end = rank_memory("zero3", wide, 1, 1, 1, "none", layout, 0.0, micro_steps=1)
    profile = activation_profile(wide, 1, 1, "none", forward_values("zero3", 1, layout, True))
    assert end.grads == round(runtime_states("zero3", wide, 1, 1, layout).grads)
    assert end.activations == round(profile.blocks_done) < profile.in_blocks


def test_zero3_holds_no_gathered_weights_while_the_loss_runs_backward_and_zero2_holds_them_all():
    """Found by rehearsal (a 12-block Llama 40% over): zero3 and hsdp reshard every unit after
    its forward, the root with the head too, and gather none again before the loss's backward
    is done; zero2 keeps every unit gathered from its forward to its backward."""
    from orchestrator.planning.memory import buffer_bytes, rank_memory

    shape = ModelShape(layers=8, hidden=1024, heads=16, vocab=128_000, seq=4096, bias=False)
    layout = byte_layout("bf16")
    for strategy in ("zero3", "hsdp", "zero2"):
        m = rank_memory(strategy, shape, 1, 8, 2, "none", layout, 0.0, on_gpu=False, micro_steps=1)
        assert m.grads == 0  # the loss's backward is the peak
        st = runtime_states(strategy, shape, 1, 8, layout)
        held = buffer_bytes(strategy, shape, 1, 8, layout, 0.0, 2, on_gpu=False) - st.unsharded_grads
        assert m.buffers == (st.gathered if strategy == "zero2" else 0) and held == st.gathered > 0
