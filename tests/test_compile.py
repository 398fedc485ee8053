"""Per-block torch.compile: when the planner compiles (priced against the run's length), what a
block that breaks the graph gets, and that compiled blocks train exactly as eager ones under
every way the runtime composes them (DDP, FSDP2 with recomputation, tensor parallelism,
pipelines), one compiled graph shared by the blocks, reused from the cache by a later process."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from orchestrator.cli import main
from orchestrator.config import load_config
from orchestrator.errors import ConfigError, PlanError
from orchestrator.planning import Plan, plan_job
from orchestrator.planning.calibration import (
    MAX_SPEEDUP,
    CompileGain,
    block_speedup,
    speedup_from_saving,
    with_compile_gain,
)
from orchestrator.planning.calibration import load as load_calibration
from orchestrator.planning.compile import AUTO_MARGIN, COMPILE_S, COMPILE_SPEEDUP, EAGER, block_saving_s, decide
from orchestrator.planning.flow import block_share
from orchestrator.planning.model_math import ModelShape
from orchestrator.topology.model import ClusterTopology, cpu_node

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
TOPO = "tests/fixtures/topology/topo_4gpu_pcie_pxb_pix_nccl667.txt"


def test_auto_compiles_only_when_the_run_saves_more_than_compiling_costs():
    per_step = 0.2 * (1 - 1 / COMPILE_SPEEDUP["gpu"])
    short = decide("auto", "gpu", 0.2, steps=100)
    assert not short.enabled and short.saving_s_per_step == 0 and short.compile_s == 0
    # It must save twice what compiling costs (AUTO_MARGIN): the reason says from how many steps.
    even = AUTO_MARGIN * COMPILE_S["gpu"] / per_step
    assert f"{per_step * 1e3:.2f} ms per step" in short.reason
    assert short.reason.endswith(f"it compiles where a run saves 2x what compiling costs, "
                                 f"{math.ceil(even)} steps or more")
    assert not decide("auto", "gpu", 0.2, steps=int(even) - 1).enabled
    long = decide("auto", "gpu", 0.2, steps=int(even) + 1)
    assert long.enabled and long.compile_s == COMPILE_S["gpu"]
    assert long.saving_s_per_step == pytest.approx(per_step)
    # On CPU ranks compiling measured no gain beyond the spread between launches: never under auto.
    cpu = decide("auto", "cpu", 10.0, steps=10**7)
    assert not cpu.enabled and "saves nothing measurable on cpu ranks" in cpu.reason


def test_auto_prices_a_measured_gain_instead_of_the_table():
    gain = CompileGain(model="gpt", block_class="Block", params=1000, speedup=2.0, compile_s=4.0)
    # 0.25 s of blocks twice as fast: 125 ms a step, so 64 steps save twice the 4 s of compiling.
    long = decide("auto", "cpu", 0.25, 64, measured=gain, source="runs/a")
    assert long.enabled and long.compile_s == 4.0 and long.saving_s_per_step == 0.125
    assert long.measured  # the runtime compiles without timing the gain again
    assert "2.00x as fast compiled, measured in runs/a" in long.reason
    short = decide("auto", "cpu", 0.25, 63, measured=gain, source="runs/a")
    assert not short.enabled and not short.measured and short.reason.endswith("64 steps or more")
    assert not decide("true", "cpu", 0.2, 10).measured  # the table's price: the run times the gain
    slower = decide("auto", "gpu", 0.2, 10**6, measured=replace(gain, speedup=0.9), source="runs/b")
    assert not slower.enabled and "compiled blocks ran 0.90x as fast as eager in runs/b" in slower.reason
    # What the user asks for still wins, and a break still keeps auto eager.
    assert decide("true", "cpu", 0.2, 1, measured=replace(gain, speedup=0.9)).enabled
    assert not decide("auto", "cpu", 0.2, 10**6, graph_break="x.py:1", measured=gain).enabled


def test_block_speedup_gives_the_whole_pass_difference_to_the_blocks():
    # A 1.0 s pass, 0.8 s of it blocks, 0.9 s compiled: blocks 0.8 -> 0.7 s.
    assert block_speedup(1.0, 0.9, 0.8) == pytest.approx(0.8 / 0.7)
    assert block_speedup(1.0, 1.1, 0.8) == pytest.approx(0.8 / 0.9)  # compiled ran slower
    assert block_speedup(1.0, 0.1, 0.5) == MAX_SPEEDUP  # more saved than the blocks took: noise, capped
    with pytest.raises(ValueError):
        block_speedup(1.0, 0.9, 0.0)


def test_a_later_plan_of_the_same_model_takes_the_measured_gain_another_model_does_not(tmp_path):
    cfg = load_config("jobs/llm.yaml", ["cluster.num_workers=2", "train.max_steps=100000"])
    topo = ClusterTopology(nodes=[cpu_node(2)])
    eager = plan_job(cfg, topo)
    assert not eager.compile.enabled  # the table prices CPU ranks at no gain
    m = eager.model
    (tmp_path / "calibration.json").write_text(json.dumps(with_compile_gain(
        {"ratios": {"compute": 1.1}}, CompileGain(m.name, m.block_class, m.params, speedup=1.2, compile_s=3.0))))
    cal = load_calibration(str(tmp_path))
    assert cal.compute == 1.1 and cal.compile.speedup == 1.2  # a trial's ratios kept beside it
    measured = plan_job(cfg, topo, calibration=cal)
    assert measured.compile.enabled and f"measured in {tmp_path}" in measured.compile.reason
    assert measured.compile.block_share == pytest.approx(
        block_share(ModelShape.from_config(cfg.model), cfg.train.global_batch_size, str(measured.recompute)))
    assert Plan.from_dict(json.loads(json.dumps(measured.to_dict()))).compile == measured.compile
    wider = load_config("jobs/llm.yaml", ["cluster.num_workers=2", "train.max_steps=100000", "model.n_embd=192"])
    other = plan_job(wider, topo, calibration=cal)
    assert not other.compile.enabled
    assert any(line.startswith(f"compile: the calibration's compile figure ({tmp_path}) was measured on gpt "
                               f"(Block, {m.params:,} parameters), not this model") for line in other.explanation)


def test_a_compiled_run_records_its_measured_gain_where_a_later_plan_reads_it(tmp_path):
    from orchestrator.record.rundir import RunDir
    from orchestrator.record.summary import compile_record, save_compile_gain

    cfg = load_config("jobs/llm.yaml", ["cluster.num_workers=2", "train.compile=true"])
    plan = plan_job(cfg, ClusterTopology(nodes=[cpu_node(2)]))
    share = plan.compile.block_share
    rows = [{"step_s": 3.0}] + [{"step_s": 0.1}] * 9
    setups = [{"compile_times": {"compiled_s": 0.09, "eager_s": 0.1, "compile_s": 2.5}},
              {"compile_times": {"compiled_s": 0.09, "eager_s": 0.1, "compile_s": 2.9}}]
    rec = compile_record(plan, rows, [{}, {}], setups)
    # The slowest rank's compile; the whole pass's 10 ms saved is the blocks'.
    assert rec["measured_compile_s"] == 2.9 and rec["measured_pass_speedup"] == pytest.approx(0.1 / 0.09)
    assert rec["measured_speedup"] == pytest.approx(0.1 * share / (0.1 * share - 0.01))
    run = RunDir(tmp_path)
    run.write_json("calibration.json", {"ratios": {"communication": 0.9}})  # a trial's, kept
    line = save_compile_gain(run, plan, rec)
    assert line.startswith(f"compile: the blocks ran {rec['measured_speedup']:.2f}x as fast compiled and compiling "
                           f"took 2.9 s; parallel.calibration={tmp_path} prices")
    cal = load_calibration(str(tmp_path))
    assert cal.communication == 0.9 and cal.compile.speedup == pytest.approx(rec["measured_speedup"], rel=1e-3)
    assert cal.compile.same_model(plan.model.name, plan.model.block_class, plan.model.params)
    # A pipeline's ranks time no pass: the first step's excess is the compile, and nothing is saved.
    piped = compile_record(plan, rows, [{}, {}], [{}, {}])
    assert piped["measured_compile_s"] == pytest.approx(2.9) and "measured_speedup" not in piped
    assert save_compile_gain(run, plan, piped) is None
    eager = plan_job(load_config("jobs/llm.yaml", ["cluster.num_workers=2"]), ClusterTopology(nodes=[cpu_node(2)]))
    assert "measured_compile_s" not in compile_record(eager, rows, [{}, {}], setups)


def test_steps_trained_both_ways_are_the_gain_a_later_plan_prices_back(tmp_path):
    """Where the ranks timed whole steps eager and compiled, the blocks' speedup is the one that
    saves what the steps saved: the same plan, priced from it, predicts exactly that saving."""
    from orchestrator.record.rundir import RunDir
    from orchestrator.record.summary import compile_record, save_compile_gain

    cfg = load_config("jobs/llm.yaml", ["cluster.num_workers=2", "train.compile=true", "train.max_steps=1000"])
    topo = ClusterTopology(nodes=[cpu_node(2)])
    plan = plan_job(cfg, topo)
    block_s = plan.compile.block_compute_s
    assert block_s > 0.001
    rows = [{"step_s": 3.0}] + [{"step_s": 0.1}] * 9
    setups = [{"compile_times": {"compiled_s": 0.09, "eager_s": 0.1, "compile_s": 2.5}}] * 2
    # The fastest step of each kind counts; rank 1's 1 ms less saving is the median's other half.
    finals = [{"compile_steps": {"eager_s": [0.205, 0.2, 0.21, 0.2], "compiled_s": [0.2 - 0.001, 0.22, 0.2, 0.2]}},
              {"compile_steps": {"eager_s": [0.2, 0.2, 0.2, 0.2], "compiled_s": [0.2, 0.2, 0.2, 0.2]}}]
    rec = compile_record(plan, rows, finals, setups)
    eager, compiled = 0.2, 0.2 - 0.0005
    assert rec["measured_step_speedup"] == pytest.approx(eager / compiled)
    assert rec["measured_speedup_from"] == "steps"
    assert rec["measured_pass_speedup"] == pytest.approx(0.1 / 0.09)  # the passes', kept beside it
    assert rec["measured_speedup"] == pytest.approx(block_s / (block_s - 0.0005))
    assert block_saving_s(block_s, rec["measured_speedup"]) == pytest.approx(0.0005)
    run = RunDir(tmp_path)
    line = save_compile_gain(run, plan, rec)
    assert rec["measured_saving_s_per_step"] == pytest.approx(0.0005)
    assert line.startswith(f"compile: steps ran {eager / compiled:.2f}x as fast with the blocks compiled (0.5 ms "
                           f"saved a step) and compiling took 2.5 s")
    auto = load_config("jobs/llm.yaml", ["cluster.num_workers=2", "train.compile=auto", "train.max_steps=1000"])
    again = plan_job(auto, topo, calibration=load_calibration(str(tmp_path)))
    assert again.compile.compile_s == 0.0 and again.compile.saving_s_per_step == 0.0  # 0.5 s saved < 2 x 2.5 s
    assert "saves 0.50 ms per step" in again.compile.reason
    # Compiled steps slower than eager ones: a speedup below 1, whatever the passes said.
    slower = [{"compile_steps": {"eager_s": [0.2], "compiled_s": [0.21]}}] * 2
    assert compile_record(plan, rows, slower, setups)["measured_speedup"] == pytest.approx(block_s / (block_s + 0.01))
    # A plan.json from before the blocks' time was kept: the passes' figure, said as such.
    old = replace(plan, compile=replace(plan.compile, block_compute_s=0.0))
    assert compile_record(old, rows, finals, setups)["measured_speedup_from"] == "passes"
    # The steps that timed the gain are named, by metrics row, where the ranks said which they were.
    assert "gain_steps" not in rec
    named = {"eager": [3, 5, 7, 9], "compiled": [4, 6, 8, 10]}
    assert compile_record(plan, rows, [{**f, "compile_gain_steps": named} for f in finals],
                          setups)["gain_steps"] == named


def test_speedup_from_saving_inverts_the_saving_and_caps_noise():
    assert speedup_from_saving(0.8, 0.1) == pytest.approx(0.8 / 0.7)
    assert block_saving_s(0.8, speedup_from_saving(0.8, -0.1)) == pytest.approx(-0.1)
    assert speedup_from_saving(0.8, 0.8) == MAX_SPEEDUP
    with pytest.raises(ValueError):
        speedup_from_saving(0.0, 0.1)


@pytest.mark.parametrize(("content", "says"), [
    ({"compile": {"model": "gpt", "block_class": "Block", "params": 1, "speedup": -1, "compile_s": 1}},
     "compile 'speedup' must be a positive ratio below 100, got -1"),
    ({"compile": {"model": "gpt", "speedup": 1.1}}, "missing"),
    ({"compile": [1]}, "'compile' must be an object with model, block_class, params, speedup, compile_s"),
    ({}, "holds no 'ratios' (expected compute, communication) and no 'compile' figure"),
])
def test_a_damaged_compile_calibration_is_one_line_naming_the_key(tmp_path, content, says):
    (tmp_path / "calibration.json").write_text(json.dumps(content))
    with pytest.raises(ConfigError, match=r"^key 'parallel.calibration': ") as e:
        load_calibration(str(tmp_path))
    assert says in str(e.value) and "\n" not in str(e.value)


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
def test_a_compiled_start_times_its_pass_both_ways_and_what_compiling_took(parity):
    times = parity["ddp-again"]["compile_times"]
    assert set(times) == {"compiled_s", "eager_s", "compile_s"}
    # The warm-up traced the blocks again (the cache spares only inductor's part): it took longer.
    assert times["compile_s"] > 0 and times["compiled_s"] > 0 and times["eager_s"] > 0
    assert 0.2 < times["eager_s"] / times["compiled_s"] < 5
    assert parity["ddp-again"]["eager_times"] is None  # eager blocks: nothing to compare
    # Planned from a measured gain: the compile is timed, the gain is not timed again.
    assert set(parity["ddp-again"]["priced_times"]) == {"compiled_s", "compile_s"}


@pytest.mark.slow
def test_a_compiled_run_trains_every_other_of_its_gain_steps_eager_and_times_both(parity):
    got = parity["ddp-again"]["stepped"]
    assert got["eager_at"] == [2, 4, 6, 8]
    steps = got["compile_steps"]
    assert len(steps["eager_s"]) == len(steps["compiled_s"]) == 4
    assert 0.2 < min(steps["eager_s"]) / min(steps["compiled_s"]) < 5
    # Planned from a measured gain: no step runs eager.
    assert parity["ddp-again"]["stepped_priced"] == {"compile_steps": {"eager_s": [], "compiled_s": []},
                                                     "eager_at": []}


@pytest.mark.slow
def test_a_later_process_finds_the_compiled_graphs_in_the_cache(parity):
    again = parity["ddp-again"]
    assert again["cache"]["fxgraph_cache_miss"] == 0 and again["cache"]["fxgraph_cache_hit"] > 0, again["cache"]
    assert again["compiled"] == pytest.approx(parity["ddp"]["compiled"], rel=1e-6)
