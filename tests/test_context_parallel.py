"""Context parallelism trains exactly like one process: head-tail sequence shards, their
positions and labels, the all-gather-KV and Ulysses attentions, and the runtime around them.

The quick tests check the sharding's numbers in-process. One launch of 4 gloo ranks
(tests/_cp_parity_worker.py) trains the built-in GPT and Llama at cp=2 and cp=4, with zero3,
DDP, HSDP and tp=2, and a Hugging Face Llama at cp=2 through transformers' attention registry,
and compares each with one process on the same global batches: loss and clipped gradient norm
at every step, the whole first gradients, and a resume from a checkpoint written under another
cp; Ulysses' head all-to-all at cp=4 and cp=2 x tp=2 (K/V heads repeated) and through the
registry; then the real Trainer under cp=1, cp=2, pp=2 x cp=2 and (Llama) cp=2 through Ulysses,
each cp resuming the other's checkpoint. Each attention alone (tests/_cp_attention_worker.py) matches
whole-sequence attention's output and gradients at cp=4.
"""

from __future__ import annotations

import importlib.util
import json
import re

import _cp_attention_worker as aw
import _cp_parity_worker as cw
import pytest
import torch
import torch.multiprocessing as mp
import torch.nn as nn

from orchestrator.config import load_config
from orchestrator.control.preflight import check_context_parallel
from orchestrator.errors import ConfigError, PlanError
from orchestrator.runtime.context_parallel import (
    apply_context_parallel,
    chunk_positions,
    gathered_order,
    prepare_for_context_parallel,
)
from orchestrator.sequence_split import sequence_split_problem
from orchestrator.workloads.hf_sequence import ATTENTION_NAME
from orchestrator.workloads.sequence import WHOLE_SEQUENCE

# The Hugging Face case needs transformers (the `hf` extra, in the dev install).
CASES = {c.name: c for c in cw.CASES if not c.model.startswith("hf") or importlib.util.find_spec("transformers")}


def test_each_rank_keeps_one_early_and_one_late_chunk() -> None:
    # 16 tokens, cp=2: chunks of 4, rank 0 keeps chunks 0 and 3, rank 1 chunks 1 and 2.
    assert chunk_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert chunk_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    # cp=4: chunks of 2, rank r keeps chunks r and 7 - r.
    assert [chunk_positions(16, 4, r).tolist() for r in range(4)] == [
        [0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    # Under a causal mask the work of a query is its position + 1: every rank gets the same.
    work = [int((chunk_positions(64, 4, r) + 1).sum()) for r in range(4)]
    assert work == [520] * 4


def test_the_gathered_shards_go_back_in_sequence_order() -> None:
    gathered = torch.cat([chunk_positions(16, 4, r) for r in range(4)])
    assert gathered[gathered_order(16, 4)].tolist() == list(range(16))


def test_labels_shifted_before_sharding_stay_right_at_chunk_boundaries() -> None:
    tokens = torch.arange(100, 117).unsqueeze(0)  # one sequence of 17 tokens: 16 inputs, 16 labels
    x, y = tokens[:, :-1], tokens[:, 1:]
    for rank in range(2):
        held = chunk_positions(16, 2, rank)
        # Every label is the token after its input, the last of each chunk included (its next
        # token lies in a chunk another rank holds, or past the sequence's inputs).
        assert (y[:, held] == x[:, held] + 1).all()
        assert y[0, held].tolist() == [101 + int(p) for p in held]


def test_the_whole_sequence_layout_is_plain_causal_attention() -> None:
    assert WHOLE_SEQUENCE.positions(5, torch.device("cpu")).tolist() == [0, 1, 2, 3, 4]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g) for _ in range(3))
    scores = (q @ k.transpose(-1, -2) / 2).masked_fill(torch.ones(6, 6).triu(1).bool(), float("-inf"))
    assert torch.allclose(WHOLE_SEQUENCE.attend(q, k, v), scores.softmax(-1) @ v, atol=1e-6)


@pytest.mark.parametrize(("cp", "seq", "problem"), [
    (1, 17, None),
    (2, 16, None),
    (4, 16, None),
    (3, 16, "cp=3 needs a sequence length divisible by 2 x cp = 6"),
    (16, 16, "cp=16 needs a sequence length divisible by 2 x cp = 32"),
    (0, 16, "cp must be at least 1, got 0"),
])
def test_a_sequence_allows_the_degrees_that_halve_it_evenly(cp, seq, problem) -> None:
    got = sequence_split_problem(cp, seq)
    assert (got is None) if problem is None else got.startswith(problem)
    if problem is None:
        held = torch.cat([chunk_positions(seq, cp, r) for r in range(cp)])
        assert sorted(held.tolist()) == list(range(seq))
    else:
        with pytest.raises(ValueError, match=re.escape(problem)):
            chunk_positions(seq, cp, 0)


