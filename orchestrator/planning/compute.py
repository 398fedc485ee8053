"""Compute time of one step: FLOPs / (peak x efficiency), plus the optimizer's memory traffic.

Peak comes from the GPU table (`gpus.py`), or from the device's measured figure when a
measured probe recorded one; a GPU the table does not list is planned with conservative default
figures (`UNLISTED_GPU`), and the plan says so. Efficiency is what fraction of peak the step reaches.

On a GPU it is the block's GEMMs as the device runs them, capped at the 60% a whole step of a
large dense transformer reaches (attention, norms and elementwise work run beside them): each
GEMM is cut into output tiles (cuBLAS's 256x128 or 128x256, whichever wastes less), the tiles
run in waves of one per SM, so a last, partly filled wave or tiles hanging over the matrix's
edge are paid in full; and a GEMM whose FLOPs per byte moved fall below the device's ridge
point (peak over memory bandwidth) runs at the memory's pace. Large GEMMs lose nearly nothing
to either; tensor parallelism and small micro-batches shrink them into the range where they do.

A CPU slot has no tiles or waves to speak of: its efficiency rises with the tokens per
micro-batch and the hidden size per rank along a saturating curve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from ..topology.model import Device
from .gpus import CPU_SLOT, UNLISTED_GPU, GpuSpec, lookup

MAX_EFFICIENCY = 0.6
# Half-saturation points of a CPU slot's efficiency curve: tokens per micro-batch, hidden size
# per rank (a core's vector units fill early).
_CPU_TOKENS_HALF = 64
_CPU_HIDDEN_HALF = 32
# Output tiles of cuBLAS's large bf16 GEMM kernels on A100/H100, rows x columns.
_TILES = ((256, 128), (128, 256))
# AdamW reads and writes every state it touches once per step.
_OPTIMIZER_PASSES = 2


@dataclass(frozen=True)
class DeviceSpeed:
    """What one rank's device computes at."""

    name: str
    """The table entry (or `measured`) the figures come from."""
    peak_tflops: float
    """Peak matmul TFLOP/s at the run's precision."""
    mem_gbps: float
    """Memory bandwidth, GB/s."""
    memory_bytes: int
    """Device memory (the probe's figure over the table's)."""
    sms: int = 0
    """Streaming multiprocessors (0: unknown; GEMMs are then priced without wave quantization)."""
    datasheet_tflops: float = 0.0
    """The datasheet's peak at the run's precision, which MFU is measured against (a measured
    rate prices plans better but would flatter MFU); 0: the same as `peak_tflops` (a device
    planned from its table figure, or a CPU slot, which has no datasheet)."""

    @property
    def mfu_peak_tflops(self) -> float:
        """The peak MFU divides by: the datasheet's, else the planning peak."""
        return self.datasheet_tflops or self.peak_tflops


def device_speed(device: Device, precision: str, fallback_gpu: str | None = None) -> DeviceSpeed:
    """The speed and memory of a device: its table entry (by its name, else `fallback_gpu`), or
    for a GPU the table has no entry for, `UNLISTED_GPU`'s conservative figures (its measured
    matmul rate and memory where the probe has them; `unlisted_note` says which)."""
    if device.kind == "cpu":
        spec: GpuSpec = CPU_SLOT
    else:
        spec = lookup(device.name) or lookup(fallback_gpu) or UNLISTED_GPU
    peak = spec.fp32_tflops if precision == "fp32" and device.kind != "cpu" else spec.peak_tflops
    mem_gbps = spec.mem_gbps
    # A probe that measured the device's matmul rate replaces the table's peak.
    name = spec.name
    datasheet = 0.0
    if device.measured_tflops:
        # A CPU slot's table figure is a placeholder, not a datasheet: its measured rate is its peak.
        datasheet = peak if device.kind != "cpu" and spec is not UNLISTED_GPU else 0.0
        peak, name = float(device.measured_tflops), f"{spec.name} (measured)"
    memory = device.memory_bytes or spec.memory_bytes
    return DeviceSpeed(name, peak, mem_gbps, int(memory), spec.sms, datasheet)


