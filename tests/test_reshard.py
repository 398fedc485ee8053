"""Any plan resumes any other: a run checkpointed under plan A and resumed under plan B goes on
exactly as the uninterrupted run under A (tests/_reshard_worker.py).

The plans cover ddp, zero1, zero2, zero3, tp=2 and pp=2 (1F1B and interleaved) on two gloo
ranks, hsdp and pp=2 x dp=2 (sharded stages) on four, so checkpoints cross strategies, tensor
and pipeline splits, schedules and world sizes both ways; each with a tied-embedding GPT and an
untied Llama. Every resumed plan is built once and loads every checkpoint in turn, as a rank that
keeps its process between runs would.
"""

from __future__ import annotations

import json
import math
import time

import _reshard_worker as rw
import pytest
import torch.multiprocessing as mp
from torch.distributed.checkpoint import FileSystemReader

pytestmark = pytest.mark.slow

REL = 1e-5  # fp32 reduction order differs between plans; exactly equal where the plan is the same
NAMES = [c.name for c in rw.PLANS]
WORLD_OF = {c.name: c.world for c in rw.PLANS}


def _spawn(world: int, spec: dict, tmp) -> dict:
    spec_file = tmp / f"spec-{world}-{time.monotonic_ns()}.json"
    out = tmp / f"out-{spec_file.stem}.json"
    spec_file.write_text(json.dumps(spec))
    mp.spawn(rw.run_rank, args=(world, str(tmp / f"init-{spec_file.stem}"), str(spec_file), str(out)),
             nprocs=world, join=True)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("reshard")
    plans: dict = {}
    for world in rw.WORLDS:
        for model, by_name in rw.plans(world).items():
            plans.setdefault(model, {}).update(by_name)

    def runs(world: int) -> list:
        return [[m, n, str(tmp), True] for m in rw.MODELS for n in NAMES if WORLD_OF[n] == world]

    def resumes(world: int) -> list:
        return [[m, b, [rw.checkpoint_path(str(tmp), m, a) for a in NAMES]] for m in rw.MODELS for b in NAMES
                if WORLD_OF[b] == world]

    # Two ranks train; four train and then resume every checkpoint (theirs and the two ranks');
    # two ranks resume every checkpoint. The calibration check (the same run without the
    # worker's calibration) and a checkpoint of another model (refused) go with the two ranks.
    first = _spawn(2, {"plans": plans, "train": runs(2) + [["tied", "zero3", str(tmp), False]], "resume": []}, tmp)
    second = _spawn(4, {"plans": plans, "train": runs(4), "resume": resumes(4)}, tmp)
    third = _spawn(2, {"plans": plans, "train": [], "resume": resumes(2) + [
        ["untied", "ddp", [rw.checkpoint_path(str(tmp), "tied", "ddp")]]]}, tmp)
    out = {"trained": {**first["train"], **second["train"]}, "resume": {}, "errors": {}}
    for got in (second, third):
        out["resume"].update(got["resume"])
        out["errors"].update(got["errors"])
    return out


@pytest.mark.parametrize("model", list(rw.MODELS))
@pytest.mark.parametrize("written", NAMES)
def test_a_checkpoint_resumes_under_every_plan_where_the_run_would_have_gone(matrix, model, written):
    run = matrix["trained"][f"{model}/{written}"]
    ckpt = run["checkpoint"]
    assert ckpt and ckpt.endswith(f"step_{rw.CHECKPOINT_AT:08d}")
    after = [f"loss {s}" for s in range(rw.CHECKPOINT_AT, rw.STEPS)] + ["val"]
    expected = {k: run["losses"][k] for k in after}
    wrong = {}
    for read in NAMES:
        key = f"{model}/{read}<{ckpt}"
        if key in matrix["errors"]:
            wrong[read] = matrix["errors"][key]
            continue
        got = matrix["resume"][key]
        assert sorted(got) == sorted(expected), (read, got)
        if read == written:
            ok = got == expected
        else:
            ok = all(math.isclose(got[s], expected[s], rel_tol=REL) for s in expected)
        if not ok:
            wrong[read] = {s: (got[s], expected[s]) for s in expected}
    assert not wrong, f"{model} checkpoint written under {written} resumed differently: {wrong}"


def test_the_workers_calibration_leaves_training_unchanged(matrix):
    # The worker times backward passes without gradient sync before the first step; under
    # FSDP2 their gradients used to stay in its unsharded buffers and join the first step's.
    calibrated = matrix["trained"]["tied/zero3"]["losses"]
    assert matrix["trained"]["tied/zero3/uncalibrated"]["losses"] == calibrated


def test_a_tied_weight_is_checkpointed_once_under_the_same_names_by_every_plan(matrix):
    keys = {}
    for name in NAMES:
        md = FileSystemReader(matrix["trained"][f"tied/{name}"]["checkpoint"]).read_metadata()
        keys[name] = set(md.state_dict_metadata)
    assert "model.wte.weight" in keys["ddp"] and "optimizer.state.wte.weight.exp_avg" in keys["ddp"]
    assert not any("lm_head" in k for k in keys["ddp"])
    assert all(k == keys["ddp"] for k in keys.values()), {n: k ^ keys["ddp"] for n, k in keys.items()}


def test_a_checkpoint_of_another_model_is_refused_in_one_line_naming_a_key(matrix):
    err = matrix["errors"][f"untied/ddp<{matrix['trained']['tied/ddp']['checkpoint']}"]
    assert err.startswith("CheckpointError: checkpoint ") and "cannot be loaded into this run" in err
    assert "Missing key in checkpoint state_dict: model." in err
