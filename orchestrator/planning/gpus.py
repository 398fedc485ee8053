"""What each accelerator can do: dense 16-bit peak, memory, memory bandwidth.

Vendor datasheet figures (dense, no sparsity). The planner reads memory from the probe when
the probe has it, and takes a device's measured figures over this table where a measured
probe recorded them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

GB = 10**9
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


# Most specific first: "H100 PCIE" must match before "H100", "A100-SXM4-40GB" before "A100", and
# the names that contain others ("GB200" holds "B200", "GH200" holds "H200" and "H20", "H200"
# holds "H20") before those. Where a datasheet gives only the sparse tensor figure, the dense one
# is half of it. Memory is the probe's (NVML's) wherever it read it; the table's is the fallback.
GPU_TABLE: tuple[GpuSpec, ...] = (
    # Per GPU of a GB200 NVL72 rack (360 PFLOPS bf16 sparse, 5,760 TFLOPS fp32, 13.4 TB HBM3e at
    # 576 TB/s for 72 GPUs): https://www.nvidia.com/en-us/data-center/gb200-nvl72/
    GpuSpec("GB200", 2500.0, 186 * GB, 8000.0, 80.0, ("GB200",), sms=148),
    GpuSpec("B200", 2250.0, 180 * GB, 8000.0, 75.0, ("B200",), sms=148),
    # HGX B300 (36 PFLOPS bf16 sparse, 600 TFLOPS fp32 for 8 GPUs; 270 GB and 7.7 TB/s each in the
    # datasheet's HGX column): https://www.nvidia.com/en-us/data-center/hgx/ ; GB300 reads as this.
    GpuSpec("B300", 2250.0, 270 * GB, 7700.0, 75.0, ("B300",)),
    # The Hopper GPU of Grace Hopper, 96 GB HBM3 at 4 TB/s (1,979 TFLOPS bf16 sparse):
    # https://www.nvidia.com/en-us/data-center/grace-hopper-superchip/
    GpuSpec("GH200", 989.0, 96 * GB, 4000.0, 67.0, ("GH200",), sms=132),
    # H200 NVL: 1,671 TFLOPS bf16 sparse, 60 TFLOPS fp32, 141 GB at 4.8 TB/s
    # (https://www.nvidia.com/en-us/data-center/h200/): "H200 NVL" holds "H200", so it comes first.
    GpuSpec("H200-NVL", 835.0, 141 * GB, 4800.0, 60.0, ("H200 NVL",), sms=132),
    GpuSpec("H200", 989.0, 141 * GB, 4800.0, 67.0, ("H200",), sms=132),
    # 148 TFLOPS bf16 dense, 96 GB HBM3 at 4.0 TB/s, 900 GB/s NVLink: NVIDIA AI Enterprise's H20
    # page https://docs.nvidia.com/ai-enterprise/release-8/latest/infra-software/vgpu/reference/hopper-h20.html
    # and MegaScale-Infer, Table 3 (https://arxiv.org/abs/2504.02263).
    GpuSpec("H20", 148.0, 96 * GB, 4000.0, 44.0, ("H20",), sms=78),
    GpuSpec("H100-PCIe", 756.0, 80 * GB, 2000.0, 51.0, ("H100 PCIE",), sms=114),
    GpuSpec("H100-NVL", 835.0, 94 * GB, 3900.0, 60.0, ("H100 NVL",), sms=132),
    GpuSpec("H100", 989.0, 80 * GB, 3350.0, 67.0, ("H100",), sms=132),
    # H100 SXM's compute and memory with NVLink cut to 400 GB/s (H800 datasheet: 1,979 TFLOPS
    # bf16 sparse, 80 GB at 3.35 TB/s).
    GpuSpec("H800", 989.0, 80 * GB, 3350.0, 67.0, ("H800",), sms=132),
    GpuSpec("A100-40GB", 312.0, 40 * GB, 1555.0, 19.5, ("A100-SXM4-40GB", "A100-PCIE-40GB", "A100 40GB"), sms=108),
    GpuSpec("A100", 312.0, 80 * GB, 2039.0, 19.5, ("A100",), sms=108),
    # A100's figures with NVLink cut to 400 GB/s: the A100 datasheet
    # https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
    GpuSpec("A800", 312.0, 80 * GB, 2039.0, 19.5, ("A800",), sms=108),
    GpuSpec("L40S", 362.0, 48 * GB, 864.0, 91.6, ("L40S",), sms=142),
    GpuSpec("L40", 181.0, 48 * GB, 864.0, 90.5, ("L40",), sms=142),
    # 119.5 TFLOPS bf16 dense, 48 GB GDDR6 at 864 GB/s: MegaScale-Infer, Table 3 (above).
    GpuSpec("L20", 119.5, 48 * GB, 864.0, 59.4, ("L20",), sms=92),
    GpuSpec("L4", 121.0, 24 * GB, 300.0, 30.3, ("L4",), sms=58),
    GpuSpec("A10G", 70.0, 24 * GB, 600.0, 31.2, ("A10G",), sms=80),
    GpuSpec("A10", 125.0, 24 * GB, 600.0, 31.2, ("A10",), sms=72),
    # Ada whitepaper (https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf):
    # 364.2 TFLOPS fp16/bf16 with fp32 accumulate dense (full rate on the professional card), 91.1
    # fp32, 48 GB GDDR6 at 960 GB/s, 142 SMs.
    GpuSpec("RTX-6000-Ada", 364.2, 48 * GB, 960.0, 91.1, ("RTX 6000 ADA",), sms=142),
    GpuSpec("RTX-A6000", 154.8, 48 * GB, 768.0, 38.7, ("RTX A6000", "A6000"), sms=84),
    GpuSpec("A40", 149.7, 48 * GB, 696.0, 37.4, ("A40",), sms=84),
    # Blackwell RTX whitepaper (https://images.nvidia.com/aem-dam/Solutions/geforce/blackwell/nvidia-rtx-blackwell-gpu-architecture.pdf):
    # 209.5 TFLOPS fp16/bf16 with fp32 accumulate dense (half rate on GeForce), 104.8 fp32, 32 GB
    # GDDR7 at 1,792 GB/s, 170 SMs.
    GpuSpec("RTX-5090", 209.5, 32 * GB, 1792.0, 104.8, ("RTX 5090", "5090"), sms=170),
    GpuSpec("RTX-4090", 165.2, 24 * GB, 1008.0, 82.6, ("RTX 4090", "4090"), sms=128),
    GpuSpec("RTX-3090", 71.0, 24 * GB, 936.0, 35.6, ("RTX 3090", "3090"), sms=82),
    GpuSpec("V100-16GB", 125.0, 16 * GB, 900.0, 15.7, ("V100-SXM2-16GB", "V100-PCIE-16GB"), sms=80),
    GpuSpec("V100", 125.0, 32 * GB, 900.0, 15.7, ("V100",), sms=80),
    GpuSpec("T4", 65.0, 16 * GB, 320.0, 8.1, ("T4",), sms=40),
)

# A GPU the table does not list (a newer or rarer part, or one nothing named: a fake-GPU node, a
# capture): figures no current training GPU falls below by much, so a plan made with them fits
# and is not sold as faster than the part is. Memory is the probe's where it read it.
UNLISTED_GPU = GpuSpec("unlisted GPU", 100.0, 16 * GB, 900.0, 15.0)

# One CPU slot (a gloo rank with a share of the host's cores): a deliberately modest figure.
# The planner only needs CPU slots to compare strategies with each other, never with GPUs.
# A CPU slot's memory is the probe's (its share of the host's); a cluster described without one
# (a JSON or a test) is assumed to have this much per slot, never the planning host's own.
CPU_SLOT = GpuSpec("cpu", 0.2, 8 * GIB, 20.0, 0.2, ("CPU",))


@functools.cache
def lookup(name: str | None) -> GpuSpec | None:
    """The table entry whose short name or NVML substring matches `name`; None when none does.
    Cached: planning a cluster asks it for every device, by the same few names."""
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
