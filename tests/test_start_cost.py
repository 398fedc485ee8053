"""What every start and restart waits for before its first step: the group's rendezvous and the
compute-only baseline. (How long they take is benchmarks/runtime_overhead.py's to say.)"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from orchestrator.runtime import rendezvous

ROOT = Path(__file__).resolve().parents[1]

_JOIN = r"""
import json, os, sys, time
import torch, torch.distributed as dist
from orchestrator.runtime import rendezvous
rank, port = int(sys.argv[1]), int(sys.argv[2])
t0 = time.monotonic()
rendezvous.join(rank, 2, ("127.0.0.1", port), "gloo")
x = torch.tensor([rank + 1.0]); dist.all_reduce(x)
print(json.dumps({"sum": x.item(), "rank": dist.get_rank(), "world": dist.get_world_size()}), flush=True)
dist.destroy_process_group()
os._exit(0)  # past torch's gloo teardown at interpreter exit, which can abort once the work is done
"""


def test_a_rank_that_arrives_before_rank_0_joins_the_store_rank_0_served():
    """Rank 0 serves the store when asked where the group meets; a peer that comes before rank 0
    joins finds it listening, and the group forms once rank 0 joins with that same store."""
    served = rendezvous.serve("127.0.0.1")
    other = rendezvous.serve("127.0.0.1")
    assert served.port != other.port  # each group its own store: a re-formed group never meets in the old one
    del other
    peer = subprocess.Popen([sys.executable, "-c", _JOIN, "1", str(served.port)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.0)  # the peer is waiting in the group's store well before rank 0 comes
        assert peer.poll() is None
        rendezvous.join(0, 2, ("127.0.0.1", served.port), "gloo", served)
        x = torch.tensor([1.0])
        dist.all_reduce(x)
        assert x.item() == 3.0
        out, err = peer.communicate(timeout=60)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        peer.kill()
    assert peer.returncode == 0, err[-2000:]
    assert json.loads(out) == {"sum": 3.0, "rank": 1, "world": 2}


def test_rank_0_must_join_with_the_store_it_served():
    with pytest.raises(ValueError, match="rank 0 of the group at 127.0.0.1:1234 must join with the store it served"):
        rendezvous.join(0, 2, ("127.0.0.1", 1234), "gloo")


_CALIBRATE = r"""
import json, os, sys, time
import torch, torch.distributed as dist
from orchestrator.config import load_config
from orchestrator.planning import plan_job
from orchestrator.runtime import step_timer as timer_module
from orchestrator.runtime.step_timer import StepTimer
from orchestrator.runtime.trainer import Trainer
from orchestrator.topology.model import ClusterTopology, cpu_node
rank, world, init, strategy, budget, slow_s, micro = sys.argv[1:8]
rank, world, budget, slow_s = int(rank), int(world), float(budget), float(slow_s)
torch.set_num_threads(1)
timer_module.CALIBRATION_BUDGET_S = budget
dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
cfg = load_config(None, ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=16",
                         "train.global_batch_size=4", "train.max_steps=2", f"cluster.num_workers={world}",
                         f"parallel.strategy={strategy}", "parallel.tp=1", f"train.micro_batch_size={micro}"])
tr = Trainer(cfg, plan_job(cfg, ClusterTopology(nodes=[cpu_node(world)])), torch.device("cpu"))
forwards = []
def hook(*_):
    forwards.append(1)
    if rank == world - 1:
        time.sleep(slow_s)  # this rank's passes are the slow ones
tr.par.model.register_forward_hook(hook)
tr.start()
timer = StepTimer(tr)
timer.calibrate()
print(json.dumps({"forwards": len(forwards), "compute_micro_s": timer.compute_micro_s}), flush=True)
dist.destroy_process_group()
os._exit(0)  # past torch's gloo teardown at interpreter exit, which can abort once the work is done
"""


def _calibrate(tmp_path, world: int, strategy: str, budget: float, slow_s: float = 0.0, micro: int = 4) -> list[dict]:
    init = tmp_path / f"init-{strategy}-{budget}"
    args = [str(world), str(init), strategy, str(budget), str(slow_s), str(micro)]
    procs = [subprocess.Popen([sys.executable, "-c", _CALIBRATE, str(r), *args], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-3000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            p.kill()
    return outs


@pytest.mark.slow
def test_the_compute_baseline_times_as_many_passes_as_fit_its_budget(tmp_path):
    """A warm-up and up to 3 timed passes where they fit the budget; one timed pass where a pass
    alone fills it. The figure is the fastest timed pass."""
    (roomy,) = _calibrate(tmp_path, 1, "ddp", budget=100.0)
    assert roomy["forwards"] == 1 + 3
    (tight,) = _calibrate(tmp_path, 1, "ddp", budget=1e-6)
    assert tight["forwards"] == 1 + 1
    assert 0 < roomy["compute_micro_s"] < 5 and 0 < tight["compute_micro_s"] < 5


@pytest.mark.slow
def test_every_rank_times_as_many_passes_as_the_slowest_allows(tmp_path):
    """Sharded passes gather parameters, so ranks that ran different numbers of them would hang:
    the count is agreed. Shown under DDP, whose passes do not wait for each other: the fast rank,
    whose own passes would fit 3 in the budget, runs as many as the slow one."""
    outs = _calibrate(tmp_path, 2, "ddp", budget=0.5, slow_s=0.3, micro=2)
    assert [o["forwards"] for o in outs] == [1 + 1, 1 + 1]
    assert outs[0]["compute_micro_s"] < 0.3 <= outs[1]["compute_micro_s"]
