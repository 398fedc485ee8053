"""Search: enumerate strategy x mesh x micro-batch x recomputation, drop what does not fit,
rank the rest by predicted step time.

Fixed choices in the job's config narrow each dimension; `auto` leaves it open. The search
enumerates divisors, never permutations: the layout of a mesh on identical nodes is computed
once per distinct node wiring (`layout.py`), so a thousand-node cluster costs what one does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..choices import Compression, Recompute, Strategy, SyncAlgorithm
from ..config import JobConfig
from .cost import Choice, Estimate, JobContext, estimate
from .layout import ClusterLayout, Wirings, cluster_layout
from .mesh import Mesh
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
        )

    def forced(self) -> list[str]:
        """The config keys this search was narrowed by, as `key=value`."""
        keys = (("parallel.strategy", self.strategy), ("parallel.tp", self.tp), ("parallel.dp_shard", self.dp_shard),
                ("train.micro_batch_size", self.micro_batch), ("parallel.recompute", self.recompute),
                ("parallel.compression", self.compression),
                ("parallel.sync", None if self.algorithm == "auto" else self.algorithm))
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
    return (_SIMPLICITY[c.strategy], c.mesh.tp, RECOMPUTES.index(c.recompute), c.compression != Compression.none,
            -c.micro_batch)


def _meshes(strategy: Strategy, world: int, g: int, n_head: int, cons: Constraints) -> list[tuple[Mesh, str]]:
    """(mesh, why it cannot be used or '') for every mesh of a strategy."""
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
    for strategy in strategies:
        for mesh, bad in _meshes(strategy, world, wirings.devices_per_node, n_head, cons):
            if bad:
                rejected.append(Rejected(strategy, mesh, bad))
                continue
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
            fitting, closest = [], None
            try:
                for rc in recomputes:
                    for mb in mbs:
                        ch = Choice(strategy, mesh, mb, rc, cons.compression or Compression.none, cons.algorithm,
                                    cons.bucket_mb)
                        e = estimate(ctx, cl, ch)
                        evaluated += 1
                        if e.fits(ctx.usable_bytes):
                            fitting.append(e)
                        elif closest is None or e.memory.total < closest.memory.total:
                            closest = e
            except Unsupported as e:
                rejected.append(Rejected(strategy, mesh, str(e)))
                continue
            if fitting:
                best = _fastest(fitting)
                if cons.compression is None and ctx.on_gpu and cons.allow_compression \
                        and best.exposed_comm_s > COMM_BOUND_FRACTION * best.compute_s:
                    b = best.choice
                    tries = [estimate(ctx, cl, Choice(strategy, mesh, b.micro_batch, b.recompute, comp,
                                                      cons.algorithm, cons.bucket_mb))
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
