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
from orchestrator.planning.mesh import Mesh
from orchestrator.planning.resolve import resolve
from orchestrator.runtime.comm_hooks import fsdp_policy, hierarchy_groups, register_ddp_sync
from orchestrator.runtime.parallelize import build_mesh, parallelize
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
@pytest.mark.slow
def test_loss_and_grad_norm_match_single_process(name, results, references) -> None:
    case, got, ref = CASES[name], results[name], _reference(references, CASES[name])
    assert len(got["losses"]) == pw.STEPS >= 5
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
        assert abs(a - b) <= case.tolerance, f"{name} step {step}: loss {a} vs single process {b}"
    for step, (a, b) in enumerate(zip(got["norms"], ref["norms"])):
        assert abs(a - b) <= 1e-5 * b, f"{name} step {step}: grad norm {a} vs single process {b}"


@pytest.mark.slow
def test_fp16_compression_is_applied_and_close(results, references) -> None:
    got, ref = results["ddp_fp16"], _reference(references, CASES["ddp_fp16"])
    diffs = [abs(a - b) for a, b in zip(got["losses"], ref["losses"])]
    # fp16 all-reduce rounds the gradients: visibly different, but only at fp16 precision.
    assert max(diffs) > 1e-6
    assert max(diffs) <= CASES["ddp_fp16"].tolerance


@pytest.mark.slow
def test_powersgd_warm_up_keeps_the_early_steps_exact(results, references) -> None:
    # zero1's run is long enough that every step here is warm-up: it stays in the exact cases.
    zero1 = CASES["zero1"]
    assert zero1.ex.compression == "powersgd" and zero1.ex.compression_warmup_steps >= pw.STEPS
    assert zero1.tolerance <= 1e-5
    # A run of STEPS steps: plain all-reduce for the warm-up, then low-rank compression.
    case = CASES["ddp_powersgd"]
    warm = case.ex.compression_warmup_steps
    assert case.ex.compression == "powersgd" and 2 <= warm < pw.STEPS - 1
    got, ref = results["ddp_powersgd"]["losses"], _reference(references, case)["losses"]
    # The loss of step k is taken before update k: the first warm + 1 follow plain updates only.
    for step in range(warm + 1):
        assert abs(got[step] - ref[step]) <= 1e-5, f"warm-up step {step}: loss {got[step]} vs {ref[step]}"
    assert max(abs(a - b) for a, b in zip(got[warm + 1:], ref[warm + 1:])) > 1e-4
    assert got[-1] < got[0]


@pytest.mark.slow
def test_bf16_on_gloo_is_skipped_with_a_note(results) -> None:
    # resolve drops it for CPU ranks, and the runtime reports that note and nothing else.
    assert results["zero2"]["notes"] == [
        "bf16 gradient compression skipped: it needs the NCCL backend, CPU ranks use gloo"
    ]
    assert CASES["zero2"].ex.compression == "none"


@pytest.mark.parametrize("name", [c.name for c in pw.CASES])
@pytest.mark.slow
def test_the_runtime_notes_are_the_executions_own(name, results) -> None:
    # What ran differently from the request is what resolve said, no more: only zero2's
    # compression and tp_ddp's wrapping (ddp with tp=2 runs as FSDP2) differ from the request.
    assert results[name]["notes"] == list(CASES[name].ex.notes)
    assert bool(results[name]["notes"]) == (name in ("zero2", "tp_ddp"))


def test_bf16_reduction_on_a_gloo_group_is_skipped_by_the_runtime_too(one_rank_group) -> None:
    # A plan resolved for GPUs that lands on gloo: the FSDP2 policy reduces in fp32 and says why.
    policy, notes = fsdp_policy("bf16", "bf16", one_rank_group)
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    assert notes == ["bf16 gradient compression skipped: it needs the NCCL backend, this group uses gloo"]


