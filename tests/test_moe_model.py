"""The built-in MoE decoder: published parameter counts, the router's rules, grouped experts
against a per-expert loop, the bias update and the sequence-wise auxiliary loss."""

from __future__ import annotations

import pytest
import torch

from orchestrator.config import ModelConfig
from orchestrator.errors import ConfigError
from orchestrator.workloads import moe
from orchestrator.workloads.models import block_list, build_model, pipeline_ends, tp_plan

# The model cards' totals (DeepSeek-V3 without its multi-token-prediction module).
PUBLISHED = {"deepseek-v3": 671e9, "qwen3-30b-a3b": 30.5e9, "qwen3-235b-a22b": 235e9, "mixtral-8x7b": 46.7e9,
             "mixtral-8x22b": 141e9}


@pytest.mark.slow  # building them on meta takes seconds
@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_presets_have_their_published_parameter_counts(preset: str) -> None:
    with torch.device("meta"):
        model = moe.build(preset)
    params = sum(p.numel() for p in model.parameters())
    assert abs(params - PUBLISHED[preset]) <= 0.005 * PUBLISHED[preset], f"{preset}: {params / 1e9:.2f}B"


@pytest.mark.slow
def test_active_parameters_of_deepseek_v3_are_its_37b() -> None:
    with torch.device("meta"):
        model = moe.build("deepseek-v3")
    spec = model.expert_spec()
    params = sum(p.numel() for p in model.parameters())
    active = params - spec.moe_blocks * spec.inactive_params_per_block(model.cfg.dim)
    assert (spec.experts, spec.top_k, spec.moe_blocks, spec.shared_experts) == (256, 8, 58, 1)
    # Grouped-query attention stands in for MLA with 1.1B more parameters, all of them active.
    assert abs(active - 37e9) <= 0.05 * 37e9


def test_the_family_is_exposed_as_the_llama() -> None:
    model = build_model(ModelConfig(factory="orchestrator.workloads.moe:build", args={"preset": "tiny"}))
    assert isinstance(model, moe.MoETransformer)
    assert pipeline_ends(model) == (("tok_embeddings",), ("norm", "output"))
    assert tp_plan(model) == moe.MoETransformer.tp_plan
    assert len(block_list(model)) == model.cfg.n_layers  # dense and MoE blocks are one repeated list


@pytest.mark.parametrize("args, key", [({"top_k": 9}, "top_k"), ({"router_groups": 3}, "router_groups"),
                                       ({"num_expert": 8}, "num_expert"), ({"dense_layers": 4}, "dense_layers")])
def test_bad_args_name_their_key(args: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=rf"model\.args.*{key}"):
        build_model(ModelConfig(factory="orchestrator.workloads.moe:build", args=args))


def _experts(dim: int, width: int, experts: int) -> moe.GroupedExperts:
    torch.manual_seed(0)
    ex = moe.GroupedExperts(dim, width, experts)
    for w in (ex.w1, ex.w2, ex.w3):
        torch.nn.init.normal_(w, std=0.1)
    return ex


@pytest.mark.parametrize("dim, width", [(16, 8), (12, 6)])  # grouped_mm, and rows off the 16-byte rule
def test_grouped_experts_match_one_matmul_per_expert(dim: int, width: int) -> None:
    ex = _experts(dim, width, 4)
    counts = torch.tensor([3, 0, 7, 0])  # experts with no tokens
    x = torch.randn(10, dim, requires_grad=True)
    assert moe._grouped_mm_fits(x, ex.w1.transpose(-2, -1)) == (dim == 16)
    out = ex(x, counts)
    ref, start = [], 0
    for e, n in enumerate(counts.tolist()):
        rows = x[start:start + n]
        start += n
        ref.append((torch.nn.functional.silu(rows @ ex.w1[e].T) * (rows @ ex.w3[e].T)) @ ex.w2[e].T)
    torch.testing.assert_close(out, torch.cat(ref), rtol=1e-5, atol=1e-6)
    out.square().mean().backward()
    assert ex.w1.grad[1].abs().sum() == 0 and ex.w1.grad[0].abs().sum() > 0


def test_every_token_on_one_expert_runs() -> None:
    ex = _experts(16, 8, 4)
    out = ex(torch.randn(12, 16), torch.tensor([0, 12, 0, 0]))
    assert out.shape == (12, 16) and torch.isfinite(out).all()


