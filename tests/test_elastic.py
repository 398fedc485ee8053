"""Re-planning for a changed world keeps the global batch, and the data a step sees does not
depend on how many ranks share it; a GPU-less head is left out of a GPU plan."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from orchestrator.config import load_config
from orchestrator.control.elastic import plan_keeping_batch
from orchestrator.data.stream import TextData, load_tokens
from orchestrator.errors import PlanError
from orchestrator.planning.cluster_view import plannable
from orchestrator.planning.describe import describe_cluster
from orchestrator.topology.files import load_topology_file
from orchestrator.topology.model import ClusterTopology, Network, cpu_node

ROOT = Path(__file__).resolve().parent.parent
CAPTURE = ROOT / "tests" / "fixtures" / "topology" / "topo_4gpu_pcie_pxb_pix_nccl667.txt"
TINY = ["model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.block_size=32", "cluster.gpu=A100",
        "parallel.strategy=ddp", "parallel.tp=1"]


def _cfg(*over: str):
    return load_config(ROOT / "jobs" / "llm.yaml", [*TINY, *over])


def _gpus(nodes: int) -> ClusterTopology:
    return describe_cluster(load_topology_file(CAPTURE, "A100"), nodes, Network(bandwidth_gbps=25.0, latency_us=10.0),
                            "A100")


def _covers(plan, gb: int) -> bool:
    m = plan.mesh
    return plan.micro_batch_size * plan.sync.grad_accum_steps * m.dp_replicate * m.dp_shard == gb


def test_keeping_the_batch_plans_only_the_gpu_nodes_and_names_the_head_left_out():
    gpus = _gpus(2)
    mixed = ClusterTopology(nodes=[cpu_node(2, hostname="head"), *gpus.nodes], network=gpus.network)
    topo, left_out = plannable(mixed)
    assert [x.hostname for x in left_out] == ["head"]
    assert topo.num_devices == 8 and all(d.kind == "gpu" for n in topo.nodes for d in n.devices)
    plan, used, note = plan_keeping_batch(_cfg("train.global_batch_size=8"), topo, left_out=left_out)
    assert plan.world_size == 8 and note is None
    assert [x.hostname for x in plan.left_out] == ["head"]


def test_survivors_that_do_not_divide_the_batch_use_the_largest_world_that_does():
    # 3 nodes x 4 GPUs: 12 ranks do not divide 18 (tp is forced to 1), so the plan uses fewer ranks
    cfg = _cfg("train.global_batch_size=18")
    plan, used, note = plan_keeping_batch(cfg, _gpus(3))
    assert plan.world_size == 9 and _covers(plan, 18) and {len(n.devices) for n in used.nodes} == {3}
    assert note and "9 of 12 devices used" in note
    # losing a node: 8 survivors do not divide 18 either; 6 do (3 per node on 2 nodes)
    plan, used, note = plan_keeping_batch(cfg, _gpus(2))
    assert plan.world_size == 6 and _covers(plan, 18) and {len(n.devices) for n in used.nodes} == {3}
    # a batch the whole world divides uses all of it
    plan, _, note = plan_keeping_batch(_cfg("train.global_batch_size=16"), _gpus(2))
    assert plan.world_size == 8 and note is None and _covers(plan, 16)


def test_below_min_workers_is_one_line_naming_the_key():
    cfg = _cfg("train.global_batch_size=18", "elastic.min_workers=7")
    with pytest.raises(PlanError, match="elastic.min_workers=7") as e:
        plan_keeping_batch(cfg, _gpus(2))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("dp", [1, 2, 3, 6])
def test_a_step_sees_the_same_sequences_whatever_the_data_parallel_size(dp):
    cfg = _cfg("train.global_batch_size=18")
    data = TextData(load_tokens(None), cfg.model.block_size, cfg.data.val_fraction, cfg.train.seed)
    for step in (0, 7):
        ref_x, ref_y = data.train_batch(step, 18, 0, 1)
        parts = [data.train_batch(step, 18, r, dp) for r in range(dp)]
        assert torch.equal(torch.cat([p[0] for p in parts]), ref_x)
        assert torch.equal(torch.cat([p[1] for p in parts]), ref_y)


def test_a_cause_no_world_size_changes_is_stated_alone():
    # A forced pipeline of a model that names no ends to cut at: every smaller world fails the
    # same way, so the sub-world search adds nothing to the one line.
    from dataclasses import replace

    from orchestrator.control.preflight import measure_model

    llama = ["model.factory=orchestrator.workloads.llama:build", "model.args.n_layers=2", "model.n_layer=2"]
    spec = replace(measure_model(_cfg(*llama)), pipeline_ends=False)
    with pytest.raises(PlanError) as e:
        plan_keeping_batch(_cfg(*llama, "parallel.pp=2", "train.global_batch_size=18"), _gpus(2), spec)
    assert str(e.value).startswith("key 'parallel.pp':") and "names no ends" in str(e.value)
    assert "sub-world" not in str(e.value) and "elastic.min_workers" not in str(e.value) and "\n" not in str(e.value)
