"""Search: enumerate strategy x mesh x micro-batch x recomputation, drop what does not fit,
rank the rest by predicted step time.

Fixed choices in the job's config narrow each dimension; `auto` leaves it open. The search
enumerates divisors, never permutations: the layout of a mesh on identical nodes is computed
once per distinct node wiring (`layout.py`), so a thousand-node cluster costs what one does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ..choices import AccumSync, Compression, CpAttention, PipelineSchedule, Recompute, Strategy, SyncAlgorithm
from ..config import JobConfig
from ..sequence_split import sequence_split_problem, ulysses_problem
from .activations import kv_heads_and_width
from .cost import Choice, Estimate, JobContext, compute_floor, estimate
from .layout import ClusterLayout, Wirings, cluster_layout
from .mesh import Mesh
from .pipeline import schedules_for
from .resolve import Unsupported, wrapping_of
from .sync import COMM_BOUND_FRACTION

STRATEGIES = Strategy.concrete()
RECOMPUTES = Recompute.concrete()
# Plans within this fraction of the fastest are ranked by simplicity instead.
NEAR_TIE = 0.01
MAX_ALTERNATIVES = 12


def divisors(n: int) -> list[int]:
    """Divisors of n, ascending."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


@dataclass(frozen=True)
class Constraints:
    """The job's fixed choices; None leaves a dimension to the search."""

    strategy: Strategy | None = None
    tp: int | None = None
    dp_shard: int | None = None
    micro_batch: int | None = None
    recompute: Recompute | None = None
    compression: Compression | None = None
    allow_compression: bool = False
    algorithm: SyncAlgorithm = SyncAlgorithm.auto
    bucket_mb: float | None = None
    pp: int | None = None
    pp_schedule: PipelineSchedule | None = None
    pp_microbatches: int | None = None
    accum_sync: AccumSync | None = None
    cp: int | None = None
    cp_attention: CpAttention | None = None
    ep: int | None = None

    @classmethod
    def from_config(cls, cfg: JobConfig) -> "Constraints":
        p, t = cfg.parallel, cfg.train

        def fixed(v):
            return None if v == "auto" else v

        return cls(
            strategy=fixed(p.strategy),
            tp=fixed(p.tp),
            dp_shard=fixed(p.dp_shard),
            micro_batch=fixed(t.micro_batch_size),
            recompute=fixed(p.recompute),
            compression=fixed(p.compression),
            allow_compression=p.allow_compression,
            algorithm=p.sync,
            bucket_mb=None if p.bucket_mb == "auto" else float(p.bucket_mb),
            pp=fixed(p.pp),
            pp_schedule=fixed(p.pp_schedule),
            pp_microbatches=fixed(p.pp_microbatches),
            accum_sync=fixed(p.accum_sync),
            cp=fixed(p.cp),
            cp_attention=fixed(p.cp_attention),
            ep=fixed(p.ep),
        )

    def forced(self) -> list[str]:
        """The config keys this search was narrowed by, as `key=value`."""
        keys = (("parallel.strategy", self.strategy), ("parallel.tp", self.tp), ("parallel.dp_shard", self.dp_shard),
                ("train.micro_batch_size", self.micro_batch), ("parallel.recompute", self.recompute),
                ("parallel.compression", self.compression),
                ("parallel.sync", None if self.algorithm == "auto" else self.algorithm), ("parallel.pp", self.pp),
                ("parallel.pp_schedule", self.pp_schedule), ("parallel.pp_microbatches", self.pp_microbatches),
                ("parallel.accum_sync", self.accum_sync), ("parallel.cp", self.cp),
                ("parallel.cp_attention", self.cp_attention), ("parallel.ep", self.ep))
        return [f"{k}={v}" for k, v in keys if v is not None]


@dataclass
class Rejected:
    """A candidate mesh that could not be evaluated at all, and why."""

    strategy: Strategy
    mesh: Mesh
    reason: str


@dataclass
class SearchResult:
    """The chosen estimate and everything it was compared with."""

    best: Estimate | None
    """None when no candidate could be estimated (see `rejected`)."""
    layout: ClusterLayout | None
    fits: bool
    runners_up: list[Estimate] = field(default_factory=list)
    """Best estimate of each other (strategy, mesh), fastest first, then those that do not fit."""
    rejected: list[Rejected] = field(default_factory=list)
    evaluated: int = 0
    """Candidates whose memory and time were estimated."""
    notes: list[str] = field(default_factory=list)
    """Why the plan has the context and expert parallelism it has, in words (one line each)."""


