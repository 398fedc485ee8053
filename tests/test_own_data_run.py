"""Bring your own data on a real (embedded) Ray cluster, one small run reused: `prepare` with a
tokenizer trained here -> `submit` on the token file (a nanoGPT .bin for validation) -> the
model out with `export`, which `transformers` loads and which gives the trained shards' logits;
and a resumed run on the token file ends exactly where the uninterrupted one did."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from rich.console import Console

from orchestrator.cli import main
from orchestrator.config import load_config
from orchestrator.connect.cluster import connect
from orchestrator.control.driver import run_job
from orchestrator.data.stream import builtin_text
from orchestrator.record.rundir import RunDir
from orchestrator.runtime import checkpoint, checkpoint_files
from orchestrator.workloads.gpt import GPT, GPTConfig

ROOT = Path(__file__).resolve().parent.parent
JOB = str(ROOT / "jobs" / "llm.yaml")
TINY = [
    "model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=32",
    "train.global_batch_size=8", "train.warmup_steps=2", "train.eval_iters=2",
    "monitor.progress=false", "monitor.dashboard=false", "parallel.strategy=ddp", "cluster.num_workers=2",
]

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster():
    with connect(None, num_cpus=4):
        yield


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("corpus")
    text = builtin_text()
    (d / "all.txt").write_text(text)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([str(d / "all.txt")], trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(d / "tokenizer.json"))
    cut = int(len(text) * 0.9)
    with open(d / "train.jsonl", "w") as f:
        for i in range(0, cut, 4000):
            f.write(json.dumps({"text": text[i:min(i + 4000, cut)]}) + "\n")
    assert main(["prepare", str(d / "train.jsonl"), "--out", str(d / "train.npy"),
                 "--tokenizer", str(d / "tokenizer.json")]) == 0
    # validation as a nanoGPT .bin: raw uint16, no metadata, made outside the project
    np.array(tok.encode(text[cut:]).ids, dtype=np.uint16).tofile(d / "val.bin")
    return d


def _overrides(corpus: Path, runs: Path, *more: str) -> list[str]:
    return [*TINY, f"data.path={corpus / 'train.npy'}", f"data.val_path={corpus / 'val.bin'}",
            "model.vocab_size=400", "train.max_steps=6", "train.eval_interval=3", "checkpoint.interval=3",
            f"monitor.runs_dir={runs}", *more]


@pytest.fixture(scope="module")
def trained(cluster, corpus, tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    assert main(["submit", JOB, *_overrides(corpus, runs, "checkpoint.export=true")]) == 0
    (run_dir,) = runs.glob("llm-*")
    return run_dir


def _weights(ckpt: str, cfg: GPTConfig) -> GPT:
    model = GPT(cfg)
    checkpoint.load_model_weights(ckpt, model)
    return model.eval()


def test_prepare_submit_export_round_trip_loads_in_transformers(trained, corpus, tmp_path):
    from transformers import GPT2LMHeadModel

    from orchestrator.control.export import load_exported

    summary = json.loads((trained / "summary.json").read_text())
    assert summary["steps"] == 6
    # the 400-token vocabulary is what trained: the untrained loss is ln(400), not ln(256)
    assert summary["first_val_loss"] == pytest.approx(np.log(400), abs=0.3)
    assert summary["final_val_loss"] < summary["first_val_loss"]
    out = tmp_path / "model"
    assert main(["export", str(trained), "--out", str(out)]) == 0
    for name in ("config.json", "model.safetensors", "gpt_config.json", "tokenizer.json"):
        assert (out / name).is_file(), name
    assert (out / "model.safetensors").read_bytes() == (trained / "export" / "model.safetensors").read_bytes()
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == json.loads((corpus / "train.npy.meta.json").read_text())["eos_id"]

    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=400, block_size=32)
    ours = _weights(checkpoint_files.committed(str(trained / "checkpoints"))[-1], cfg)
    x = torch.from_numpy(np.fromfile(corpus / "val.bin", dtype=np.uint16)[:64].astype(np.int64)).view(2, 32)
    hf = GPT2LMHeadModel.from_pretrained(out).eval()
    with torch.no_grad():
        want = ours(x)
        torch.testing.assert_close(hf(x).logits, want, rtol=0, atol=1e-5)
        assert torch.equal(load_exported(out).eval()(x), want)


def test_resume_on_a_token_file_is_exact(trained, corpus, tmp_path):
    ckpts = checkpoint_files.committed(str(trained / "checkpoints"))
    assert [Path(c).name for c in ckpts] == ["step_00000003", "step_00000006"]
    cfg = load_config(JOB, _overrides(corpus, tmp_path))
    run = RunDir.create(tmp_path, cfg.name)
    summary = run_job(cfg, run, Console(file=open(os.devnull, "w")), resume_from=ckpts[0])
    first = json.loads((trained / "summary.json").read_text())
    assert summary["final_val_loss"] == pytest.approx(first["final_val_loss"], abs=1e-6)
    gcfg = GPTConfig(**{f.name: getattr(cfg.model, f.name) for f in dataclasses.fields(GPTConfig)})
    resumed = _weights(checkpoint_files.committed(str(run.checkpoints))[-1], gcfg).state_dict()
    for k, v in _weights(ckpts[-1], gcfg).state_dict().items():
        torch.testing.assert_close(resumed[k], v, rtol=0, atol=1e-6, msg=k)
