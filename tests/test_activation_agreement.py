"""The planner's activation and peak bytes per rank agree with torch's own tracker.

The built-in GPT (priced by counting what its layers keep under fused attention) and a Llama
of the family (priced by what `workloads.inspect` measured on the meta device) run on CPU in
fp32 under `MemTracker`, one warm-up iteration and one tracked one, with the runtime's
checkpointing for each recompute mode (`benchmarks/activation_memory.py`, small shapes): the
activations alive at the end of forward and the iteration's peak must both be within 10% of
the plan.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import activation_memory  # noqa: E402

TOLERANCE = 0.10
SEQ, BATCH, LAYERS, WIDTH = 128, 4, 2, 64


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_planned_activations_and_peak_match_memtracker(model, recompute):
    pytest.importorskip("torch")
    row = activation_memory.one(model, activation_memory.model_overrides(model, LAYERS, WIDTH), SEQ, BATCH,
                                recompute)
    assert row["predicted_activations"] == pytest.approx(row["measured_activations"], rel=TOLERANCE), row
    assert row["predicted_peak"] == pytest.approx(row["measured_peak"], rel=TOLERANCE), row
    # Activations dominate these shapes, so the peak check is not carried by the model states alone.
    assert row["measured_activations"] > 0.3 * row["measured_peak"] or recompute == "full", row


def test_the_tensor_parallel_split_of_activations_follows_the_model():
    pytest.importorskip("torch")
    from orchestrator.config import ModelConfig
    from orchestrator.workloads.inspect import model_spec

    dim, heads, kv_ratio, ffn = 64, 4, 2 / 4, 160
    args = {"dim": dim, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 256, "ffn_dim": ffn}
    spec = model_spec(ModelConfig(factory="orchestrator.workloads.llama:build", args=args, block_size=64))
    # A Llama block keeps, in values of s x h: whole on every rank the input, both RMSNorms'
    # normalised input and output (2 each), the residual after attention and the rotary cos and
    # sin of q and k (4 x s x head_dim); split by the plan q (1), k and v (kv_heads / heads
    # each), the attention output (1) and the four SwiGLU tensors of width ffn (gate, up, SiLU,
    # product).
    whole, split = 6 + 4 / heads, 2 + 2 * kv_ratio + 4 * ffn / dim
    assert spec.tp_sharded_activation_fraction == pytest.approx(split / (whole + split), rel=0.03)
    # The GPT's split (12 of 16) would be wrong for it.
    assert abs(spec.tp_sharded_activation_fraction - 12 / 16) > 0.03


def _saved_bytes(block, x, *, weights_bf16: bool) -> int:
    """Bytes of every storage autograd keeps for backward of `block(x)` under bf16 autocast on
    CPU with CUDA's fp32 normalisations (what a GPU keeps), each storage once."""
    import torch

    from orchestrator.runtime.rehearse_fake import cuda_autocast_norms

    storages: dict[int, int] = {}
    # The weights themselves are model state (FSDP2 frees its gathered ones after forward);
    # autocast's copies of them are activations.
    weights = {p.untyped_storage().data_ptr() for p in block.parameters()}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with cuda_autocast_norms(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            block(x.to(torch.bfloat16) if weights_bf16 else x)
    return sum(storages.values())


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("wrapping", ["ddp", "zero3"])
def test_a_gpt_block_keeps_what_the_planner_counts_under_cuda_autocast(wrapping, recompute):
    """Every value a block keeps, in the dtype autocast leaves it: ddp's fp32 residual stream
    and weight copies, FSDP2's 16-bit stream, fp32 LayerNorm inputs and one 16-bit copy of
    ln_1's output for each of q, k and v (counted from autograd's saved tensors, not MemTracker)."""
    torch = pytest.importorskip("torch")
    from orchestrator.planning.activations import gpt_block_bytes, gpt_weight_copy_bytes, value_bytes
    from orchestrator.planning.model_math import ModelShape
    from orchestrator.runtime.parallelize import apply_recompute
    from orchestrator.workloads.gpt import GPT, GPTConfig

    width, heads, seq, batch = 256, 4, 128, 2
    dtype = torch.bfloat16 if wrapping == "zero3" else torch.float32
    model = GPT(GPTConfig(n_layer=1, n_head=heads, n_embd=width, vocab_size=64, block_size=seq)).to(dtype)
    apply_recompute(model, recompute)
    x = torch.randn(batch, seq, width, requires_grad=True)
    measured = _saved_bytes(model.h[0], x, weights_bf16=wrapping == "zero3")

    shape = ModelShape(layers=1, hidden=width, heads=heads, vocab=64, seq=seq)
    values = value_bytes(2, 2 if wrapping == "zero3" else 4, on_gpu=True)
    copies, _ = gpt_weight_copy_bytes(shape, 1, recompute, values, blocks=1, last=False)
    planned = batch * gpt_block_bytes(shape, 1, recompute, values) + copies
    # Biases and LayerNorm weights are the only values left out.
    assert planned == pytest.approx(measured, rel=0.03), (planned, measured)


def _hf_llama(tmp_path, layers: int, width: int = 256):
    transformers = pytest.importorskip("transformers")
    from orchestrator.workloads.hf import build

    # A config as a real checkpoint ships it: saved in bf16, with a KV cache on by default.
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=width, intermediate_size=width * 43 // 16,
                                      num_hidden_layers=layers, num_attention_heads=width // 128 * 2,
                                      num_key_value_heads=width // 128, torch_dtype="bfloat16")
    config.to_json_file(tmp_path / "config.json")
    return build(str(tmp_path / "config.json")), str(tmp_path / "config.json")


def test_a_hugging_face_model_trains_from_fp32_master_weights_whatever_its_checkpoints_dtype(tmp_path):
    model, _ = _hf_llama(tmp_path, 1)
    assert {p.dtype for p in model.parameters()} == {__import__("torch").float32}


def test_a_hugging_face_block_keeps_what_the_planner_counts_under_fsdp2(tmp_path):
    """A Hugging Face RMSNorm normalises by hand (fp32 inside, its input's dtype out): no
    matmul keeps a copy of its output, unlike torch's rms_norm that CUDA autocast runs in fp32."""
    torch = pytest.importorskip("torch")
    from orchestrator.config import ModelConfig
    from orchestrator.planning.activations import activation_profile, value_bytes
    from orchestrator.planning.model_math import ModelShape
    from orchestrator.planning.pipeline import StageShare
    from orchestrator.workloads.inspect import model_spec

    # A real model's width: the rotary tables each block casts for itself are a share of it of
    # head_dim / width, which the planner leaves out.
    seq, width = 128, 1024
    model, path = _hf_llama(tmp_path, 2, width)
    spec = model_spec(ModelConfig(hf_config=path, block_size=seq))
    assert spec.fp32_norms_per_block == 0 and spec.tp_colwise_per_block == 5
    layer = model.to(torch.bfloat16).model.layers[0]
    x = torch.randn(1, seq, width, requires_grad=True)
    pos = torch.arange(seq)[None]
    cos, sin = model.model.rotary_emb(x, pos)

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = layer

        def forward(self, h):
            out = self.layer(h, position_embeddings=(cos, sin), attention_mask=None, position_ids=pos)
            return out[0] if isinstance(out, tuple) else out

    measured = _saved_bytes(Block(), x, weights_bf16=True)
    shape = ModelShape.from_spec(spec)
    # One block of a stage without the head: what the block keeps, nothing else.
    planned = activation_profile(shape, 1, 1, "none", value_bytes(2, 2, on_gpu=True),
                                 stage=StageShare(1, 0, False, False)).kept
    assert planned == pytest.approx(measured, rel=0.03), (planned, measured)


def test_a_recomputed_hugging_face_block_frees_its_values_once_its_backward_is_done(tmp_path):
    # With the config's KV cache on, each recomputed attention appended its keys and values to
    # the cache, which held them and the block's other recomputed values to the end of backward.
    torch = pytest.importorskip("torch")
    from torch.distributed._tools.mem_tracker import MemTracker

    from orchestrator.workloads.models import apply_recompute, block_list

    seq, width = 384, 256
    model, _ = _hf_llama(tmp_path, 4)
    apply_recompute(model, "full")
    tracker, alive = MemTracker(), []

    def after_backward(*_):
        # fp32 values of a block's width: the norms' inputs, recomputed in each block's backward.
        alive.append(sum(1 for _, (w, _) in list(tracker._WINFO.items()) if w.mem_consumed == seq * width * 4))

    for block in block_list(model):
        block.register_full_backward_hook(after_backward)
    with tracker:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(torch.randint(0, 256, (1, seq))).logits
        logits.float().sum().backward()
    # Each block's saved input goes as backward passes it; nothing a block recomputed stays.
    assert alive == sorted(alive, reverse=True) and alive[-1] < alive[0], alive
