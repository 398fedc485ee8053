"""Pipelines on gloo train exactly as one process does: pp=2 (1F1B, interleaved 1F1B, zero bubble),
pp=2 x dp=2 (FSDP2) and pp=2 x tp=2 (GPipe), loss and clipped gradient norm per step, and a
DCP checkpoint of every stage that resumes the last step exactly (tests/_pipeline_worker.py)."""

from __future__ import annotations

import json

import _pipeline_worker as pw
import pytest
import torch
import torch.multiprocessing as mp

from orchestrator.errors import PlanError
from orchestrator.planning.pipeline import resolve_pipeline
from orchestrator.runtime.pipeline import split_model
from orchestrator.workloads.llama import build as llama

CASES = {c.name: c for cases in pw.CASES.values() for c in cases}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = {}
    for world in pw.CASES:
        root = tmp_path_factory.mktemp(f"pipeline{world}")
        mp.spawn(pw.run_rank, args=(world, str(root / "init"), str(root / "out.json")), nprocs=world, join=True)
        out.update(json.loads((root / "out.json").read_text()))
    return out


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, list[float]]]:
    torch.set_num_threads(1)
    return {model: pw.reference(model) for model in ("gpt", "hf")}


@pytest.mark.parametrize("model", ["gpt", "hf"])
def test_reference_learns_and_clips(references, model) -> None:
    reference = references[model]
    assert reference["losses"][0] - reference["losses"][-1] > 0.3
    assert min(reference["norms"]) > pw.MAX_NORM


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.slow
def test_pipeline_matches_one_process(name, results, references) -> None:
    reference = references[CASES[name].model]
    got = results[name]
    assert len(got["losses"]) == pw.STEPS
    for step, (a, b) in enumerate(zip(got["losses"], reference["losses"])):
        assert abs(a - b) <= 1e-5, f"{name} step {step}: loss {a} vs one process {b}"
    # fp32 sums in another order (tensor-parallel partial norms, then over the pipeline) drift
    # by a few 1e-6 per step; a wrong gradient is off by far more.
    for step, (a, b) in enumerate(zip(got["norms"], reference["norms"])):
        assert abs(a - b) <= 3e-5 * b, f"{name} step {step}: grad norm {a} vs one process {b}"


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.checkpoint])
@pytest.mark.slow
def test_resume_from_a_pipeline_checkpoint_is_exact(name, results) -> None:
    got = results[name]
    assert got["resumed_loss"] == got["losses"][-1]


@pytest.mark.slow
def test_stages_checkpoint_under_the_whole_models_names(results) -> None:
    # Ranks of one stage hold the same keys; the two stages together hold every block once,
    # the embedding on the first and the (tied) head on the last.
    keys = results["pp2"]["keys"]
    first, last = set(keys[0]), set(keys[1])
    assert {k.split(".")[1] for k in first if k.startswith("h.")} == {"0", "1"}
    assert {k.split(".")[1] for k in last if k.startswith("h.")} == {"2", "3"}
    assert "wte.weight" in first and "lm_head.weight" in last and "lm_head.weight" not in first
    four = results["pp2_dp2"]["keys"]
    assert four[0] == four[1] and four[2] == four[3] and set(four[0]) == first and set(four[2]) == last
    # A Hugging Face model's stages keep its own nested names, so its safetensors load by them.
    hf = results["hf_pp2"]["keys"]
    first, last = set(hf[0]), set(hf[1])
    assert {k.split(".")[2] for k in first if k.startswith("model.layers.")} == {"0", "1"}
    assert {k.split(".")[2] for k in last if k.startswith("model.layers.")} == {"2", "3"}
    assert "model.embed_tokens.weight" in first and {"model.norm.weight", "lm_head.weight"} <= last


def test_llama_splits_at_block_boundaries_and_matches_the_whole_model() -> None:
    torch.manual_seed(0)
    model = llama(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_dim=64)
    x = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        want = model(x)
    pl = resolve_pipeline(pw.SHAPE, 2, "1f1b", 4)
    import copy

    stages = [split_model(copy.deepcopy(model), pl, r)[0] for r in range(2)]
    assert {n.split(".")[1] for n, _ in stages[1].named_parameters() if n.startswith("layers.")} == {"2", "3"}
    assert "tok_embeddings.weight" not in dict(stages[1].named_parameters())
    with torch.no_grad():
        assert torch.allclose(stages[1](stages[0](x)), want, atol=1e-6)


@pytest.mark.parametrize("family", ["llama_tied", "mistral_sliding_window", "qwen2", "gemma_scaled_embedding",
                                    "llama_eager_attention"])
