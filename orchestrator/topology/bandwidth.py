"""Link tables: what each kind of link carries, before (or without) measuring it.

Figures are GB/s per direction. NVLink per-lane rates are NVIDIA's (25 GB/s for NVLink 2-4,
50 for NVLink 5; 14.06 for the RTX A6000 bridge); PCIe is width x transfer rate after
128b/130b coding. Paths through the CPU lose bandwidth and add latency at each hop, which is
what NCCL's own topology search assumes too (its PHB/SYS figures are lower than PIX/PXB).
"""

from __future__ import annotations

NO_MODEL_WARNING = "the capture does not name the GPU model; NVLink bandwidth assumes 25 GB/s per lane"
"""What a parser says when a capture leaves the GPU model, and so the NVLink lane rate, unsaid."""
# Per-lane NVLink bandwidth by generation, GB/s per direction.
NVLINK_LANE_GBPS = {1: 20.0, 2: 25.0, 3: 25.0, 4: 25.0, 5: 50.0}
# PCIe x16 bandwidth by generation, GB/s per direction (after encoding overhead).
PCIE_X16_GBPS = {1: 4.0, 2: 8.0, 3: 15.75, 4: 31.5, 5: 63.0, 6: 121.0}
DEFAULT_PCIE_GEN = 4

# Fraction of the PCIe link a path keeps, and its latency, by how far it travels.
_PCIE_PATH = {
    "pix": (1.0, 1.5),
    "pxb": (0.95, 2.0),
    "phb": (0.75, 3.0),
    "node": (0.6, 4.0),
    "sys": (0.4, 6.0),
}
_NVLINK_LATENCY_US = 1.0
# gloo between processes of one host goes through TCP loopback, not shared memory: a few GB/s
# and tens of microseconds (what `probe --measure` found: benchmarks/README.md, "Start-up settings").
_SHM = (3.0, 50.0)
NETWORK_DEFAULT = (12.5, 10.0)
"""(GB/s, us) out of a node when nothing says otherwise: 100 Gbit Ethernet-class."""

# NVLink generation by GPU product name (a substring test, most specific first).
_NVLINK_GEN_BY_NAME = (
    ("B200", 5), ("GB200", 5), ("B100", 5), ("B300", 5), ("GB300", 5),
    ("H200", 4), ("H100", 4), ("H800", 4), ("GH200", 4), ("H20", 4),
    ("A100", 3), ("A800", 3), ("A6000", 3), ("A40", 3), ("A30", 3), ("3090", 3),
    ("V100", 2),
    ("P100", 1),
)


def nvlink_gen_for(name: str) -> int | None:
    """NVLink generation of a GPU product name, or None when the name does not tell."""
    up = name.upper()
    for key, gen in _NVLINK_GEN_BY_NAME:
        if key in up:
            return gen
    return None


def nvlink_lane_gbps(gen: int | None, name: str = "") -> float:
    """Per-lane NVLink bandwidth; the A6000/A40/3090 bridge lanes run at 14.06 GB/s."""
    up = name.upper()
    if any(k in up for k in ("A6000", "A40", "3090", "A5000")):
        return 14.0625
    return NVLINK_LANE_GBPS.get(gen or 3, 25.0)


def pcie_gbps(gen: int | None = None, width: int | None = None) -> float:
    """Bandwidth of a PCIe link of the given generation and width (defaults: Gen4 x16)."""
    x16 = PCIE_X16_GBPS.get(gen or DEFAULT_PCIE_GEN, PCIE_X16_GBPS[DEFAULT_PCIE_GEN])
    return x16 * (width or 16) / 16


def estimate(
    kind: str,
    nvlinks: int = 0,
    nvlink_gen: int | None = None,
    pcie_gen: int | None = None,
    pcie_width: int | None = None,
    name: str = "",
) -> tuple[float, float]:
    """(bandwidth GB/s per direction, latency us) expected of a link of this kind."""
    if kind == "nvlink":
        if nvlinks <= 0:
            raise ValueError("an nvlink link needs at least one lane")
        return nvlinks * nvlink_lane_gbps(nvlink_gen, name), _NVLINK_LATENCY_US
    if kind in _PCIE_PATH:
        frac, lat = _PCIE_PATH[kind]
        return round(pcie_gbps(pcie_gen, pcie_width) * frac, 3), lat
    if kind == "shm":
        return _SHM
    if kind == "net":
        return NETWORK_DEFAULT
    raise ValueError(f"unknown link kind {kind!r}")
