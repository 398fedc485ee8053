"""Per-block torch.compile: when the planner compiles (priced against the run's length), what a
block that breaks the graph gets, and that compiled blocks train exactly as eager ones under
every way the runtime composes them (DDP, FSDP2 with recomputation, tensor parallelism,
pipelines), one compiled graph shared by the blocks, reused from the cache by a later process."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from orchestrator.cli import main
from orchestrator.config import load_config
from orchestrator.errors import ConfigError, PlanError
from orchestrator.planning import Plan, plan_job
from orchestrator.planning.compile import COMPILE_S, COMPILE_SPEEDUP, EAGER, decide
from orchestrator.planning.model_math import ModelShape
from orchestrator.planning.plan import block_share
from orchestrator.topology.model import ClusterTopology, cpu_node

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
TOPO = "tests/fixtures/topology/topo_4gpu_pcie_pxb_pix_nccl667.txt"


def test_auto_compiles_only_when_the_run_saves_more_than_compiling_costs():
    per_step = 0.2 * (1 - 1 / COMPILE_SPEEDUP["gpu"])
    short = decide("auto", "gpu", 0.2, steps=100)
    assert not short.enabled and short.saving_s_per_step == 0 and short.compile_s == 0
    assert f"{per_step * 1e3:.2f} ms per step" in short.reason and "a longer run would pay" in short.reason
    even = COMPILE_S["gpu"] / per_step
    assert not decide("auto", "gpu", 0.2, steps=int(even) - 1).enabled
    long = decide("auto", "gpu", 0.2, steps=int(even) + 1)
    assert long.enabled and long.compile_s == COMPILE_S["gpu"]
    assert long.saving_s_per_step == pytest.approx(per_step)
    # On CPU ranks compiling measured no gain beyond the spread between launches: never under auto.
    cpu = decide("auto", "cpu", 10.0, steps=10**7)
    assert not cpu.enabled and "saves nothing measurable on cpu ranks" in cpu.reason


def test_true_and_false_are_obeyed_and_a_break_is_eager_under_auto_refused_under_true():
    assert decide("true", "cpu", 0.001, 2).enabled
    assert decide("false", "gpu", 10.0, 10**6) == EAGER
    where = "blocks.py:12 `print(x)`: Failed to trace builtin operator"
    fallback = decide("auto", "gpu", 10.0, 10**6, graph_break=where)
    assert not fallback.enabled and where in fallback.reason
    with pytest.raises(PlanError, match=r"^key 'train.compile': true, but the block does not compile as one graph "
                                        r"\(blocks.py:12"):
        decide("true", "cpu", 1.0, 10, graph_break=where)
    with pytest.raises(ValueError, match="train.compile must be one of auto, true, false"):
        decide("yes", "cpu", 1.0, 10)


@pytest.mark.parametrize(("given", "want"), [(True, "true"), (False, "false"), ("on", "true"), ("off", "false"),
                                             ("auto", "auto"), ("TRUE", "true")])
def test_train_compile_reads_the_spellings_users_write(given, want):
    cfg = load_config(None, [])
    cfg.train.compile = given
    from orchestrator.config import validate

    validate(cfg)
    assert cfg.train.compile == want


def test_a_bad_train_compile_is_one_line_exit_2(capsys):
    assert main(["plan", "jobs/llm.yaml", "train.compile=maybe"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: key 'train.compile': expected auto, true or false, got 'maybe'"]
    with pytest.raises(ConfigError):
        load_config(None, ["train.compile=3"])


def test_the_default_job_runs_eager_and_a_long_run_on_gpus_compiles_with_the_step_it_saves():
    from clusters import dgx_a100

    short = plan_job(load_config("jobs/llm.yaml", ["cluster.num_workers=2"]), ClusterTopology(nodes=[cpu_node(2)]))
    assert not short.compile.enabled and short.run_step_s == short.step_time.total_s
    assert any(line.startswith("compile: blocks run eager: compiling costs about") for line in short.explanation)
    big = ["model.n_layer=24", "model.n_embd=2048", "model.n_head=16", "model.block_size=2048",
           "train.global_batch_size=256"]
    brief = plan_job(load_config(None, [*big, "train.max_steps=10"]), dgx_a100(1))
    long = plan_job(load_config(None, [*big, "train.max_steps=20000"]), dgx_a100(1))
    assert not brief.compile.enabled and long.compile.enabled and long.compile.steps == 20000
    # Only the blocks speed up: the saving is their share of the step's compute.
    share = block_share(ModelShape.from_config(load_config(None, big).model), 256, str(long.recompute))
    assert 0.5 < share < 1
    assert long.compile.saving_s_per_step == pytest.approx(
        long.step_time.compute_s * share * (1 - 1 / COMPILE_SPEEDUP["gpu"]))
    assert long.run_step_s == pytest.approx(long.step_time.total_s - long.compile.saving_s_per_step)
    # The search's own figures stay the eager step's, so compiling changes no other choice.
    assert long.step_time == brief.step_time and long.strategy == brief.strategy and long.mesh == brief.mesh
    assert any(line.startswith("compile: blocks compiled: compiling costs about") for line in long.explanation)
    again = Plan.from_dict(json.loads(json.dumps(long.to_dict())))
    assert again.compile == long.compile
    older = long.to_dict()
    del older["compile"]
    assert Plan.from_dict(older).compile == EAGER


def test_block_share_leaves_the_head_out():
    shape = ModelShape.from_config(load_config(None, ["model.n_layer=2", "model.n_embd=64", "model.vocab_size=256",
                                                      "model.block_size=32"]).model)
    h, s, v, layers = 64, 32, 256, 2
    blocks = layers * (24 * h * h + 4 * s * h)
    assert block_share(shape, 8, "none") == pytest.approx(blocks / (blocks + 2 * h * v))
    assert block_share(shape, 8, "full") > block_share(shape, 8, "none")


def test_the_builtin_models_compile_as_one_graph_and_a_break_is_named():
    from orchestrator.workloads.compile_check import graph_break

    assert graph_break(load_config(None, []).model) is None
    llama = ["model.factory=orchestrator.workloads.llama:build", "model.args.dim=32", "model.args.n_layers=2",
             "model.args.n_heads=4", "model.args.n_kv_heads=2", "model.args.ffn_dim=64", "model.args.vocab_size=256",
             "model.block_size=16"]
    assert graph_break(load_config(None, llama).model) is None
    ours = graph_break(load_config(None, ["model.factory=_compile_models:build", "model.block_size=16"]).model)
    assert ours is not None and ours.startswith("_compile_models.py:")
    assert "`y = y + os.getpid() * 0" in ours and "Attempted to call function marked as skipped" in ours
    assert graph_break(load_config(None, ["model.factory=_compile_models:build", "model.args.breaks=false",
                                          "model.block_size=16"]).model) is None


def test_plan_refuses_a_breaking_block_under_true_and_runs_it_eager_under_auto(capsys):
    # Wide enough, and long enough a run, that an A100 plan would compile it.
    model = ["model.factory=_compile_models:build", "model.args.width=2048", "model.args.layers=8",
             "model.block_size=1024", "train.max_steps=100000"]
    assert main(["plan", "--topology", TOPO, "--gpu", "A100", "jobs/llm.yaml", *model, "train.compile=true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: key 'train.compile': true, but the block does not compile "
                                               "as one graph (_compile_models.py:")
    # Under auto the block is traced once the plan would compile it, and then runs eager.
    assert main(["plan", "--topology", TOPO, "--gpu", "A100", "jobs/llm.yaml", *model, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["compile"]["enabled"] is False and "does not compile as one graph" in out["compile"]["reason"]
    # The same model without the break compiles.
    assert main(["plan", "--topology", TOPO, "--gpu", "A100", "jobs/llm.yaml", *model, "model.args.breaks=false",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["compile"]["enabled"] is True


def test_a_plan_that_never_compiles_never_traces_the_block(monkeypatch):
    """Tracing imports dynamo (seconds): a run that stays eager does not pay for it."""
    from orchestrator.control import preflight
    from orchestrator.workloads import compile_check

    monkeypatch.setattr(compile_check, "graph_break", lambda *a, **k: pytest.fail("traced"))
    cfg = load_config(None, ["model.factory=_compile_models:build", "model.block_size=16"])
    spec = preflight.measure_model(cfg)
    assert spec is not None and not spec.compile_checked
    assert not plan_job(cfg, ClusterTopology(nodes=[cpu_node(2)]), spec).compile.enabled


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    """{case: {"eager": [...], "compiled": [...], "graphs": n}} from real gloo ranks, and the same
    compiled run again in fresh processes, whose inductor cache counters are kept."""
    import _compile_worker as cw
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("compile")
    out = {}
    for world in sorted({c.world for c in cw.CASES}):
        mp.spawn(cw.run_rank, args=(world, str(tmp / f"init-{world}"), str(tmp), False), nprocs=world, join=True)
    mp.spawn(cw.run_rank, args=(2, str(tmp / "init-again"), str(tmp), True), nprocs=2, join=True)
    for f in tmp.glob("*.json"):
        out[f.stem] = json.loads(f.read_text())
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", ["ddp", "zero3_full_recompute", "tp2", "pp2"])
def test_compiled_blocks_train_as_eager_ones_under_every_composition(parity, case):
    got = parity[case]
    assert got["compiled"] == pytest.approx(got["eager"], rel=1e-5, abs=1e-6), case
    # Every block shares the one compiled graph (per class, not per layer).
    assert got["graphs"] == 1, f"{case}: {got['graphs']} compiled graphs for 2 blocks of one class"


@pytest.mark.slow
def test_a_later_process_finds_the_compiled_graphs_in_the_cache(parity):
    again = parity["ddp-again"]
    assert again["cache"]["fxgraph_cache_miss"] == 0 and again["cache"]["fxgraph_cache_hit"] > 0, again["cache"]
    assert again["compiled"] == pytest.approx(parity["ddp"]["compiled"], rel=1e-6)
