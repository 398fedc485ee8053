"""The straggler report and the hang timeout, from numbers alone."""

from __future__ import annotations

from orchestrator.control.straggler import StragglerTracker, describe
from orchestrator.control.supervise import hang_timeout_s


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
