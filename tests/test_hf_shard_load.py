"""`model.hf_weights` loaded by shard: each rank of a meta-built, sharded Hugging Face Llama
reads only its slices of the saved weights, and a checkpoint that does not fit the model is
refused, in one line, from its headers alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import _hf_load_worker as hw  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402

from orchestrator.errors import ConfigError  # noqa: E402
from orchestrator.runtime.hf_weights import check_weights, load_weights  # noqa: E402
from orchestrator.runtime.state_names import tied_aliases  # noqa: E402
from orchestrator.workloads.hf import build  # noqa: E402

CASES = {c.name: c for c in hw.CASES}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Every case on 4 gloo ranks: what each rank measured and found."""
    root = tmp_path_factory.mktemp("hf_shards")
    for case in hw.CASES:
        hw.save(case, root)
    try:
        mp.spawn(hw.run_rank, args=(str(root / "init"), str(root), list(CASES)), nprocs=hw.WORLD, join=True)
    except mp.ProcessExitedException:
        # A gloo rank's exit now and then aborts in torch's own teardown ("terminate called
        # without an active exception"), after its work is done. What these tests read is each
        # rank's results file, written whole before the teardown: only a missing one is a failure.
        if not all((root / f"rank{r}.json").exists() for r in range(hw.WORLD)):
            raise
    return [json.loads((root / f"rank{r}.json").read_text()) for r in range(hw.WORLD)]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_holds_the_saved_weights(name: str, ranks: list[dict]) -> None:
    case = CASES[name]
    for r, result in enumerate(ranks):
        got = result[name]
        assert got["wrong"] == [], (r, got["wrong"])
        assert got["compared"] == got["saved_keys"], r  # every tensor of the file was compared
        assert got["files"] > 1 if case.sharded_file else got["files"] == 1
        # Hugging Face saves a tied head once, as the embedding: the head was read from that.
        assert ("lm_head.weight" in got["saved_keys"]) != case.tied
        assert "lm_head.weight" in got["names"]


@pytest.mark.slow
def test_tensor_parallel_shards_under_fsdp2_were_loaded(ranks: list[dict]) -> None:
    placements = set(ranks[0]["tp_fsdp_tied_index"]["placements"])
    # Column-parallel weights, FSDP2-sharded on top: the strided placement DCP must place right.
    assert "q_proj:(_StridedShard(dim=0, sf=2), Shard(dim=0))" in placements
    assert "down_proj:(Shard(dim=0), Shard(dim=1))" in placements  # row-parallel: 2-D blocks
    assert "embed_tokens:(Shard(dim=0),)" in placements


@pytest.mark.slow
def test_a_rank_reads_little_more_than_its_shard(ranks: list[dict]) -> None:
    for r, result in enumerate(ranks):
        got = result["memory"]
        assert got["file_bytes"] > 60e6 and got["shard_bytes"] < got["file_bytes"] / 3.9
        # The old way holds the whole file; the peak counts the checkpoint's mapped page cache too
        # (safetensors reads through mmap), so it exceeds the shard, but stays well below that.
        assert got["whole_peak_growth"] >= got["file_bytes"] * 0.95, r
        assert got["sliced_peak_growth"] < 0.75 * got["whole_peak_growth"], (r, got)


@pytest.mark.slow
def test_a_tensor_only_one_rank_lacks_stops_every_rank(ranks: list[dict]) -> None:
    for r, result in enumerate(ranks):
        assert "1 missing (extra_head.weight)" in result["one_rank_lacks_a_tensor"], r


# --- check_weights, from headers, on the meta model ---

def _saved(tmp_path: Path, tied: bool = True, **overrides) -> tuple[Path, nn.Module]:
    """A tiny Llama saved by save_pretrained under tmp_path/<tied>, and its state dict."""
    cfg = hw.llama_config(tied)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    out = tmp_path / f"tied{tied}{''.join(f'_{k}{v}' for k, v in overrides.items())}"
    model.save_pretrained(out, safe_serialization=True)
    return out, model


def _meta(directory: Path) -> nn.Module:
    with torch.device("meta"):
        return build(str(directory / "config.json"))


def _rewrite(directory: Path, change) -> Path:
    """The directory's model.safetensors, its tensors changed by `change(dict)`, as another file."""
    tensors = safetensors_torch.load_file(str(directory / "model.safetensors"))
    change(tensors)
    out = directory / "changed.safetensors"
    safetensors_torch.save_file(tensors, str(out), metadata={"format": "pt"})
    return out


def _one_line_error(model: nn.Module, path: Path) -> str:
    with pytest.raises(ConfigError) as e:
        check_weights(model, str(path))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("key 'model.hf_weights': ")
    return msg


