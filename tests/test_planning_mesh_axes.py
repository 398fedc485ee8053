"""The mesh's context- and expert-parallel axes: what they multiply, what they borrow, how they are written."""

from __future__ import annotations

import pytest

from orchestrator.planning.mesh import AXES, EXPERT_AXES, Mesh


def test_cp_is_a_factor_of_the_world_and_sits_between_dp_shard_and_tp():
    mesh = Mesh(dp_replicate=2, dp_shard=2, tp=2, cp=2)
    assert AXES.index("dp_shard") < AXES.index("cp") < AXES.index("tp")
    assert mesh.world_size == 16 and mesh.dp == 4
    assert mesh.shape == (1, 2, 2, 2, 2)
    # tp varies fastest, cp next: a cp group is ranks tp apart.
    assert mesh.groups()["cp"][0] == [0, 2]
    assert mesh.groups()["tp"][0] == [0, 1]


def test_ep_borrows_from_dp_shard_cp_and_tp_without_growing_the_world():
    mesh = Mesh(dp_replicate=2, dp_shard=4, tp=2, ep=4)
    assert mesh.world_size == 16
    assert mesh.efsdp == 2 and mesh.expert_shape == (1, 2, 2, 4)
    assert len(EXPERT_AXES) == len(mesh.expert_shape)
    assert mesh.groups()["ep"][:2] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert str(mesh) == "dp_replicate=2 x dp_shard=4 x tp=2 x ep=4"


def test_an_ep_that_does_not_divide_the_ranks_it_borrows_is_refused_naming_them():
    with pytest.raises(ValueError, match=r"ep=3 must divide dp_shard x cp x tp \(2 x 1 x 2 = 4\)"):
        Mesh(dp_shard=2, tp=2, ep=3)


def test_cp_and_ep_are_written_only_above_one_and_read_back_with_their_defaults():
    dense = Mesh(2, 4, 1)
    assert dense.to_dict() == {"pp": 1, "dp_replicate": 2, "dp_shard": 4, "tp": 1}
    assert "cp" not in dense.groups() and "ep" not in dense.groups()
    assert Mesh.from_dict(dense.to_dict()) == dense
    wide = Mesh(1, 4, 1, cp=2, ep=2)
    assert wide.to_dict() == {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "cp": 2, "tp": 1, "ep": 2}
    assert Mesh.from_dict(wide.to_dict()) == wide
    with pytest.raises(ValueError, match="got sp"):
        Mesh.from_dict({"sp": 2})


def test_an_expert_spec_counts_active_parameters_and_mixed_blocks():
    from orchestrator.planning.model_spec import ExpertSpec, ModelSpec

    hidden = 8
    experts = ExpertSpec(experts=4, top_k=2, expert_hidden=16, moe_blocks=2, dense_block_params=500)
    moe_block = 100 + experts.routed_params_per_block(hidden)  # attention and router + 4 x 3 x 8 x 16
    acts = {"none": 1.0, "selective": 1.0, "full": 1.0}
    spec = ModelSpec(name="m", params=2 * moe_block + 500 + 64, blocks=3, block_class="B",
                     block_params=moe_block, root_params=64, hidden=hidden, heads=1, kv_heads=1, vocab=8, seq=8,
                     forward_flops_per_token=1.0, block_forward_flops_per_token=1.0, block_activation_bytes=acts,
                     root_activation_bytes=1.0, backward_transient_bytes=acts, tp_sharded_activation_fraction=None,
                     tp_sharded_params=0, tp_plan=False, tied_embeddings=False, experts=experts)
    assert spec.active_params == spec.params - 2 * 2 * 3 * 8 * 16
    assert "experts" in spec.to_dict()
    with pytest.raises(ValueError, match="top_k=5 must be at most the 4 experts"):
        ExpertSpec(experts=4, top_k=5, expert_hidden=16, moe_blocks=1)