@pytest.mark.slow
def test_hierarchical_all_reduce_ran_over_node_groups(results) -> None:
    # The parity of ddp_hier (above) only means something if its buckets took the hierarchy.
    h = results["ddp_hier"]["hierarchy"]
    assert h["intra"] == [[0, 1], [2, 3]]
    assert h["inter"] == [[0, 2], [1, 3]]
    # One synced backward per step; DDP's first one fills a single large first bucket, the
    # rebuilt ones several of bucket_mb=0.05, and every one of them went through the hook.
    assert h["buckets"] > pw.STEPS
    assert all(results[n]["hierarchy"] is None for n in CASES if n != "ddp_hier")


@pytest.mark.slow
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


@pytest.mark.slow
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
@pytest.mark.slow
def test_fsdp2_gathers_weights_in_the_spec_param_dtype(name, results) -> None:
    case, got = CASES[name], results[name]
    fsdp2 = case.ex.strategy not in ("ddp", "zero1") or case.ex.mesh.tp > 1
    assert fsdp2 == (not case.ex.ddp_reduces)
    gathered = str(pw.PARAM_DTYPES[str(case.ex.param_dtype)] if fsdp2 else torch.float32)
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
    def ex(precision: str):
        return resolve("ddp", Mesh(dp_replicate=4), precision=precision, device="cpu")

    assert (ex("fp32").autocast, ex("fp32").param_dtype) == (None, "fp32")
    assert (ex("bf16").autocast, ex("bf16").param_dtype) == ("bf16", "bf16")
    assert (ex("fp16").autocast, ex("fp16").param_dtype) == ("fp16", "fp16")
    assert set(pw.PARAM_DTYPES) == {"fp32", "bf16", "fp16"}
    with pytest.raises(ValueError, match="fp64"):
        ex("fp64")
    with pytest.raises(ValueError, match="param_dtype must be one of"):
        fsdp_policy("fp64", "none", None)


@pytest.mark.parametrize("name", [c.name for c in pw.CASES if c.checkpoint])
@pytest.mark.slow
def test_dcp_checkpoint_resumes_exactly(name, results) -> None:
    got = results[name]
    assert got["resumed_loss"] == got["losses"][-1]


@pytest.mark.parametrize("name", [c.name for c in pw.CASES if c.resume_from])
@pytest.mark.slow
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
    mesh, strategy = case.ex.mesh, case.ex.strategy
    dp = mesh.dp_replicate * mesh.dp_shard
    shard = {"ddp": 1, "zero1": 1, "zero2": dp, "zero3": dp, "hsdp": mesh.dp_shard}[strategy]
    total = 0.0
    for name, p in pw.fresh_model().named_parameters():
        total += p.numel() * 4 / (mesh.tp if _is_tp_sharded(name) else 1)
    return total / shard


@pytest.mark.parametrize("name", [c.name for c in pw.CASES])
@pytest.mark.slow
def test_state_bytes_match_the_strategy(name, results) -> None:
    case = CASES[name]
    states = results[name]["state_bytes"]
    expected = _expected_param_bytes(case)
    for rank, s in enumerate(states):
        assert s["params"] == pytest.approx(expected, rel=0.10), f"rank {rank} params"
        # Gradients live in the same layout as the parameters (full under DDP/ZeRO-1).
        assert s["grads"] == pytest.approx(expected, rel=0.10), f"rank {rank} grads"
    if case.ex.strategy == "zero1":
        full = 2 * _expected_param_bytes(CASES["ddp"])  # AdamW: exp_avg + exp_avg_sq
        assert sum(s["optimizer"] for s in states) == pytest.approx(full, rel=0.01)
        assert max(s["optimizer"] for s in states) < full / 2
    else:
        for rank, s in enumerate(states):
            assert s["optimizer"] == pytest.approx(2 * expected, rel=0.10), f"rank {rank} optimizer"


