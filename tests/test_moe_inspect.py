"""The planner's measurement of Mixture-of-Experts models: the built-in family's and Hugging
Face MoE configs' (built locally, tiny), their experts in `ModelSpec.experts`."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from orchestrator.config import ModelConfig
from orchestrator.errors import ConfigError
from orchestrator.workloads import moe
from orchestrator.workloads.inspect import model_spec

SEQ = 16


@pytest.mark.slow
def test_builtin_moe_spec_counts_experts_and_the_flops_of_a_real_forward() -> None:
    # Experts of width 30 run the per-expert loop, whose matmuls the FLOP counter sees.
    args = {"preset": "tiny", "shared_experts": 1, "dense_layers": 2, "n_layers": 4, "moe_dim": 30}
    spec = model_spec(ModelConfig(factory="orchestrator.workloads.moe:build", args=args, block_size=SEQ))
    torch.manual_seed(0)
    model = moe.build(**args)
    assert spec.experts == model.expert_spec()
    assert spec.experts.moe_blocks == 2 and spec.experts.dense_block_params > 0
    assert spec.block_params == sum(p.numel() for p in model.layers[2].parameters())  # an MoE block's
    assert spec.params == sum(p.numel() for p in model.parameters())
    counter = FlopCounterMode(display=False)
    with counter:
        model(torch.randint(0, 256, (1, SEQ)))
    # The real forward's matmuls (whatever the routing sent where), plus the fused attention's
    # two products per block, which the CPU forward's unfused attention does not report.
    attention = 4 * SEQ * model.cfg.dim * model.cfg.n_layers
    assert spec.forward_flops_per_token == pytest.approx(counter.get_total_flops() / SEQ + attention, rel=1e-9)


def _hf(tmp_path, **fields) -> ModelConfig:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "num_key_value_heads": 2, **fields}))
    return ModelConfig(hf_config=str(path), block_size=SEQ)


@pytest.mark.slow
@pytest.mark.parametrize("fields, experts", [
    ({"model_type": "qwen3_moe", "intermediate_size": 128, "moe_intermediate_size": 32, "head_dim": 16,
      "num_experts": 8, "num_experts_per_tok": 2}, (8, 2, 32, 2, 0)),
    ({"model_type": "mixtral", "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2},
     (4, 2, 32, 2, 0)),
    ({"model_type": "deepseek_v3", "num_hidden_layers": 3, "num_key_value_heads": 4, "intermediate_size": 128,
      "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
      "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "q_lora_rank": 32, "kv_lora_rank": 16,
      "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16}, (8, 2, 32, 2, 1)),
])
def test_hugging_face_moe_configs_are_measured(tmp_path, fields: dict, experts: tuple) -> None:
    # The fp32 measuring pass used to stop in transformers' grouped expert matmul (whose meta
    # kernel takes bf16 alone), and DeepSeek-V3's narrower values in the fused attention.
    from orchestrator.workloads.hf import build

    m = _hf(tmp_path, **fields)
    spec = model_spec(m)
    e = spec.experts
    assert (e.experts, e.top_k, e.expert_hidden, e.moe_blocks, e.shared_experts) == experts
    with torch.device("meta"):
        assert spec.params == sum(p.numel() for p in build(m.hf_config).parameters())
    # An MoE block runs its top-k experts' three matmuls per token, at least.
    assert spec.block_forward_flops_per_token >= 2 * e.top_k * 3 * spec.hidden * e.expert_hidden


@pytest.mark.slow
def test_an_hf_moe_whose_expert_fields_are_unknown_names_the_key(tmp_path) -> None:
    m = _hf(tmp_path, model_type="olmoe", intermediate_size=32, num_key_value_heads=4, num_experts=4,
            num_experts_per_tok=2, eos_token_id=1, pad_token_id=0, bos_token_id=None)
    with pytest.raises(ConfigError, match=r"key 'model.hf_config'.*olmoe.*expert fields are not known"):
        model_spec(m)


@pytest.mark.slow
def test_expert_parallelism_refuses_experts_it_cannot_split(tmp_path) -> None:
    from orchestrator.errors import PlanError
    from orchestrator.runtime.expert_parallel import check_splittable
    from orchestrator.workloads.hf import build

    check_splittable(moe.build("tiny"))  # the built-in family's split
    m = _hf(tmp_path, model_type="qwen3_moe", intermediate_size=128, moe_intermediate_size=32, head_dim=16,
            num_experts=8, num_experts_per_tok=2)
    with torch.device("meta"):
        hf = build(m.hf_config)
    with pytest.raises(PlanError, match=r"key 'parallel.ep'.*Qwen3MoeExperts; use ep=1"):
        check_splittable(hf)