_SIMPLICITY = {s: i for i, s in enumerate(STRATEGIES)}


def _simplicity(priced: Estimate) -> tuple:
    choice = priced.choice
    # A pipeline is the bigger step away from plain data parallelism: among near ties, fewer stages
    # first; and reducing once per step (less traffic) before reducing every micro-step.
    return (choice.mesh.pp, choice.virtual, _SIMPLICITY[choice.strategy], choice.mesh.tp,
            RECOMPUTES.index(choice.recompute), choice.cp_attention != CpAttention.allgather_kv,
            choice.compression != Compression.none, -choice.micro_batch, choice.accum_sync == AccumSync.per_micro_step)


def asks_for_ddp_hooks(cons: Constraints) -> bool:
    """A forced hierarchical all-reduce or PowerSGD: DDP comm hooks, which a pipeline's FSDP2
    stages do not run, so `auto` searches no pipeline for them."""
    return cons.algorithm == SyncAlgorithm.hierarchical or cons.compression == Compression.powersgd


def pipeline_degrees(world: int, g: int, layers: int, cons: Constraints, splittable: bool = True) -> list[int]:
    """Pipeline degrees worth searching: the forced one; else 1 and, on more than one node, every
    degree whose stages fill whole nodes (the pipeline crosses the network, tensor and data
    parallelism keep the node's fast links) and divides the blocks (equal stages, as Narayanan
    et al. 2021 run them; uneven splits would only add cases the search must price)."""
    if cons.pp:
        return [cons.pp]
    if not splittable:
        return [1]  # the model names no ends to cut a pipeline at
    if asks_for_ddp_hooks(cons):
        return [1]
    return [1] + [p for p in divisors(world) if 1 < p <= layers and layers % p == 0 and (world // p) % g == 0
                  and world // p >= g and world > g]


CP_FROM_TOKENS = 8192
"""`parallel.cp=auto` searches context parallelism from this sequence length (Megatron-Core's
guide uses it from 8K tokens); below it a sequence's activations are small beside the model's."""


def context_degrees(world: int, tp: int, seq: int, cons: Constraints, g: int = 1,
                    across_islands: bool = False) -> list[int]:
    """Context-parallel degrees worth searching over a stage of `world` ranks at `tp`: the forced
    one; else 1 and, from `CP_FROM_TOKENS`, every divisor of the ranks tp leaves that keeps a
    cp group inside one NVLink island of `g` devices, or any (`across_islands`, searched only
    where none of those fits). The pruning rules say which the sequence cannot split into."""
    if cons.cp:
        return [cons.cp]
    if seq < CP_FROM_TOKENS or world % tp:
        return [1]
    return [cp for cp in divisors(world // tp) if across_islands or cp * tp <= g]


def expert_degrees(mesh: Mesh, experts: int, cons: Constraints, g: int = 1, across_islands: bool = False) -> list[int]:
    """Expert-parallel degrees of a mesh: 1 for a dense model (`experts` 0); the forced one;
    else every divisor of the dp_shard x cp x tp ranks ep borrows that keeps an expert group
    inside one NVLink island of `g` devices, or any (`across_islands`, searched only where none
    of those fits). ep=1 is the FSDP-only experts alternative."""
    if not experts:
        return [1]
    if cons.ep:
        return [cons.ep]
    return [ep for ep in divisors(mesh.borrowable) if across_islands or ep <= g]


def meshes_of(strategy: Strategy, world: int, g: int, n_head: int, cons: Constraints,
            layers: int = 1, splittable: bool = True, seq: int = 1, experts: int = 0,
            across_islands: bool = False) -> list[tuple[Mesh, str]]:
    """(mesh, why it cannot be used or '') for every mesh of a strategy: the dense factorisation
    pp x dp_replicate x dp_shard x cp x tp, and for a model with `experts` routed experts the
    second one, ep over dp_shard x cp x tp."""
    out = []
    for pp in pipeline_degrees(world, g, layers, cons, splittable):
        if world % pp:
            out.append((Mesh(world, 1, 1, pp=pp), f"parallel.pp={pp} does not divide the {world} ranks"))
            continue
        for m, bad in _stage_meshes(strategy, world // pp, g, n_head, cons, seq, experts > 0, across_islands):
            mesh = Mesh(m.dp_replicate, m.dp_shard, m.tp, pp=pp, cp=m.cp)
            for ep in expert_degrees(mesh, experts, cons, g, across_islands):
                if mesh.borrowable % ep:
                    out.append((mesh, bad or f"parallel.ep={ep} does not divide the {mesh.borrowable} ranks of "
                                             f"dp_shard x cp x tp it borrows"))
                else:
                    out.append((replace(mesh, ep=ep), bad))
    return out


def _stage_meshes(strategy: Strategy, world: int, g: int, n_head: int, cons: Constraints, seq: int = 1,
                  experts: bool = False, across_islands: bool = False) -> list[tuple[Mesh, str]]:
    """(mesh, why it cannot be used or '') of the data-, context- and tensor-parallel axes over
    `world` ranks."""
    tps = [cons.tp] if cons.tp else [t for t in divisors(g) if n_head % t == 0]
    out = []
    for tp in tps:
        for cp in context_degrees(world, tp, seq, cons, g, across_islands):
            out += _data_meshes(strategy, world, tp, cp, cons, experts)
    return out


def _data_meshes(strategy: Strategy, world: int, tp: int, cp: int, cons: Constraints,
                 experts: bool) -> list[tuple[Mesh, str]]:
    """(mesh, why it cannot be used or '') of the data-parallel axes at one tp and cp."""
    out: list[tuple[Mesh, str]] = []
    if world % (tp * cp):
        what = f"tp={tp}" if cp == 1 else f"tp x cp = {tp} x {cp}"
        return [(Mesh(world, 1, tp), f"{what} does not divide the {world} ranks")]
    if (cp > 1 or experts) and strategy in (Strategy.ddp, Strategy.zero1):
        if cons.strategy is None:
            return []  # zero2, zero3 and hsdp stand for them
        what = f"parallel.cp={cp}" if cp > 1 else "a Mixture of Experts"
        return [(Mesh(world // (tp * cp), 1, tp, cp=cp),
                 f"{what} runs with FSDP2 (zero2, zero3 or hsdp), which shards over dp_shard x cp and the "
                 f"experts over efsdp; {strategy} does not")]
    d = world // (tp * cp)
    if strategy == Strategy.ddp:
        mesh = Mesh(d, 1, tp, cp=cp)
        bad = f"strategy ddp does not shard (dp_shard=1), got parallel.dp_shard={cons.dp_shard}" \
            if cons.dp_shard not in (None, 1) else ""
        out.append((mesh, bad))
    elif strategy in (Strategy.zero1, Strategy.zero2, Strategy.zero3):
        if d == 1 and cons.strategy is None and cp == 1 and not experts:
            return out  # one data-parallel rank: the same plan as ddp
        if strategy == Strategy.zero1 and wrapping_of(strategy, tp) != strategy and cons.strategy is None:
            return out  # it runs as zero2 (see resolve): offer zero2 by its name
        mesh = Mesh(1, d, tp, cp=cp)
        bad = (f"strategy {strategy} shards over all {d} data-parallel ranks, "
               f"got parallel.dp_shard={cons.dp_shard}; use parallel.strategy=hsdp to shard over fewer"
               ) if cons.dp_shard not in (None, d) else ""
        out.append((mesh, bad))
    else:
        shards = [cons.dp_shard] if cons.dp_shard else [s for s in divisors(d) if 1 < s < d]
        if not shards and cons.strategy == Strategy.hsdp:
            out.append((Mesh(d, 1, tp, cp=cp),
                        f"hsdp needs a shard group between 1 and the {d} data-parallel ranks"))
        for s in shards:
            if d % s:
                out.append((Mesh(d, 1, tp, cp=cp),
                            f"parallel.dp_shard={s} does not divide the {d} data-parallel ranks"))
            else:
                out.append((Mesh(d // s, s, tp, cp=cp), ""))
    return out


def _compressions(strategy: Strategy, tp: int, ctx: JobContext) -> list[Compression]:
    """Lossy gradient compressions worth trying: 16-bit (the autocast dtype, bf16 for fp32 runs)
    only when gradients travel in fp32; PowerSGD is a DDP comm hook, so only where DDP reduces
    the gradients (ddp and zero1 as `resolve` runs them)."""
    out = [Compression(ctx.layout.half or "bf16")] if ctx.layout.grads > 2 else []
    if wrapping_of(strategy, tp) in (Strategy.ddp, Strategy.zero1):
        out.append(Compression.powersgd)
    return out


def accum_syncs(strategy: Strategy, mesh: Mesh, accum: int, cons: Constraints) -> tuple[AccumSync, ...]:
    """The accumulation syncs to price for a candidate: both where FSDP2 reduces without a
    pipeline over several micro-steps (ZeRO's sharded gradients and traffic x accum, or
    unsharded gradients and one reduction); `last_micro_step` where that is all that runs (DDP
    and ZeRO-1 keep whole gradients anyway, torch's pipeline stages sync on the last
    micro-batch) or one micro-step makes it moot; a forced one as forced (`resolve` notes where
    it cannot run)."""
    if accum <= 1:
        return (AccumSync.last_micro_step,)
    if cons.accum_sync is not None:
        return (cons.accum_sync,)
    if mesh.pp > 1 or wrapping_of(strategy, mesh.tp) in (Strategy.ddp, Strategy.zero1):
        return (AccumSync.last_micro_step,)
    return (AccumSync.last_micro_step, AccumSync.per_micro_step)


def _fastest(estimates: list[Estimate]) -> Estimate:
    best_s = min(priced.total_s for priced in estimates)
    near = [priced for priced in estimates if priced.total_s <= best_s * (1 + NEAR_TIE)]
    return min(near, key=lambda priced: (_simplicity(priced), priced.total_s))


@dataclass(frozen=True)
class MeshCandidate:
    """A strategy on a mesh: the unit the search prices, keeps the best choice of and compares."""

    strategy: Strategy
    mesh: Mesh
    unusable: str = ""
    """Why the mesh cannot be used at all under the constraints ('' where it can)."""


@dataclass
class SearchSpace:
    """What the pruning rules and the per-mesh search read: the job, its constraints, the
    cluster's wirings, and each mesh's layout once it is computed."""

    ctx: JobContext
    constraints: Constraints
    wirings: Wirings
    layouts: dict[Mesh, ClusterLayout] = field(default_factory=dict)
    """Layouts computed so far, by mesh (one per mesh, whatever the strategy)."""
    evaluated: int = 0
    """Candidates whose memory and time were estimated so far (a mesh that turns out not to
    run at all counts those it priced before)."""
    across_islands: bool = False
    """Whether `parallel.cp=auto` and `parallel.ep=auto` may put a group across NVLink islands
    (searched only where no plan with the groups inside one fits)."""

    @property
    def devices_per_node(self) -> int:
        return self.wirings.devices_per_node

    @property
    def experts(self) -> int:
        """Routed experts per MoE layer of the model (0 for a dense one)."""
        spec = self.ctx.shape.spec
        return spec.experts.experts if spec is not None and spec.experts is not None else 0

    def layout(self, mesh: Mesh) -> ClusterLayout:
        """`mesh` laid out on the cluster; ValueError where it cannot be."""
        if mesh not in self.layouts:
            self.layouts[mesh] = cluster_layout(self.wirings, mesh, routes_experts=self.experts > 0)
        return self.layouts[mesh]

    def per_rank(self, mesh: Mesh) -> int:
        """Sequences per data-parallel rank and step."""
        return self.ctx.global_batch // mesh.dp


def mesh_candidates(space: SearchSpace, n_head: int) -> list[MeshCandidate]:
    """Every (strategy, mesh) the constraints allow, those without a pipeline first: the
    fastest of them bounds the pipelined ones."""
    ctx, constraints = space.ctx, space.constraints
    world = space.devices_per_node * len(space.wirings.node_index)
    strategies = [constraints.strategy] if constraints.strategy else list(STRATEGIES)
    splittable = ctx.shape.spec is None or ctx.shape.spec.pipeline_ends
    candidates = [MeshCandidate(strategy, mesh, unusable) for strategy in strategies
                  for mesh, unusable in meshes_of(strategy, world, space.devices_per_node, n_head, constraints,
                                                  ctx.shape.layers, splittable, ctx.shape.seq, space.experts,
                                                  space.across_islands)]
    return sorted(candidates, key=lambda candidate: candidate.mesh.pp)


# Pruning rules, in the order they are asked. Each returns why a candidate goes no further, or
# None. A REPORTED rule's reason reaches the plan's alternatives (`Rejected`); a silent one drops
# a candidate another one already stands for, or one that cannot win.


def mesh_unusable(space: SearchSpace, candidate: MeshCandidate, fastest_s: float) -> str | None:
    return candidate.unusable or None


def pipeline_adds_nothing(space: SearchSpace, candidate: MeshCandidate, fastest_s: float) -> str | None:
    if candidate.mesh.pp > 1 and space.constraints.strategy is None \
            and candidate.strategy in (Strategy.zero1, Strategy.zero3):
        return "with a pipeline zero3 runs as zero2 (see resolve), and zero1 adds nothing to it"
    return None


def pipeline_shards_across_nodes(space: SearchSpace, candidate: MeshCandidate, fastest_s: float) -> str | None:
    mesh = candidate.mesh
    if mesh.pp > 1 and candidate.strategy == Strategy.hsdp and space.constraints.dp_shard is None \
            and mesh.dp_shard * mesh.cp != space.devices_per_node // mesh.tp:
        return "a pipeline's HSDP shards inside a node; larger groups are zero2's territory"
    return None


def pipeline_cannot_win(space: SearchSpace, candidate: MeshCandidate, fastest_s: float) -> str | None:
    ctx, mesh = space.ctx, candidate.mesh
    if mesh.pp > 1 and ctx.global_batch % mesh.dp == 0 and min(
            compute_floor(ctx, mesh, micro_batch) for micro_batch in divisors(space.per_rank(mesh))) \
            > fastest_s * (1 + NEAR_TIE):
        return "its matmuls and bubble alone, at their best, take longer than a plan already found"
    return None


def sequence_does_not_split(space: SearchSpace, candidate: MeshCandidate, fastest_s: float) -> str | None:
    problem = sequence_split_problem(candidate.mesh.cp, space.ctx.shape.seq)
    return f"sequence does not split: {problem}" if problem else None


def experts_do_not_divide(space: SearchSpace, candidate: MeshCandidate, fastest_s: float) -> str | None:
    ep, experts = candidate.mesh.ep, space.experts
    if experts and experts % ep:
        return f"ep does not divide the experts: ep={ep}, {experts} routed experts per MoE layer"
    return None


def batch_does_not_divide(space: SearchSpace, candidate: MeshCandidate, fastest_s: float) -> str | None:
    dp, batch = candidate.mesh.dp, space.ctx.global_batch
    if batch % dp:
        return f"train.global_batch_size={batch} is not a multiple of the data-parallel size {dp}"
    return None


def cannot_lay_out(space: SearchSpace, candidate: MeshCandidate, fastest_s: float) -> str | None:
    try:
        space.layout(candidate.mesh)
    except ValueError as error:
        return str(error)
    return None


def micro_batch_does_not_divide(space: SearchSpace, candidate: MeshCandidate, fastest_s: float) -> str | None:
    micro_batch, per_rank = space.constraints.micro_batch, space.per_rank(candidate.mesh)
    if micro_batch is not None and per_rank % micro_batch:
        allowed = ", ".join(map(str, divisors(per_rank)))
        return (f"train.micro_batch_size={micro_batch} does not divide the {per_rank} sequences per "
                f"data-parallel rank (train.global_batch_size={space.ctx.global_batch} / {candidate.mesh.dp}); "
                f"allowed: {allowed}")
    return None


def pp_microbatches_do_not_divide(space: SearchSpace, candidate: MeshCandidate, fastest_s: float) -> str | None:
    microbatches, per_rank = space.constraints.pp_microbatches, space.per_rank(candidate.mesh)
    if microbatches and per_rank % microbatches:
        return (f"parallel.pp_microbatches={microbatches} does not divide the {per_rank} sequences per "
                "data-parallel rank")
    return None


PRUNING_RULES = ((mesh_unusable, True), (sequence_does_not_split, True), (experts_do_not_divide, True),
                 (pipeline_adds_nothing, False), (pipeline_shards_across_nodes, False),
                 (pipeline_cannot_win, False), (batch_does_not_divide, True), (cannot_lay_out, True),
                 (micro_batch_does_not_divide, True), (pp_microbatches_do_not_divide, True))
"""(rule, whether its reason is reported), in the order they are asked."""


def pruned(space: SearchSpace, candidate: MeshCandidate, fastest_s: float) -> tuple[str, bool] | None:
    """The first rule's reason to go no further with `candidate`, and whether it is reported."""
    for rule, reported in PRUNING_RULES:
        reason = rule(space, candidate, fastest_s)
        if reason is not None:
            return reason, reported
    return None


def micro_batches(space: SearchSpace, mesh: Mesh) -> list[int]:
    """The micro-batch sizes worth pricing on `mesh`: the forced one, else every divisor of a
    rank's sequences; those giving the forced number of pipeline micro-batches; with a pipeline
    (but GPipe's, whose bubble does not shrink so) at least as many micro-batches as stages."""
    constraints, per_rank = space.constraints, space.per_rank(mesh)
    sizes = [constraints.micro_batch] if constraints.micro_batch else divisors(per_rank)
    if constraints.pp_microbatches:
        sizes = [size for size in sizes if per_rank // size == constraints.pp_microbatches]
    if mesh.pp > 1 and not constraints.pp_microbatches and constraints.pp_schedule != PipelineSchedule.gpipe:
        sizes = [size for size in sizes if per_rank // size >= mesh.pp] or sizes
    return sizes


def choices_for(space: SearchSpace, candidate: MeshCandidate, micro_batch: int, recompute: Recompute) -> list[Choice]:
    """Every schedule and accumulation sync of one micro-batch size and recomputation."""
    constraints, mesh = space.constraints, candidate.mesh
    micro_steps, layers = space.per_rank(mesh) // micro_batch, space.ctx.shape.layers
    return [Choice(candidate.strategy, mesh, micro_batch, recompute, constraints.compression or Compression.none,
                   constraints.algorithm, constraints.bucket_mb, schedule, virtual, accum_sync, attention)
            for schedule, virtual in schedules_for(mesh.pp, micro_steps, constraints.pp_schedule, layers)
            for accum_sync in accum_syncs(candidate.strategy, mesh, micro_steps, constraints)
            for attention in cp_attentions(space.ctx, mesh, constraints)]


def cp_attentions(ctx: JobContext, mesh: Mesh, constraints: Constraints) -> list[CpAttention]:
    """The context-parallel attentions worth pricing on `mesh`: the forced one, else the K/V
    all-gather and, where the rank's heads (after tp) divide by cp, the head all-to-all; the
    all-gather alone (unused) at cp=1. Unsupported where a forced Ulysses cannot split the heads."""
    if mesh.cp == 1:
        return [CpAttention.allgather_kv]
    problem = mesh_ulysses_problem(ctx, mesh)
    if constraints.cp_attention == CpAttention.ulysses and problem:
        raise Unsupported(problem)
    if constraints.cp_attention:
        return [constraints.cp_attention]
    return [CpAttention.allgather_kv] + ([CpAttention.ulysses] if problem is None else [])


@dataclass
class MeshBest:
    """The best estimate of one (strategy, mesh): the fastest that fits, else the smallest."""

    estimate: Estimate
    fits: bool
    layout: ClusterLayout
    fastest_fitting_s: float = math.inf
    """The fastest fitting estimate's step (before compression is tried)."""


def best_on_mesh(space: SearchSpace, candidate: MeshCandidate, fastest_s: float) -> MeshBest | None:
    """The best choice of `candidate` (None where none was estimated); Unsupported where it
    cannot run at all."""
    ctx, mesh, layout = space.ctx, candidate.mesh, space.layout(candidate.mesh)
    recomputes = [space.constraints.recompute] if space.constraints.recompute else list(RECOMPUTES)
    fitting, closest = [], None
    fitted: set[int] = set()
    for recompute in recomputes:
        for micro_batch in micro_batches(space, mesh):
            if mesh.pp > 1 and (micro_batch in fitted
                                or compute_floor(ctx, mesh, micro_batch, recompute) > fastest_s * (1 + NEAR_TIE)):
                continue  # less recomputation already fits (and is faster), or it cannot win
            for choice in choices_for(space, candidate, micro_batch, recompute):
                priced = estimate(ctx, layout, choice)
                space.evaluated += 1
                if priced.fits(ctx.usable_bytes):
                    fitting.append(priced)
                    fitted.add(micro_batch)
                elif closest is None or priced.memory.total < closest.memory.total:
                    closest = priced
    if not fitting:
        return None if closest is None else MeshBest(closest, False, layout)
    best = with_compression(space, candidate, _fastest(fitting))
    return MeshBest(best, True, layout, min(e.total_s for e in fitting))


def with_compression(space: SearchSpace, candidate: MeshCandidate, best: Estimate) -> Estimate:
    """`best`, or a lossy-compressed variant of it that fits and is faster, where compression
    is allowed and left to the search and `best` is bound by its communication."""
    ctx, constraints = space.ctx, space.constraints
    if not (constraints.compression is None and ctx.on_gpu and constraints.allow_compression
            and best.exposed_comm_s > COMM_BOUND_FRACTION * best.compute_s):
        return best
    layout = space.layout(candidate.mesh)
    tries = [estimate(ctx, layout, replace(best.choice, compression=compression))
             for compression in _compressions(candidate.strategy, candidate.mesh.tp, ctx)]
    space.evaluated += len(tries)
    return min([best] + [variant for variant in tries if variant.fits(ctx.usable_bytes)],
               key=lambda priced: priced.total_s)


def search(ctx: JobContext, wirings: Wirings, cons: Constraints, n_head: int) -> SearchResult:
    """Best plan under the constraints (best=None when no candidate could be estimated).
    Context- and expert-parallel groups go inside an NVLink island first: groups across
    islands are searched only where no plan keeps them inside one and fits."""
    result = _search(SearchSpace(ctx, cons, wirings), n_head)
    spec = ctx.shape.spec
    searched_cp = cons.cp is None and ctx.shape.seq >= CP_FROM_TOKENS
    searched_ep = cons.ep is None and spec is not None and spec.experts is not None
    if result.fits or not (searched_cp or searched_ep):
        return result
    wider = _search(SearchSpace(ctx, cons, wirings, across_islands=True), n_head)
    g = wirings.devices_per_node
    if not wider.fits or wider.best is None:
        return result
    mesh = wider.best.choice.mesh
    axes = [axis for axis, size in (("cp", mesh.cp * mesh.tp), ("ep", mesh.ep)) if size > g]
    if not axes:
        return result
    frugal = f" (the most frugal needs {result.best.memory.total / 1e9:.2f} GB per rank)" if result.best else ""
    wider.notes.insert(0, f"{' and '.join(axes)} across NVLink islands: no plan with its groups inside one island of "
                          f"{g} devices fits{frugal}")
    return wider


def _search(space: SearchSpace, n_head: int) -> SearchResult:
    """The search over one space of candidates."""
    per_mesh: list[MeshBest] = []
    rejected: list[Rejected] = []
    fastest_s = math.inf
    for candidate in mesh_candidates(space, n_head):
        reason = pruned(space, candidate, fastest_s)
        if reason is not None:
            if reason[1]:
                rejected.append(Rejected(candidate.strategy, candidate.mesh, reason[0]))
            continue
        try:
            best = best_on_mesh(space, candidate, fastest_s)
        except Unsupported as error:
            rejected.append(Rejected(candidate.strategy, candidate.mesh, str(error)))
            continue
        if best is not None:
            per_mesh.append(best)
            fastest_s = min(fastest_s, best.fastest_fitting_s)
    result = _result(per_mesh, rejected, space.evaluated)
    result.notes += axis_notes(space, per_mesh, result)
    return result


def axis_notes(space: SearchSpace, per_mesh: list[MeshBest], result: SearchResult) -> list[str]:
    """Why the chosen plan has its context and expert parallelism: whether the sequence does not
    fit without cp or cp is faster, and whether expert parallelism or the FSDP-only experts
    (ep=1) are faster; against the best plan of the other kind (none where the search had none)."""
    best = result.best
    if best is None or not result.fits:
        return []
    notes = []
    mesh = best.choice.mesh
    if space.ctx.shape.seq >= CP_FROM_TOKENS and space.constraints.cp is None:
        other = [b for b in per_mesh if (b.estimate.choice.mesh.cp > 1) != (mesh.cp > 1)]
        notes.append(_versus("context parallelism", f"cp={mesh.cp}" if mesh.cp > 1 else "none (cp=1)",
                             "cp=1" if mesh.cp > 1 else "cp>1", best, other, mesh.cp > 1))
    if mesh.cp > 1:
        notes.append(cp_attention_note(space, best))
    if space.experts and space.constraints.ep is None:
        other = [b for b in per_mesh if (b.estimate.choice.mesh.ep > 1) != (mesh.ep > 1)]
        notes.append(_versus("experts", f"ep={mesh.ep}" if mesh.ep > 1 else "FSDP-only (ep=1)",
                             "FSDP-only experts (ep=1)" if mesh.ep > 1 else "ep>1", best, other, mesh.ep > 1))
    return notes


def mesh_ulysses_problem(ctx: JobContext, mesh: Mesh) -> str | None:
    """Why Ulysses cannot split the model's heads on `mesh` (a rank's heads after tp), or None."""
    kv, _ = kv_heads_and_width(ctx.shape)
    return ulysses_problem(ctx.shape.heads // mesh.tp, max(1, kv // mesh.tp), mesh.cp)


def cp_attention_note(space: SearchSpace, best: Estimate) -> str:
    """One line: the chosen plan's context-parallel attention against the other on the same
    plan, each with the seconds per step its traffic costs; or why the other cannot run."""
    choice = best.choice
    chosen = choice.cp_attention
    if space.constraints.cp_attention:
        return f"context-parallel attention: {chosen} (parallel.cp_attention={chosen}; {_cp_cost(best)})"
    others = [a for a in cp_attentions(space.ctx, choice.mesh, space.constraints) if a != chosen]
    if not others:
        return f"context-parallel attention: {chosen}, as {mesh_ulysses_problem(space.ctx, choice.mesh)}"
    rival = estimate(space.ctx, space.layout(choice.mesh), replace(choice, cp_attention=others[0]))
    space.evaluated += 1
    if not rival.fits(space.ctx.usable_bytes):
        return (f"context-parallel attention: {chosen} ({_cp_cost(best)}); {rival.choice.cp_attention} needs "
                f"{rival.memory.total / 1e9:.2f} GB per rank and does not fit")
    if rival.total_s < best.total_s:
        return (f"context-parallel attention: {chosen} ({_cp_cost(best)}) over {rival.choice.cp_attention} "
                f"({_cp_cost(rival)}), as simpler: their steps are within {NEAR_TIE:.0%}")
    return (f"context-parallel attention: {chosen} ({_cp_cost(best)}), faster than {rival.choice.cp_attention} "
            f"({_cp_cost(rival)}) on the cp group's links")


def _cp_cost(priced: Estimate) -> str:
    """The seconds per step a plan's context-parallel attention traffic costs, in words."""
    spent = sum(seconds for name, seconds in priced.comm_parts.items() if name.startswith("cp "))
    return f"{spent * 1e3:.1f} ms per step"


def _versus(what: str, chosen: str, other_kind: str, best: Estimate, others: list[MeshBest],
            chosen_has_it: bool) -> str:
    """One line: `chosen` against the best plan of `other_kind`: it is faster by so much, or
    nothing fits without it (`chosen_has_it`), or no plan with it fits."""
    fitting = [b for b in others if b.fits]
    if fitting:
        rival = min(fitting, key=lambda b: b.estimate.total_s).estimate
        pct = (rival.total_s / best.total_s - 1) * 100 if best.total_s > 0 else 0.0
        return (f"{what}: {chosen}, faster: the best {other_kind} plan ({rival.choice.strategy} on "
                f"{rival.choice.mesh}) is slower by {pct:.1f}%")
    if others:
        frugal = min(others, key=lambda b: b.estimate.memory.total).estimate
        why = "because nothing fits without it" if chosen_has_it else f"as no {other_kind} plan fits"
        return (f"{what}: {chosen}, {why}: the most frugal {other_kind} plan needs "
                f"{frugal.memory.total / 1e9:.2f} GB per rank")
    return f"{what}: {chosen}; no {other_kind} plan was priced"


def _result(per_mesh: list[MeshBest], rejected: list[Rejected], evaluated: int) -> SearchResult:
    """The fastest fitting mesh's best (the most frugal one where none fits), beside the others."""
    if not per_mesh:
        return SearchResult(best=None, layout=None, fits=False, rejected=rejected, evaluated=evaluated)
    fitting = [best for best in per_mesh if best.fits]
    if fitting:
        fastest = _fastest([best.estimate for best in fitting])
        chosen = next(best for best in fitting if best.estimate is fastest)
    else:
        chosen = min(per_mesh, key=lambda best: best.estimate.memory.total)
    others = [best for best in per_mesh if best is not chosen]
    others.sort(key=lambda best: (not best.fits, best.estimate.total_s if best.fits else best.estimate.memory.total))
    return SearchResult(best=chosen.estimate, layout=chosen.layout, fits=chosen.fits,
                        runners_up=[best.estimate for best in others], rejected=rejected, evaluated=evaluated)
