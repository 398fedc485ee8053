"""plan.json files the planner wrote before load as the Plan they describe, and write back the same."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.choices import Strategy
from orchestrator.planning.compile import EAGER
from orchestrator.planning.plan import Plan

PLANS = Path(__file__).resolve().parent / "fixtures" / "plans"
FILES = sorted(PLANS.glob("*.json"))


def test_there_are_stored_plans():
    assert len(FILES) >= 5


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_stored_plan_loads_and_writes_back_the_same(path):
    stored = json.loads(path.read_text())
    plan = Plan.from_dict(stored)
    assert plan.world_size == len(stored["ranks"])
    assert plan.to_dict() == stored


def test_stored_plan_reads_what_it_says():
    plan = Plan.from_dict(json.loads((PLANS / "gpt7b-4n-pp4-inter.json").read_text()))
    assert plan.strategy == Strategy.ddp
    assert (plan.mesh.pp, plan.mesh.dp_replicate, plan.mesh.dp_shard, plan.mesh.tp) == (4, 8, 1, 1)
    assert plan.execution.pipeline is not None and plan.execution.pipeline.stages == 4
    assert plan.compile.enabled


def test_a_plan_written_before_its_later_keys_loads_with_their_stated_defaults():
    stored = json.loads((PLANS / "gpt7b-8n-hsdp.json").read_text())
    for key in ("alternatives", "explanation", "left_out", "compile"):
        del stored[key]
    for key in ("flat_reason", "notes", "pipeline", "reduce_every_micro_step"):
        del stored["execution"][key]
    del stored["sync"]["accum_sync"]  # written with reduce_every_micro_step, as the runtime's choice of it
    plan = Plan.from_dict(stored)
    assert plan.alternatives == () and plan.explanation == () and plan.left_out == ()
    assert plan.compile == EAGER
    assert plan.execution.flat_reason == "" and plan.execution.notes == ()
    assert plan.execution.pipeline is None
    # Plans written before the choice existed ran every micro-step but the last in no_sync().
    assert plan.execution.reduce_every_micro_step is False
    assert plan.sync.accum_sync == "last_micro_step"


def test_a_plan_whose_stated_strategy_disagrees_with_its_execution_does_not_load():
    stored = json.loads((PLANS / "gpt7b-8n-hsdp.json").read_text())
    stored["strategy"] = "zero3"
    with pytest.raises(ValueError, match="plan.json says zero3 .* its execution runs hsdp"):
        Plan.from_dict(stored)


def test_a_runs_plan_json_reads_as_its_plan_whatever_the_run_added_beside_it():
    # A run's plan.json carries its trial section, `plan --json --rehearse` a rehearsal: the
    # report and a resume read the plan out of both.
    import json

    from orchestrator.planning.plan import Plan

    written = json.loads((PLANS / "cpu-2x4.json").read_text())
    plan = Plan.from_dict(written)
    assert Plan.from_dict({**written, "trial": {"ran": False}, "rehearsal": {}}) == plan
