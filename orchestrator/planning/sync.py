"""Gradient-sync choices: bucket size, compression ratio, accumulation.

DDP reduces gradients in buckets while backward still runs; a bucket must be large enough
that the ring's latency is small beside its transfer, and small enough that several buckets
overlap with backward rather than one big reduction waiting at the end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..choices import AccumSync, Compression, SyncAlgorithm
from ..serialize import from_plain, to_plain
from .comm import LAUNCH_S, bus_factor
from .model_math import ModelShape

# torch's PowerSGD hook: matrix_approximation_rank the runtime passes to PowerSGDState.
POWERSGD_RANK = 4
# Latency may be at most this fraction of a bucket's reduction time.
_LATENCY_SHARE = 0.1
# At least this many buckets, so that reduction overlaps with backward.
_MIN_BUCKETS = 4
_BUCKET_MB_RANGE = (1.0, 256.0)
MB = 2**20
# Exposed communication above this fraction of compute makes a step comm-bound.
COMM_BOUND_FRACTION = 0.2


@dataclass(frozen=True)
class SyncPlan:
    """How gradients are synchronised."""

    bucket_mb: float
    """DDP bucket_cap_mb; for the sharded strategies, one block's reduce-scatter in MB."""
    algorithm: SyncAlgorithm
    """`flat` (one ring or tree through every rank) or `hierarchical` (intra, inter, intra)."""
    compression: Compression
    """`none`, `fp16`, `bf16` (DDP comm hook / FSDP reduce_dtype) or `powersgd` (DDP comm hook)."""
    grad_accum_steps: int
    """Micro-steps per optimizer step (`accum_sync` says on which of them gradients are reduced)."""
    overlap: bool = True
    """Whether reduction overlaps with backward (off on CPU, where gloo competes with compute)."""
    accum_sync: AccumSync = AccumSync.last_micro_step
    """`per_micro_step`: FSDP2 reduce-scatters every micro-step and keeps sharded gradients;
    `last_micro_step`: gradients stay whole (DDP, ZeRO-1) or unsharded (FSDP2, pipelines) until
    the last micro-step, which reduces once. With one micro-step the two are the same and the
    plan records `last_micro_step`; so do plans written before the choice existed, which ran so."""

    def to_dict(self) -> dict:
        return to_plain(self)

    @classmethod
    def from_dict(cls, d: dict) -> "SyncPlan":
        return from_plain(cls, d)


def auto_bucket_mb(grad_bytes: float, p: int, bw_gbps: float, lat_us: float) -> float:
    """The smallest power-of-two bucket whose ring latency is at most 10% of its transfer,
    capped so that at least four buckets overlap with backward, within 1..256 MB."""
    lo, hi = _BUCKET_MB_RANGE
    if p <= 1:
        return lo
    alpha = LAUNCH_S + 2 * (p - 1) * lat_us * 1e-6
    need = alpha * (1 - _LATENCY_SHARE) / _LATENCY_SHARE * bw_gbps * 1e9 / bus_factor("all_reduce", p)
    cap = grad_bytes / _MIN_BUCKETS
    size = max(min(need, cap), lo * MB) if math.isfinite(need) else cap
    mb = 2 ** math.ceil(math.log2(max(size / MB, lo)))
    return float(min(max(mb, lo), hi))


def powersgd_ratio(shape: ModelShape, rank: int = POWERSGD_RANK) -> float:
    """Bytes PowerSGD sends over bytes of the full gradient: r(m+n) for an m x n matrix,
    vectors (biases, LayerNorms) in full."""
    h, v, s, l = shape.hidden, shape.vocab, shape.seq, shape.layers
    mats = [(h, h)] * 4 + [(h, 4 * h), (4 * h, h)]
    full = sent = 0.0
    for m, n in mats:
        full += l * m * n
        sent += l * min(m * n, rank * (m + n))
    for m, n in ((v, h), (s, h)):
        full += m * n
        sent += min(m * n, rank * (m + n))
    vectors = l * (13 * h if shape.bias else 2 * h) + 2 * h
    return (sent + vectors) / (full + vectors)


def wire_bytes_per_grad(compression: Compression | str, grad_bytes: int, ratio: float, warmup: float = 0.0) -> float:
    """Bytes per gradient element on the wire under a compression, averaged over the run:
    PowerSGD sends plain gradients for the `warmup` fraction of the steps, then `ratio` of them."""
    compression = Compression(compression)
    if compression == Compression.none:
        return float(grad_bytes)
    if compression in (Compression.fp16, Compression.bf16):
        return float(min(2, grad_bytes))
    if compression == Compression.powersgd:
        w = min(max(warmup, 0.0), 1.0)
        return grad_bytes * (w + (1 - w) * ratio)
    raise ValueError(f"compression must be one of {', '.join(map(str, Compression.concrete()))}, got {compression!r}")
