"""Compute time of one step: FLOPs / (peak x efficiency), plus the optimizer's memory traffic.

Peak comes from the GPU table (`gpus.py`), or from the device's measured figure when a
measured probe recorded one. Efficiency is what fraction of peak the matmuls reach: it rises
with the tokens per micro-batch and the per-rank hidden size (small GEMMs leave tensor cores
idle) towards the 60% large dense transformers reach on current GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..topology.model import Device
from .gpus import CPU_SLOT, GpuSpec, lookup

MAX_EFFICIENCY = 0.6
# Half-saturation points of the efficiency curve: tokens per micro-batch, hidden size per rank.
# A GPU needs thousands of rows to fill its tensor cores; a CPU core's vector units fill early.
_TOKENS_HALF = {True: 512, False: 64}
_HIDDEN_HALF = {True: 256, False: 32}
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


def device_speed(device: Device, precision: str, fallback_gpu: str | None = None) -> DeviceSpeed | None:
    """The speed and memory of a device; None when neither its name nor `fallback_gpu` is in the table."""
    if device.kind == "cpu":
        spec: GpuSpec | None = CPU_SLOT
    else:
        spec = lookup(device.name) or lookup(fallback_gpu)
    if spec is None:
        return None
    peak = spec.fp32_tflops if precision == "fp32" and device.kind != "cpu" else spec.peak_tflops
    mem_gbps = spec.mem_gbps
    # A probe that measured the device's matmul rate replaces the table's peak.
    name = spec.name
    if device.measured_tflops:
        peak, name = float(device.measured_tflops), f"{spec.name} (measured)"
    memory = device.memory_bytes or spec.memory_bytes
    return DeviceSpeed(name, peak, mem_gbps, int(memory))


def efficiency(tokens_per_micro_batch: int, hidden_per_rank: float, on_gpu: bool = True) -> float:
    """Fraction of peak the step's matmuls reach."""
    if tokens_per_micro_batch < 1 or hidden_per_rank <= 0:
        raise ValueError("tokens per micro-batch and hidden size per rank must be positive")
    tok = tokens_per_micro_batch / (tokens_per_micro_batch + _TOKENS_HALF[on_gpu])
    hid = hidden_per_rank / (hidden_per_rank + _HIDDEN_HALF[on_gpu])
    # Peak is a matmul figure on both (datasheet or measured); a whole training step also runs
    # attention, norms and elementwise work, which is what caps both near 60%.
    return MAX_EFFICIENCY * tok * hid


def matmul_seconds(flops: float, speed: DeviceSpeed, eff: float) -> float:
    """Seconds to run `flops` at `eff` of the device's peak."""
    if eff <= 0:
        raise ValueError(f"efficiency must be > 0, got {eff}")
    return flops / (speed.peak_tflops * 1e12 * eff)


def optimizer_seconds(state_bytes: float, speed: DeviceSpeed) -> float:
    """AdamW's step is memory bound: it streams the rank's weights, gradients and moments."""
    return _OPTIMIZER_PASSES * state_bytes / (speed.mem_gbps * 1e9)
