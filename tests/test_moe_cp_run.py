"""A Mixture-of-Experts job submitted with experts and sequences split over the ranks
(`parallel.ep=2 parallel.cp=2`, jobs/moe-tiny-cpu.yaml) trains through the driver as the same
job does on plain data parallelism, and records every layer's load per expert."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from rich.console import Console

from orchestrator.config import load_config
from orchestrator.connect.cluster import connect
from orchestrator.control.driver import run_job
from orchestrator.record.rundir import RunDir

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "jobs" / "moe-tiny-cpu.yaml"
STEPS = 4
pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster():
    with connect(None, num_cpus=4):
        yield


def _run(tmp_path: Path, *overrides: str) -> tuple[dict, list[dict]]:
    cfg = load_config(JOB, [f"train.max_steps={STEPS}", f"train.eval_interval={STEPS}", "parallel.trial=false",
                            f"monitor.runs_dir={tmp_path}", *overrides])
    run = RunDir.create(cfg.monitor.runs_dir, cfg.name)
    run_job(cfg, run, Console(file=open(os.devnull, "w")))
    plan = json.loads((run.path / "plan.json").read_text())
    rows = [json.loads(line) for line in (run.path / "metrics.jsonl").read_text().splitlines()]
    return plan, rows


def test_experts_and_sequences_split_over_the_ranks_train_as_data_parallelism_does(cluster, tmp_path):
    split_plan, split = _run(tmp_path, "parallel.ep=2", "parallel.cp=2")
    assert split_plan["mesh"]["ep"] == 2 and split_plan["mesh"]["cp"] == 2
    plain_plan, plain = _run(tmp_path, "parallel.ep=1", "parallel.cp=1")
    assert "ep" not in plain_plan["mesh"] and "cp" not in plain_plan["mesh"]
    assert [r["step"] for r in split] == list(range(1, STEPS + 1))
    for a, b in zip(split, plain):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), a["step"]
    assert split[-1]["val_loss"] == pytest.approx(plain[-1]["val_loss"], rel=1e-4)
    # Every token goes to top_k=2 experts in each of the 2 MoE layers: 8 sequences of 64 tokens.
    for row in split:
        assert [sum(layer) for layer in row["expert_tokens"]] == [8 * 64 * 2] * 2
        assert all(i >= 1.0 for i in row["expert_imbalance"])
