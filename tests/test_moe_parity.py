"""MoE decoders train exactly like one process with and without expert parallelism.

One launch of 4 gloo ranks runs every case (tests/_moe_parity_worker.py): two MoE shapes and a
two-expert one at ep 1, 2 and 4 under zero3, ep=2 under hsdp, ep 2 and 4 with tp=2, and a
collapsed router; the loss, the clipped gradient norm and the experts' bias after every step
against one process, and resuming from a checkpoint another ep wrote.
"""

from __future__ import annotations

import json

import _moe_parity_worker as pw
import pytest
import torch
import torch.multiprocessing as mp

CASES = {c.name: c for c in pw.CASES}
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("moe_parity")
    out = root / "results.json"
    mp.spawn(pw.run_rank, args=(str(root / "init"), str(out), list(CASES)), nprocs=pw.WORLD, join=True)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def references() -> dict[str, dict]:
    torch.set_num_threads(1)
    return {shape: pw.reference(shape) for shape in pw.SHAPES}


def test_references_learn_clip_and_balance(references) -> None:
    for shape, ref in references.items():
        assert ref["losses"][0] - ref["losses"][-1] > 0.03, shape
        assert min(ref["norms"]) > pw.MAX_NORM, shape
        assert any(b != 0 for layer in ref["bias"] for b in layer), shape  # the bias update ran


@pytest.mark.parametrize("name", list(CASES))
def test_loss_grad_norm_and_bias_match_one_process(name, results, references) -> None:
    shape = CASES[name].shape
    got, ref, tolerance = results[name], references[shape], pw.TOLERANCE[shape]
    assert len(got["losses"]) == pw.STEPS
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
        assert abs(a - b) <= tolerance, f"{name} step {step}: loss {a} vs one process {b}"
    # The routed sums accumulate in another order than one process's (per rank, per expert
    # group): a few ulps a step, which the gradient norm shows first. A mis-divided expert
    # gradient (a factor of ep) or one changed route is orders of magnitude more.
    for step, (a, b) in enumerate(zip(got["norms"], ref["norms"])):
        assert abs(a - b) <= 10 * tolerance * b, f"{name} step {step}: grad norm {a} vs one process {b}"
    # The bias moves by whole steps of the coefficient: only a miscounted expert changes it.
    torch.testing.assert_close(torch.tensor(got["bias"]), torch.tensor(ref["bias"]), rtol=0, atol=1e-7)


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.resume_from])
def test_resume_from_a_checkpoint_of_another_ep_is_exact(name, results) -> None:
    # The state another ep saved, loaded under this one, takes the step that ep took: the same
    # loss but for the order of the reductions (equal to the last bit in every case here).
    for source, loss in results[name]["resumed"].items():
        expected = results[source]["losses"][-1]
        assert abs(loss - expected) <= 1e-6, f"{name} resumed from {source}: {loss} vs {expected}"


def test_experts_are_held_as_planned(results) -> None:
    # ep=1: plain parameters FSDP-sharded with their block on the dense mesh.
    assert results["tiny_ep1"]["experts_mesh"] == ["dp_shard"]
    # ep=2 of 4 ranks: 4 of the 8 experts a rank, sharded again over the 2 expert-FSDP ranks.
    assert results["tiny_ep2"]["experts_mesh"] == ["efsdp", "ep"]
    assert results["tiny_ep2"]["experts_local_shape"] == [2, 32, 64]
    assert results["tiny_ep4"]["experts_local_shape"] == [2, 32, 64]
    assert results["tiny_hsdp_ep2"]["experts_mesh"] == ["dp_replicate", "efsdp", "ep"]
    # One expert a rank and two expert-FSDP ranks: sharded by width, not by expert.
    assert results["two_ep2"]["experts_local_shape"] == [1, 16, 64]


def test_a_collapsed_router_sends_every_token_to_one_rank_and_trains(results) -> None:
    # Every token of every step on expert 0, held by rank 0 and 2 of their ep groups; ranks 1
    # and 3 get no rows, and the loss still matches one process (above).
    tokens = pw.GLOBAL_MICRO_BATCH * pw.SEQ
    for layer in results["collapsed_ep2"]["load"]:
        assert layer == [tokens] + [0] * 7
