"""One rank's model, data, optimizer and step under a plan, free of Ray: the step loop
(`loop.py`) drives it, under a worker actor or torchrun alike.

One optimizer step = `grad_accum_steps` micro-steps over this rank's data-parallel share of
the step's global batch; gradients are synchronised on the last micro-step, or on every one
where the plan reduce-scatters sharded gradients each micro-step (`reduce_every_micro_step`).
The loss logged is the mean over the whole global batch, the same number a single process
would print.
With pp > 1 the micro-steps are the pipeline's micro-batches, run by torch's schedule over the
stages (`pipeline.py`); the loss comes from the last stage.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..choices import Precision
from ..config import JobConfig
from ..data.stream import open_data
from ..errors import PlanError
from ..planning import Plan
from ..planning.resolve import on_device
from ..sequence_split import sequence_split_problem
from ..workloads.gpt import param_groups
from ..workloads.models import build_model, logits_of
from .compile import eager_for_eval
from .context_parallel import ZigzagShard
from .expert_parallel import expert_load
from .hf_weights import check_weights, load_weights
from .lr_schedule import lr_at
from .materialize import allocate, build_on_meta, init_recipe, materialize
from .parallelize import Parallelized, build_mesh, data_parallel_rank, parallelize
from .peer_state import Held, PeerRestore, restore
from .pipeline import Pipelined, build_pipeline
from .rendezvous import group_options
from .state_names import canonical, restore_names, tied_aliases

_DTYPES = {Precision.bf16: torch.bfloat16, Precision.fp16: torch.float16}

@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did and took, as the step itself measured it."""

    step: int
    """The step's number, counted from 0."""
    loss: float
    """Mean training loss over the whole global batch."""
    lr: float
    """The learning rate the update used."""
    step_s: float
    """Wall seconds of the whole step, data to update."""
    tokens_per_s: float
    """The global batch's tokens over `step_s`."""
    grad_norm: float
    """The gradients' total norm before clipping (nan where clipping is off)."""
    optimizer_s: float
    """Seconds of the update itself (unscale, clip, step, zero), timed on the device's stream:
    what the step timer subtracts to find exposed communication."""
    expert_load: dict[str, Any] | None = None
    """The step's tokens per expert and imbalance per MoE layer (`expert_parallel.expert_load`);
    None for a dense model."""


