"""A training step reads nothing back to the host before its update is queued: a read there
(`.item()`, `float()`, `.tolist()`) from its first forward on holds the host until backward and its reductions are done,
and on a GPU the update then starts only after the host has caught up."""

from __future__ import annotations

import pytest
import torch

READS = ("item", "tolist", "__float__")


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_nothing_is_read_back_before_the_optimizer_steps(one_rank, monkeypatch, strategy):
    from orchestrator.config import load_config
    from orchestrator.planning import plan_job
    from orchestrator.runtime.trainer import Trainer
    from orchestrator.topology.model import ClusterTopology, cpu_node

    cfg = load_config(None, ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.block_size=16",
                             "train.global_batch_size=4", "train.max_steps=4", "cluster.num_workers=1",
                             f"parallel.strategy={strategy}", "parallel.trial=false"])
    trainer = Trainer(cfg, plan_job(cfg, ClusterTopology(nodes=[cpu_node(1)])), torch.device("cpu"))
    trainer.start()
    trainer.train_step(0)  # the first step may set things up (DDP's first sync, lazy state)
    events: list[str] = []
    # From the first forward on: the batch's sampling reads its CPU offsets before any compute.
    recording = False

    def forward_starts(*_):
        nonlocal recording
        recording = True

    trainer.par.model.register_forward_pre_hook(forward_starts)
    for name in READS:
        original = getattr(torch.Tensor, name)

        def reading(self, *args, _original=original, _name=name, **kwargs):
            if recording:
                events.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, reading)
    trainer.par.optimizer.register_step_pre_hook(lambda *_: events.append("optimizer step"))
    result = trainer.train_step(1)
    monkeypatch.undo()
    assert "optimizer step" in events
    assert events[:events.index("optimizer step")] == [], events
    assert result.loss == pytest.approx(result.loss) and result.loss > 0  # read at the step's end


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_the_loss_reduction_completes_before_the_update(one_rank, monkeypatch, strategy):
    """A rank whose peer dies after the gradients' reduction but before the loss's must not
    have applied the update: the survivors then all hold the step before (peer_state.py), and
    one of them restores the group without a checkpoint. The reduction is the step's barrier."""
    import torch.distributed as dist

    from orchestrator.config import load_config
    from orchestrator.planning import plan_job
    from orchestrator.runtime import trainer as trainer_module
    from orchestrator.runtime.trainer import Trainer
    from orchestrator.topology.model import ClusterTopology, cpu_node

    cfg = load_config(None, ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.block_size=16",
                             "train.global_batch_size=4", "train.max_steps=4", "cluster.num_workers=1",
                             f"parallel.strategy={strategy}", "parallel.trial=false"])
    trainer = Trainer(cfg, plan_job(cfg, ClusterTopology(nodes=[cpu_node(1)])), torch.device("cpu"))
    trainer.start()
    trainer.train_step(0)
    events: list[str] = []

    class Recorded:
        def __init__(self, work):
            self.work = work

        def wait(self, *args, **kwargs):
            events.append("loss reduced")
            return self.work.wait(*args, **kwargs) if self.work is not None else True

    original = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        work = original(tensor, *args, **kwargs)
        return Recorded(work) if tensor.dim() == 0 and kwargs.get("async_op") else work

    monkeypatch.setattr(trainer_module.dist, "all_reduce", all_reduce)
    trainer.par.optimizer.register_step_pre_hook(lambda *_: events.append("optimizer step"))
    trainer.train_step(1)
    assert events[:2] == ["loss reduced", "optimizer step"], events
