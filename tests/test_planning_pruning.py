"""The search's pruning rules one by one: each says why a (strategy, mesh) goes no further, or
nothing, and only the reported ones reach the plan's alternatives."""

from __future__ import annotations

import math

from clusters import dgx_a100

from orchestrator.choices import Strategy
from orchestrator.config import load_config
from orchestrator.planning import job_context, plan_job
from orchestrator.planning.layout import Wirings
from orchestrator.planning.mesh import Mesh
from orchestrator.planning.search import (
    PRUNING_RULES,
    Constraints,
    MeshCandidate,
    SearchSpace,
    batch_does_not_divide,
    mesh_candidates,
    micro_batch_does_not_divide,
    pipeline_adds_nothing,
    pipeline_cannot_win,
    pipeline_shards_across_nodes,
    pp_microbatches_do_not_divide,
    pruned,
)

GPT = ["model.n_layer=8", "model.n_head=16", "model.n_embd=1024", "model.block_size=512",
       "train.global_batch_size=32"]


def space(overrides: list[str] = (), nodes: int = 2) -> SearchSpace:
    cfg = load_config(None, GPT + list(overrides))
    topo = dgx_a100(nodes)
    return SearchSpace(job_context(cfg, topo), Constraints.from_config(cfg), Wirings.of(topo))


def test_the_batch_must_be_a_multiple_of_the_data_parallel_size():
    search = space(["train.global_batch_size=24"])
    assert batch_does_not_divide(search, MeshCandidate(Strategy.ddp, Mesh(16, 1, 1)), math.inf) == \
        "train.global_batch_size=24 is not a multiple of the data-parallel size 16"
    assert batch_does_not_divide(search, MeshCandidate(Strategy.ddp, Mesh(8, 1, 2)), math.inf) is None


def test_a_forced_micro_batch_must_divide_a_ranks_sequences():
    search = space(["train.micro_batch_size=3"])
    # 32 sequences over 16 data-parallel ranks: 2 each, which 3 does not divide.
    assert micro_batch_does_not_divide(search, MeshCandidate(Strategy.ddp, Mesh(16, 1, 1)), math.inf) == (
        "train.micro_batch_size=3 does not divide the 2 sequences per data-parallel rank "
        "(train.global_batch_size=32 / 16); allowed: 1, 2")
    assert micro_batch_does_not_divide(space(), MeshCandidate(Strategy.ddp, Mesh(16, 1, 1)), math.inf) is None


def test_forced_pipeline_micro_batches_must_divide_a_ranks_sequences():
    search = space(["parallel.pp=2", "parallel.pp_microbatches=3"])
    assert pp_microbatches_do_not_divide(search, MeshCandidate(Strategy.zero2, Mesh(1, 8, 1, pp=2)), math.inf) == \
        "parallel.pp_microbatches=3 does not divide the 4 sequences per data-parallel rank"


def test_silent_rules_drop_pipelined_plans_another_candidate_stands_for():
    search = space()
    piped = Mesh(1, 8, 1, pp=2)
    assert pipeline_adds_nothing(search, MeshCandidate(Strategy.zero3, piped), math.inf) is not None
    assert pipeline_adds_nothing(search, MeshCandidate(Strategy.zero2, piped), math.inf) is None
    # A forced strategy is priced as forced.
    assert pipeline_adds_nothing(space(["parallel.strategy=zero3"]), MeshCandidate(Strategy.zero3, piped),
                                 math.inf) is None
    # HSDP under a pipeline shards inside a node (8 GPUs, tp=1: dp_shard=8).
    assert pipeline_shards_across_nodes(search, MeshCandidate(Strategy.hsdp, Mesh(2, 4, 1, pp=2)), math.inf)
    assert pipeline_shards_across_nodes(search, MeshCandidate(Strategy.hsdp, Mesh(1, 8, 1, pp=2)), math.inf) is None


def test_a_pipeline_whose_compute_floor_exceeds_the_fastest_plan_found_cannot_win():
    search = space()
    candidate = MeshCandidate(Strategy.zero2, Mesh(1, 8, 1, pp=2))
    assert pipeline_cannot_win(search, candidate, math.inf) is None
    assert pipeline_cannot_win(search, candidate, 1e-9) is not None


def test_pruned_asks_the_rules_in_order_and_says_which_reach_the_plan():
    search = space(["train.global_batch_size=24"])
    unusable = MeshCandidate(Strategy.ddp, Mesh(16, 1, 1), unusable="tp=3 does not divide the 16 ranks")
    assert pruned(search, unusable, math.inf) == ("tp=3 does not divide the 16 ranks", True)
    assert pruned(search, MeshCandidate(Strategy.ddp, Mesh(16, 1, 1)), math.inf)[1] is True
    assert pruned(search, MeshCandidate(Strategy.zero3, Mesh(1, 8, 1, pp=2)), math.inf)[1] is False
    assert pruned(search, MeshCandidate(Strategy.ddp, Mesh(8, 1, 2)), math.inf) is None
    assert [reported for _, reported in PRUNING_RULES].count(False) == 3


def test_candidates_without_a_pipeline_come_first():
    candidates = mesh_candidates(space(), n_head=16)
    stages = [candidate.mesh.pp for candidate in candidates]
    assert stages == sorted(stages) and stages[0] == 1 and stages[-1] > 1


def test_a_reported_reason_reaches_the_plans_alternatives():
    cfg = load_config(None, GPT + ["train.global_batch_size=24", "parallel.pp=1"])
    plan = plan_job(cfg, dgx_a100(2))
    assert any(not alternative.fits and alternative.reason ==
               "train.global_batch_size=24 is not a multiple of the data-parallel size 16"
               for alternative in plan.alternatives)
