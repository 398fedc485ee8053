"""Which plans a trial runs, whether it is worth its cost, and the calibration it leaves for
the next plan (pure: no Ray, no torch)."""

from __future__ import annotations

import json

import pytest

from orchestrator.cli import main
from orchestrator.config import load_config
from orchestrator.errors import ConfigError
from orchestrator.planning import plan_job
from orchestrator.planning.calibration import Calibration, load, term_ratios
from orchestrator.planning.trial import (
    candidates,
    equal_links,
    error_band,
    pinned,
    signature,
    trial_limit,
    within_band,
    worth_it,
)
from orchestrator.topology.model import ClusterTopology, Network, cpu_node

# The shaped testbed's job: a large vocabulary on a small body, 2 sequences per rank.
MODEL = ["model.n_layer=2", "model.n_head=4", "model.n_embd=256", "model.vocab_size=50304", "model.block_size=32",
         "parallel.tp=1", "train.global_batch_size=8"]


def _cluster(nodes: int, gbit: float, slots: int = 2) -> ClusterTopology:
    return ClusterTopology(nodes=[cpu_node(slots, f"n{i}", f"node-{i}") for i in range(nodes)],
                           network=Network(gbit / 8, 300.0, "measured"))


def _cfg(*extra: str):
    return load_config(None, [*MODEL, *extra])


@pytest.mark.parametrize("gbit", [0.05, 0.3, 1.0, 4.0])
def test_the_choice_and_the_equal_links_plan_come_first_then_runners_up_inside_the_band(gbit):
    topo = _cluster(2, gbit)
    cfg = _cfg("parallel.trial=4")
    planned = plan_job(cfg, topo)
    cands = candidates(cfg, topo, planned, 4)
    assert cands[0].label == "planned" and cands[0].plan is planned
    blind = plan_job(equal_links(cfg, topo), topo)
    labels = [c.label for c in cands]
    if signature(plan_job(pinned(cfg, blind), topo)) != signature(planned):
        assert labels[1] == "equal links"
        eq = cands[1].plan
        assert (eq.strategy, eq.mesh, eq.execution.sync_algorithm) == (
            blind.strategy, blind.mesh, blind.execution.sync_algorithm)
        # Priced on the real links, not the equal ones it was chosen on.
        assert eq.step_time.total_s >= planned.step_time.total_s
    assert len({signature(c.plan) for c in cands}) == len(cands) <= 4
    for c in cands:
        assert c.plan.world_size == planned.world_size and c.plan.fits
        if c.label == "runner-up":
            assert within_band(c.plan.step_time, planned.step_time)


def test_a_slow_network_puts_a_plan_the_links_decide_against_the_one_that_ignores_them():
    topo = _cluster(2, 0.15)
    cfg = _cfg("parallel.trial=2")
    cands = candidates(cfg, topo, plan_job(cfg, topo), 2)
    assert [c.label for c in cands] == ["planned", "equal links"]
    assert "sees every link alike" in cands[1].why
    assert cands[0].plan.step_time.total_s < cands[1].plan.step_time.total_s


@pytest.mark.parametrize("extra", [[], ["parallel.pp=2"], ["parallel.strategy=hsdp"], ["parallel.sync=hierarchical"],
                                   ["parallel.strategy=zero3", "parallel.accum_sync=per_micro_step",
                                    "train.micro_batch_size=1"]])
def test_pinning_a_plan_plans_it_again(extra):
    topo = _cluster(2, 0.5)
    plan = plan_job(_cfg(*extra), topo)
    again = plan_job(pinned(_cfg(), plan), topo)
    assert signature(again) == signature(plan)
    assert again.step_time.total_s == pytest.approx(plan.step_time.total_s)


def test_error_band_weighs_each_term_by_its_share():
    from orchestrator.planning.plan import StepTime

    compute_only = StepTime(1.0, 0.0, 0.0, 1.0)
    assert error_band(compute_only) == pytest.approx(0.26)
    assert within_band(StepTime(1.5, 0, 0, 1.5), compute_only)  # 1.11 <= 1.26
    assert not within_band(StepTime(1.8, 0, 0, 1.8), compute_only)  # 1.33 > 1.26