def test_a_hugging_face_decoder_splits_into_stages_that_match_the_whole_model(family, tmp_path) -> None:
    # Each stage hands its blocks what the model's own forward would (rotary tables, a causal
    # or sliding-window mask, Gemma's scaled embedding), so the stages' logits are the model's.
    transformers = pytest.importorskip("transformers")
    from orchestrator.workloads.hf import build

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2)
    config = {"llama_tied": lambda: transformers.LlamaConfig(**small, tie_word_embeddings=True),
              "mistral_sliding_window": lambda: transformers.MistralConfig(**small, sliding_window=3),
              "qwen2": lambda: transformers.Qwen2Config(**small),
              "gemma_scaled_embedding": lambda: transformers.GemmaConfig(**small, head_dim=8),
              "llama_eager_attention": lambda: transformers.LlamaConfig(**small, attn_implementation="eager")}[family]()
    config.to_json_file(tmp_path / "config.json")
    torch.manual_seed(0)
    model = build(str(tmp_path / "config.json"))
    x = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        want = model(x).logits
    pl = resolve_pipeline(pw.SHAPE, 2, "1f1b", 4)
    import copy

    stages = [split_model(copy.deepcopy(model), pl, r)[0] for r in range(2)]
    assert "model.embed_tokens.weight" not in dict(stages[1].named_parameters())
    assert "model.rotary_emb.inv_freq" in dict(stages[1].named_buffers())  # moves to the stage's device
    with torch.no_grad():
        assert torch.allclose(stages[1](stages[0](x)), want, atol=1e-6)


def test_a_model_without_the_pipeline_contract_is_refused_in_one_line() -> None:
    class Plain(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(4))

    with pytest.raises(PlanError, match="parallel.pp > 1 needs a model whose forward"):
        split_model(Plain(), resolve_pipeline(pw.SHAPE, 2, "1f1b", 4), 0)


class _NoEnds(torch.nn.Module):
    """A model the planner can measure (token ids in, logits out, a repeated block list) that
    does not name its ends, so no pipeline can split it."""

    def __init__(self, vocab: int = 256, dim: int = 16) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(4))
        self.out = torch.nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def test_a_forced_pipeline_of_a_model_without_ends_is_refused_before_any_worker() -> None:
    from orchestrator.config import load_config
    from orchestrator.control.preflight import measure_model
    from orchestrator.errors import ConfigError

    cfg = load_config(None, ["parallel.pp=2", "model.block_size=8"])
    with pytest.raises(ConfigError, match=r"^key 'parallel.pp': parallel.pp > 1 needs a model whose forward"):
        measure_model(cfg, _NoEnds)
    assert measure_model(load_config(None, ["model.block_size=8"]), _NoEnds) is not None


def test_the_planner_keeps_a_model_without_ends_out_of_pipelines() -> None:
    from orchestrator.config import load_config
    from orchestrator.errors import PlanError as Refused
    from orchestrator.planning import plan_job
    from orchestrator.topology.model import ClusterTopology, cpu_node
    from orchestrator.workloads.inspect import model_spec

    cfg = load_config(None, ["model.block_size=8", "train.global_batch_size=8"])
    assert not model_spec(cfg.model, _NoEnds).pipeline_ends
    topo = ClusterTopology(nodes=[cpu_node(2, hostname=f"n{i}", node_id=f"n{i}") for i in range(2)])
    forced = load_config(None, ["model.block_size=8", "train.global_batch_size=8", "parallel.pp=2"])
    with pytest.raises(Refused, match=r"^key 'parallel.pp': .* names no ends"):
        plan_job(forced, topo, model_spec(forced.model, _NoEnds))
    llama_cfg = load_config(None, ["model.factory=orchestrator.workloads.llama:build", "model.block_size=8",
                                   "model.args={n_layers: 4}", "train.global_batch_size=8"])
    assert model_spec(llama_cfg.model).pipeline_ends


def test_evaluation_asks_torch_for_the_losses_only_not_every_micro_batchs_logits() -> None:
    """Merged outputs on the last stage are m micro-batches x seq x vocab of logits (tens of GB
    for a large vocabulary): neither training nor evaluation asks torch's schedule for them."""
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules

    from orchestrator.runtime.pipeline import Pipelined

    asked: list[tuple[str, object]] = []

    class Schedule:
        def step(self, *args, **kwargs):
            asked.append(("step", kwargs.get("return_outputs", True)))

        def eval(self, *args, **kwargs):
            asked.append(("eval", kwargs.get("return_outputs", True)))

    me = SimpleNamespace(parts=[SimpleNamespace(model=torch.nn.Linear(2, 2))], has_first=True, has_last=True,
                         schedule=Schedule(), _sync_tied=lambda: None)
    x, y = torch.zeros(2, 2), torch.zeros(2, dtype=torch.long)
    Pipelined.step(me, x, y, train=True)
    Pipelined.step(me, x, y, train=False)
    assert asked == [("step", False), ("eval", False)]
    # torch's own eval hands its keywords to step, where return_outputs is step's parameter.
    seen = {}
    torch_self = SimpleNamespace(_has_backward=True, step=lambda *a, **k: seen.update(k))
    schedules.PipelineScheduleSingle.eval(torch_self, x, target=y, losses=[], return_outputs=False)
    assert seen["return_outputs"] is False and torch_self._has_backward is True


def test_a_stage_without_gradients_sums_a_zero_on_its_own_device(monkeypatch) -> None:
    # NCCL takes only tensors on the group's device: a CPU zero from a GPU stage would fail
    # there. "meta" stands in for a GPU here: any device but the CPU tells the two apart.
    from orchestrator.runtime import pipeline

    seen = []
    monkeypatch.setattr(pipeline.dist, "all_reduce", lambda t, op=None, group=None: seen.append(t.device))
    stage = pipeline.Pipelined(parts=[], schedule=None, pipeline=None, pp_group=None, pp_ranks=[0, 1], pp_rank=1,
                               device=torch.device("meta"))
    total = stage.clip_grad_norm_(1.0)
    assert seen == [torch.device("meta")] and total.device == torch.device("meta")
