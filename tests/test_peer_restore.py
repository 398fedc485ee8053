"""A recovered group restores from its survivors' memory exactly: under every plan that
replicates its states (HSDP's DTensor shards, DDP over tensor-parallel DTensors, DDP stages of
a pipeline), a rank that comes back empty takes its replica group's state from the survivor the
driver chooses, and the run goes on with the losses of a run that never stopped
(tests/_peer_restore_worker.py). When memory is refused for a checkpoint: tests/test_heal.py."""

from __future__ import annotations

import json

import _peer_restore_worker as pw
import pytest
import torch.multiprocessing as mp

from orchestrator.control.heal import choose_restore
from orchestrator.planning.mesh import Mesh

pytestmark = pytest.mark.slow

REPLACED = 1


@pytest.fixture(scope="module")
def restored(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("peers")
    plans = pw.plans()
    sources = {}
    for name, plan in plans.items():
        held = {r: {"step": pw.HELD_AT, "digest": "same", "rows": []} for r in range(pw.WORLD) if r != REPLACED}
        peers, _, why = choose_restore(Mesh.from_dict(plan["mesh"]), held, last_step=pw.HELD_AT,
                                      max_steps=pw.STEPS)
        assert why is None, (name, why)
        sources[name] = peers.source
    spec = tmp / "spec.json"
    spec.write_text(json.dumps({"plans": plans, "replaced": REPLACED, "source": sources}))
    mp.spawn(pw.run_rank, args=(str(tmp / "init"), str(spec), str(tmp / "out.json")), nprocs=pw.WORLD, join=True)
    return {"out": json.loads((tmp / "out.json").read_text()), "plans": plans, "sources": sources}


@pytest.mark.parametrize("case", [c.name for c in pw.CASES])
def test_a_replaced_rank_takes_its_replica_groups_state_and_the_run_goes_on_exactly(restored, case):
    got = restored["out"][case]
    assert got["step"] == pw.HELD_AT
    # The same plan, the same reduction order: exactly the losses of the run that never stopped.
    assert got["restored"] == got["reference"][pw.HELD_AT:]


@pytest.mark.parametrize("case", [c.name for c in pw.CASES])
def test_replicas_hold_the_same_digest_and_other_shards_another(restored, case):
    mesh = Mesh.from_dict(restored["plans"][case]["mesh"])
    digests = restored["out"][case]["digests"]
    for group in mesh.groups()["dp_replicate"]:
        assert len({digests[r] for r in group}) == 1, group
    assert len(set(digests)) == pw.WORLD // mesh.dp_replicate  # each replica group holds its own shard
    # the replaced rank's group is served by a survivor of it
    source = restored["sources"][case][REPLACED]
    assert source != REPLACED and any(REPLACED in g and source in g for g in mesh.groups()["dp_replicate"])
