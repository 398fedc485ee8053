"""The first run's predictions beside what it measured, each figure compared like with like: the
step time re-priced from the compute the ranks measured, exposed communication split into
moving bytes and waiting for the slowest rank, CPU memory shown as RSS and not as a missed
prediction, and the host's CPU rate corrected by what a run measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.planning.plan import Plan
from orchestrator.record.summary import exposed_split, repriced_step_s
from orchestrator.runtime.cpu_rate import implied_cpu_slot_tflops

PLAN = Path(__file__).parent / "fixtures" / "plans" / "cpu-2x4.json"


@pytest.fixture(scope="module")
def plan() -> Plan:
    # ddp on CPU slots: compute 35.56 ms, exposed communication 7.39 ms, one accumulation step,
    # each slot priced at 0.2 TFLOP/s.
    return Plan.from_dict(json.loads(PLAN.read_text()))


def test_the_step_is_re_priced_from_the_slowest_ranks_measured_compute(plan):
    # Ranks measured 50 ms and 71.1 ms of compute: the slowest sets the step, twice the plan's
    # 35.56 ms, so the compute doubles and the communication stays as planned:
    # 2 x 35.56 + 7.39 = 78.5 ms.
    setups = [{"compute_micro_s": 0.050}, {"compute_micro_s": 2 * 0.0355577856}]
    assert repriced_step_s(plan, setups) == pytest.approx(2 * 0.0355577856 + 0.0073923456)
    assert repriced_step_s(plan, [{"compute_micro_s": None}, {}]) is None  # nothing measured: not re-priced


def test_the_rate_a_run_measured_is_the_one_its_compute_implies(plan):
    # The plan priced 35.56 ms at 0.2 TFLOP/s; the rank took 71.1 ms: the slot runs 0.1 TFLOP/s.
    assert implied_cpu_slot_tflops(plan, 2 * 0.0355577856) == pytest.approx(0.1)
    assert implied_cpu_slot_tflops(plan, None) is None


def test_exposed_communication_splits_into_transfer_and_waiting_for_the_slowest_rank():
    # Rank 1 is slow: at each step it exposes 2 ms (the transfer alone), rank 0 waits 10 ms more.
    samples = {0: [(0.30, 0.012)] * 10, 1: [(0.30, 0.002)] * 10}
    transfer, wait = exposed_split(samples)
    assert transfer == pytest.approx(0.002) and wait == pytest.approx(0.005)  # 10 ms over two ranks
    assert exposed_split({0: [(0.3, 0.01)]}) is None  # one rank: no one to wait for
    assert exposed_split({0: [(0.3, None)], 1: [(0.3, None)]}) is None  # no baseline, no split