class Trainer:
    """Model, data, optimizer and loop of one rank under a plan."""

    def __init__(self, cfg: JobConfig, plan: Plan, device: torch.device,
                 model_fn: Callable[..., Any] | None = None, data: Any | None = None, resuming: bool = False) -> None:
        """`resuming`: `start` will load a checkpoint into the model, so its parameters are only
        allocated, never initialised or read from `model.hf_weights` first."""
        self.cfg = cfg
        self.resuming = resuming
        self.plan = plan
        self.device = device
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        if plan.world_size != self.world:
            raise RuntimeError(f"plan is for {plan.world_size} ranks but the process group has {self.world}")
        # What runs is the plan's own statement, unless this rank got another kind of device.
        self.execution = on_device(plan.execution, "gpu" if device.type == "cuda" else "cpu", cfg.train.precision,
                                   _requested_compression(cfg, plan), cfg.train.max_steps)
        self.accum = plan.sync.grad_accum_steps
        self.micro = plan.micro_batch_size
        self.mesh = build_mesh(plan.mesh, device.type)
        self.dp_rank, self.dp_world = data_parallel_rank(self.mesh)
        gb = cfg.train.global_batch_size
        if self.micro * self.accum * self.dp_world != gb:
            raise RuntimeError(
                f"plan does not cover the global batch: micro {self.micro} x accum {self.accum} x "
                f"data-parallel {self.dp_world} != train.global_batch_size {gb}"
            )
        problem = sequence_split_problem(plan.mesh.cp, cfg.model.block_size)
        if problem:
            raise PlanError(f"key 'parallel.cp': {problem}")
        # Under context parallelism the ranks of a cp group take the same samples and each keeps
        # its chunks of every sequence, labels shifted before (`context_parallel.py`).
        self.sequence = ZigzagShard(self.mesh["cp"]) if plan.mesh.cp > 1 else None
        ex = self.execution
        self.build_notes: list[str] = []
        """How the model was built where it differs from the meta build (one sentence each)."""
        self.autocast_dtype = _DTYPES.get(ex.autocast) if ex.autocast else None
        self.compiled = plan.compile.enabled
        """The blocks run compiled (the plan's choice): each compiles at its first forward."""

        m = cfg.model
        model, init_shards = self._build(model_fn)
        self.num_params = sum(p.numel() for p in model.parameters())
        t = cfg.train

        def make_optimizer(mod: torch.nn.Module) -> torch.optim.Optimizer:
            return torch.optim.AdamW(param_groups(mod, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2))

        self.pipelined = ex.pipeline is not None
        self.par: Parallelized | Pipelined
        if ex.pipeline is not None:
            if ex.pipeline.microbatches != self.accum:
                raise RuntimeError(f"the pipeline runs {ex.pipeline.microbatches} micro-batches but the plan "
                                   f"accumulates {self.accum}: they are the same thing under a pipeline")
            # Split first, then move: each rank puts only its own stage on the device.
            self.par = build_pipeline(model, ex, self.mesh, make_optimizer, device, node_of_rank=plan.node_of_rank,
                                      materialize=init_shards, compile_blocks=self.compiled)
        else:
            self.par = parallelize(model, ex, self.mesh, make_optimizer, device, node_of_rank=plan.node_of_rank,
                                   materialize=init_shards, compile_blocks=self.compiled)
        del model  # a pipeline rank keeps only its own stage's modules
        if m.hf_weights and not resuming:
            # Every rank takes part (it is collective), each reading only its own slices.
            parts = self.par.modules if isinstance(self.par, Pipelined) else [self.par.model]
            load_weights(parts, m.hf_weights, self.aliases)
        # Ranks holding the reported loss: all of them, or the last pipeline stage's.
        self.loss_ranks = self.world // plan.mesh.pp
        d = cfg.data
        # `data`: anything with open_data's train_batch/val_batch (a rehearsal's stand-in tokens).
        self.data = data if data is not None else open_data(d.path, d.val_path, d.val_fraction, m.block_size,
                                                            t.seed, vocab_size=m.vocab_size)
        # fp16's narrow range needs loss scaling (bf16 does not); resolve admits fp16 with DDP
        # only, where every rank holds whole gradients and the scaler's inf check agrees.
        self.scaler = torch.amp.GradScaler(device.type) if ex.loss_scaling else None
        self.tokens_per_step = gb * m.block_size
        self.applied = 0
        """Optimizer steps the model's state has applied (a step's update counts once made)."""

    def _build(self, model_fn: Callable[..., Any] | None):
        """The model on the meta device and how to allocate and initialise it once sharded
        (`materialize.py`: the same full weights under every plan, and no rank ever holds more
        than its shards); or, for a model with a module that cannot be initialised on its own,
        the whole model on this host from the job's seed, as every rank builds it."""
        m, seed = self.cfg.model, self.cfg.train.seed
        model = build_on_meta(m, model_fn)
        # Checkpoints name a tied parameter once, whichever stage or wrapper holds it.
        self.aliases = tied_aliases(model)
        if self.resuming:
            # Every parameter comes from the checkpoint `start` loads: initialising them first
            # (a large model's slowest part of building) would only be overwritten. Any model
            # builds on meta, so this holds for one that cannot be initialised by module too.
            return model, lambda mod: allocate(mod, self.device)
        if m.hf_weights:
            # Checked from the file's headers against the whole model, before any memory is
            # spent; every parameter then comes from the file, so none is initialised.
            check_weights(model, m.hf_weights)
            return model, lambda mod: allocate(mod, self.device)
        recipe, why = init_recipe(model, seed)
        if recipe is not None:
            return model, lambda mod: materialize(mod, recipe, self.device, self.aliases)
        self.build_notes.append(f"the model is built whole on every rank's host: {why}")
        torch.manual_seed(seed)  # the same seed gives every rank one init, before any sharding
        model = build_model(m, model_fn)
        self.aliases = tied_aliases(model)
        return model, None

    def load_checkpoint(self, path: str) -> int:
        """Load model and optimizer from a committed checkpoint (any world size or strategy DCP
        can reshard between); returns the step to continue from."""
        from . import checkpoint, checkpoint_files

        # Sizes only: the driver hashed every file before it chose this checkpoint, and a full
        # read on every rank would multiply the I/O by the world size.
        meta = checkpoint_files.verify(path, hashes=False)
        local = self.par.state_dict()
        wanted = canonical(local, self.aliases)
        checkpoint.load(path, wanted)
        self.par.load_state_dict(restore_names(local, wanted, self.aliases))
        return int(meta["step"])

    def restore_from_peers(self, peers: PeerRestore, held: Held | None) -> int:
        """Take the state of this rank's replica-group source (`peer_state`) instead of reading
        a checkpoint; returns the step to continue from."""
        self.par.state_dict()  # creates the optimizer's state (Adam's moments) for it to be filled
        restore(self.par.live_state(), held, peers, self.rank, self.mesh.get_group("dp_replicate"))
        return peers.step

    def held_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """This rank's state after `applied` steps, for `peer_state.hold`: the tensors themselves
        (detached local shards), taken with no collective, so after its group broke, and
        referring to no process group, so the group can close while they are kept."""
        with torch.no_grad():  # local shards as plain views: no autograd link back to the mesh
            return [(name, t.detach()) for name, t in self.par.live_state()]

    def state_dict(self) -> dict[str, Any]:
        """This rank's model and optimizer state as a checkpoint holds it: the whole model's
        canonical names, sharded tensors, the same keys under every plan (`dcp.save` it)."""
        return canonical(self.par.state_dict(), self.aliases)

    def checkpoint_meta(self) -> dict[str, Any]:
        """What meta.json records of the plan that wrote a checkpoint (any plan can read it)."""
        return {"world_size": self.world, "strategy": str(self.plan.strategy), "mesh": self.plan.mesh.to_dict()}

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    @staticmethod
    def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy of the model's logits, in fp32 whatever autocast computed."""
        logits = logits_of(model(x))
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))

    def _mark(self):
        """A point in time on the device's stream; on a GPU an event, so timing never stalls it."""
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _seconds(self, start, end) -> float:
        if self.device.type == "cuda":
            return start.elapsed_time(end) / 1000.0
        return end - start

    def sync_device(self) -> None:
        """Wait for the device's queued work (a CPU has none)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self, resume_from: str | PeerRestore | None = None, held: Held | None = None) -> int:
        """Ready the rank to train, as every launcher does: load `resume_from` if given (a
        checkpoint, or the survivors' memory, this rank's own `held` copy among it). Returns the
        step to train from. What the rank measures before its first step is the step timer's
        (`step_timer.StepTimer.calibrate`), run after this."""
        if self.resuming and not resume_from:
            raise RuntimeError("this trainer was built to resume (its weights only allocated) but start() got "
                               "no checkpoint to load")
        if isinstance(resume_from, PeerRestore):
            step = self.restore_from_peers(resume_from, held)
        else:
            step = self.load_checkpoint(resume_from) if resume_from else 0
        self.applied = step
        return step

    def _own_tokens(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's tokens of its data-parallel share: all of them, or its cp chunks of each."""
        if self.sequence is None:
            return x, y
        return self.sequence.take(x), self.sequence.take(y)

    def _global_mean(self, value: torch.Tensor) -> float:
        return self._start_global_mean(value).read()

    def _start_global_mean(self, value: torch.Tensor) -> _PendingMean:
        """Start summing `value` over the world; `wait` then `read` give the mean.

        gloo has no AVG: sum then divide. Every rank of a tp group holds the same value, so the
        mean over the ranks holding it (the last stage's, under a pipeline; the others hold
        zero) is the mean over the global batch; the cp ranks of a sequence hold the means of
        equally many of its tokens, so theirs is its mean too."""
        return _PendingMean(dist.all_reduce(value, op=dist.ReduceOp.SUM, async_op=True), value, self.loss_ranks)

    def _accumulate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward of every micro-step; the sum of their losses over the count."""
        par = self.par
        assert isinstance(par, Parallelized), "a pipeline's stages accumulate its micro-batches themselves"
        model = par.model
        model.train()
        total = torch.zeros((), device=self.device)
        every = self.execution.reduce_every_micro_step
        for i in range(self.accum):
            sl = slice(i * self.micro, (i + 1) * self.micro)
            sync = every or i == self.accum - 1
            # The plan's choice: reduce-scatter every micro-step (FSDP2 then keeps only sharded
            # gradients between them), or only on the last (unsharded gradients live until then,
            # one reduction). Forward and backward both sit inside it because DDP decides at
            # forward time whether backward will sync.
            with par.micro_step(sync, last=i == self.accum - 1):
                with self._autocast():
                    loss = self._loss(model, x[sl], y[sl]) / self.accum
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            total += loss.detach()
        return total

    def train_step(self, step: int) -> StepResult:
        """Optimizer step `step` (counted from 0), as the plan runs it."""
        t = self.cfg.train
        t0 = time.perf_counter()
        # Dropout's randomness is a function of (seed, step, data-parallel rank): a resumed run
        # draws exactly the masks the uninterrupted run drew, with no RNG state to carry. The cp
        # ranks of a sequence hold different tokens of it, so each draws masks of its own.
        key = (t.seed, step, self.dp_rank) + ((self.sequence.rank,) if self.sequence is not None else ())
        torch.manual_seed(hash(key) & 0x7FFF_FFFF)
        lr = lr_at(step, lr=t.lr, min_lr=t.min_lr, warmup_steps=t.warmup_steps, max_steps=t.max_steps)
        for group in self.par.optimizer.param_groups:
            group["lr"] = lr
        x, y = self._own_tokens(*self.data.train_batch(step, t.global_batch_size, self.dp_rank, self.dp_world))
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        if isinstance(self.par, Pipelined):
            with self._autocast():
                total = self.par.step(x, y)
        else:
            total = self._accumulate(x, y)
        # Every collective of a step completes before its update, the loss's reduction too: a
        # rank that loses a peer has applied the step entirely or not at all, as every survivor
        # has, so a survivor's memory holds a whole step to restore the group from
        # (peer_state.py). Waiting is not reading: under NCCL the wait orders the streams and
        # frees the host at once; under gloo it is the barrier itself. The loss is read only at
        # the step's end: reading it here would hold the host until backward and its
        # reductions are done before it could queue the update.
        loss_mean = self._start_global_mean(total)
        loss_mean.wait()
        opt_start = self._mark()
        if self.scaler:
            self.scaler.unscale_(self.par.optimizer)  # clip the true gradients, not scaled ones
        grad_norm = self.par.clip_grad_norm_(t.grad_clip) if t.grad_clip > 0 else None
        if self.scaler:
            self.scaler.step(self.par.optimizer)  # skipped when the gradients overflowed
            self.scaler.update()
        else:
            self.par.optimizer.step()
        self.applied = step + 1
        self.par.zero_grad()
        opt_end = self._mark()
        self.sync_device()  # the step's end: its marks are done
        mean_loss = loss_mean.read()
        step_s = time.perf_counter() - t0
        return StepResult(step=step, loss=mean_loss, lr=lr, step_s=step_s,
                          tokens_per_s=self.tokens_per_step / step_s,
                          grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
                          optimizer_s=self._seconds(opt_start, opt_end),
                          expert_load=expert_load(self.par.modules if isinstance(self.par, Pipelined)
                                                  else [self.par.model]))

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over `eval_iters` batches of `global_batch_size` sequences: the
        same sequences whatever the world size, each rank taking its data-parallel share in
        micro-batch chunks (the share is micro x accum, so chunks are equal and means average)."""
        with eager_for_eval(self.compiled):
            return self._evaluate()

    def _evaluate(self) -> float:
        t = self.cfg.train
        model = self.par.model
        model.eval()
        total = torch.zeros((), device=self.device)
        for i in range(t.eval_iters):
            x, y = self._own_tokens(*self.data.val_batch(i, t.global_batch_size, self.dp_rank, self.dp_world))
            x, y = x.to(self.device), y.to(self.device)
            if isinstance(self.par, Pipelined):
                # Forward only through the stages, in the training micro-batches: their mean.
                with self._autocast():
                    total += self.par.step(x, y, train=False) * self.accum
                continue
            for j in range(0, len(x), self.micro):
                with self._autocast():
                    total += self._loss(model, x[j:j + self.micro], y[j:j + self.micro]).float()
        return self._global_mean(total / (t.eval_iters * self.accum))