@pytest.mark.slow
def test_zero3_holds_a_quarter_of_the_model(results) -> None:
    total = sum(p.numel() * 4 for p in pw.fresh_model().parameters())
    assert results["zero3"]["state_bytes"][0]["params"] == pytest.approx(total / 4, rel=0.05)
    assert math.isclose(results["ddp"]["state_bytes"][0]["params"], total)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"strategy": "zero4"}, "'zero4' is not a valid Strategy"),
        ({"compression": "int8"}, "'int8' is not a valid Compression"),
        ({"recompute": "some"}, "'some' is not a valid Recompute"),
        ({"precision": "int8"}, "'int8' is not a valid Precision"),
        ({"bucket_mb": 0}, "bucket_mb must be positive"),
        ({"algorithm": "tree"}, "'tree' is not a valid SyncAlgorithm"),
        ({"device": "tpu"}, "device kind must be one of gpu, cpu, got 'tpu'"),
        ({"strategy": "auto"}, "resolve takes concrete choices"),
    ],
)
def test_resolve_rejects_impossible_requests(kwargs, message) -> None:
    args = {"strategy": "ddp", "mesh": Mesh(dp_replicate=4), "precision": "fp32", "device": "cpu"} | kwargs
    with pytest.raises(ValueError, match=re.escape(message)):
        resolve(**args)


def test_resolve_rejects_what_cannot_run() -> None:
    # ddp does not shard, whatever the tensor parallelism: an Unsupported plan, not a wrong run.
    for tp in (1, 2):
        with pytest.raises(PlanError, match=re.escape("ddp does not shard: dp_shard must be 1, got 2")):
            resolve("ddp", Mesh(dp_shard=2, tp=tp), precision="fp32", device="cpu")


@pytest.mark.parametrize(
    ("axes", "message"),
    [
        ({"dp": 4, "tp": 1}, "mesh axes are pp, dp_replicate, dp_shard, cp, tp, ep; got dp"),
        ({"dp_replicate": 0, "dp_shard": 1, "tp": 1}, "mesh axis dp_replicate must be a positive integer, got 0"),
    ],
)
def test_mesh_rejects_impossible_axes(axes, message) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        Mesh.from_dict(axes)


def test_parallelize_needs_node_of_rank_for_a_hierarchical_all_reduce(one_rank_group) -> None:
    ex = resolve("ddp", Mesh(), precision="fp32", device="cpu", algorithm="hierarchical")
    assert ex.sync_algorithm == "hierarchical"
    with pytest.raises(ValueError, match=re.escape("a hierarchical all-reduce needs node_of_rank")):
        parallelize(torch.nn.Linear(4, 4), ex, build_mesh(Mesh(), "cpu"), pw.make_optimizer, torch.device("cpu"))


def test_parallelize_rejects_a_device_mesh_of_another_shape(one_rank_group) -> None:
    ex = resolve("ddp", Mesh(dp_replicate=4), precision="fp32", device="cpu")
    with pytest.raises(ValueError, match=re.escape("the device mesh has shape (1, 1, 1, 1, 1), the execution is for")):
        parallelize(torch.nn.Linear(4, 4), ex, build_mesh(Mesh(), "cpu"), pw.make_optimizer, torch.device("cpu"))


def _cpu_plan():
    from pathlib import Path

    from orchestrator.config import load_config
    from orchestrator.planning import plan_job
    from orchestrator.topology.model import ClusterTopology, cpu_node

    job = Path(__file__).resolve().parent.parent / "jobs" / "llm.yaml"
    return plan_job(load_config(job, ["train.global_batch_size=8"]), ClusterTopology(nodes=[cpu_node(4)]))


def test_plan_places_every_rank_of_its_mesh_on_a_named_node() -> None:
    # The runtime takes node_of_rank from the plan: it must name a node for every rank.
    import dataclasses

    from orchestrator.planning.mesh import RankPlacement

    plan = _cpu_plan()
    assert plan.world_size == 4 and len(plan.node_of_rank) == 4 and all(plan.node_of_rank)
    with pytest.raises(ValueError, match=re.escape("has 4 ranks, the plan places 2")):
        dataclasses.replace(plan, ranks=plan.ranks[:2])
    with pytest.raises(ValueError, match=re.escape("rank 2 needs a non-empty node id")):
        RankPlacement(2, "", plan.ranks[2].gpu)


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
