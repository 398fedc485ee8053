"""Search: enumerate strategy x mesh x micro-batch x recomputation, drop what does not fit,
rank the rest by predicted step time.

Fixed choices in the job's config narrow each dimension; `auto` leaves it open. The search
enumerates divisors, never permutations: the layout of a mesh on identical nodes is computed
once per distinct node wiring (`layout.py`), so a thousand-node cluster costs what one does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ..choices import AccumSync, Compression, PipelineSchedule, Recompute, Strategy, SyncAlgorithm
from ..config import JobConfig
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
        )

    def forced(self) -> list[str]:
        """The config keys this search was narrowed by, as `key=value`."""
        keys = (("parallel.strategy", self.strategy), ("parallel.tp", self.tp), ("parallel.dp_shard", self.dp_shard),
                ("train.micro_batch_size", self.micro_batch), ("parallel.recompute", self.recompute),
                ("parallel.compression", self.compression),
                ("parallel.sync", None if self.algorithm == "auto" else self.algorithm), ("parallel.pp", self.pp),
                ("parallel.pp_schedule", self.pp_schedule), ("parallel.pp_microbatches", self.pp_microbatches),
                ("parallel.accum_sync", self.accum_sync))
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


_SIMPLICITY = {s: i for i, s in enumerate(STRATEGIES)}


def _simplicity(e: Estimate) -> tuple:
    c = e.choice
    # A pipeline is the bigger step away from plain data parallelism: among near ties, fewer stages
    # first; and reducing once per step (less traffic) before reducing every micro-step.
    return (c.mesh.pp, c.virtual, _SIMPLICITY[c.strategy], c.mesh.tp, RECOMPUTES.index(c.recompute),
            c.compression != Compression.none, -c.micro_batch, c.accum_sync == AccumSync.per_micro_step)


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


def _meshes(strategy: Strategy, world: int, g: int, n_head: int, cons: Constraints,
            layers: int = 1, splittable: bool = True) -> list[tuple[Mesh, str]]:
    """(mesh, why it cannot be used or '') for every mesh of a strategy."""
    out = []
    for pp in pipeline_degrees(world, g, layers, cons, splittable):
        if world % pp:
            out.append((Mesh(world, 1, 1, pp=pp), f"parallel.pp={pp} does not divide the {world} ranks"))
            continue
        out += [(Mesh(m.dp_replicate, m.dp_shard, m.tp, pp=pp), bad)
                for m, bad in _stage_meshes(strategy, world // pp, g, n_head, cons)]
    return out


def _stage_meshes(strategy: Strategy, world: int, g: int, n_head: int, cons: Constraints) -> list[tuple[Mesh, str]]:
    """(mesh, why it cannot be used or '') of the data- and tensor-parallel axes over `world` ranks."""
    tps = [cons.tp] if cons.tp else [t for t in divisors(g) if n_head % t == 0]
    out = []
    for tp in tps:
        if world % tp:
            out.append((Mesh(world, 1, tp), f"tp={tp} does not divide the {world} ranks"))
            continue
        d = world // tp
        if strategy == Strategy.ddp:
            mesh = Mesh(d, 1, tp)
            bad = f"strategy ddp does not shard (dp_shard=1), got parallel.dp_shard={cons.dp_shard}" \
                if cons.dp_shard not in (None, 1) else ""
            out.append((mesh, bad))
        elif strategy in (Strategy.zero1, Strategy.zero2, Strategy.zero3):
            if d == 1 and cons.strategy is None:
                continue  # one data-parallel rank: the same plan as ddp
            if strategy == Strategy.zero1 and wrapping_of(strategy, tp) != strategy and cons.strategy is None:
                continue  # it runs as zero2 (see resolve): offer zero2 by its name
            mesh = Mesh(1, d, tp)
            bad = (f"strategy {strategy} shards over all {d} data-parallel ranks, "
                   f"got parallel.dp_shard={cons.dp_shard}; use parallel.strategy=hsdp to shard over fewer"
                   ) if cons.dp_shard not in (None, d) else ""
            out.append((mesh, bad))
        else:
            shards = [cons.dp_shard] if cons.dp_shard else [s for s in divisors(d) if 1 < s < d]
            if not shards and cons.strategy == Strategy.hsdp:
                out.append((Mesh(d, 1, tp), f"hsdp needs a shard group between 1 and the {d} data-parallel ranks"))
            for s in shards:
                if d % s:
                    out.append((Mesh(d, 1, tp), f"parallel.dp_shard={s} does not divide the {d} data-parallel ranks"))
                else:
                    out.append((Mesh(d // s, s, tp), ""))
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


def _fastest(cands: list[Estimate]) -> Estimate:
    best_t = min(e.total_s for e in cands)
    near = [e for e in cands if e.total_s <= best_t * (1 + NEAR_TIE)]
    return min(near, key=lambda e: (_simplicity(e), e.total_s))


def search(ctx: JobContext, wirings: Wirings, cons: Constraints, n_head: int) -> SearchResult:
    """Best plan under the constraints (best=None when no candidate could be estimated)."""
    world = wirings.devices_per_node * len(wirings.node_index)
    strategies = [cons.strategy] if cons.strategy else list(STRATEGIES)
    recomputes = [cons.recompute] if cons.recompute else list(RECOMPUTES)
    per_mesh: list[tuple[Estimate, bool, ClusterLayout]] = []
    rejected: list[Rejected] = []
    layouts: dict[Mesh, ClusterLayout] = {}
    evaluated = 0
    fastest = math.inf
    # Every plan without a pipeline first: the fastest of them bounds the pipelined ones.
    cands = [(strategy, mesh, bad) for strategy in strategies
             for mesh, bad in _meshes(strategy, world, wirings.devices_per_node, n_head, cons, ctx.shape.layers,
                                      ctx.shape.spec is None or ctx.shape.spec.pipeline_ends)]
    cands.sort(key=lambda x: x[1].pp)
    for strategy, mesh, bad in cands:
        if bad:
            rejected.append(Rejected(strategy, mesh, bad))
            continue
        if mesh.pp > 1 and cons.strategy is None and strategy in (Strategy.zero1, Strategy.zero3):
            continue  # with a pipeline zero3 runs as zero2 (see resolve), and zero1 adds nothing to it
        if mesh.pp > 1 and strategy == Strategy.hsdp and cons.dp_shard is None \
                and mesh.dp_shard != wirings.devices_per_node // mesh.tp:
            continue  # a pipeline's HSDP shards inside a node; larger groups are zero2's territory
        if mesh.pp > 1 and ctx.global_batch % mesh.dp == 0 and min(
                compute_floor(ctx, mesh, mb) for mb in divisors(ctx.global_batch // mesh.dp)) \
                > fastest * (1 + NEAR_TIE):
            continue  # its matmuls and bubble alone, at their best, take longer than a plan already found
        dp = mesh.dp
        if ctx.global_batch % dp:
            why = f"train.global_batch_size={ctx.global_batch} is not a multiple of the data-parallel size {dp}"
            rejected.append(Rejected(strategy, mesh, why))
            continue
        if mesh not in layouts:
            try:
                layouts[mesh] = cluster_layout(wirings, mesh)
            except ValueError as e:
                rejected.append(Rejected(strategy, mesh, str(e)))
                continue
        cl = layouts[mesh]
        per_rank = ctx.global_batch // dp
        if cons.micro_batch is not None and per_rank % cons.micro_batch:
            ok = ", ".join(map(str, divisors(per_rank)))
            why = (f"train.micro_batch_size={cons.micro_batch} does not divide the {per_rank} sequences per "
                   f"data-parallel rank (train.global_batch_size={ctx.global_batch} / {dp}); allowed: {ok}")
            rejected.append(Rejected(strategy, mesh, why))
            continue
        mbs = [cons.micro_batch] if cons.micro_batch else divisors(per_rank)
        if cons.pp_microbatches:
            if per_rank % cons.pp_microbatches:
                rejected.append(Rejected(strategy, mesh, f"parallel.pp_microbatches={cons.pp_microbatches} does "
                                                         f"not divide the {per_rank} sequences per data-parallel rank"))
                continue
            mbs = [mb for mb in mbs if per_rank // mb == cons.pp_microbatches]
        if mesh.pp > 1 and not cons.pp_microbatches and cons.pp_schedule != PipelineSchedule.gpipe:
            mbs = [mb for mb in mbs if per_rank // mb >= mesh.pp] or mbs
        fitting, closest = [], None
        fitted: set[int] = set()
        try:
            for rc in recomputes:
                for mb in mbs:
                    if mesh.pp > 1 and (mb in fitted or compute_floor(ctx, mesh, mb, rc) > fastest * (1 + NEAR_TIE)):
                        continue  # less recomputation already fits (and is faster), or it cannot win
                    for sched, v in schedules_for(mesh.pp, per_rank // mb, cons.pp_schedule, ctx.shape.layers):
                        for acc in accum_syncs(strategy, mesh, per_rank // mb, cons):
                            ch = Choice(strategy, mesh, mb, rc, cons.compression or Compression.none, cons.algorithm,
                                        cons.bucket_mb, sched, v, acc)
                            e = estimate(ctx, cl, ch)
                            evaluated += 1
                            if e.fits(ctx.usable_bytes):
                                fitting.append(e)
                                fitted.add(mb)
                            elif closest is None or e.memory.total < closest.memory.total:
                                closest = e
        except Unsupported as e:
            rejected.append(Rejected(strategy, mesh, str(e)))
            continue
        if fitting:
            best = _fastest(fitting)
            fastest = min(fastest, min(e.total_s for e in fitting))
            if cons.compression is None and ctx.on_gpu and cons.allow_compression \
                    and best.exposed_comm_s > COMM_BOUND_FRACTION * best.compute_s:
                tries = [estimate(ctx, cl, replace(best.choice, compression=comp))
                         for comp in _compressions(strategy, mesh.tp, ctx)]
                evaluated += len(tries)
                best = min([best] + [t for t in tries if t.fits(ctx.usable_bytes)], key=lambda e: e.total_s)
            per_mesh.append((best, True, cl))
        elif closest is not None:
            per_mesh.append((closest, False, cl))
    if not per_mesh:
        return SearchResult(best=None, layout=None, fits=False, rejected=rejected, evaluated=evaluated)
    fit = [x for x in per_mesh if x[1]]
    if fit:
        best = _fastest([e for e, _, _ in fit])
        chosen = next(x for x in fit if x[0] is best)
    else:
        chosen = min(per_mesh, key=lambda x: x[0].memory.total)
    others = [x for x in per_mesh if x is not chosen]
    others.sort(key=lambda x: (not x[1], x[0].total_s if x[1] else x[0].memory.total))
    return SearchResult(best=chosen[0], layout=chosen[2], fits=chosen[1],
                        runners_up=[e for e, _, _ in others], rejected=rejected, evaluated=evaluated)
