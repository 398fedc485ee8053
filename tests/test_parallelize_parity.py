"""Every sharding strategy trains exactly like one process on the same global batch.

One launch of 4 gloo ranks runs all cases (see tests/_parity_worker.py); each case is
compared with a single-process reference: loss and clipped gradient norm per step, the
per-rank model-state bytes the strategy should hold, and a DCP save/restore that must
resume bit-for-bit. The ddp_hier case reduces DDP's buckets through the hierarchical hook
(two "nodes" of two ranks). The bf16 case (FSDP2 gathering bf16 weights under bf16 autocast) is
compared with a single process under the same autocast.
"""

from __future__ import annotations

import json
import math
import re

import _parity_worker as pw
import pytest
import torch
import torch.multiprocessing as mp

from orchestrator.errors import PlanError
from orchestrator.runtime.comm_hooks import hierarchy_groups, register_ddp_sync
from orchestrator.runtime.parallelize import ParallelSpec, param_dtype_for
from orchestrator.runtime.tensor_parallel import apply_tensor_parallel
from orchestrator.workloads.gpt import GPT

CASES = {c.name: c for c in pw.CASES}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("parity")
    out = root / "results.json"
    mp.spawn(pw.run_rank, args=(str(root / "init"), str(out), list(CASES)), nprocs=pw.WORLD, join=True)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def references() -> dict[tuple[int, torch.dtype | None], dict[str, list[float]]]:
    """Single-process trajectories by (accum, autocast dtype)."""
    torch.set_num_threads(1)
    return {key: pw.reference(*key) for key in {(c.accum, c.autocast) for c in pw.CASES}}


def _reference(references: dict, case: pw.Case) -> dict[str, list[float]]:
    return references[(case.accum, case.autocast)]


def test_reference_learns_and_clips(references) -> None:
    # Parity is only meaningful if the trajectory moves and clipping is active.
    for ref in references.values():
        assert ref["losses"][0] - ref["losses"][-1] > 0.3
        assert min(ref["norms"]) > pw.MAX_NORM


@pytest.mark.parametrize("name", [c.name for c in pw.CASES if c.tolerance <= 1e-5])
def test_loss_and_grad_norm_match_single_process(name, results, references) -> None:
    case, got, ref = CASES[name], results[name], _reference(references, CASES[name])
    assert len(got["losses"]) == pw.STEPS >= 5
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
        assert abs(a - b) <= case.tolerance, f"{name} step {step}: loss {a} vs single process {b}"
    for step, (a, b) in enumerate(zip(got["norms"], ref["norms"])):
        assert abs(a - b) <= 1e-5 * b, f"{name} step {step}: grad norm {a} vs single process {b}"


def test_fp16_compression_is_applied_and_close(results, references) -> None:
    got, ref = results["ddp_fp16"], _reference(references, CASES["ddp_fp16"])
    diffs = [abs(a - b) for a, b in zip(got["losses"], ref["losses"])]
    # fp16 all-reduce rounds the gradients: visibly different, but only at fp16 precision.
    assert max(diffs) > 1e-6
    assert max(diffs) <= CASES["ddp_fp16"].tolerance


def test_bf16_on_gloo_is_skipped_with_a_note(results) -> None:
    assert results["zero2"]["notes"] == [
        "bf16 gradient compression skipped: it needs the NCCL backend, this group uses gloo"
    ]
    assert all(not results[n]["notes"] for n in CASES if n != "zero2")


def test_hierarchical_all_reduce_ran_over_node_groups(results) -> None:
    # The parity of ddp_hier (above) only means something if its buckets took the hierarchy.
    h = results["ddp_hier"]["hierarchy"]
    assert h["intra"] == [[0, 1], [2, 3]]
    assert h["inter"] == [[0, 2], [1, 3]]
    # One synced backward per step; DDP's first one fills a single large first bucket, the
    # rebuilt ones several of bucket_mb=0.05, and every one of them went through the hook.
    assert h["buckets"] > pw.STEPS
    assert all(results[n]["hierarchy"] is None for n in CASES if n != "ddp_hier")


def test_hierarchical_all_reduce_pads_and_composes_with_fp16(results) -> None:
    errors = results["ddp_hier"]["hierarchy"]["odd_errors"]
    # 7 elements over nodes of 2 ranks: the padded tail must not leak into the mean.
    assert errors["fp32"] <= 1e-6
    # In fp16 the shard travels rounded: visibly, but only at fp16 precision.
    assert 1e-6 < errors["fp16"] <= 1e-2


