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
