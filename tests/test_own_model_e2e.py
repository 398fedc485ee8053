"""A model the orchestrator has never seen, on the embedded cluster: a plain torch.nn module on
PYTHONPATH named by `model.factory`, and a Hugging Face model built by a function defined in
a script and passed to `orchestrator.submit`; both train and the plan counts them exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
JOB = str(ROOT / "examples/own_model/job.yaml")
pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _env(pythonpath: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(pythonpath)
    return env


def _run_dir(runs: Path) -> Path:
    (run,) = list(runs.iterdir())
    return run


def test_cli_trains_a_module_from_pythonpath_with_tensor_parallelism(tmp_path: Path) -> None:
    mods, cwd, runs = tmp_path / "mods", tmp_path / "cwd", tmp_path / "runs"
    mods.mkdir()
    cwd.mkdir()
    # The example model under a name nothing in the project knows.
    (mods / "unseen_lm.py").write_text((ROOT / "examples/own_model/mymodel.py").read_text())
    r = subprocess.run([sys.executable, "-m", "orchestrator", "submit", JOB, "model.factory=unseen_lm:build",
                        "parallel.strategy=zero3", "parallel.tp=2", "train.max_steps=30", f"monitor.runs_dir={runs}"],
                       cwd=cwd, env=_env(mods), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run = _run_dir(runs)
    plan, summary = json.loads((run / "plan.json").read_text()), json.loads((run / "summary.json").read_text())
    sys.path.insert(0, str(mods))
    try:
        import unseen_lm

        exact = sum(p.numel() for p in unseen_lm.build(dim=64, layers=2, heads=4).parameters())
    finally:
        sys.path.remove(str(mods))
    assert plan["model"]["params"] == exact == summary["num_params"]
    assert plan["mesh"]["tp"] == 2 and plan["model"]["block_class"] == "Block"
    assert summary["final_val_loss"] < 0.8 * summary["first_val_loss"]
    # Measured on a thread while Ray started: what it took beyond Ray's start is its own part.
    startup = summary["startup"]
    assert list(startup)[:2] == ["ray_start_s", "measure_s"] and startup["measure_s"] >= 0


API_SCRIPT = """
import json, sys
import orchestrator
from transformers import LlamaConfig, LlamaForCausalLM

def build(dim=64, layers=2, heads=4):  # defined in __main__: reaches the workers pickled
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=dim, intermediate_size=2 * dim,
                                        num_hidden_layers=layers, num_attention_heads=heads,
                                        num_key_value_heads=2, max_position_embeddings=64))

summary = orchestrator.submit(sys.argv[1], model=build, overrides=["parallel.strategy=ddp", "parallel.tp=1",
                              "train.max_steps=30", "monitor.runs_dir=" + sys.argv[2]])
exact = sum(p.numel() for p in build().parameters())
print("RESULT", json.dumps({"summary": summary, "exact": exact}))
"""


def test_python_api_trains_a_hugging_face_model_from_a_callable(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    runs = tmp_path / "runs"
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(API_SCRIPT), JOB, str(runs)], cwd=tmp_path,
                       env=_env(ROOT), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("RESULT"))[len("RESULT "):])
    plan = json.loads((_run_dir(runs) / "plan.json").read_text())
    assert plan["model"]["params"] == got["exact"] == got["summary"]["num_params"]
    assert plan["model"]["block_class"] == "LlamaDecoderLayer" and plan["strategy"] == "ddp"
    assert got["summary"]["final_val_loss"] < 0.8 * got["summary"]["first_val_loss"]