def test_hierarchy_groups_by_node_and_local_position() -> None:
    nodes = ("a", "b", "a", "b", "c", "c")
    assert hierarchy_groups(range(6), nodes) == ([[0, 2], [1, 3], [4, 5]], [[0, 1, 4], [2, 3, 5]])
    uneven = "nodes hold unequal numbers of data-parallel ranks (a holds 3, b holds 1)"
    with pytest.raises(ValueError, match=re.escape(uneven)):
        hierarchy_groups(range(4), ("a", "a", "b", "a"))


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo process group of this process alone, torn down afterwards."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("compression", "note"),
    [
        ("none", "hierarchical all-reduce ran flat: the data-parallel group has one node, "
                 "so there is no level to split"),
        ("powersgd", "hierarchical all-reduce ran flat: powersgd compression is its own all-reduce scheme"),
    ],
)
def test_hierarchical_sync_that_cannot_run_falls_back_to_flat_with_a_note(one_rank_group, compression, note) -> None:
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4), process_group=one_rank_group)
    hierarchy, notes = register_ddp_sync(ddp, one_rank_group, compression, "hierarchical", ("n0",))
    assert hierarchy is None
    assert notes == [note]


def test_bf16_gathers_track_a_bf16_autocast_single_process(results, references) -> None:
    case, got = CASES["zero3_bf16"], results["zero3_bf16"]
    ref = _reference(references, case)
    # Sharding must not add to what bf16 autocast already rounds: the loss stays within
    # 1e-2 (0.25% of a loss near 4) of one process under the same autocast, every step.
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
        assert abs(a - b) <= case.tolerance, f"step {step}: loss {a} vs bf16-autocast single process {b}"
    # Gradients are computed against bf16 weights, so their norm only tracks to a few percent.
    for step, (a, b) in enumerate(zip(got["norms"], ref["norms"])):
        assert abs(a - b) <= 0.1 * b, f"step {step}: grad norm {a} vs bf16-autocast single process {b}"
    # And the run really is mixed precision: it left the fp32 trajectory, which every fp32
    # strategy follows to 1e-5.
    fp32 = references[(case.accum, None)]["losses"]
    assert max(abs(a - b) for a, b in zip(got["losses"], fp32)) > 1e-5


@pytest.mark.parametrize("name", [c.name for c in pw.CASES])
def test_fsdp2_gathers_weights_in_the_spec_param_dtype(name, results) -> None:
    case, got = CASES[name], results[name]
    fsdp2 = case.spec.strategy not in ("ddp", "zero1") or case.spec.mesh["tp"] > 1
    gathered = str(pw.PARAM_DTYPES[case.spec.param_dtype] if fsdp2 else torch.float32)
    # What the layers multiply with inside forward: FSDP2's all-gathered weights, DDP's own.
    assert got["compute_dtypes"] == [gathered]
    # Master weights, and so the optimizer's states and the checkpoint, stay fp32.
    assert got["sharded_dtypes"] == ["torch.float32"]
    if fsdp2:
        # Gradients reduce in fp32 (bf16 compression is skipped on gloo) whatever is gathered.
        assert got["mp_policies"] == [[gathered, "torch.float32"]]
    else:
        assert got["mp_policies"] == []


def test_param_dtype_follows_the_autocast_dtype() -> None:
    assert param_dtype_for(None) == "fp32"
    assert param_dtype_for(torch.bfloat16) == "bf16"
    assert param_dtype_for(torch.float16) == "fp16"
    with pytest.raises(ValueError, match="autocast dtype must be one of"):
        param_dtype_for(torch.float64)


@pytest.mark.parametrize("name", [c.name for c in pw.CASES if c.checkpoint])
def test_dcp_checkpoint_resumes_exactly(name, results) -> None:
    got = results[name]
    assert got["resumed_loss"] == got["losses"][-1]


@pytest.mark.parametrize("name", [c.name for c in pw.CASES if c.resume_from])
def test_dcp_checkpoint_reshards_across_strategies(name, results, references) -> None:
    # A checkpoint written under another strategy and mesh continues the same trajectory.
    case = CASES[name]
    assert CASES[case.resume_from].accum == case.accum
    assert abs(results[name]["resharded_loss"] - _reference(references, case)["losses"][-1]) <= case.tolerance


def _is_tp_sharded(param_name: str) -> bool:
    for pattern, style in GPT.tp_plan.items():
        module = pattern.removeprefix("h.*.")
        # Row-parallel biases are added after the all-reduce, so they stay whole.
        if param_name.endswith(f"{module}.weight") or (style == "colwise" and param_name.endswith(f"{module}.bias")):
            return True
    return False


