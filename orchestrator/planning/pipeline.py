"""Pipeline parallelism as it runs: the stage split, the schedule's bubble, per-stage memory.

`Pipeline` is the one statement of how a pipeline runs (resolved once by `resolve_pipeline`,
priced by the cost and memory models, executed by `runtime/pipeline.py`):

- **Split.** The blocks are cut into p*v contiguous chunks (v virtual stages per rank under
  the interleaved schedule; chunk c runs on stage c mod p, torch's "loop" placement). The first
  chunk also holds the token and position embeddings, the last the final LayerNorm, the
  (tied) output head and the loss. Chunks are balanced by cost, counted in blocks: the head
  costs 2 h V FLOPs per token forward, a block 24 h^2 + 4 s h, so the last chunk gets fewer
  blocks when V is large.
- **Bubble.** Over m micro-batches a pipeline of p stages idles (p-1)/m of its busy time
  under GPipe and 1F1B (Narayanan et al. 2021 Sec. 2.2), (p-1)/(v m) under interleaved 1F1B.
  Zero-bubble schedules (Qi et al. 2023) split backward into input and weight gradients and
  fill most of the warm-up and cool-down with weight gradients; torch's interleaved
  zero-bubble schedule is priced at a third of interleaved 1F1B's bubble, the ZB-H1 figure.
- **Activations in flight.** GPipe keeps all m micro-batches' activations until the flush;
  1F1B keeps at most p - i on stage i (the first stage p, Narayanan Sec. 2.2.1); interleaved
  1F1B's first stage keeps about p (1 + (p-1)/(p v)) chunks' worth of micro-batches
  (Korthikanti et al. 2022 Sec. 4.2.3), and the zero-bubble schedule as much as 1F1B. What
  a rank holds is read off its passes in the order torch's schedule runs them (`ops`): at the
  start of each backward (`Moment`), its micro-batches in flight per chunk, its chunks'
  outputs (torch keeps each until its backward; the last chunk's are the logits) and the
  share of its gradients made. The last chunk runs each micro-batch's backward right after
  its forward (but under GPipe), so the last stage keeps the loss's log-probabilities of one
  micro-batch, however many of its earlier chunks' it holds; and where every forward comes
  first, the most in flight sits beside no gradient yet.
- **Tied weights.** The GPT ties lm_head to wte. With p > 1 the first and last stages each keep
  a copy, and the runtime all-reduces the tied gradient between them (Megatron's way): each
  copy is counted in its stage's memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterator

from ..choices import PipelineSchedule
from ..serialize import from_plain, to_plain
from .model_math import ModelShape

# ZB-H1's bubble relative to 1F1B's (Qi et al. 2023, Sec. 3): about a third.
ZERO_BUBBLE_SHARE = 1 / 3


@dataclass(frozen=True)
class Pipeline:
    """How one pipeline runs: degree, schedule, micro-batches and the blocks of every chunk."""

    stages: int
    """p: pipeline ranks (the mesh's pp axis)."""
    schedule: PipelineSchedule
    microbatches: int
    """m: micro-batches each pipeline runs per optimizer step."""
    virtual: int
    """v: chunks per rank (1 except under the interleaved schedules)."""
    layers: tuple[int, ...]
    """Blocks of each of the p*v chunks, in model order; chunk c runs on stage c mod p."""

    def __post_init__(self) -> None:
        if self.stages < 1 or self.virtual < 1 or self.microbatches < 1:
            raise ValueError(f"a pipeline needs positive stages, virtual stages and micro-batches, got "
                             f"p={self.stages}, v={self.virtual}, m={self.microbatches}")
        if len(self.layers) != self.stages * self.virtual:
            raise ValueError(f"{self.stages} stages x {self.virtual} virtual stages need {self.stages * self.virtual} "
                             f"chunks, got {len(self.layers)}")

    @property
    def chunks(self) -> int:
        return self.stages * self.virtual

    def chunks_of(self, stage: int) -> tuple[int, ...]:
        """The chunk indices stage `stage` runs (torch's loop placement: c mod p)."""
        return tuple(range(stage, self.chunks, self.stages))

    def block_range(self, chunk: int) -> tuple[int, int]:
        """[first, last) block index of a chunk."""
        start = sum(self.layers[:chunk])
        return start, start + self.layers[chunk]

    @property
    def bubble(self) -> float:
        """Idle time over busy time of one step: (p-1)/(v m), a third of it under zero bubble."""
        return bubble_fraction(self.schedule, self.stages, self.microbatches, self.virtual)

    def ops(self, stage: int) -> tuple[tuple[bool, int, int], ...]:
        """Stage `stage`'s passes in the order torch's schedule runs them: (forward?, local
        chunk index, micro-batch) each.

        GPipe runs every forward first. 1F1B runs min(m, p - stage) forwards, then a backward
        and a forward in turn (`Schedule1F1B`). The interleaved schedules run torch's warm-up
        (`_get_warmup_ops`: (v - 1) rounds of micro-batches, then two forwards, one under zero
        bubble, per hop from the last rank), then a forward and a backward in turn
        (`_get_1f1b_rank_ops`): forwards in rounds through the rank's chunks in order,
        backwards in rounds from its last chunk down. Zero bubble's split backward is taken
        whole."""
        return tuple(self._passes(stage))

    def _passes(self, stage: int, periods: bool = True) -> Iterator[tuple[bool, int, int]]:
        """`ops` one by one. Without `periods`, the steady state's repeats are left out: it
        runs the same passes every round through the chunks, holding the same then; the first
        and last micro-batch of every chunk stay."""
        p, m, v = self.stages, self.microbatches, self.virtual
        if p == 1 or self.schedule == PipelineSchedule.gpipe:
            yield from ((True, c, i) for c in range(v) for i in range(m))
            yield from ((False, c, i) for c in reversed(range(v)) for i in range(m))
            return
        if v == 1:
            warmup = min(m, p - stage)
            steady = range(m - warmup) if periods else sorted({0, 1, m - warmup - 1} & set(range(m - warmup)))
            yield from ((True, 0, i) for i in range(warmup))
            for i in steady:
                yield False, 0, i
                yield True, 0, warmup + i
            yield from ((False, 0, i) for i in range(m - warmup, m))
            return
        per_round = m // max(1, m // p)
        period = per_round * v

        def micro_batch(k: int) -> int:
            return k // period * per_round + k % per_round

        hop = 1 if self.schedule == PipelineSchedule.zero_bubble else 2
        warmup = min((v - 1) * per_round + hop * (p - 1 - stage), m * v)
        yield from ((True, (k // per_round) % v, micro_batch(k)) for k in range(warmup))
        pairs, k = m * v - warmup, 0
        while k < m * v:
            if warmup + k < m * v:
                yield True, ((warmup + k) // per_round) % v, micro_batch(warmup + k)
            yield False, v - 1 - (k // per_round) % v, micro_batch(k)
            k += 1
            if not periods and k == period and pairs - k > 2 * period:
                k += ((pairs - k) // period - 1) * period

    def moments(self, stage: int) -> tuple["Moment", ...]:
        """The starts of stage `stage`'s backwards (`ops`) and what the rank holds at each,
        less those another one holds at least as much at (same chunk size and loss)."""
        return _moments(self, stage)

    def to_dict(self) -> dict:
        return to_plain(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Pipeline":
        return from_plain(cls, d)


def bubble_fraction(schedule: PipelineSchedule | str, p: int, m: int, v: int = 1) -> float:
    """(p-1)/(v m) of the busy time; GPipe and 1F1B have v = 1."""
    schedule = PipelineSchedule(schedule)
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"p, m and v must be positive, got p={p}, m={m}, v={v}")
    if schedule in (PipelineSchedule.gpipe, PipelineSchedule.one_f_one_b) and v != 1:
        raise ValueError(f"{schedule} has one chunk per rank, got v={v}")
    base = (p - 1) / (v * m)
    return base * ZERO_BUBBLE_SHARE if schedule == PipelineSchedule.zero_bubble else base


def head_cost_in_blocks(shape: ModelShape) -> float:
    """The output head's (and loss's) forward FLOPs per token in units of one block's."""
    h, s = shape.hidden, shape.seq
    return 2 * h * shape.vocab / (24 * h * h + 4 * s * h)


@lru_cache(maxsize=4096)
def split_layers(shape: ModelShape, chunks: int) -> tuple[int, ...]:
    """Blocks per chunk, contiguous, balanced by cost: the last chunk carries the head, so it
    gets fewer blocks where the head is heavy. Every chunk holds at least one block."""
    n = shape.layers
    if chunks < 1 or chunks > n:
        raise ValueError(f"{n} blocks cannot be cut into {chunks} chunks of at least one block")
    if chunks == 1:
        return (n,)
    head = head_cost_in_blocks(shape)
    # Smallest bottleneck over the last chunk's block count k; the rest split evenly.
    best: tuple[float, int] | None = None
    for k in range(1, n - chunks + 2):
        rest = n - k
        per = math.ceil(rest / (chunks - 1))
        worst = max(per, k + head)
        if best is None or worst < best[0]:
            best = (worst, k)
    assert best is not None, "a model of more blocks than chunks has at least one last-chunk size to try"
    k = best[1]
    rest, others = n - k, chunks - 1
    # The remainder goes to the later chunks: the first one also holds the embeddings.
    base, extra = divmod(rest, others)
    return tuple(base + (1 if i >= others - extra else 0) for i in range(others)) + (k,)


def schedules_for(p: int, m: int, forced: PipelineSchedule | None, layers: int,
                  max_virtual: int = 2) -> list[tuple[PipelineSchedule, int]]:
    """(schedule, v) worth pricing for p stages and m micro-batches: 1F1B, and interleaved 1F1B
    with v = 2..max_virtual where the blocks allow p*v chunks and p divides m (torch's interleaved
    schedules run micro-batches in rounds of p). A forced schedule is priced alone."""
    if p == 1:
        return [(PipelineSchedule.one_f_one_b, 1)]
    interleaved = [v for v in range(2, max_virtual + 1) if p * v <= layers and m % p == 0]
    if forced in (PipelineSchedule.gpipe, PipelineSchedule.one_f_one_b):
        return [(forced, 1)]
    if forced in (PipelineSchedule.interleaved_1f1b, PipelineSchedule.zero_bubble):
        vs = interleaved or ([2] if 2 * p <= layers else [])
        return [(forced, v) for v in vs[:1 if forced == PipelineSchedule.zero_bubble else None]]
    return [(PipelineSchedule.one_f_one_b, 1)] + [(PipelineSchedule.interleaved_1f1b, v) for v in interleaved]


@lru_cache(maxsize=4096)
def resolve_pipeline(shape: ModelShape, stages: int, schedule: PipelineSchedule | str, microbatches: int,
                     virtual: int = 1) -> Pipeline:
    """The pipeline that runs: the split of the blocks over p*v chunks; ValueError stating the
    invariant when it cannot run."""
    schedule = PipelineSchedule(schedule)
    if schedule == PipelineSchedule.auto:
        raise ValueError("resolve_pipeline takes a concrete schedule; `auto` is the planner's to decide")
    if stages == 1:
        return Pipeline(1, PipelineSchedule.one_f_one_b, microbatches, 1, (shape.layers,))
    if microbatches < stages and schedule != PipelineSchedule.gpipe:
        raise ValueError(f"{schedule} needs at least as many micro-batches as stages: m={microbatches} < p={stages}")
    if stages * virtual > shape.layers:
        raise ValueError(f"{stages} stages x {virtual} virtual stages exceed the {shape.layers} blocks")
    return Pipeline(stages, schedule, microbatches, virtual, split_layers(shape, stages * virtual))


@dataclass(frozen=True)
class Moment:
    """The start of one backward of a rank, as its schedule runs: what the rank holds then."""

    in_flight: float
    """Micro-batches of its blocks' activations held (forward done, backward not), weighted by
    the blocks of each of its chunks; the backward starting counts."""
    tail_in_flight: int
    """Micro-batches of its last chunk held: what that chunk keeps outside its blocks (on the
    last stage the loss's log-probabilities) is held that many times."""
    outputs_in_flight: int
    """Chunk outputs held, one per chunk and micro-batch in flight: torch's PipelineStage keeps
    each until that micro-batch's backward (the last chunk's are the logits). None without a
    pipeline, whose loss frees the logits."""
    blocks: int
    """Blocks of the chunk this backward runs: what it frees as it goes."""
    blocks_before: float
    """Share of the rank's blocks whose unsharded gradients earlier backwards (or micro-steps)
    made and still hold: a pipeline's chunk accumulates them from its first micro-batch's
    backward and reduces them with its last's."""
    blocks_after: float
    """Share holding them once this backward is done."""
    root_before: bool
    """Whether the gradient of the rank's parameters outside its blocks (the embeddings of the
    first stage's first chunk, the head of the last stage's last chunk) is held already."""
    root_after: bool
    """Whether it is held once this backward is done."""
    makes_root: bool
    """Whether this backward runs the chunk that holds them (and so makes their gradient)."""
    loss: bool
    """Whether this backward starts with the loss's: the model's last chunk (no pipeline: the
    whole model)."""


def whole_model_moment(blocks: int, micro_steps: int) -> Moment:
    """A rank without a pipeline: one micro-batch in flight, the gradients of earlier
    micro-steps (accumulation) there from the start of its backward."""
    earlier = micro_steps > 1
    return Moment(1.0, 1, 0, blocks, float(earlier), 1.0, earlier, True, True, True)


@lru_cache(maxsize=4096)
def _moments(pipeline: Pipeline, stage: int) -> tuple[Moment, ...]:
    chunks = pipeline.chunks_of(stage)
    blocks = [pipeline.layers[c] for c in chunks]
    total = max(1, sum(blocks))
    last = len(chunks) - 1
    loss_chunk = last if chunks[-1] == pipeline.chunks - 1 else None
    root = 0 if stage == 0 else loss_chunk
    m = pipeline.microbatches
    held = [0] * len(chunks)
    holding = [False] * len(chunks)  # an unsharded gradient accumulated, not yet reduced
    weighted = outputs = 0
    found: dict[Moment, None] = {}  # in order, once each: a steady state repeats one moment

    def share() -> float:
        return sum(b for b, h in zip(blocks, holding) if h) / total

    for forward, c, mb in pipeline._passes(stage, periods=False):
        if forward:
            held[c] += 1
            weighted += blocks[c]
            outputs += 1
            continue
        before, root_before = share(), root is not None and holding[root]
        holding[c] = mb < m - 1
        found[Moment(weighted / total, held[last], outputs, blocks[c], before, share(), root_before,
                     root is not None and holding[root], c == root, c == loss_chunk)] = None
        held[c] -= 1
        weighted -= blocks[c]
        outputs -= 1
    # A moment another holds at least as much at (same chunk size and role) cannot be the peak.
    def role(mo: Moment) -> tuple:
        return mo.blocks, mo.loss, mo.makes_root

    def amounts(mo: Moment) -> tuple:
        return (mo.in_flight, mo.tail_in_flight, mo.outputs_in_flight, mo.blocks_before, mo.blocks_after,
                mo.root_before, mo.root_after)

    kept: list[Moment] = []
    for mo in sorted(found, key=amounts, reverse=True):  # a moment's coverers come before it
        if not any(role(k) == role(mo) and all(x >= y for x, y in zip(amounts(k), amounts(mo))) for k in kept):
            kept.append(mo)
    return tuple(mo for mo in found if mo in kept)


@dataclass(frozen=True)
class StageShare:
    """What one pipeline rank holds of the model."""

    blocks: int
    """Blocks over all of the rank's chunks."""
    root: int
    """Parameters outside the blocks it holds: the embeddings on the first stage; the final
    LayerNorm and the head on the last (the tied head a copy of wte when p > 1)."""
    first: bool
    last: bool
    moments: tuple[Moment, ...] = ()
    """The starts of its backwards (`Pipeline.moments`); none without a pipeline."""
    recv_buffers: int = 0
    """Receive buffers of one micro-batch's boundary activation the rank's stages hold all run
    long: torch's PipelineStage allocates one per micro-batch, up front, for the activation
    into every chunk but the first and for the gradient into every chunk but the last."""


@lru_cache(maxsize=65536)
def stage_share(shape: ModelShape, pipeline: Pipeline | None, stage: int) -> StageShare:
    """The blocks and non-block parameters of pipeline rank `stage` (the whole model without a pipeline)."""
    h = shape.hidden
    norm = 2 * h if shape.bias else h
    if pipeline is None or pipeline.stages == 1:
        return StageShare(shape.layers, (shape.vocab + shape.seq) * h + norm, True, True)
    if not 0 <= stage < pipeline.stages:
        raise ValueError(f"stage must be in [0, {pipeline.stages}), got {stage}")
    chunks = pipeline.chunks_of(stage)
    blocks = sum(pipeline.layers[c] for c in chunks)
    first, last = stage == 0, stage == (pipeline.chunks - 1) % pipeline.stages
    root = (shape.vocab + shape.seq) * h * first + (norm + shape.vocab * h) * last
    boundaries = sum((c > 0) + (c < pipeline.chunks - 1) for c in chunks)
    return StageShare(blocks, root, first, last, moments=pipeline.moments(stage),
                      recv_buffers=boundaries * pipeline.microbatches)


def stage_cost(shape: ModelShape, pipeline: Pipeline | None, stage: int) -> float:
    """Forward FLOPs of a rank's chunks in blocks (the head counted by `head_cost_in_blocks`)."""
    share = stage_share(shape, pipeline, stage)
    return share.blocks + (head_cost_in_blocks(shape) if share.last else 0.0)


@lru_cache(maxsize=4096)
def slowest_stage(shape: ModelShape, pipeline: Pipeline | None) -> int:
    """The pipeline rank with the most work: it sets the pipeline's pace."""
    if pipeline is None:
        return 0
    return max(range(pipeline.stages), key=lambda s: stage_cost(shape, pipeline, s))
