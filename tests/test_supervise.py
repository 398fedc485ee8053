"""The straggler report and the hang timeout, from numbers alone; blame, the heartbeat and what
a survivor does to leave fast, from real processes."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from orchestrator.control.supervise import (
    Heartbeat,
    _node_may_be_going,
    blame,
    dead_from_futures,
    hang_timeout_s,
    save_stacks,
)
from orchestrator.record.straggler import StragglerTracker, describe


def test_the_rank_whose_own_work_is_over_1_3x_the_median_is_named_with_its_node():
    t = StragglerTracker()
    for rank in range(8):
        # every rank's step takes 1.0 s (they wait for each other); rank 5 waits least: it is the slow one
        exposed = 0.05 if rank == 5 else 0.45
        t.add(rank, [(1.0, exposed)] * 10)
    where = {r: {"node": f"node{r // 4}", "gpu": r % 4, "nic": f"mlx5_{r % 4}"} for r in range(8)}
    slow = t.report(where)
    assert [(s["rank"], s["node"], s["gpu"], s["link"]) for s in slow] == [(5, "node1", 1, "mlx5_1")]
    assert abs(slow[0]["ratio"] - 0.95 / 0.55) < 1e-9
    assert "rank 5 on node1 GPU 1 (link mlx5_1)" in describe(slow)


def test_no_straggler_within_1_3x_or_before_enough_steps():
    t = StragglerTracker()
    for rank in range(4):
        t.add(rank, [(1.0, 0.4 if rank else 0.3)] * 10)  # rank 0: 0.7 vs 0.6, under 1.3x
    t.add(4, [(1.0, 0.0)] * 3)  # too few steps to judge
    assert t.report({}) == []


def test_hang_timeout_is_k_times_the_predicted_step_but_never_below_the_floor():
    assert hang_timeout_s(2.0, 20.0, 60.0) == 60.0
    assert hang_timeout_s(10.0, 20.0, 60.0) == 200.0
    assert hang_timeout_s(None, 20.0, 60.0) == 60.0


@pytest.fixture(scope="module")
def local_ray():
    # One Ray for the module: starting it is most of each test's time. A test's ranks go when it
    # drops their handles; CPUs enough for two tests' ranks at once, so the next never waits on that.
    import ray

    ray.init(address="local", num_cpus=6, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield ray
    ray.shutdown()


def _ranks(ray, n: int) -> list:
    @ray.remote(num_cpus=1, concurrency_groups={"control": 1})
    class Rank:
        def pid(self) -> int:
            return os.getpid()

        def train(self) -> None:
            time.sleep(600)

        @ray.method(concurrency_group="control")
        def alive(self) -> bool:
            return True

    return [Rank.remote() for _ in range(n)]


def test_a_killed_rank_alone_is_blamed_without_waiting_for_a_node_to_go(local_ray):
    ray = local_ray
    actors = _ranks(ray, 3)
    pids = ray.get([a.pid.remote() for a in actors])
    futures = [a.train.remote() for a in actors]
    os.kill(pids[1], signal.SIGKILL)
    errors = {}
    try:
        ray.get(futures[1], timeout=60)
    except Exception as e:  # noqa: BLE001 - what the driver's wait on the futures gets
        errors[1] = e
    known = dead_from_futures(errors)
    assert list(known) == [1]
    # Its raylet reported the death, so no node is going: the pause that would let a lost node's
    # workers exit is not taken (a minute here, were it taken).
    t = time.monotonic()
    who = blame(actors, known, settle_s=60.0)
    assert time.monotonic() - t < 30.0
    assert who.dead == [1] and who.silent == []
    # Asked with nothing known, the dead rank's own answer says the same.
    t = time.monotonic()
    assert blame(actors, settle_s=60.0).ranks == [1]
    assert time.monotonic() - t < 30.0


def test_a_failure_that_may_be_a_lost_node_waits_before_asking_again():
    from ray.exceptions import ActorDiedError, ActorUnavailableError

    unavailable = ActorUnavailableError("the actor is temporarily unavailable: RpcError: failed to connect", None)
    node_died = ActorDiedError()
    node_died.error_msg = "The actor is dead because its node has died. Node Id: 6c68"
    assert _node_may_be_going({})  # a rank raised because a peer vanished: whose node may be going
    assert _node_may_be_going({2: unavailable})
    assert _node_may_be_going({2: node_died})


def test_the_heartbeat_names_a_stopped_rank_and_neither_the_busy_nor_the_dead(local_ray):
    ray = local_ray
    actors = _ranks(ray, 3)
    pids = ray.get([a.pid.remote() for a in actors])
    for a in actors:
        a.train.remote()  # every rank busy in its step: the control thread answers beside it
    beat = Heartbeat(actors, silent_after_s=2.0, every_s=0.2)
    os.kill(pids[0], signal.SIGKILL)
    os.kill(pids[2], signal.SIGSTOP)
    try:
        t = time.monotonic()
        seen = []
        while not seen and time.monotonic() - t < 60:
            seen = beat.silent()
            time.sleep(0.1)
        assert seen == [2]
        assert time.monotonic() - t >= 2.0  # not before it had been silent that long
        assert beat.silent() == [2]  # still silent, and the others still answering
    finally:
        os.kill(pids[2], signal.SIGKILL)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] in ("Z", "X")  # dead, awaiting its reaper
    except FileNotFoundError:
        return True


def test_a_rank_kills_a_stopped_peer_at_once_and_nothing_that_is_not_a_worker(local_ray):
    import subprocess

    from orchestrator.runtime.worker import Worker

    ray = local_ray
    ranks = [Worker.options(num_cpus=1).remote(r, 2, r, 1) for r in range(2)]
    pids = [rep["pid"] for rep in ray.get([a.report.remote() for a in ranks])]
    bystander = subprocess.Popen(["sleep", "120"])
    os.kill(pids[1], signal.SIGSTOP)
    try:
        # Not one of the job's workers: left alone, whatever pid the driver passed.
        assert ray.get(ranks[0].kill_peer.remote(bystander.pid), timeout=30) is False
        assert bystander.poll() is None
        assert ray.get(ranks[0].kill_peer.remote(pids[1]), timeout=30) is True
        t = time.monotonic()
        while time.monotonic() - t < 5 and not _gone(pids[1]):
            time.sleep(0.05)
        assert _gone(pids[1])  # at once, not after Ray's kill timeout
    finally:
        bystander.kill()
        for pid in pids[1:]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_the_stacks_of_a_hang_wait_only_for_the_ranks_not_known_silent(local_ray, tmp_path):
    from orchestrator.runtime.worker import Worker

    ray = local_ray
    ranks = [Worker.options(num_cpus=1).remote(r, 3, r, 1) for r in range(3)]
    pids = [rep["pid"] for rep in ray.get([a.report.remote() for a in ranks])]
    os.kill(pids[2], signal.SIGSTOP)
    try:
        t = time.monotonic()
        who = save_stacks(ranks, tmp_path, timeout_s=60.0, silent=[2])
        assert time.monotonic() - t < 30.0  # the stopped rank's minute is not waited out
        assert who.silent == [2] and who.dead == []
        assert "no answer" in (tmp_path / "rank_0002.txt").read_text()
        assert (tmp_path / "rank_0000.txt").read_text().startswith(f"rank 0, pid {pids[0]}")
    finally:
        os.kill(pids[2], signal.SIGKILL)


def test_a_rank_puts_its_imports_out_of_the_collectors_sight_once_and_never_a_model():
    import subprocess
    import sys

    script = r"""
import gc, json, torch
import orchestrator.runtime.trainer
from orchestrator.runtime.worker import freeze_imports
freeze_imports()
frozen = gc.get_freeze_count()
model = torch.nn.Linear(4, 4)
freeze_imports()  # a survivor's next setup: its model must stay collectable
print(json.dumps([frozen, gc.get_freeze_count(), len(gc.get_objects())]))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120)
    frozen, again, tracked = json.loads(out.stdout.strip().splitlines()[-1])
    assert frozen > 100_000 and again == frozen
    assert tracked < frozen / 10  # what a full collection still scans