def init_process_group(rank: int, world: int, master_addr: str, master_port: int, backend: str,
                       device: torch.device | None = None) -> None:
    """Rendezvous over TCP on rank 0's address (no env:// so nothing leaks between runs); on NCCL
    bound to `device`, the current CUDA device where none is given (`rendezvous.group_options`)."""
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world,
        **group_options(backend, device),
    )


def _requested_compression(cfg: JobConfig, plan: Plan):
    """The compression to resolve again on another device kind: the config's own choice where it
    made one (one dropped on the planned kind may run on this one), else the plan's."""
    asked = cfg.parallel.compression
    return plan.sync.compression if asked == "auto" else asked


@dataclass
class _PendingMean:
    """A world sum started asynchronously, and how to read its mean once it is done."""

    work: Any
    """The collective's handle (None where the process group ran it synchronously)."""
    value: torch.Tensor
    """The tensor the sum lands in."""
    ranks: int
    """How many ranks' values the sum holds, to divide by."""

    def wait(self) -> None:
        """Wait for the sum: the host waits under gloo, only the device's stream under NCCL."""
        if self.work is not None:
            self.work.wait()
            self.work = None

    def read(self) -> float:
        """The mean, on the host: the one read of the step."""
        self.wait()
        return self.value.item() / self.ranks
