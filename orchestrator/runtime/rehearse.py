"""Rehearse one training step of a plan, one rank at a time, without devices or memory.

The rank runs the runtime's own code (`Trainer`: mesh, wrapping, recomputation, accumulation,
pipeline schedule, clipping, optimizer) at the plan's real world size in this process:
torch.distributed's `fake` backend stands in for the other ranks and FakeTensorMode for the
memory (`rehearse_fake`), so a 70B model at hundreds of ranks costs only the time to run its
ops' shape functions.

What it measures, over one step taken with the optimizer's state already in place (a step over
zero gradients creates it first; under a pipeline a whole first step runs unmeasured, since
torch's stages learn their shapes in it), so that the step is the steady state every later
step repeats: the peak bytes of every live storage on the rank (torch's MemTracker, entered
before the Trainer is built so that persistent buffers such as DDP's buckets count too), and
every collective the rank issues (`rehearse_record`).
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from ..config import JobConfig
from ..errors import ConfigError
from ..planning import Plan
from ..planning.compile import EAGER
from ..workloads.hf import unpacked_sequences
from .rehearse_fake import SENT_META, cuda_autocast_norms, fake_safe_runtime, forget_world, peak_tracker
from .rehearse_record import AxisNames, Collective, CollectiveRecorder

REHEARSAL_DEVICE = torch.device("cpu")
"""The device type of the rehearsed rank: fake tensors cannot live on a CUDA device in a
torch built without CUDA, and the fake backend serves CPU tensors like any other."""


@dataclass(frozen=True)
class RankRehearsal:
    """What one rank did in a rehearsed step."""

    rank: int
    """The global rank rehearsed."""
    stage: int
    """Its pipeline stage (0 without a pipeline)."""
    peak_bytes: int
    """Peak bytes of all the rank's live storages over the step."""
    collectives: tuple[Collective, ...]
    """Its collectives, by (op, axis)."""
    seconds: float = 0.0
    """Wall-clock seconds the rehearsal of this rank took."""
    notes: tuple[str, ...] = ()
    """What the rehearsal ran differently from the planned device (one sentence each)."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["collectives"] = [c.to_dict() for c in self.collectives]
        d["notes"] = list(self.notes)
        return d


def rehearsal_ranks(plan: Plan) -> tuple[int, ...]:
    """The ranks whose rehearsal covers the fullest rank: rank 0 without a pipeline (every
    rank holds the same); with one, the first rank of the first stage (embeddings, the most
    micro-batches in flight) and of the last (head, logits, loss)."""
    if plan.mesh.pp == 1:
        return (0,)
    per_stage = plan.world_size // plan.mesh.pp
    return (0, (plan.mesh.pp - 1) * per_stage)


class _StandInTokens:
    """Random token ids in place of the job's data: the step reads only their shapes."""

    def __init__(self, vocab: int, block_size: int) -> None:
        self.vocab, self.block_size = vocab, block_size

    def _batch(self, global_batch: int, dp_world: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = global_batch // dp_world
        x = torch.randint(0, self.vocab, (n, self.block_size), dtype=torch.int64)
        return x, torch.randint(0, self.vocab, (n, self.block_size), dtype=torch.int64)

    def train_batch(self, step: int, global_batch: int, dp_rank: int, dp_world: int):
        return self._batch(global_batch, dp_world)

    def val_batch(self, i: int, global_batch: int, dp_rank: int, dp_world: int):
        return self._batch(global_batch, dp_world)


def _rehearsal_config(cfg: JobConfig, plan: Plan) -> tuple[JobConfig, list[str]]:
    """The job as the rehearsed rank runs it: the planned device's autocast made explicit, since
    the rank runs on a CPU device, where `auto` would mean fp32."""
    run = copy.deepcopy(cfg)
    autocast = plan.execution.autocast
    run.train.precision = type(cfg.train.precision)(str(autocast) if autocast else "fp32")
    notes = []
    if plan.execution.device == "gpu":
        notes.append("rehearsed on a fake CPU device with the plan's autocast: CPU autocast's lists, with "
                     "normalisations in fp32 as CUDA's runs them, stand in for CUDA's")
    return run, notes


def _unsupported(e: BaseException) -> ConfigError | None:
    """One line for an op the rehearsal cannot run without a device; None for any other error."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        UnsupportedOperatorException,
    )

    if isinstance(e, UnsupportedOperatorException):
        return ConfigError(f"rehearsal: the op {e.func} has no meta/fake kernel, so a step cannot run without a "
                           f"device; the plan stands unchecked (drop --rehearse, or register a fake kernel for it)")
    if isinstance(e, (DataDependentOutputException, DynamicOutputShapeException)):
        return ConfigError(f"rehearsal: the op {e.func} needs real tensor values, which a rehearsal does not have; "
                           f"the plan stands unchecked (drop --rehearse)")
    return None


def _step(trainer: Any, step: int) -> None:
    """`Trainer.train_step` without reading any value back (a fake tensor has none): the same
    batch, micro-steps or pipeline schedule, unscale, clipping, optimizer and loss mean."""
    t = trainer.cfg.train
    par = trainer.par
    # The rank's own tokens, as the trainer's step takes them: under cp, its chunks of every sequence.
    x, y = trainer._own_tokens(*trainer.data.train_batch(step, t.global_batch_size, trainer.dp_rank,
                                                         trainer.dp_world))
    x, y = x.to(trainer.device), y.to(trainer.device)
    if trainer.pipelined:
        with trainer._autocast():
            total = par.step(x, y)
    else:
        total = trainer._accumulate(x, y)
    if trainer.scaler:
        trainer.scaler.unscale_(par.optimizer)
    if t.grad_clip > 0:
        par.clip_grad_norm_(t.grad_clip)
    # GradScaler.step reads the inf check's value; with no value to read, step as when finite.
    par.optimizer.step()
    par.zero_grad()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)  # `_global_mean`'s reduction, less its .item()


def _prime_optimizer(par: Any) -> None:
    """Create the optimizer's state as a first step does (a step over zero gradients), so the
    rehearsed step is the steady state: its forward and backward run beside the moments.
    Gradients that exist already (DDP's bucket views) are stepped as they are."""
    optimizers = getattr(par.optimizer, "optimizers", [par.optimizer])  # a pipeline rank's chunks
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        opt.step()
    par.zero_grad()


def rehearse_rank(cfg: JobConfig, plan: Plan, rank: int, vocab: int | None = None,
                  fake_tensors: bool = True) -> RankRehearsal:
    """Rehearse one step of `plan` as global `rank`, optimizer state in place. Needs a process
    with no process group of its own; leaves none behind. ConfigError in one line for an op
    that cannot run on fake tensors. `fake_tensors=False` runs the same step on real tensors
    (real memory and compute: for checking the rehearsal itself on small models)."""
    import time

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from .trainer import Trainer

    if dist.is_initialized():
        raise RuntimeError("rehearse_rank needs a process without a process group (it starts a fake one)")
    if not 0 <= rank < plan.world_size:
        raise ValueError(f"rank must be in [0, {plan.world_size}), got {rank}")
    start = time.perf_counter()
    run_cfg, notes = _rehearsal_config(cfg, plan)
    if plan.compile.enabled:
        notes.append("rehearsed with the blocks eager: the plan compiles them, and compiled kernels' memory is "
                     "not rehearsed")
    data = _StandInTokens(vocab or cfg.model.vocab_size, cfg.model.block_size)
    recorder = CollectiveRecorder(AxisNames(plan, rank))
    tracker = peak_tracker()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.world_size)
    try:
        fake = FakeTensorMode(allow_non_fake_inputs=True) if fake_tensors else contextlib.nullcontext()
        norms = cuda_autocast_norms() if plan.execution.device == "gpu" else contextlib.nullcontext()
        with fake_safe_runtime(), fake, norms, unpacked_sequences(), warnings.catch_warnings():
            # The runtime's storage bookkeeping reads data pointers, which fake storages lack.
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            try:
                # The tracker is on from the first allocation, so what the Trainer keeps
                # (shards, buckets, stage buffers) is counted; re-entering it resets its peak.
                with tracker, recorder:
                    # Eager: fake tensors do not go through inductor (compiled blocks' memory is
                    # not rehearsed; the note says so).
                    trainer = Trainer(run_cfg, replace(plan, compile=EAGER), REHEARSAL_DEVICE, data=data)
                    if trainer.pipelined:
                        # torch's stages learn their shapes in their first step (a vote, and
                        # a forward and backward on meta tensors, all-gathering FSDP2's units):
                        # once per run, so a first step runs unmeasured.
                        _step(trainer, 0)
                    else:
                        _prime_optimizer(trainer.par)
                recorder.recording = True
                with tracker, recorder:
                    _step(trainer, 0)
            except Exception as e:  # noqa: BLE001 - only an op without a fake kernel is the user's
                one_line = _unsupported(e)
                if one_line is not None:
                    raise one_line from e
                raise
        peak = tracker.get_tracker_snapshot("peak").get(REHEARSAL_DEVICE, {})
        notes += [n for n in trainer.execution.notes if n not in plan.execution.notes]
    finally:
        dist.destroy_process_group()
        forget_world()
    stage = rank // (plan.world_size // plan.mesh.pp)
    return RankRehearsal(rank=rank, stage=stage, peak_bytes=int(peak.get("Total", 0)),
                         collectives=recorder.collectives(), seconds=round(time.perf_counter() - start, 2),
                         notes=tuple(notes))


@dataclass(frozen=True)
class Rehearsal:
    """The rehearsed ranks of one plan."""

    ranks: tuple[RankRehearsal, ...] = field(default_factory=tuple)
    """One per rehearsed rank (`rehearsal_ranks`)."""


def rehearse(cfg: JobConfig, plan: Plan, vocab: int | None = None,
             ranks: tuple[int, ...] | None = None) -> Rehearsal:
    """Rehearse `plan` on each of `ranks` (default: `rehearsal_ranks`), one after another."""
    chosen = rehearsal_ranks(plan) if ranks is None else tuple(sorted(ranks))
    SENT_META.clear()
    done = [rehearse_rank(cfg, plan, chosen[0], vocab)]
    if len(chosen) > 1:
        # Every later rank in a process of its own: torch keeps meshes of a destroyed world in
        # caches a second world in the same process would read (process groups by stale name).
        import concurrent.futures
        import multiprocessing

        spawn = multiprocessing.get_context("spawn")
        for r in chosen[1:]:
            # A pool per rank, not max_tasks_per_child=1: that keyword is Python 3.11's.
            with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
                done.append(pool.submit(_rehearse_elsewhere, cfg, plan, r, vocab, dict(SENT_META)).result())
    return Rehearsal(tuple(done))


def _rehearse_elsewhere(cfg: JobConfig, plan: Plan, rank: int, vocab: int | None,
                        sent: dict[str, Any]) -> RankRehearsal:
    """`rehearse_rank` in a fresh process, with what the stages rehearsed before sent."""
    SENT_META.update(sent)
    return rehearse_rank(cfg, plan, rank, vocab)
