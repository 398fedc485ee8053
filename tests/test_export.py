"""`export`: every model the project trains comes out in Hugging Face's format, which
`AutoModelForCausalLM.from_pretrained` loads with the trained logits (fp32, within 1e-5).

The checkpoints here are written in one process with DCP, as a run commits them (canonical
names under `model.`, a meta.json manifest), from models with weights moved off their init."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from orchestrator.cli import main
from orchestrator.config import load_config, to_yaml
from orchestrator.errors import CheckpointError, ConfigError, UserError

TINY_LLAMA = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 96, "ffn_dim": 48}
SHARD = 20_000
"""Bytes per safetensors file in these exports: small enough that each model takes several."""


def _jostled(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """`model` with every weight moved away from its init (ones and zeros hide a wrong mapping)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def _commit(root: Path, step: int, model: torch.nn.Module) -> Path:
    """A committed checkpoint of `model` under `root`, as `runtime/checkpoint.py` writes one."""
    import torch.distributed.checkpoint as dcp

    from orchestrator.runtime.checkpoint_files import META, filesystem, manifest, step_dir_name
    from orchestrator.runtime.state_names import canonical, tied_aliases

    path = root / step_dir_name(step)
    state = canonical({"model": model.state_dict()}, tied_aliases(model))
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    fs, base = filesystem(str(path))
    (path / META).write_text(json.dumps({"step": step, "files": manifest(fs, base, 0)}))
    return path


