"""Recovery without a cluster: where the survivors' state comes from, and the clock of a start or
restart. (Whether the survivors may stay, and the driver carrying that out:
test_recovery_decisions.py. With real ranks killed, hung and lost: test_runtime.py and
test_recovery.py.)"""

from __future__ import annotations

import time

import pytest

from orchestrator.control import heal
from orchestrator.planning.mesh import Mesh
from orchestrator.record.startup_clock import PART_NAMES, Phases, describe


def test_a_clock_adds_its_parts_and_names_the_largest():
    record: dict = {}
    clock = Phases(time.time() - 5.0, record)
    clock.add("detection_s", 0.2)
    clock.add("actor_start_s", 2.5)
    # A survivor waits in the process group while the new rank imports the runtime: one wait,
    # which each part's slowest rank would count twice (0.9 + 1.05 + 0.3 > the 1.35 s it took).
    clock.add_setups([{"timings": {"process_group_s": 0.9, "model_build_s": 0.1, "state_restore_s": 0.3}},
                      {"timings": {"process_group_s": 0.0, "model_build_s": 1.05, "state_restore_s": 0.3}}])
    clock.add("first_step_s", 0.6)
    out = clock.finish()
    assert record["breakdown"] is out
    # the slowest rank's setup is what the others waited for
    assert out["model_build_s"] == 1.05 and out["process_group_s"] == 0.0 and out["state_restore_s"] == 0.3
    assert out["largest"] == "actor_start_s"
    assert out["total_s"] >= 5.0  # from the detection, so time no part accounts for counts too
    assert list(out)[:-2] == [k for k in PART_NAMES if k in out]  # in the order they happen
    assert describe(out).endswith("(largest part: actor start 2.5 s)")


def test_an_unknown_part_is_refused():
    with pytest.raises(ValueError, match="unknown phase 'warmup_s'"):
        Phases(time.time()).add("warmup_s", 1.0)


def test_the_start_clock_fills_no_restart_record():
    clock = Phases(time.time())
    clock.add("probe_s", 0.1)
    out = clock.finish()
    assert clock.record is None and out["largest"] == "probe_s"


def _held(step, digest="d", rows=()):
    return {"step": step, "digest": digest, "rows": [{"step": s, "loss": 1.0} for s in rows]}


def test_ddp_restores_the_newest_step_any_survivor_holds_from_the_lowest_rank_holding_it():
    # Rank 1 died mid-step: rank 2 finished step 6 before the loss reduction lost its peer,
    # ranks 0 and 3 had not. Rank 2 is the one source; the driver had rows up to step 4.
    held = {0: _held(5, "five", rows=[5]), 2: _held(6, rows=[5, 6]), 3: _held(5, "five", rows=[5])}
    peers, rows, why = heal.choose_restore(Mesh(dp_replicate=4), held, last_step=4, max_steps=100)
    assert why is None
    assert peers.step == 6 and peers.source == {0: 2, 1: 2, 2: 2, 3: 2}
    assert [r["step"] for r in rows] == [5, 6]  # the steps rank 0 had not sent yet


def test_hsdp_takes_each_shard_from_a_survivor_of_its_own_replica_group():
    # dp_replicate=2 x dp_shard=2: replica groups [0, 2] and [1, 3]; rank 1 died.
    held = {0: _held(7, "shard0"), 2: _held(7, "shard0"), 3: _held(7, "shard1")}
    peers, rows, why = heal.choose_restore(Mesh(dp_replicate=2, dp_shard=2), held, last_step=7, max_steps=100)
    assert why is None and rows == []
    assert peers.source == {0: 0, 2: 0, 1: 3, 3: 3}


@pytest.mark.parametrize("mesh, held, reason", [
    # zero3: every shard exists once; the dead rank's is in no survivor's memory
    (Mesh(dp_shard=4), {0: None, 2: None, 3: None}, "dp_replicate=1"),
    # both replicas of shard 1 lost
    (Mesh(dp_replicate=2, dp_shard=2), {0: _held(3), 2: _held(3)}, "no survivor of replica group [1, 3]"),
    # the one other replica of shard 1 is torn (its update applied, its step not done)
    (Mesh(dp_replicate=2, dp_shard=2), {0: _held(3), 2: _held(3), 3: None}, "no survivor of replica group [1, 3]"),
    # the survivor of shard 1's group is a step behind the newest step
    (Mesh(dp_replicate=2, dp_shard=2), {0: _held(4), 2: _held(4), 3: _held(3)}, "holds step 4"),
    # replicas that should be equal are not: memory is not trusted
    (Mesh(dp_replicate=3), {0: _held(3, "x"), 2: _held(3, "y")}, "different contents"),
    (Mesh(dp_replicate=2), {0: None}, "no survivor holds a whole step"),
    # rank 0 died with rows unsent and the survivor no longer keeps them
    (Mesh(dp_replicate=2), {1: _held(9, rows=[8, 9])}, "metrics of steps 6-9"),
    # nothing left to train: the final checkpoint is what the run ends with
    (Mesh(dp_replicate=2), {1: _held(100, rows=range(6, 101))}, "after the last step"),
])
def test_a_checkpoint_is_read_instead_and_the_record_says_why(mesh, held, reason):
    peers, rows, why = heal.choose_restore(mesh, held, last_step=5, max_steps=100)
    assert peers is None and rows == []
    assert reason in why
