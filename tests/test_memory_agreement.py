"""The planner's per-rank model-state bytes agree with what the runtime's ranks really hold.

One launch of 4 gloo processes builds every strategy from `plan_job`'s own plan with the
runtime's Trainer (ddp, zero1, zero2, zero3, hsdp 2x2, tensor parallelism 2 under FSDP2),
runs an optimizer step and one more backward, and counts each rank's storages
(`Parallelized.state_bytes`). The plan's params + grads + optimizer must match the largest
rank's within 10%, state by state as well as in total.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import memory_model  # noqa: E402

WORLD = 4
TOLERANCE = 0.10
# Small enough to build six times in seconds, wide enough that every state is megabytes.
MODEL = ["model.n_layer=3", "model.n_head=4", "model.n_embd=96", "model.block_size=32", "model.vocab_size=512",
         "train.global_batch_size=8"]


@pytest.fixture(scope="module")
def agreement():
    planned = memory_model.plans(WORLD, MODEL)
    return memory_model.compare(planned, memory_model.measure(WORLD, planned))


@pytest.mark.slow
def test_every_strategy_is_measured_on_every_rank(agreement):
    rows = {r["strategy"]: r for r in agreement["rows"]}
    assert set(rows) == {"ddp", "zero1", "zero2", "zero3", "hsdp", "tp+fsdp"}
    for r in rows.values():
        assert len(r["measured_per_rank"]) == WORLD and min(r["measured_per_rank"]) > 0


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3", "hsdp", "tp+fsdp"])
@pytest.mark.slow
def test_planned_model_states_match_the_runtime_within_10_percent(agreement, strategy):
    row = next(r for r in agreement["rows"] if r["strategy"] == strategy)
    pred, meas = row["predicted"], row["measured"]
    assert pred["total"] == pytest.approx(meas["total"], rel=TOLERANCE), row
    for state in memory_model.STATES:
        assert pred[state] == pytest.approx(meas[state], rel=TOLERANCE), (state, row)


@pytest.mark.slow
def test_sharding_shrinks_what_a_rank_holds(agreement):
    # The measured order the strategies promise: replicate > shard optimizer > shard all.
    meas = {r["strategy"]: r["measured"] for r in agreement["rows"]}
    assert meas["ddp"]["total"] > meas["zero1"]["total"] > meas["zero2"]["total"]
    # zero2 keeps only a weight shard at rest, as zero3 does (FSDP2 reshards after backward).
    assert meas["zero2"]["params"] == pytest.approx(meas["zero3"]["params"], rel=0.01)
    assert meas["hsdp"]["total"] == pytest.approx(2 * meas["zero3"]["total"], rel=0.05)