def test_a_saved_model_fits_as_file_directory_and_sharded_directory(tmp_path: Path) -> None:
    for tied in (True, False):
        directory, _ = _saved(tmp_path, tied)
        check_weights(_meta(directory), str(directory))
        check_weights(_meta(directory), str(directory / "model.safetensors"))
    sharded = tmp_path / "sharded"
    _saved(tmp_path, False)[1].save_pretrained(sharded, safe_serialization=True, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file() and not (sharded / "model.safetensors").exists()
    check_weights(_meta(sharded), str(sharded))


def test_a_missing_tensor_is_named(tmp_path: Path) -> None:
    directory, _ = _saved(tmp_path, tied=False)
    path = _rewrite(directory, lambda t: (t.pop("model.norm.weight"), t.pop("lm_head.weight")))
    msg = _one_line_error(_meta(directory), path)
    assert "2 missing (model.norm.weight, lm_head.weight)" in msg
    assert "extra" not in msg and "wrong shape" not in msg


def test_an_untied_model_needs_the_head_a_tied_file_leaves_out(tmp_path: Path) -> None:
    tied_dir, _ = _saved(tmp_path, tied=True)
    untied_dir, _ = _saved(tmp_path, tied=False)
    msg = _one_line_error(_meta(untied_dir), tied_dir / "model.safetensors")
    assert "1 missing (lm_head.weight)" in msg


def test_extra_tensors_are_named_but_old_rotary_buffers_are_not(tmp_path: Path) -> None:
    directory, _ = _saved(tmp_path)

    def add(t):
        t["model.layers.7.mlp.up_proj.weight"] = torch.zeros(64, 32)
        t["model.rotary_emb.inv_freq"] = torch.zeros(4)  # what older transformers saved

    msg = _one_line_error(_meta(directory), _rewrite(directory, add))
    assert "1 extra (model.layers.7.mlp.up_proj.weight)" in msg and "inv_freq" not in msg
    assert "missing" not in msg


def test_wrong_shapes_are_named_with_both_shapes_and_counted(tmp_path: Path) -> None:
    small, _ = _saved(tmp_path, intermediate_size=48)
    model_dir, _ = _saved(tmp_path)
    msg = _one_line_error(_meta(model_dir), small)
    # gate, up and down of 2 layers; the first three named, in the model's order.
    assert "6 with a wrong shape (" in msg, msg
    assert "model.layers.0.mlp.down_proj.weight: file [32, 48] vs model [32, 64]" in msg
    assert "model.layers.0.mlp.gate_proj.weight: file [48, 32] vs model [64, 32]" in msg
    assert msg.count(" vs model ") == 3 and ", ...)" in msg


def test_a_path_that_holds_no_checkpoint_is_refused(tmp_path: Path) -> None:
    directory, _ = _saved(tmp_path)
    model = _meta(directory)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "expected a .safetensors file or a directory holding model.safetensors" in _one_line_error(model, empty)
    index = {"metadata": {}, "weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (empty / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "names 1 missing file(s): model-00002-of-00002.safetensors" in _one_line_error(model, empty)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    assert "cannot read" in _one_line_error(model, tmp_path / "junk.safetensors")


# --- load_weights in one process (no process group): plain tensors, aliases, neighbours ---

def test_a_stage_holding_only_the_tied_head_reads_the_embedding(tmp_path: Path) -> None:
    directory, saved = _saved(tmp_path, tied=True)
    stage = nn.Module()  # a pipeline's last stage: the head alone, under the whole model's name
    stage.lm_head = nn.Linear(32, 301, bias=False)
    stage.lm_head.weight.data.fill_(float("nan"))
    load_weights([stage], str(directory), tied_aliases(saved))
    assert torch.equal(stage.lm_head.weight, saved.model.embed_tokens.weight)


def test_only_the_named_file_is_read_not_its_neighbours(tmp_path: Path) -> None:
    directory, saved = _saved(tmp_path, tied=False)
    # A download may keep another copy of the weights beside the named file.
    other = {k: torch.zeros_like(v) for k, v in saved.state_dict().items()}
    safetensors_torch.save_file(other, str(directory / "consolidated.safetensors"))
    torch.manual_seed(5)
    fresh = transformers.LlamaForCausalLM(hw.llama_config(False))
    load_weights([fresh], str(directory / "model.safetensors"), tied_aliases(fresh))
    for name, tensor in saved.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name


def test_loading_refuses_a_parameter_the_file_lacks(tmp_path: Path) -> None:
    directory, saved = _saved(tmp_path, tied=False)
    path = _rewrite(directory, lambda t: t.pop("model.layers.1.self_attn.o_proj.weight"))
    with pytest.raises(ConfigError, match=r"1 missing \(model.layers.1.self_attn.o_proj.weight\)"):
        load_weights([saved], str(path), {})


def test_a_bf16_checkpoint_fills_fp32_parameters(tmp_path: Path) -> None:
    directory, _ = _saved(tmp_path, tied=True)
    full = safetensors_torch.load_file(str(directory / "model.safetensors"))
    half = {k: v.to(torch.bfloat16) for k, v in full.items()}
    safetensors_torch.save_file(half, str(tmp_path / "bf16.safetensors"), metadata={"format": "pt"})
    fresh = transformers.LlamaForCausalLM(hw.llama_config(True))
    load_weights([fresh], str(tmp_path / "bf16.safetensors"), tied_aliases(fresh))
    assert fresh.model.layers[1].mlp.up_proj.weight.dtype == torch.float32
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, half[tied_aliases(fresh).get(name, name)].float()), name
