"""Recovery without a cluster: when the survivors may stay, and the clock of a start or restart.
(With real ranks killed, hung and lost: test_runtime.py and test_recovery.py.)"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from orchestrator.control import heal
from orchestrator.control.failures import WorkerFailure
from orchestrator.control.phases import PART_NAMES, Phases, describe


def _placement(world: int):
    return SimpleNamespace(actors=[object()] * world)


def _failure(ranks, nodes=(), training=True) -> WorkerFailure:
    f = WorkerFailure("worker died: gone", list(ranks), list(nodes))
    if training:
        f.train_refs = [object()] * 4
    return f


@pytest.fixture
def alive(monkeypatch):
    """ray.nodes() as Ray reports it: node `b` is dead."""
    monkeypatch.setattr(heal.ray, "nodes", lambda: [{"NodeID": "a" * 56, "Alive": True},
                                                    {"NodeID": "b" * 56, "Alive": False}])


def test_survivors_stay_when_the_dead_ranks_nodes_are_alive(alive):
    assert heal.precheck(_placement(4), _failure([1], ["a" * 56]), keep_survivors=True) is None


@pytest.mark.parametrize("failure, keep, why", [
    (_failure([1], ["b" * 56]), True, "node bbbbbbbbbbbb is gone"),
    (_failure([0, 1, 2, 3], ["a" * 56]), True, "every rank failed"),
    (_failure([1], ["a" * 56], training=False), True, "before training"),
    (_failure([1], ["a" * 56]), False, "elastic.keep_survivors=false"),
])
def test_the_whole_world_restarts_and_says_why(alive, failure, keep, why):
    assert why in heal.precheck(_placement(4), failure, keep_survivors=keep)


def test_a_node_ray_reports_gone_only_later_is_named_as_the_cause(alive):
    """Ray says a node is gone seconds after its ranks die: a recovery that fails again asks
    again, and names the node rather than the second failure."""
    assert heal.gone_node(_failure([1], ["b" * 56])).startswith("node bbbbbbbbbbbb is gone")
    assert heal.gone_node(_failure([1], ["a" * 56])) is None
    assert heal.gone_node(_failure([1])) is None


def test_a_clock_adds_its_parts_and_names_the_largest():
    record: dict = {}
    clock = Phases(time.time() - 5.0, record)
    clock.add("detection_s", 0.2)
    clock.add("actor_start_s", 2.5)
    clock.add_setups([{"timings": {"process_group_s": 0.1, "model_build_s": 0.4, "state_restore_s": 0.3}},
                      {"timings": {"process_group_s": 0.2, "model_build_s": 0.9, "state_restore_s": 0.1}}])
    clock.add("first_step_s", 0.6)
    out = clock.finish()
    assert record["breakdown"] is out
    # the slowest rank's setup is what the others waited for
    assert out["model_build_s"] == 0.9 and out["process_group_s"] == 0.2 and out["state_restore_s"] == 0.3
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