def test_when_a_trial_runs():
    assert trial_limit(_cfg(), 1) == (0, "one node: parallel.trial=auto tries plans on multi-node runs only")
    assert trial_limit(_cfg(), 2)[0] == 3
    assert trial_limit(_cfg("parallel.trial=off"), 2) == (0, "parallel.trial=off")
    assert trial_limit(_cfg("parallel.trial=5"), 1) == (5, "")
    topo = _cluster(2, 0.15)
    short, long = _cfg("train.max_steps=20"), _cfg("train.max_steps=20000")
    plan = plan_job(short, topo)
    cands = candidates(short, topo, plan, 3)
    why = worth_it(short, plan, cands)
    assert "is too short" in why and "parallel.trial_budget=0.05" in why
    assert worth_it(long, plan_job(long, topo), candidates(long, topo, plan_job(long, topo), 3)) == ""
    # A number asked for runs whatever the run's length.
    assert worth_it(_cfg("parallel.trial=2", "train.max_steps=20"), plan, cands) == ""
    assert "no other plan" in worth_it(long, plan, cands[:1])
    assert equal_links(_cfg(), _cluster(1, 0.15)) is None
    assert equal_links(_cfg(), _cluster(2, 0.15, slots=1)) is None


@pytest.mark.parametrize("value, message", [
    ("1", "a number of plans >= 2, got 1"), ("maybe", "got 'maybe'"), ("true", "got True"),
])
def test_bad_trial_settings_are_one_line(value, message):
    with pytest.raises(ConfigError) as e:
        _cfg(f"parallel.trial={value}")
    assert str(e.value).startswith("key 'parallel.trial': expected 'auto', 'off' or a number of plans >= 2")
    assert str(e.value).endswith(message)
    with pytest.raises(ConfigError, match="parallel.trial_budget"):
        _cfg("parallel.trial_budget=0")
    assert _cfg("parallel.trial=off").parallel.trial == "off"


def test_ratios_are_medians_of_the_terms_measured():
    rows = [{"predicted_compute_s": 1.0, "measured_compute_s": 2.0, "predicted_communication_s": 0.5,
             "measured_communication_s": 0.25},
            {"predicted_compute_s": 1.0, "measured_compute_s": 4.0, "predicted_communication_s": 0.5,
             "measured_communication_s": None},
            {"predicted_compute_s": 1.0, "measured_compute_s": 3.0, "predicted_communication_s": 1e-6,
             "measured_communication_s": 1.0}]  # a term predicted at nothing says nothing
    assert term_ratios(rows) == {"compute": 3.0, "communication": 0.5}
    assert term_ratios([{"predicted_compute_s": 1.0, "measured_compute_s": None}]) == {}


def test_a_calibration_scales_the_terms_it_measured_and_the_explanation_says_so(tmp_path):
    topo = _cluster(2, 0.5)
    cfg = _cfg("parallel.strategy=ddp", "parallel.pp=1", "parallel.sync=flat")
    base = plan_job(cfg, topo)
    (tmp_path / "calibration.json").write_text(json.dumps({"ratios": {"compute": 2.0, "communication": 0.5}}))
    cal = load(str(tmp_path))
    assert (cal.compute, cal.communication, cal.source) == (2.0, 0.5, str(tmp_path))
    scaled = plan_job(cfg, topo, calibration=cal)
    assert scaled.step_time.compute_s == pytest.approx(2 * base.step_time.compute_s)
    assert scaled.step_time.exposed_comm_s == pytest.approx(0.5 * base.step_time.exposed_comm_s)
    assert any(line.startswith("priced with the measured calibration of") for line in scaled.explanation)
    assert not any("calibration" in line for line in base.explanation)
    # The search prices every candidate so: the fastest under the calibration is the choice.
    free = plan_job(_cfg(), topo, calibration=Calibration(communication=50.0))
    for alt in free.alternatives:
        if alt.fits and alt.step_time_s is not None:
            assert alt.step_time_s >= free.step_time.total_s * 0.99


@pytest.mark.parametrize("content, message", [
    (None, "no calibration.json at"), ("{", "is not readable JSON"), ('{"ratios": {}}', "holds no 'ratios'"),
    ('{"ratios": {"network": 2}}', "unknown term(s) ['network']"),
    ('{"ratios": {"compute": -1}}', "must be a positive ratio"),
])
def test_a_bad_calibration_is_one_line_exit_2(tmp_path, capsys, content, message):
    if content is not None:
        (tmp_path / "calibration.json").write_text(content)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        load(str(tmp_path))
    assert main(["plan", "--topology", "tests/fixtures/topology/topo_4gpu_pcie_pxb_pix_nccl667.txt", "--gpu", "A100",
                 "--calibration", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "key 'parallel.calibration'" in err[0]
    # submit refuses it before any cluster or run directory exists.
    runs = tmp_path / "runs"
    assert main(["submit", "jobs/llm.yaml", f"parallel.calibration={tmp_path}", f"monitor.runs_dir={runs}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "key 'parallel.calibration'" in err[0] and not runs.exists()
