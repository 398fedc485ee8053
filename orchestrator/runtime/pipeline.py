"""Pipeline parallelism with torch.distributed.pipelining, as the plan's `Pipeline` says.

The model is cut at block boundaries (`split_stages`): the first chunk keeps the token and
position embeddings, the last the final LayerNorm and the head; every chunk keeps its blocks
under their original names (`h.5...`), so DCP checkpoints of a pipelined run name the same
parameters as a run without one. Chunk c runs on pipeline rank c mod p (torch's loop placement
for the interleaved schedules).

Tied weights: the GPT ties lm_head to wte. With p > 1 the first and the last stage each keep a
copy, initialised equal; after backward their gradients are summed between the two ranks
(`sync_tied_grads`, Megatron's way), so both copies take the same optimizer step and stay
equal. torchtitan unties instead; untying would change the model being trained.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..choices import PipelineSchedule

TIED = ("wte.weight", "lm_head.weight")
"""The tied pair: the first stage's embedding and the last stage's head."""


class StageModule(nn.Module):
    """One chunk of the GPT: token ids (first) or hidden states in, hidden states or logits (last) out."""

    def __init__(self, model: nn.Module, start: int, stop: int, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
        # A ModuleDict keyed by the original index keeps the parameter names of the whole model.
        self.h = nn.ModuleDict({str(i): model.h[i] for i in range(start, stop)})
        if last:
            self.ln_f = model.ln_f
            self.lm_head = model.lm_head
            if not first:
                # The last stage's own copy of the tied weight (see the module docstring).
                self.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.wte(x) + self.wpe(pos))
        for block in self.h.values():
            x = block(x)
        if self.last:
            x = self.lm_head(self.ln_f(x))
        return x


def split_stages(model: nn.Module, chunk: int, layers: tuple[int, ...]) -> StageModule:
    """Chunk `chunk` of `model` (a GPT with `wte`, `wpe`, `h`, `ln_f`, `lm_head`), holding
    `layers[chunk]` blocks after the `sum(layers[:chunk])` before it. The model is copied: the
    stage owns its parameters."""
    if sum(layers) != len(model.h):
        raise ValueError(f"the stage split {layers} covers {sum(layers)} blocks, the model has {len(model.h)}")
    if not 0 <= chunk < len(layers):
        raise ValueError(f"chunk must be in [0, {len(layers)}), got {chunk}")
    start = sum(layers[:chunk])
    return StageModule(copy.deepcopy(model), start, start + layers[chunk], chunk == 0, chunk == len(layers) - 1)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The GPT's own loss: mean cross-entropy in fp32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


def build_schedule(stages: list, schedule: PipelineSchedule | str, microbatches: int):
    """torch's schedule for this rank's stage(s); gradients are averaged over the micro-batches,
    so a step equals one over the whole batch."""
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
            raise ValueError(f"{schedule} runs one stage per rank, got {len(stages)}")
        return single[schedule](stages[0], n_microbatches=microbatches, loss_fn=loss_fn)
    if schedule in multi:
        return multi[schedule](stages, n_microbatches=microbatches, loss_fn=loss_fn)
    raise ValueError(f"no pipeline schedule {schedule!r}; allowed: {PipelineSchedule.names()}")


def pipeline_stages(model: nn.Module, pipeline, pp_rank: int, device: torch.device, group=None) -> list:
    """This rank's PipelineStages (one per chunk it runs) and their modules."""
    from torch.distributed.pipelining import PipelineStage

    out = []
    for c in pipeline.chunks_of(pp_rank):
        module = split_stages(model, c, pipeline.layers).to(device)
        out.append(PipelineStage(module, c, pipeline.chunks, device, group=group))
    return out


def sync_tied_grads(modules: list[StageModule], first_rank: int, last_rank: int, group=None) -> None:
    """Sum the tied embedding/head gradient between the first and the last stage (a no-op on
    ranks holding neither, and where one module holds both)."""
    if first_rank == last_rank:
        return
    mine = [m.wte.weight for m in modules if m.first] + [m.lm_head.weight for m in modules if m.last]
    for p in mine:
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        peer = last_rank if any(m.first for m in modules) else first_rank
        # A two-rank all-reduce as a send/receive pair: only the two holders take part.
        other = torch.empty_like(grad)
        ops = [dist.P2POp(dist.isend, grad.contiguous(), peer, group), dist.P2POp(dist.irecv, other, peer, group)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        p.grad = grad + other