def unlisted_note(device: Device, where: str, fallback_gpu: str | None = None) -> str | None:
    """One line saying how a GPU the table has no entry for was planned; None for a listed one."""
    if device.kind == "cpu" or lookup(device.name) or lookup(fallback_gpu):
        return None
    what = f"GPU {device.name or '(unnamed)'} on {where} is not in the planner's table"
    u = UNLISTED_GPU
    memory = (f"{device.memory_bytes / 1e9:.0f} GB as the probe read it" if device.memory_bytes
              else f"{u.memory_bytes / 1e9:.0f} GB")
    if device.measured_tflops:
        how = (f"planned from its measured matmul rate ({device.measured_tflops:.0f} TFLOP/s), {memory} and an "
               f"assumed {u.mem_gbps:.0f} GB/s memory bandwidth")
    else:
        how = (f"planned with conservative default figures ({u.peak_tflops:.0f} TFLOP/s bf16, {u.fp32_tflops:.0f} "
               f"TFLOP/s fp32, {memory}, {u.mem_gbps:.0f} GB/s)")
    return f"{what}: {how}; set cluster.gpu to a listed model or probe with cluster.measure=true for its own figures"


def efficiency(tokens_per_micro_batch: int, hidden: int, tp: int = 1, speed: DeviceSpeed | None = None,
               on_gpu: bool = True) -> float:
    """Fraction of peak the step's matmuls reach, for micro-batches of `tokens_per_micro_batch`
    through blocks of width `hidden` split `tp` ways (see the module docstring). A GPU needs its
    `speed` (peak, memory bandwidth, SMs)."""
    if tokens_per_micro_batch < 1 or hidden <= 0 or tp < 1:
        raise ValueError("tokens per micro-batch, hidden size and tensor-parallel degree must be positive")
    if not on_gpu:
        tok = tokens_per_micro_batch / (tokens_per_micro_batch + _CPU_TOKENS_HALF)
        per_rank = hidden / tp
        hid = per_rank / (per_rank + _CPU_HIDDEN_HALF)
        return MAX_EFFICIENCY * tok * hid
    if speed is None:
        raise ValueError("a GPU's efficiency needs its speed (peak, memory bandwidth, SMs)")
    return MAX_EFFICIENCY * block_gemm_efficiency(tokens_per_micro_batch, int(hidden), tp, speed.sms,
                                                  speed.peak_tflops / speed.mem_gbps * 1e3)


