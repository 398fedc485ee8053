"""The fine-tune round trip on a real (embedded) Ray cluster: Hugging Face weights in
(`model.hf_weights`) -> trained under ZeRO-3 on two ranks -> out with `checkpoint.export=true`
-> `AutoModelForCausalLM.from_pretrained` gives the last checkpoint's logits."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from orchestrator.cli import main
from orchestrator.config import load_config
from orchestrator.runtime import checkpoint, checkpoint_files
from orchestrator.workloads.models import build_model

ROOT = Path(__file__).resolve().parent.parent
JOB = str(ROOT / "jobs" / "llm.yaml")

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_hf_weights_in_train_export_and_from_pretrained_gives_the_last_checkpoints_logits(tmp_path):
    import transformers

    hf_config = transformers.Qwen2Config(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(hf_config).save_pretrained(tmp_path / "base")
    runs = tmp_path / "runs"
    overrides = [f"model.hf_config={tmp_path / 'base' / 'config.json'}", f"model.hf_weights={tmp_path / 'base'}",
                 "model.block_size=32", "parallel.strategy=zero3", "cluster.num_workers=2",
                 "train.max_steps=4", "train.global_batch_size=4", "train.warmup_steps=1", "train.eval_iters=1",
                 "train.eval_interval=4", "checkpoint.interval=2", "checkpoint.export=true",
                 "monitor.progress=false", "monitor.dashboard=false", f"monitor.runs_dir={runs}"]
    assert main(["submit", JOB, *overrides]) == 0
    (run,) = runs.glob("*-*")
    out = run / "export"
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    assert (out / "model.safetensors.index.json").is_file()

    model_config = dataclasses.replace(load_config(JOB, overrides).model, hf_weights=None)
    last = build_model(model_config)
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
    checkpoint.load_model_weights(checkpoint_files.committed(str(run / "checkpoints"))[-1], last)
    exported = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = last.eval()(ids).logits
        torch.testing.assert_close(exported(ids).logits, want, rtol=0, atol=1e-5)
        assert (base(ids).logits - want).abs().max() > 1e-3  # it trained: the export is not the base model
