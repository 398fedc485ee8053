"""`model.hf_weights`: a job that names local safetensors weights trains from them, not from a
random initialisation."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.config import load_config
from orchestrator.workloads.models import build_model


@pytest.mark.parametrize("tied", [True, False])
def test_the_job_loads_the_saved_weights(tmp_path: Path, tied: bool) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    torch.manual_seed(1)
    saved = transformers.LlamaForCausalLM(cfg)
    saved.save_pretrained(tmp_path, safe_serialization=True)
    weights = tmp_path / "model.safetensors"
    assert weights.is_file()

    job = load_config(None, [f"model.hf_config={tmp_path / 'config.json'}", f"model.hf_weights={weights}",
                             "model.block_size=16"])
    torch.manual_seed(2)  # a different seed: only loading can make the weights equal
    loaded = build_model(job.model)
    fresh = build_model(load_config(None, [f"model.hf_config={tmp_path / 'config.json'}", "model.block_size=16"]).model)

    want, got = saved.state_dict(), loaded.state_dict()
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    assert not torch.equal(fresh.state_dict()["model.layers.0.mlp.up_proj.weight"],
                           want["model.layers.0.mlp.up_proj.weight"])
    # A tied head is still one tensor after loading (the saved file holds it once).
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tied
    ids = torch.randint(0, 300, (2, 16))
    assert torch.equal(loaded(ids).logits, saved(ids).logits)


def test_a_model_built_on_meta_reads_no_weights(tmp_path: Path) -> None:
    # The runtime builds on meta and loads each rank's slices once its shards exist
    # (runtime/hf_weights.py); reading the whole file there would cost every rank the model.
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from orchestrator.workloads.hf import build

    transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2).save_pretrained(tmp_path)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not safetensors: reading it fails")
    with torch.device("meta"):
        model = build(str(tmp_path / "config.json"), str(junk))
    assert all(p.is_meta for p in model.parameters())
    with pytest.raises(Exception, match="(?i)header|safetensor"):
        build(str(tmp_path / "config.json"), str(junk))  # built for real, it does read them


@pytest.mark.parametrize("tied", [True, False])
def test_each_pipeline_stage_loads_its_own_part_of_the_saved_weights(tmp_path: Path, tied: bool) -> None:
    # Stages keep the model's own names (model.layers.3...), so each reads its slices by them;
    # a tied head on the last stage reads the one tensor the file holds for both.
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from orchestrator.planning.model_math import ModelShape
    from orchestrator.planning.pipeline import resolve_pipeline
    from orchestrator.runtime.hf_weights import load_weights
    from orchestrator.runtime.materialize import allocate, build_on_meta
    from orchestrator.runtime.pipeline import split_model
    from orchestrator.runtime.state_names import tied_aliases

    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    torch.manual_seed(1)
    saved = transformers.LlamaForCausalLM(cfg)
    saved.save_pretrained(tmp_path, safe_serialization=True)
    pipeline = resolve_pipeline(ModelShape(layers=4, hidden=32, heads=4, vocab=300, seq=16), 2, "1f1b", 2)
    want = saved.state_dict()
    stages = []
    job = load_config(None, [f"model.hf_config={tmp_path / 'config.json'}", "model.block_size=16"])
    for rank in range(2):
        model = build_on_meta(job.model)  # the runtime's build: rotary tables real, weights on meta
        aliases = tied_aliases(model)
        (stage,) = split_model(model, pipeline, rank)
        allocate(stage, torch.device("cpu"))
        load_weights([stage], str(tmp_path / "model.safetensors"), aliases)
        for name, value in stage.state_dict().items():
            assert torch.equal(value, want[aliases.get(name, name)]), name
        stages.append(stage)
    assert "lm_head.weight" in stages[1].state_dict() and "model.embed_tokens.weight" in stages[0].state_dict()
    ids = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        assert torch.allclose(stages[1](stages[0](ids)), saved(ids).logits, atol=1e-6)
