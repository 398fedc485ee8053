"""The model is built on the meta device and each rank materialises only its own shards, with
values that do not depend on the plan: under ddp, zero3, hsdp, tp=2, pp=2 and their mixes the
ranks hold, between them, exactly the weights one process builds from the same seed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _meta_init_worker as mw  # noqa: E402
import _reshard_worker as rw  # noqa: E402

from orchestrator.config import load_config  # noqa: E402
from orchestrator.runtime.materialize import build_initialised, build_on_meta, init_recipe, params_on_meta  # noqa: E402


@pytest.fixture(scope="module")
def held(tmp_path_factory) -> dict:
    """{(model, case): [per-rank {"params", "loss"}]} from real gloo ranks."""
    tmp = tmp_path_factory.mktemp("meta")
    out: dict = {}
    for world in sorted({c.world for c in mw.CASES}):
        mp.spawn(mw.run_rank, args=(world, str(tmp / f"init-{world}"), mw.plans(world), str(tmp)), nprocs=world,
                 join=True)
        for model in rw.MODELS:
            for case in mw.CASES:
                if case.world == world:
                    out[(model, case.name)] = [torch.load(tmp / f"{model}-{case.name}-{r}.pt") for r in range(world)]
    return out


def _reference(model: str) -> dict[str, torch.Tensor]:
    cfg = load_config(None, rw.overrides(model, mw.CASES[0]))
    ref = build_initialised(cfg.model, cfg.train.seed)
    return {n: p.detach() for n, p in ref.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("model", list(rw.MODELS))
@pytest.mark.parametrize("case", [c.name for c in mw.CASES])
def test_every_plan_holds_the_one_process_weights(held, model, case):
    ref = _reference(model)
    ranks = held[(model, case)]
    seen = set()
    for r, got in enumerate(ranks):
        for name, value in got["params"].items():
            assert name in ref, f"rank {r} holds {name}, which the model does not have"
            assert torch.equal(value, ref[name]), f"{case}: rank {r}'s {name} differs from the one-process weights"
            seen.add(name)
    assert seen == set(ref), f"{case}: no rank holds {sorted(set(ref) - seen)[:3]}"


@pytest.mark.slow
@pytest.mark.parametrize("model", list(rw.MODELS))
def test_the_first_step_loss_is_the_same_under_every_plan(held, model):
    losses = {case.name: held[(model, case.name)][0]["loss"] for case in mw.CASES}
    first = losses["ddp"]
    for case, loss in losses.items():
        assert loss == pytest.approx(first, rel=1e-5), f"{case}: {loss} vs ddp's {first}"


def test_the_same_seed_gives_the_same_weights_and_another_seed_others():
    m = load_config(None, rw.MODELS["untied"]).model
    a, b, c = build_initialised(m, 1), build_initialised(m, 1), build_initialised(m, 2)
    for (name, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q), name
        if name.endswith("proj.weight"):
            assert not torch.equal(p, r), name


def test_the_initialisation_is_the_models_own():
    """GPT-2's: normal(0, 0.02), residual projections scaled by 1/sqrt(2 n_layer), zero biases,
    unit LayerNorms; the tied head is the embedding."""
    m = load_config(None, ["model.n_layer=8", "model.n_embd=256", "model.n_head=4", "model.vocab_size=4096"]).model
    gpt = build_initialised(m, 0)
    assert gpt.lm_head.weight is gpt.wte.weight
    assert gpt.wte.weight.std().item() == pytest.approx(0.02, rel=0.02)
    assert gpt.h[0].mlp.c_fc.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert gpt.h[3].attn.c_proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert torch.count_nonzero(gpt.h[0].attn.q_proj.bias) == 0
    assert torch.equal(gpt.h[0].ln_1.weight, torch.ones(256))


def test_buffers_the_constructor_computes_survive_the_meta_build():
    class Rotary(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("inv_freq", torch.arange(1.0, 3.0), persistent=False)

    with params_on_meta():
        model = Rotary()
    assert model.lin.weight.is_meta and not model.inv_freq.is_meta
    recipe, why = init_recipe(model, 0)
    assert recipe is not None, why
    from orchestrator.runtime.materialize import materialize

    materialize(model, recipe, torch.device("cpu"), {})
    assert torch.equal(model.inv_freq, torch.tensor([1.0, 2.0])) and not model.lin.weight.is_meta


def test_a_model_built_in_a_fake_mode_keeps_that_mode_in_its_initialisation_copies():
    # A rehearsal builds the model in a fake mode. Copying the mode with the model's tensors
    # copied the weak storage references it keeps for its constants, which both copies then
    # freed: a Hugging Face model's rehearsal crashed the process at random later allocations.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        with params_on_meta():
            model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        scale = torch.tensor(2.0)  # a constant: the mode keeps a weak reference to its storage
        recipe, why = init_recipe(model, 0)
    assert recipe is not None, why
    assert mode.fake_tensor_converter.constant_storage_mapping, "the mode kept no constant: the test tests nothing"
    for stand_in in recipe.stand_ins.values():
        assert all(p.fake_mode is mode for p in stand_in.parameters())
    assert float(scale.constant) == 2.0


def test_a_module_without_an_initialisation_is_named():
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(3))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(3, 3)
            self.scale = Scale()

    with params_on_meta():
        model = Model()
    recipe, why = init_recipe(model, 0)
    assert recipe is None
    assert "Scale at 'scale'" in why and "reset_parameters" in why


def test_a_hugging_face_model_builds_on_meta_and_initialises_by_its_own_rule(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, initializer_range=0.05)
    path = tmp_path / "config.json"
    cfg.to_json_file(path)
    m = load_config(None, [f"model.hf_config={path}", "model.block_size=16"]).model
    meta = build_on_meta(m)
    assert all(p.is_meta for p in meta.parameters())
    model = build_initialised(m, 0)
    assert model.model.layers[0].mlp.up_proj.weight.std().item() == pytest.approx(0.05, rel=0.1)
    assert torch.equal(model.model.norm.weight, torch.ones(32))
    # The rotary table is the constructor's, not uninitialised memory.
    fresh = transformers.LlamaForCausalLM(cfg)
    assert torch.equal(model.model.rotary_emb.inv_freq, fresh.model.rotary_emb.inv_freq)
    logits = model(torch.randint(0, 128, (1, 8))).logits
    assert torch.isfinite(logits).all()


def test_a_hugging_face_config_stands_in_for_a_jobs_factory_and_its_args(tmp_path):
    # The Llama 3 job's factory takes `preset`; a transformers model takes no such argument.
    transformers = pytest.importorskip("transformers")
    transformers.MistralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2).to_json_file(tmp_path / "config.json")
    job = Path(__file__).resolve().parents[1] / "jobs" / "llama3-8b-dgx-h100.yaml"
    m = load_config(str(job), [f"model.hf_config={tmp_path / 'config.json'}", "model.block_size=16"]).model
    assert type(build_on_meta(m)).__name__ == "MistralForCausalLM"


def test_a_parameter_no_initialisation_sets_is_named():
    """A model hook that covers only some of its modules would leave the rest uninitialised
    memory: refused, naming the parameter."""
    from orchestrator.errors import ConfigError
    from orchestrator.runtime.materialize import materialize

    class Gain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.g = nn.Parameter(torch.ones(3))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.gain = Gain()

        def init_module(self, module: nn.Module, name: str) -> None:
            if isinstance(module, nn.Linear):
                nn.init.zeros_(module.weight)

    with params_on_meta():
        model = Model()
    recipe, _ = init_recipe(model, 0)
    with pytest.raises(ConfigError, match=r"nothing initialises gain\.g of Gain"):
        materialize(model, recipe, torch.device("cpu"), {})


@pytest.mark.slow
def test_the_runtime_accumulates_as_the_plan_chose(tmp_path):
    """per_micro_step reduce-scatters every micro-step, so FSDP2 never carries an unsharded
    gradient into the next micro-step; last_micro_step carries them until the last one. Both
    give the same losses."""
    mp.spawn(mw.run_accum, args=(2, str(tmp_path / "init"), mw.accum_plans(), str(tmp_path)), nprocs=2, join=True)
    out = torch.load(tmp_path / "accum.pt")
    per, last = out["per_micro_step"], out["last_micro_step"]
    assert per["accum"] == last["accum"] == 4
    assert per["reduce_every"] and not last["reduce_every"]
    # The compute-only calibration runs backward without sync, which holds every unsharded
    # gradient: only where the plan holds them anyway.
    assert not per["calibrated"] and not per["after_start"]
    assert last["calibrated"]
    # One forward per micro-step, two steps.
    assert per["held"] == [False] * 8
    # (The calibration's zero gradients are still held when the first step begins.)
    assert last["held"] == [True, True, True, True] + [False, True, True, True]
    for a, b in zip(per["losses"], last["losses"]):
        assert a == pytest.approx(b, rel=1e-5)


def _saved_hf_llama(tmp_path, tied: bool):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    torch.manual_seed(3)
    saved = transformers.LlamaForCausalLM(cfg)
    saved.save_pretrained(tmp_path, safe_serialization=True)
    return saved


@pytest.mark.slow
@pytest.mark.parametrize("tied", [True, False])
def test_a_sharded_run_starts_from_the_named_weights(tmp_path, tied):
    """zero3 over 2 ranks: the ranks hold, between them, exactly the saved weights (each read
    its own slices), not an initialisation."""
    from orchestrator.control.preflight import measure_model
    from orchestrator.planning import plan_job
    from orchestrator.topology.model import ClusterTopology, cpu_node

    saved = _saved_hf_llama(tmp_path, tied)
    overrides = [f"model.hf_config={tmp_path / 'config.json'}", f"model.hf_weights={tmp_path}", "model.block_size=16",
                 *rw.COMMON, "parallel.strategy=zero3", "train.micro_batch_size=1", "cluster.num_workers=2"]
    cfg = load_config(None, overrides)
    plan = plan_job(cfg, ClusterTopology(nodes=[cpu_node(2)]), measure_model(cfg)).to_dict()
    mp.spawn(mw.run_loaded, args=(2, str(tmp_path / "init"), overrides, plan, str(tmp_path)), nprocs=2, join=True)
    want = {n: p.detach() for n, p in saved.named_parameters()}
    for r in range(2):
        got = torch.load(tmp_path / f"loaded-{r}.pt")
        assert set(got) == set(want)
        for name, value in got.items():
            assert torch.equal(value, want[name]), f"rank {r}: {name}"


def test_weights_that_do_not_fit_are_refused_before_any_worker_starts(tmp_path):
    import json

    from orchestrator.control.preflight import measure_model
    from orchestrator.errors import ConfigError

    _saved_hf_llama(tmp_path, tied=False)
    other = tmp_path / "other"
    other.mkdir()
    # The saved model's MLP is 64 wide; the job's config says 48, so the file no longer fits.
    conf = json.loads((tmp_path / "config.json").read_text())
    conf["intermediate_size"] = 48
    (other / "config.json").write_text(json.dumps(conf))
    cfg = load_config(None, [f"model.hf_config={other / 'config.json'}", f"model.hf_weights={tmp_path}",
                             "model.block_size=16"])
    wrong = r"model\.hf_weights.*mlp\.gate_proj\.weight: file \[64, 32\] vs model \[48, 32\]"
    with pytest.raises(ConfigError, match=wrong):
        measure_model(cfg)