def test_the_bias_chooses_but_does_not_weigh() -> None:
    cfg = moe.MoEConfig(dim=8, num_experts=4, top_k=1, score_function="sigmoid", route_norm=False)
    router = moe.Router(cfg)
    x = torch.randn(6, 8)
    plain = router(x, torch.zeros(4))
    pushed = router(x, torch.tensor([0.0, 0.0, 10.0, 0.0]))  # expert 2 wins every choice
    assert (pushed.experts == 2).all() and pushed.counts.tolist() == [0, 0, 6, 0]
    scores = router.gate(x).sigmoid()
    torch.testing.assert_close(pushed.gates[:, 0], scores[:, 2])  # its own, unbiased, score
    torch.testing.assert_close(plain.gates[:, 0], scores.max(-1).values)


def test_group_limited_routing_keeps_each_token_in_its_best_groups() -> None:
    cfg = moe.MoEConfig(dim=8, num_experts=8, top_k=2, router_groups=4, router_top_groups=1)
    router = moe.Router(cfg)
    routing = router(torch.randn(32, 8), torch.zeros(8))
    groups = routing.experts // 2
    assert (groups[:, 0] == groups[:, 1]).all()  # both experts from one group of two
    torch.testing.assert_close(routing.gates.sum(-1), torch.ones(32))  # normalised


def test_balance_moves_bias_towards_the_less_loaded_experts() -> None:
    layer = moe.MoE(moe.MoEConfig(dim=8, num_experts=4, load_balance_coeff=1e-3))
    layer.tokens_per_expert = torch.tensor([10.0, 0.0, 4.0, 2.0])  # mean 4: signs -1, +1, 0, +1
    layer.balance(layer.step_counts())
    torch.testing.assert_close(layer.expert_bias, torch.tensor([-1.25e-3, 0.75e-3, -0.25e-3, 0.75e-3]))
    assert layer.step_counts().sum() == 0


def test_training_forward_counts_tokens_once_under_recomputation() -> None:
    torch.manual_seed(0)
    model = moe.build("tiny")
    from orchestrator.workloads.models import apply_recompute

    apply_recompute(model, "full")
    model(torch.randint(0, 256, (2, 16))).float().square().mean().backward()
    for layer in moe.moe_layers(model):
        assert layer.tokens_per_expert.sum() == 2 * 16 * model.cfg.top_k


def test_aux_loss_gradient_is_that_of_adding_it_to_the_loss(monkeypatch) -> None:
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))

    def gate_grad(add_by_hand: bool) -> torch.Tensor:
        torch.manual_seed(0)
        model = moe.build("tiny", aux_loss_coeff=0.1, shared_experts=1, score_function="sigmoid")
        loss = model(ids).float().square().mean()
        if add_by_hand:
            loss = loss + sum(m.last_aux_loss for m in moe.moe_layers(model))
        loss.backward()
        return model.layers[1].feed_forward.router.gate.weight.grad.clone()

    injected = gate_grad(add_by_hand=False)
    monkeypatch.setattr(moe._AuxLoss, "apply", lambda out, aux: out)
    by_hand = gate_grad(add_by_hand=True)
    torch.testing.assert_close(injected, by_hand, rtol=1e-5, atol=1e-8)
    assert injected.abs().sum() > 0


def test_uniform_routing_has_zero_imbalance_in_the_aux_loss() -> None:
    # Every expert gets its share and the same score: f_i = 1 and P_i = 1/E, so the loss is alpha.
    cfg = moe.MoEConfig(dim=8, num_experts=4, top_k=2, aux_loss_coeff=0.5)
    layer = moe.MoE(cfg)
    experts = torch.tensor([[0, 1], [2, 3]] * 4)
    routing = moe.Routing(experts=experts, gates=torch.ones(8, 2), counts=torch.full((4,), 4),
                          probabilities=torch.full((8, 4), 0.25))
    assert float(layer._sequence_balance_loss(routing, 2, 4)) == pytest.approx(0.5)


def test_meta_forward_prices_a_balanced_router() -> None:
    with torch.device("meta"):
        model = moe.build("tiny")
    assert model(torch.zeros(1, 16, dtype=torch.long, device="meta")).shape == (1, 16, 256)
    assert moe._balanced_sizes(10, 4) == [3, 3, 2, 2]
