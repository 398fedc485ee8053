"""benchmarks/large_model_cpu.py's own logic, without a run: what it reads from a run directory,
and its refusal of a run that cannot fit the memory free now."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import large_model_cpu  # noqa: E402

from orchestrator.errors import UserError  # noqa: E402

GIB = 2**30


def _run_dir(tmp_path: Path, losses: list[float]) -> Path:
    total = 2 * GIB
    summary = {
        "num_params": 1000, "strategy": "zero3", "mesh": {"dp_shard": 2}, "first_val_loss": 10.0,
        "final_val_loss": 9.0, "step_s": 1.0, "wall_s": 10.0, "notes": [], "warnings": ["w"],
        "predicted": {"peak_memory_bytes_per_rank": total},
        "measured": {"memory_source": "rss", "peak_memory_bytes_per_rank": [3 * GIB, 2 * GIB],
                     "baseline_memory_bytes_per_rank": [GIB // 2, GIB // 2],
                     "model_state_bytes_per_rank": [{"params": 10, "grads": 10, "optimizer": 20}] * 2},
    }
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    (tmp_path / "plan.json").write_text(json.dumps({"memory_per_rank": {"total": total}}))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "loss": v}) + "\n"
                                                    for i, v in enumerate(losses)))
    return tmp_path


def test_figures_set_each_ranks_growth_above_its_baseline_against_the_plan(tmp_path):
    found = large_model_cpu.figures(_run_dir(tmp_path, [10.0, 9.5, 9.0]))
    assert [r["ratio"] for r in found["ranks"]] == [1.25, 0.75]
    assert found["ranks"][0]["above_baseline_bytes"] == 2.5 * GIB and found["ranks"][1]["model_state_bytes"] == 40
    assert found["loss"]["trains"] and found["loss"]["train"] == [10.0, 9.5, 9.0]
    assert found["whole_model_state_bytes_per_rank"] == 16_000


def test_a_loss_that_does_not_fall_is_not_training(tmp_path):
    assert not large_model_cpu.figures(_run_dir(tmp_path, [10.0, 10.2]))["loss"]["trains"]


def test_a_run_that_cannot_fit_the_free_memory_is_refused_in_one_line(monkeypatch):
    import psutil

    # 4 ranks x (the plan's 4 GiB + 0.5 GiB of baseline)
    plan = {"world_size": 4, "memory_per_rank": {"total": 4 * GIB}, "model": {"params": GIB // 4}}
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=17 * GIB))
    with pytest.raises(UserError) as e:
        large_model_cpu.refuse_unless_it_fits(plan)
    assert "\n" not in str(e.value) and "18.0 GiB" in str(e.value) and "17.0 GiB is free" in str(e.value)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=19 * GIB))
    large_model_cpu.refuse_unless_it_fits(plan)