def _run(tmp_path: Path, overrides: list[str], model: torch.nn.Module | None) -> Path:
    """A run directory trained with `overrides`, holding a checkpoint of `model` (none for None)."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(to_yaml(load_config(None, overrides)))
    if model is not None:
        _commit(run / "checkpoints", 4, model)
    return run


def _llama_overrides() -> list[str]:
    return ["model.factory=orchestrator.workloads.llama:build", "model.block_size=16",
            *(f"model.args.{k}={v}" for k, v in TINY_LLAMA.items())]


def _assert_same_logits(out: Path, model: torch.nn.Module, vocab: int) -> None:
    from transformers import AutoModelForCausalLM

    from orchestrator.workloads.models import logits_of

    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, logits_of(model(ids)), rtol=0, atol=1e-5)


def _assert_sharded(out: Path) -> None:
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    count = len(files)
    assert count > 1 and files == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    assert sorted(p.name for p in out.glob("*.safetensors")) == files
    assert index["metadata"]["total_size"] == sum((out / f).stat().st_size for f in files) - sum(
        8 + int.from_bytes((out / f).read_bytes()[:8], "little") for f in files)  # the files' data, no headers


@pytest.mark.slow
def test_the_builtin_llama_exports_as_llama_for_causal_lm(tmp_path):
    from orchestrator.control.export import export_run
    from orchestrator.workloads.llama import build

    model = _jostled(build("tiny", **TINY_LLAMA))
    # The data `prepare` tokenized: its tokenizer goes with the model, its end-of-document id in the config.
    tokens = tmp_path / "train.npy"
    np.save(tokens, np.arange(64, dtype=np.uint16))
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
    Path(f"{tokens}.meta.json").write_text(json.dumps(
        {"tokenizer": str(tmp_path / "tokenizer.json"), "vocab_size": 96, "tokens": 64, "eos_id": 95}))
    run = _run(tmp_path, [*_llama_overrides(), f"data.path={tokens}"], model)
    out = export_run(run, tmp_path / "hf", max_shard_bytes=SHARD)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_key_value_heads"] == 2
    assert config["eos_token_id"] == 95
    assert (out / "tokenizer.json").read_text() == (tmp_path / "tokenizer.json").read_text()
    _assert_sharded(out)
    _assert_same_logits(out, model, TINY_LLAMA["vocab_size"])


@pytest.mark.slow
def test_hf_config_models_of_other_families_and_shapes_export_in_their_own_layout(tmp_path):
    import transformers

    families = {
        "llama": transformers.LlamaConfig(vocab_size=120, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                                          num_attention_heads=6, num_key_value_heads=2),
        "qwen2": transformers.Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
        "qwen3": transformers.Qwen3Config(vocab_size=80, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=24),
    }
    from orchestrator.control.export import export_run
    from orchestrator.workloads.hf import build

    for family, hf_config in families.items():
        where = tmp_path / family
        where.mkdir()
        hf_config.save_pretrained(where)
        model = _jostled(build(str(where / "config.json")))
        run = _run(where, [f"model.hf_config={where / 'config.json'}", "model.block_size=16"], model)
        out = export_run(run, where / "hf", max_shard_bytes=SHARD)
        config = json.loads((out / "config.json").read_text())
        assert config["model_type"] == family and config["architectures"] == [type(model).__name__]
        index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        # A tied head is saved once, under the embedding's name, as Hugging Face saves it.
        assert ("lm_head.weight" in index) == (not hf_config.tie_word_embeddings), family
        _assert_sharded(out)
        _assert_same_logits(out, model, hf_config.vocab_size)


def test_export_of_a_run_without_a_whole_checkpoint_is_one_line(tmp_path, capsys):
    run = _run(tmp_path, _llama_overrides(), None)
    assert main(["export", str(run), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: no whole checkpoint under {run / 'checkpoints'}: nothing to export"
    assert not (tmp_path / "hf").exists()


def test_a_non_empty_out_is_refused_unchanged_and_replaced_with_force(tmp_path, capsys):
    from orchestrator.control.export import check_out, staged

    out = tmp_path / "hf"
    out.mkdir()
    (out / "mine.txt").write_text("kept")
    before = os.stat(out / "mine.txt")
    run = _run(tmp_path, _llama_overrides(), None)
    assert main(["export", str(run), "--out", str(out)]) == 2
    assert "exists and is not an empty directory; choose another, or pass --force" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["mine.txt"] and os.stat(out / "mine.txt") == before
    with pytest.raises(UserError, match="not an empty directory"):
        check_out(out)
    check_out(out, force=True)
    with pytest.raises(RuntimeError, match="half-written"), staged(out) as tmp:
        (tmp / "config.json").write_text("{}")
        raise RuntimeError("half-written")
    assert [p.name for p in out.iterdir()] == ["mine.txt"]  # a failed export leaves what was there
    with staged(out) as tmp:
        (tmp / "config.json").write_text("{}")
    assert [p.name for p in out.iterdir()] == ["config.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]  # nothing left beside it


@pytest.mark.slow
def test_a_checkpoint_of_another_model_or_a_model_without_a_layout_is_one_line(tmp_path):
    from orchestrator.control.export import export_run
    from orchestrator.workloads.gpt import GPT, GPTConfig

    gpt = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=64, block_size=16))
    run = _run(tmp_path, _llama_overrides(), gpt)
    with pytest.raises(CheckpointError, match=r"does not hold LlamaConfig of the run's config.yaml: it lacks "
                                              r"tok_embeddings.weight \(\d+ missing, 0 with another shape\)"):
        export_run(run, tmp_path / "hf")
    from orchestrator.workloads.llama import build

    llama = _run(tmp_path / "llama", [], build("tiny", **TINY_LLAMA))  # trained as the default GPT, by its config
    with pytest.raises(CheckpointError, match=r"does not hold the GPT of the run's config.yaml: it lacks wte.weight"):
        export_run(llama, tmp_path / "hf")
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["model"]["factory"] = "tests.test_export:no_such_layout"
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError, match="key 'model.factory': tests.test_export:no_such_layout has no Hugging "
                                          "Face layout"):
        export_run(run, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def _moe_overrides(args: dict) -> list[str]:
    return ["model.factory=orchestrator.workloads.moe:build", "model.block_size=16", "model.args.preset=tiny",
            *(f"model.args.{k}={v}" for k, v in args.items())]


MOE_SHAPES = {
    # DeepSeek-V3's router over Llama's attention: dense first blocks, a shared expert, group-limited
    # choice, scaled gates and a moved bias, as GLM-4.5 is.
    "Glm4MoeForCausalLM": {"dim": 48, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "vocab_size": 96,
                           "ffn_dim": 64, "num_experts": 8, "top_k": 3, "moe_dim": 24, "shared_experts": 1,
                           "dense_layers": 1, "score_function": "sigmoid", "route_scale": 2.5, "router_groups": 4,
                           "router_top_groups": 2},
    # Nothing shared, nothing dense, top-1 (its gate is the bare score, not renormalised).
    "Glm4MoeForCausalLM-bare": {"dim": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "vocab_size": 80,
                                "num_experts": 4, "top_k": 1, "moe_dim": 16, "shared_experts": 0, "dense_layers": 0,
                                "score_function": "sigmoid"},
    "MixtralForCausalLM": {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 64,
                           "num_experts": 4, "top_k": 2, "moe_dim": 40, "dense_layers": 0,
                           "load_balance_coeff": 0.0},
}


@pytest.mark.slow
@pytest.mark.parametrize("shape", sorted(MOE_SHAPES))
def test_the_builtin_moe_exports_as_the_hugging_face_model_its_router_is(tmp_path, shape):
    from orchestrator.control.export import export_run
    from orchestrator.workloads.moe import build

    args = MOE_SHAPES[shape]
    model = _jostled(build("tiny", **args))
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("expert_bias") and args.get("load_balance_coeff", 1e-3) > 0:
                buffer.copy_(0.05 * torch.randn_like(buffer))  # moved by balancing: it steers the choice
    run = _run(tmp_path, _moe_overrides(args), model)
    out = export_run(run, tmp_path / "hf", max_shard_bytes=SHARD)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [shape.split("-")[0]]
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.mlp.experts.gate_up_proj" in index
    assert any(k.endswith("e_score_correction_bias") for k in index) == shape.startswith("Glm4Moe")
    _assert_sharded(out)
    _assert_same_logits(out, model, args["vocab_size"])


def test_an_moe_without_a_hugging_face_layout_is_one_line_naming_its_fields(tmp_path):
    from orchestrator.control.export import export_run
    from orchestrator.workloads.moe import build

    run = _run(tmp_path, _moe_overrides({}), build("tiny"))  # softmax with a dense block and a moving bias
    with pytest.raises(ConfigError, match=r"^key 'model.args': a softmax-routed MoE exports as MixtralForCausalLM "
                                          r"only with .*; this one has dense_layers=1, load_balance_coeff=0.001 "
                                          r"\(score_function=sigmoid exports as Glm4MoeForCausalLM\)$"):
        export_run(run, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_a_run_asked_to_export_a_model_without_a_layout_is_refused_before_it_trains(tmp_path, capsys):
    import time

    started = time.monotonic()
    code = main(["submit", "jobs/moe-tiny-cpu.yaml", "checkpoint.enabled=true", "checkpoint.export=true",
                 "model.args.score_function=softmax", f"monitor.runs_dir={tmp_path / 'runs'}"])
    err = capsys.readouterr().err
    assert code == 2 and time.monotonic() - started < 30
    assert "key 'model.args': a softmax-routed MoE exports as MixtralForCausalLM only with" in err
    assert "Traceback" not in err and not (tmp_path / "runs").exists()
