"""What each accelerator can do: dense 16-bit peak, memory, memory bandwidth.

Vendor datasheet figures (dense, no sparsity). The planner reads memory from the probe when
the probe has it, and takes a device's measured figures over this table where a measured
probe recorded them.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
GIB = 1 << 30


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator model."""

    name: str
    """Short model name, as `cluster.gpu` and `--gpu` accept it (`H100`, `A100-40GB`, ...)."""
    peak_tflops: float
    """Dense bf16 (fp16 where bf16 is missing) tensor-core peak, TFLOP/s, fp32 accumulate."""
    memory_bytes: int
    """Device memory in bytes."""
    mem_gbps: float
    """Memory bandwidth, GB/s."""
    fp32_tflops: float
    """Peak without tensor cores in fp32 (what a `train.precision=fp32` run gets), TFLOP/s."""
    match: tuple[str, ...] = ()
    """Upper-case substrings of NVML product names that identify this model, most specific first."""
    sms: int = 0
    """Streaming multiprocessors: how many GEMM tiles run at once (0: unknown, no wave quantization)."""


# Most specific first: "H100 PCIE" must match before "H100", "A100-SXM4-40GB" before "A100".
GPU_TABLE: tuple[GpuSpec, ...] = (
    GpuSpec("B200", 2250.0, 180 * GB, 8000.0, 75.0, ("B200",), sms=148),
    GpuSpec("H200", 989.0, 141 * GB, 4800.0, 67.0, ("H200",), sms=132),
    GpuSpec("H100-PCIe", 756.0, 80 * GB, 2000.0, 51.0, ("H100 PCIE",), sms=114),
    GpuSpec("H100-NVL", 835.0, 94 * GB, 3900.0, 60.0, ("H100 NVL",), sms=132),
    GpuSpec("H100", 989.0, 80 * GB, 3350.0, 67.0, ("H100", "H800"), sms=132),
    GpuSpec("A100-40GB", 312.0, 40 * GB, 1555.0, 19.5, ("A100-SXM4-40GB", "A100-PCIE-40GB", "A100 40GB"), sms=108),
    GpuSpec("A100", 312.0, 80 * GB, 2039.0, 19.5, ("A100", "A800"), sms=108),
    GpuSpec("L40S", 362.0, 48 * GB, 864.0, 91.6, ("L40S",), sms=142),
    GpuSpec("L40", 181.0, 48 * GB, 864.0, 90.5, ("L40",), sms=142),
    GpuSpec("L4", 121.0, 24 * GB, 300.0, 30.3, ("L4",), sms=58),
    GpuSpec("A10G", 70.0, 24 * GB, 600.0, 31.2, ("A10G",), sms=80),
    GpuSpec("A10", 125.0, 24 * GB, 600.0, 31.2, ("A10",), sms=72),
    GpuSpec("RTX-A6000", 154.8, 48 * GB, 768.0, 38.7, ("RTX A6000", "A6000"), sms=84),
    GpuSpec("A40", 149.7, 48 * GB, 696.0, 37.4, ("A40",), sms=84),
    GpuSpec("RTX-4090", 165.2, 24 * GB, 1008.0, 82.6, ("RTX 4090", "4090"), sms=128),
    GpuSpec("RTX-3090", 71.0, 24 * GB, 936.0, 35.6, ("RTX 3090", "3090"), sms=82),
    GpuSpec("V100-16GB", 125.0, 16 * GB, 900.0, 15.7, ("V100-SXM2-16GB", "V100-PCIE-16GB"), sms=80),
    GpuSpec("V100", 125.0, 32 * GB, 900.0, 15.7, ("V100",), sms=80),
    GpuSpec("T4", 65.0, 16 * GB, 320.0, 8.1, ("T4",), sms=40),
)

# One CPU slot (a gloo rank with a share of the host's cores): a deliberately modest figure.
# The planner only needs CPU slots to compare strategies with each other, never with GPUs.
# A CPU slot's memory is the probe's (its share of the host's); a cluster described without one
# (a JSON or a test) is assumed to have this much per slot, never the planning host's own.
CPU_SLOT = GpuSpec("cpu", 0.2, 8 * GIB, 20.0, 0.2, ("CPU",))


def lookup(name: str | None) -> GpuSpec | None:
    """The table entry whose short name or NVML substring matches `name`; None when none does."""
    if not name:
        return None
    up = name.upper().replace("_", " ")
    for spec in GPU_TABLE + (CPU_SLOT,):
        if up == spec.name.upper() or up.replace(" ", "-") == spec.name.upper():
            return spec
    for spec in GPU_TABLE + (CPU_SLOT,):
        if any(m in up for m in spec.match):
            return spec
    return None


def known_names() -> list[str]:
    """Short names accepted by `cluster.gpu` / `--gpu`."""
    return [s.name for s in GPU_TABLE]
