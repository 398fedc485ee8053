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


def _run(tmp_path: Path, *overrides: str) -> tuple[dict, list[dict], Path]:
    cfg = load_config(JOB, [f"train.max_steps={STEPS}", f"train.eval_interval={STEPS}", "parallel.trial=false",
                            f"monitor.runs_dir={tmp_path}", *overrides])
    run = RunDir.create(cfg.monitor.runs_dir, cfg.name)
    run_job(cfg, run, Console(file=open(os.devnull, "w")))
    plan = json.loads((run.path / "plan.json").read_text())
    rows = [json.loads(line) for line in (run.path / "metrics.jsonl").read_text().splitlines()]
    return plan, rows, run.path


def test_experts_and_sequences_split_over_the_ranks_train_as_data_parallelism_does(cluster, tmp_path):
    split_plan, split, split_dir = _run(tmp_path, "parallel.ep=2", "parallel.cp=2", "checkpoint.enabled=true")
    assert split_plan["mesh"]["ep"] == 2 and split_plan["mesh"]["cp"] == 2
    plain_plan, plain, _ = _run(tmp_path, "parallel.ep=1", "parallel.cp=1")
    assert "ep" not in plain_plan["mesh"] and "cp" not in plain_plan["mesh"]
    assert [r["step"] for r in split] == list(range(1, STEPS + 1))
    for a, b in zip(split, plain):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), a["step"]
    assert split[-1]["val_loss"] == pytest.approx(plain[-1]["val_loss"], rel=1e-4)
    # Every token goes to top_k=2 experts in each of the 2 MoE layers: 8 sequences of 64 tokens.
    for row in split:
        assert [sum(layer) for layer in row["expert_tokens"]] == [8 * 64 * 2] * 2
        assert all(i >= 1.0 for i in row["expert_imbalance"])

    _exports_with_the_last_checkpoints_logits(split_dir, tmp_path / "hf")


def _exports_with_the_last_checkpoints_logits(run: Path, out: Path) -> None:
    """Experts sharded over `ep` and a bias balancing moved come out as the job's Hugging Face
    model (its sigmoid router is GLM-4.5's), with the logits of the checkpoint they were read from."""
    import torch
    import transformers

    from orchestrator.control.export import export_run
    from orchestrator.runtime import checkpoint, checkpoint_files
    from orchestrator.workloads.models import build_model, logits_of

    export_run(run, out)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Glm4MoeForCausalLM"]
    last = build_model(load_config(JOB).model)
    checkpoint.load_model_weights(checkpoint_files.committed(str(run / "checkpoints"))[-1], last)
    assert any(b.abs().sum() > 0 for n, b in last.named_buffers() if n.endswith("expert_bias"))
    exported = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, logits_of(last.eval()(ids)), rtol=0, atol=1e-5)