@lru_cache(maxsize=4096)
def block_gemm_efficiency(tokens: int, hidden: int, tp: int, sms: int, ridge_flop_per_byte: float) -> float:
    """FLOP-weighted efficiency of a transformer block's GEMMs on one tensor-parallel rank: the
    fused qkv and the MLP's first layer split by columns, the attention output and the MLP's
    second layer by rows (Megatron's split), each run forward, for its input's gradient and for
    its weight's gradient (three GEMMs of equal FLOPs, the shapes transposed)."""
    h = hidden
    forward = ((tokens, 3 * h // tp, h), (tokens, h, h // tp), (tokens, 4 * h // tp, h), (tokens, h, 4 * h // tp))
    flops = seconds = 0.0
    for m, n, k in forward:
        for shape in ((m, n, k), (m, k, n), (k, n, m)):
            f = 2.0 * m * n * k
            flops += f
            seconds += f / gemm_efficiency(*shape, sms, ridge_flop_per_byte)
    return flops / seconds


def gemm_efficiency(m: int, n: int, k: int, sms: int, ridge_flop_per_byte: float, value_bytes: int = 2) -> float:
    """Fraction of peak one (m x k) @ (k x n) GEMM reaches: the work in its tiles over the
    work its waves of tiles cost (`sms` of them at once; 0 for no waves), at most what its
    FLOPs per byte allow below the ridge point."""
    if min(m, n, k) < 1:
        raise ValueError(f"GEMM dimensions must be positive, got {m}x{n}x{k}")
    quantized = 0.0
    for tm, tn in _TILES:
        rows, cols = math.ceil(m / tm), math.ceil(n / tn)
        tiles = rows * cols
        slots = math.ceil(tiles / sms) * sms if sms else tiles
        quantized = max(quantized, m * n / (slots * tm * tn))
    intensity = 2.0 * m * n * k / (value_bytes * (m * k + k * n + m * n))
    return quantized * min(1.0, intensity / ridge_flop_per_byte)


# Values each token reads and writes per block in the elementwise work around the GEMMs, on
# one tensor-parallel rank, forward: the two LayerNorms (h in, h out) and residual adds (2h in,
# h out) run on whole rows on every rank; GELU (4h in, 4h out) and the attention output's
# copy back from heads (h in, h out) on the rank's split. Backward reads and writes about twice
# what forward did.
_ELEMENTWISE_WHOLE = 10
_ELEMENTWISE_SPLIT = 10
_BACKWARD_PASSES = 2


def elementwise_seconds(tokens: float, hidden: int, tp: int, blocks: float, recompute: str, value_bytes: int,
                        speed: DeviceSpeed) -> float:
    """Seconds of the memory-bound elementwise work of `tokens` through `blocks` blocks on one
    rank: norms, activations and residual adds move every value through device memory, so they
    cost bytes over bandwidth, a share of the step that falls as 1/hidden (GEMMs grow as
    hidden squared). Full recomputation runs forward's twice."""
    per_token = (_ELEMENTWISE_WHOLE + _ELEMENTWISE_SPLIT / tp) * hidden
    passes = 1 + _BACKWARD_PASSES + (1 if recompute == "full" else 0)
    return tokens * blocks * per_token * passes * value_bytes / (speed.mem_gbps * 1e9)


def matmul_seconds(flops: float, speed: DeviceSpeed, eff: float) -> float:
    """Seconds to run `flops` at `eff` of the device's peak."""
    if eff <= 0:
        raise ValueError(f"efficiency must be > 0, got {eff}")
    return flops / (speed.peak_tflops * 1e12 * eff)


def optimizer_seconds(state_bytes: float, speed: DeviceSpeed) -> float:
    """AdamW's step is memory bound: it streams the rank's weights, gradients and moments."""
    return _OPTIMIZER_PASSES * state_bytes / (speed.mem_gbps * 1e9)


def expert_efficiency(rows_per_expert: float, hidden: int, expert_hidden: int, speed: DeviceSpeed | None = None,
                      on_gpu: bool = True) -> float:
    """Fraction of peak a grouped matmul of routed experts reaches, each expert taking
    `rows_per_expert` rows: its SwiGLU's gate and up projections (rows x 2F x d) and its down
    projection (rows x d x F), each run forward, for its input's gradient and for its weight's
    gradient. Few rows per expert (many experts on one rank, ep=1) make small, memory-bound
    GEMMs; expert parallelism gathers every rank's rows for fewer experts."""
    rows = max(1, int(rows_per_expert))
    if not on_gpu:
        return efficiency(rows, expert_hidden, 1, None, False)
    if speed is None:
        raise ValueError("a GPU's efficiency needs its speed (peak, memory bandwidth, SMs)")
    ridge = speed.peak_tflops / speed.mem_gbps * 1e3
    flops = seconds = 0.0
    for m, n, k in ((rows, 2 * expert_hidden, hidden), (rows, hidden, expert_hidden)):
        for shape in ((m, n, k), (m, k, n), (k, n, m)):
            f = 2.0 * m * n * k
            flops += f
            seconds += f / gemm_efficiency(*shape, speed.sms, ridge)
    return MAX_EFFICIENCY * flops / seconds