def _expected_param_bytes(case: pw.Case) -> float:
    """fp32 parameter bytes one rank should hold: TP divides the block matrices, FSDP shards the rest."""
    mesh, strategy = case.spec.mesh, case.spec.strategy
    dp = mesh["dp_replicate"] * mesh["dp_shard"]
    shard = {"ddp": 1, "zero1": 1, "zero2": dp, "zero3": dp, "hsdp": mesh["dp_shard"]}[strategy]
    total = 0.0
    for name, p in pw.fresh_model().named_parameters():
        total += p.numel() * 4 / (mesh["tp"] if _is_tp_sharded(name) else 1)
    return total / shard


@pytest.mark.parametrize("name", [c.name for c in pw.CASES])
def test_state_bytes_match_the_strategy(name, results) -> None:
    case = CASES[name]
    states = results[name]["state_bytes"]
    expected = _expected_param_bytes(case)
    for rank, s in enumerate(states):
        assert s["params"] == pytest.approx(expected, rel=0.10), f"rank {rank} params"
        # Gradients live in the same layout as the parameters (full under DDP/ZeRO-1).
        assert s["grads"] == pytest.approx(expected, rel=0.10), f"rank {rank} grads"
    if case.spec.strategy == "zero1":
        full = 2 * _expected_param_bytes(CASES["ddp"])  # AdamW: exp_avg + exp_avg_sq
        assert sum(s["optimizer"] for s in states) == pytest.approx(full, rel=0.01)
        assert max(s["optimizer"] for s in states) < full / 2
    else:
        for rank, s in enumerate(states):
            assert s["optimizer"] == pytest.approx(2 * expected, rel=0.10), f"rank {rank} optimizer"


def test_zero3_holds_a_quarter_of_the_model(results) -> None:
    total = sum(p.numel() * 4 for p in pw.fresh_model().parameters())
    assert results["zero3"]["state_bytes"][0]["params"] == pytest.approx(total / 4, rel=0.05)
    assert math.isclose(results["ddp"]["state_bytes"][0]["params"], total)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"strategy": "fsdp"}, "parallel strategy must be one of ddp, zero1, zero2, zero3, hsdp; got 'fsdp'"),
        ({"mesh": {"dp": 4, "tp": 1}}, "parallel mesh must have exactly the axes dp_replicate, dp_shard, tp"),
        ({"mesh": {"dp_replicate": 0, "dp_shard": 1, "tp": 1}}, "axis dp_replicate must be a positive integer"),
        ({"compression": "int8"}, "compression must be one of none, fp16, bf16, powersgd; got 'int8'"),
        ({"recompute": "some"}, "recompute must be one of none, selective, full; got 'some'"),
        ({"param_dtype": "int8"}, "param_dtype must be one of fp32, bf16, fp16; got 'int8'"),
        ({"bucket_mb": 0}, "bucket_mb must be positive"),
        ({"sync_algorithm": "tree"}, "sync_algorithm must be one of flat, hierarchical; got 'tree'"),
        (
            {"sync_algorithm": "hierarchical"},
            "sync_algorithm hierarchical needs node_of_rank (the node of every rank)",
        ),
        ({"node_of_rank": ("n0", "n1")}, "node_of_rank names 2 ranks but the mesh"),
        ({"node_of_rank": ("n0", "n0", "", "n1")}, "every rank a non-empty node id; ranks [2] have none"),
        (
            {"mesh": {"dp_replicate": 1, "dp_shard": 2, "tp": 2}},
            "ddp with tp=2 replicates over dp_replicate only; dp_shard must be 1, got 2",
        ),
    ],
)
def test_spec_rejects_impossible_plans(kwargs, message) -> None:
    args = {"strategy": "ddp", "mesh": {"dp_replicate": 4, "dp_shard": 1, "tp": 1}} | kwargs
    with pytest.raises(PlanError, match=re.escape(message)):
        ParallelSpec(**args)


class _MeshOfSize:
    """Stands in for a tp DeviceMesh: the head-count check runs before any collective."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def test_tensor_parallel_needs_whole_heads() -> None:
    model = pw.fresh_model()  # 4 heads
    with pytest.raises(PlanError, match=re.escape("tp=3 must divide the model's 4 attention heads")):
        apply_tensor_parallel(model, _MeshOfSize(3))


def test_tensor_parallel_needs_a_declared_plan() -> None:
    with pytest.raises(PlanError, match=re.escape("tp=2) needs a model that declares a tensor-parallel plan")):
        apply_tensor_parallel(torch.nn.Linear(4, 4), _MeshOfSize(2))