class _PlainAttention(nn.Module):
    """Attention that calls SDPA itself: it cannot see the other ranks' keys."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = _PlainAttention()
        self.proj = nn.Linear(4, 4)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block() for _ in range(2))


class _FakeMesh:
    """What apply_context_parallel asks of the cp mesh before it sets anything: its size."""

    def size(self) -> int:
        return 2


def test_attention_without_the_hook_is_refused_naming_the_module() -> None:
    with pytest.raises(PlanError, match=re.escape(
            "context parallelism (cp=2) needs every block's attention to declare the sequence hook "
            "'sequence_layout' (docs/models.md); _PlainAttention (block 0's self_attn) declares none; use cp=1")):
        apply_context_parallel(_Model(), _FakeMesh())  # type: ignore[arg-type]


# (B, H, H_kv, T, D) at cp=4: multi-head (H_kv divides by cp), grouped-query with 2 query heads per
# K/V head (H_kv divides by cp), K/V heads repeated to the query heads (2 K/V heads, cp=4), and 6 heads
# that Ulysses cannot split 4 ways.
ATTENTION_SHAPES = [[2, 8, 8, 32, 4], [1, 8, 4, 32, 8], [1, 4, 2, 16, 8], [1, 6, 2, 16, 4]]


@pytest.mark.slow
def test_each_context_parallel_attention_matches_whole_sequence_attention_forward_and_backward(tmp_path) -> None:
    out = tmp_path / "attention.json"
    mp.spawn(aw.run_rank, args=(4, str(tmp_path / "init"), str(out), ATTENTION_SHAPES), nprocs=4, join=True)
    got = json.loads(out.read_text())
    refused = "ulysses B1 H6 kv2 T16 D4"
    assert got.pop(refused) == "ulysses attention needs the rank's 6 attention heads to divide by cp=4"
    assert len(got) == 2 * len(ATTENTION_SHAPES) - 1
    for key, error in got.items():
        assert error <= 5e-6, f"{key}: output or gradients differ from whole-sequence attention by {error}"


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("cp_parity")
    out = root / "results.json"
    mp.spawn(cw.run_rank, args=(str(root / "init"), str(out), list(CASES)), nprocs=cw.WORLD, join=True)
    return json.loads(out.read_text())


@pytest.mark.slow
def test_context_parallel_trains_like_one_process(results) -> None:
    assert set(results) == {*CASES, "trainer"}
    for name in CASES:
        got = results[name]
        ref = got["reference"]
        # Parity means something only where the trajectory moves and clipping scales updates.
        assert ref["losses"][0] - ref["losses"][-1] > 0.3 and min(ref["norms"]) > cw.MAX_NORM
        assert len(got["losses"]) == cw.STEPS
        case = CASES[name]
        for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
            assert abs(a - b) <= case.loss_tolerance, f"{name} step {step}: loss {a} vs one process {b}"
        for step, (a, b) in enumerate(zip(got["norms"], ref["norms"])):
            assert abs(a - b) <= case.norm_tolerance * b, f"{name} step {step}: grad norm {a} vs one process {b}"
        assert got["first_grad_error"] <= case.grad_tolerance, f"{name}: first gradients differ by " \
                                                               f"{got['first_grad_error']}"
    # fp32 everywhere but in the bf16 case.
    assert [n for n, c in CASES.items() if c.loss_tolerance > 1e-5] == ["llama_bf16_cp2"]


@pytest.mark.slow
def test_a_checkpoint_resumes_exactly_under_another_cp(results) -> None:
    # cp=2 -> cp=1 and cp=1 -> cp=4 for the GPT; cp=2 x tp=2 -> cp=4 for Llama.
    resumed = {n: c for n, c in CASES.items() if c.resume_from}
    assert {CASES[c.resume_from].ex.mesh.cp for c in resumed.values()} == {1, 2}
    for name in resumed:
        got = results[name]
        assert abs(got["resumed_loss"] - got["reference"]["losses"][-1]) <= 1e-5, name


@pytest.mark.slow
def test_the_trainer_under_cp_runs_and_resumes_as_under_cp_1(results) -> None:
    runs = results["trainer"]
    for model in cw.TRAINER_MODELS:
        whole = runs[f"{model} cp=1"]
        assert set(whole) == {*(f"loss {s}" for s in range(cw.TRAINER_STEPS)), "val"}
        for split in ("cp=2", "pp=2 cp=2") + (("cp=2 ulysses",) if model in cw.TRAINER_ULYSSES else ()):
            got = runs[f"{model} {split}"]
            for key in whole:
                assert abs(whole[key] - got[key]) <= 1e-5, f"{model} {key}: {split} {got[key]} vs cp=1 {whole[key]}"
        # Each resumes the other's checkpoint and goes on as the run that wrote it would have.
        for cp, other in ((1, 2), (2, 1)):
            resumed, written = runs[f"{model} cp={cp}<cp={other}"], runs[f"{model} cp={other}"]
            assert set(resumed) == {*(f"loss {s}" for s in range(cw.TRAINER_CHECKPOINT_AT, cw.TRAINER_STEPS)), "val"}
            for key, value in resumed.items():
                assert abs(value - written[key]) <= 1e-5, f"{model} cp={cp} resuming cp={other}: {key}"


def test_the_driver_refuses_a_cp_the_sequence_cannot_take_before_any_worker() -> None:
    cfg = load_config(None, ["model.block_size=18"])
    with pytest.raises(ConfigError, match=re.escape(
            "key 'parallel.cp': cp=2 needs a sequence length divisible by 2 x cp = 4 (each rank holds 2 of 2 x cp "
            "equal chunks); model.block_size is 18")):
        check_context_parallel(cfg, 2)
    check_context_parallel(cfg, 1)  # one rank holds the whole sequence, whatever its length


@pytest.mark.slow  # builds three models on the meta device
def test_the_driver_refuses_a_model_without_the_hook_before_any_worker() -> None:
    cfg = load_config(None, ["model.block_size=16"])
    with pytest.raises(ConfigError, match=re.escape("key 'parallel.cp': context parallelism (cp=4) needs every "
                                                    "block's attention to declare the sequence hook")):
        check_context_parallel(cfg, 4, model_fn=_Model)
    for factory in ("orchestrator.workloads.gpt:build", "orchestrator.workloads.llama:build"):
        check_context_parallel(load_config(None, ["model.block_size=16", f"model.factory={factory}"]), 4)


@pytest.mark.slow
def test_a_hugging_face_model_whose_attention_cannot_be_replaced_is_refused() -> None:
    transformers = pytest.importorskip("transformers")
    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    with torch.device("meta"):
        windowed = transformers.AutoModelForCausalLM.from_config(transformers.MistralConfig(**shape,
                                                                                            sliding_window=8))
        plain = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**shape))
    assert prepare_for_context_parallel(windowed, 2) == (
        "context parallelism (cp=2) replaces a Hugging Face model's attention through transformers' "
        "attention-function registry; MistralForCausalLM attends in a sliding window (8 tokens); use cp=1")
    assert windowed.config._attn_implementation != ATTENTION_NAME  # left as it was
    assert prepare_for_context_parallel(plain, 2) is None
    assert plain.config._attn_implementation == ATTENTION_NAME
    assert plain.model.layers[1].self_attn.sequence_layout is WHOLE_SEQUENCE


def test_model_states_shard_over_dp_shard_x_cp_and_gradients_average_over_dp_x_cp() -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from orchestrator.planning.mesh import Mesh
    from orchestrator.runtime.context_parallel import gradient_mesh, replicate_shard_mesh
    from orchestrator.runtime.parallelize import build_mesh

    # rank = r*8 + s*4 + c*2 + t on (dp_replicate=2, dp_shard=2, cp=2, tp=2): rank 0's groups.
    dist.init_process_group("fake", rank=0, world_size=16, store=FakeStore())
    try:
        mesh = build_mesh(Mesh(dp_replicate=2, dp_shard=2, cp=2, tp=2), "cpu")
        assert mesh["cp"].mesh.tolist() == [0, 2]  # cp groups are ranks tp apart
        assert gradient_mesh(mesh).mesh.tolist() == [0, 2, 4, 6, 8, 10, 12, 14]
        assert replicate_shard_mesh(mesh).mesh.tolist() == [[0, 2, 4, 6], [8, 10, 12, 14]]
        assert replicate_shard_mesh(mesh).mesh_dim_names == ("dp_replicate", "dp_shard_cp")
    finally:
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        mesh = build_mesh(Mesh(dp_replicate=2, cp=2), "cpu")
        assert gradient_mesh(mesh).mesh.tolist() == [0, 1, 2, 3]
        assert replicate_shard_mesh(mesh).mesh.tolist() == [[0, 1], [2, 3]]
        # Without cp, the data-parallel mesh is the one it always was.
        mesh = build_mesh(Mesh(dp_replicate=2, dp_shard=2), "cpu")
        assert gradient_mesh(mesh).mesh_dim_names == ("dp",)
    finally:
        dist.destroy_process_group()
