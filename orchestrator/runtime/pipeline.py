"""Pipeline parallelism with torch.distributed.pipelining, as the plan's `Pipeline` says.

A model runs in a pipeline when its forward is ``head(blocks(embed(idx)))`` and it names the
modules of each end (`pipeline_embed`, `pipeline_head`; the built-in GPT and the Llama family
do, and `workloads/hf.py` names them for a Hugging Face decoder laid out as Llama's, with the
keyword arguments its blocks take, `block_inputs`, and the modules every stage runs,
`pipeline_shared`). A chunk (`StageModule`) keeps its own blocks in a ModuleDict keyed by their
index in the whole model, under the block list's own path, and every module under its path in
the whole model, so parameter and optimizer-state names are the whole model's
(`h.5.attn.q_proj.weight`, `model.layers.5.self_attn.q_proj.weight`): DCP checkpoints hold every
stage's state without collisions, and a Hugging Face checkpoint loads by its own names. The
first chunk keeps the embedding, the last the final norm and the head. Chunk c runs on
pipeline rank c mod p (torch's loop placement for the interleaved schedules).

Each chunk is parallelized on its own, the way torchtitan composes them: tensor parallelism,
recomputation, then FSDP2 over the data-parallel axes; torch's `PipelineStage` turns gradient
sync off until the last micro-batch's backward, then reduces once and divides the gradients by
the micro-batch count, so one step equals one over the whole batch.

Tied weights: the GPT ties lm_head to wte (`pipeline_tied` names them). With p > 1 the first
and the last stage each hold it; after backward their gradients are summed between the two
ranks (Megatron's way), so both copies take the same optimizer step and stay equal, and the
gradient norm counts it once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from ..choices import PipelineSchedule
from ..errors import PlanError
from ..planning.pipeline import Pipeline
from ..planning.resolve import Execution
from ..workloads.models import block_list, block_list_name, logits_of, pipeline_ends, tp_plan
from .parallelize import Parallelized, clip_grads_with_norm, local_tensor, parallelize, total_grad_norm


class StageModule(nn.Module):
    """One chunk of a model: token ids (first chunk) or hidden states in; hidden states, or
    logits (last chunk), out. Holds the whole model's modules it uses, under their own names."""

    def __init__(self, model: nn.Module, start: int, stop: int, first: bool, last: bool) -> None:
        super().__init__()
        embed, head = pipeline_parts(model)
        self.first, self.last = first, last
        # Plain attributes, not submodules: the model's own embed/head code and its TP plan.
        object.__setattr__(self, "_whole", model)
        self.tp_plan = tp_plan(model)
        self.cfg = getattr(model, "cfg", None)
        # Every module under its path in the whole model (`model.layers.5...` for a Hugging Face
        # one): TP plans, state dicts and DCP keys are the whole model's. Modules every stage
        # runs (rotary tables) sit on every stage, so they move to its device with it.
        for name in (embed if first else ()) + (head if last else ()) + tuple(getattr(model, "pipeline_shared", ())):
            _adopt(self, name, model.get_submodule(name))
        blocks = block_list(model)
        self._blocks_name = block_list_name(model)
        # Keyed by each block's index in the whole model.
        _adopt(self, self._blocks_name, nn.ModuleDict({str(i): blocks[i] for i in range(start, stop)}))

    @property
    def stage_blocks(self) -> nn.ModuleDict:
        return self.get_submodule(self._blocks_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self._whole.embed(x)
        # What the model's blocks take beside the hidden states (a Hugging Face decoder's
        # rotary tables and mask), as the model's own forward computes it.
        block_inputs = getattr(self._whole, "block_inputs", None)
        kwargs = block_inputs(x) if block_inputs is not None else {}
        for block in self.stage_blocks.values():
            x = block(x, **kwargs)
            if isinstance(x, tuple):  # transformers 4's decoder layers return (hidden states, ...)
                x = x[0]
        if self.last:
            x = logits_of(self._whole.head(x))
        return x


def _adopt(root: nn.Module, path: str, module: nn.Module | None) -> None:
    """Register `module` at the dotted `path` under `root`, with empty containers on the way."""
    *parents, leaf = path.split(".")
    for part in parents:
        child = root._modules.get(part)
        if child is None:
            child = nn.Module()
            root.add_module(part, child)
        root = child
    root.add_module(leaf, module)


def split_model(model: nn.Module, pipeline: Pipeline, pp_rank: int) -> list[StageModule]:
    """This pipeline rank's chunks of `model` (chunk c on rank c mod p). The model keeps only
    what those chunks use (blocks and ends of other stages are dropped, so their memory is
    freed); the chunks share its modules, so nothing is copied."""
    n = len(block_list(model))
    if sum(pipeline.layers) != n:
        raise PlanError(f"the pipeline's stage split {pipeline.layers} covers {sum(pipeline.layers)} blocks, "
                        f"the model has {n}")
    if not 0 <= pp_rank < pipeline.stages:
        raise ValueError(f"pipeline rank must be in [0, {pipeline.stages}), got {pp_rank}")
    chunks = []
    for c in pipeline.chunks_of(pp_rank):
        start, stop = pipeline.block_range(c)
        chunks.append(StageModule(model, start, stop, c == 0, c == pipeline.chunks - 1))
    embed, head = pipeline_parts(model)
    kept = {name for m in chunks for name, _ in m.named_modules()}
    for name in embed + head:
        if name not in kept:
            _set_path(model, name, None)
    _set_path(model, chunks[0]._blocks_name, nn.ModuleList())
    return chunks


def _set_path(root: nn.Module, path: str, value: nn.Module | None) -> None:
    owner, _, leaf = path.rpartition(".")
    setattr(root.get_submodule(owner) if owner else root, leaf, value)


def pipeline_parts(model: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(embedding module names, head module names) of a model that can run in a pipeline;
    PlanError naming what is missing otherwise."""
    ends = pipeline_ends(model)
    if ends is None:
        raise PlanError(f"parallel.pp > 1 needs a model whose forward is head(blocks(embed(idx))) and that names "
                        f"its ends (`embed`, `head`, `pipeline_embed`, `pipeline_head`, as the built-in GPT and "
                        f"Llama do); {type(model).__name__} does not; use parallel.pp=1")
    return ends


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy in fp32, the training loop's own loss (a mean over the
    micro-batch's tokens; the stages divide gradients by the micro-batch count)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


def build_schedule(stages: list, schedule: PipelineSchedule | str, microbatches: int):
    """torch's schedule for this rank's stage(s)."""
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
    )

    schedule = PipelineSchedule(schedule)
    single = {PipelineSchedule.gpipe: ScheduleGPipe, PipelineSchedule.one_f_one_b: Schedule1F1B}
    multi = {PipelineSchedule.interleaved_1f1b: ScheduleInterleaved1F1B,
             PipelineSchedule.zero_bubble: ScheduleInterleavedZeroBubble}
    if schedule in single:
        if len(stages) != 1:
            raise PlanError(f"parallel.pp_schedule={schedule} runs one stage per rank, got {len(stages)}")
        return single[schedule](stages[0], n_microbatches=microbatches, loss_fn=loss_fn)
    if schedule in multi:
        return multi[schedule](stages, n_microbatches=microbatches, loss_fn=loss_fn)
    raise PlanError(f"key 'parallel.pp_schedule': no schedule {schedule!r}; allowed: {PipelineSchedule.names()}")


class _Optimizers:
    """This rank's chunks' optimizers as one: the training loop sets the learning rate on
    `param_groups`, steps and zeroes them together."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)


@dataclass
class Pipelined:
    """This rank's chunks, parallelized, with their stages and schedule: what the training loop
    drives in place of one `Parallelized` model when pp > 1."""

    parts: list[Parallelized]
    """One per chunk this rank runs (v under the interleaved schedules), in chunk order."""
    schedule: Any
    """torch's schedule over this rank's stages."""
    pipeline: Pipeline
    pp_group: dist.ProcessGroup
    pp_ranks: list[int]
    """Global ranks of this rank's pipeline, by stage."""
    pp_rank: int
    device: torch.device
    """This rank's device: what its stages compute on, and what its collectives' tensors live on
    (NCCL takes only tensors on the group's device)."""
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.optimizer = _Optimizers([p.optimizer for p in self.parts])
        self.modules: list[StageModule] = [_stage_module(p.model) for p in self.parts]
        self.has_first = any(m.first for m in self.modules)
        self.has_last = any(m.last for m in self.modules)

    @property
    def model(self) -> nn.Module:
        return self.parts[0].model

    def _tied(self) -> list[nn.Parameter]:
        """Parameters this rank holds that another stage holds too (a tied embedding and head,
        named by the model's `pipeline_tied`)."""
        if self.has_first and self.has_last:
            return []
        names = set(getattr(self.modules[0]._whole, "pipeline_tied", ()))
        return [p for m in self.modules for n, p in m.named_parameters() if n in names]

    def step(self, x: torch.Tensor, y: torch.Tensor, train: bool = True) -> torch.Tensor:
        """One pass of the schedule over this data-parallel rank's batch (split into the
        plan's micro-batches); returns the sum of the micro-batches' mean losses divided by
        their count on the last stage, zero elsewhere."""
        for p in self.parts:
            p.model.train(train)
        losses: list[torch.Tensor] = []
        args = (x,) if self.has_first else ()
        kwargs = {"target": y, "losses": losses} if self.has_last else {}
        # The losses are all the loop needs: torch would otherwise keep every micro-batch's
        # logits on the last stage to hand back merged (m x micro-batch x seq x vocab). `eval`
        # passes its keywords on to `step`, whose own they are.
        if train:
            self.schedule.step(*args, return_outputs=False, **kwargs)
            self._sync_tied()
        else:
            self.schedule.eval(*args, return_outputs=False, **kwargs)
        if not losses:
            return torch.zeros((), device=x.device)
        return torch.stack([v.detach().float() for v in losses]).mean()

    def _sync_tied(self) -> None:
        """Sum a tied weight's gradient between the first and the last stage (each holds the
        same shard of it: same shape, same data-parallel and tensor-parallel position)."""
        tied = self._tied()
        if not tied:
            return
        peer = self.pp_ranks[-1] if self.has_first else self.pp_ranks[0]
        for p in tied:
            grad = local_tensor(p.grad) if p.grad is not None else torch.zeros_like(local_tensor(p))
            other = torch.empty_like(grad)
            ops = [dist.P2POp(dist.isend, grad.contiguous(), peer, self.pp_group),
                   dist.P2POp(dist.irecv, other, peer, self.pp_group)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            grad.add_(other)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip every stage's gradients to one global 2-norm of `max_norm`: each rank's squared
        norm (a tied copy counted on the first stage only) summed over the pipeline."""
        tied = {id(p) for p in self._tied()} if self.has_last else set()
        params = [p for m in self.modules for p in m.parameters() if p.grad is not None]
        counted = [p for p in params if id(p) not in tied]
        # A stage without gradients still joins the sum, with a zero on its own device.
        local = total_grad_norm(counted) if counted else torch.zeros((), device=self.device)
        sq = (local.float() ** 2).reshape(())
        dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=self.pp_group)
        total = sq.sqrt()
        clip_grads_with_norm(params, max_norm, total)
        return total

    def zero_grad(self) -> None:
        for p in self.parts:
            p.zero_grad()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield

    def state_bytes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self.parts:
            for k, v in p.state_bytes().items():
                out[k] = out.get(k, 0) + v
        return out

    def state_dict(self) -> dict[str, Any]:
        """{"model", "optimizer"} of every chunk this rank runs, under the whole model's names."""
        model: dict[str, Any] = {}
        optim: dict[str, Any] = {}
        for p in self.parts:
            sd = p.state_dict()
            model.update(sd["model"])
            optim.update(sd["optimizer"])
        return {"model": model, "optimizer": optim}

    def live_state(self) -> list[tuple[str, torch.Tensor]]:
        """Every chunk's `Parallelized.live_state`, each under its chunk's index."""
        return [(f"chunk{i}/{name}", t) for i, p in enumerate(self.parts) for name, t in p.live_state()]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for p in self.parts:
            mine = p.state_dict()
            p.load_state_dict({k: {n: state_dict[k][n] for n in mine[k]} for k in ("model", "optimizer")})


def _stage_module(model: nn.Module) -> StageModule:
    return model if isinstance(model, StageModule) else next(m for m in model.modules() if isinstance(m, StageModule))


def build_pipeline(model: nn.Module, ex: Execution, mesh: DeviceMesh,
                   make_optimizer: Callable[[nn.Module], torch.optim.Optimizer], device: torch.device,
                   node_of_rank: tuple[str, ...] | None = None,
                   materialize: Callable[[nn.Module], None] | None = None, compile_blocks: bool = False) -> Pipelined:
    """Split `model` (initialised identically on every rank, or on the meta device with
    `materialize` to allocate each chunk once it is sharded) into this rank's chunks,
    parallelize each as `ex` says on `mesh`, and build their stages and torch's schedule over
    the pp axis."""
    from torch.distributed.pipelining import PipelineStage

    pl = ex.pipeline
    if pl is None or ex.mesh.pp != pl.stages:
        raise ValueError(f"build_pipeline needs an execution with a pipeline over pp={ex.mesh.pp}, got {pl}")
    pp_mesh = mesh["pp"]
    pp_rank = pp_mesh.get_local_rank()
    chunks = split_model(model, pl, pp_rank)
    parts = [parallelize(c, ex, mesh, make_optimizer, device, node_of_rank=node_of_rank, materialize=materialize,
                         compile_blocks=compile_blocks) for c in chunks]
    group = pp_mesh.get_group()
    stages = [PipelineStage(p.model, c, pl.chunks, device, group=group)
              for p, c in zip(parts, pl.chunks_of(pp_rank))]
    schedule = build_schedule(stages, pl.schedule, pl.microbatches)
    notes = list(parts[0].notes)
    return Pipelined(parts, schedule, pl, group, dist.get_process_group_ranks(group), pp_rank, device, notes)
