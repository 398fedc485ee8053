"""NVLink that a capture cannot show: the NVSwitch fabric a GPU model implies.

NCCL topology XML published for cloud VMs (AWS p4d/p5, Azure NDv4/NDv5) describes the PCI
tree only: NCCL learns NVLink from NVML at run time, so the files have no `<nvlink>` elements.
Read as they are, an 8-GPU NVSwitch board looks PCIe-only and every plan prices links 10-30x
slower than the real ones. This module says so, and fills the gap from what the user knows:
the GPU model (SXM parts ship on NVSwitch baseboards with a known number of NVLinks per GPU;
PCIe parts do not), or NVIDIA's PCI device id when the file carries it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .bandwidth import estimate
from .model import Link, NodeTopology, nvlink_domains
from .nccl_xml import NcclSystem, read_nccl_system


@dataclass(frozen=True)
class BoardFabric:
    """The NVSwitch fabric of the baseboards (HGX) a GPU part ships on."""

    part: str
    """The part, as NVML names it."""
    nvlink_gen: int
    """NVLink generation of the part."""
    lanes_per_gpu: int
    """NVLinks per GPU, all of them to the board's NVSwitches."""


# Upper-case substring of an NVML name (or a `cluster.gpu` short name) -> fabric; most specific
# first. Short names without a form factor (`A100`, `H100`, ...) are the SXM parts, as the GPU
# table's figures are. V100 SXM2 is left out: most of its boards (DGX-1, p3) wire a hybrid cube
# mesh, not an NVSwitch, so the model alone does not tell.
_SXM_FABRICS = (
    ("B200", BoardFabric("NVIDIA B200", 5, 18)),
    ("H200", BoardFabric("NVIDIA H200", 4, 18)),
    ("H800", BoardFabric("NVIDIA H800", 4, 8)),
    ("H100", BoardFabric("NVIDIA H100 80GB HBM3", 4, 18)),
    ("A800", BoardFabric("NVIDIA A800-SXM4-80GB", 3, 8)),
    ("A100", BoardFabric("NVIDIA A100-SXM4", 3, 12)),
)
# PCIe cards, and the NVL cards whose NVLink is a bridge between pairs, never sit on NVSwitch.
_NOT_ON_NVSWITCH = re.compile(r"PCIE|\bNVL\b")

# NVIDIA PCI device ids (pci.ids) -> NVML name, for XML files that keep the `device=` attribute.
PCI_DEVICE_NAMES = {
    "0x20b0": "NVIDIA A100-SXM4-40GB",
    "0x20b2": "NVIDIA A100-SXM4-80GB",
    "0x20b5": "NVIDIA A100 80GB PCIe",
    "0x20f1": "NVIDIA A100-PCIE-40GB",
    "0x2330": "NVIDIA H100 80GB HBM3",
    "0x2331": "NVIDIA H100 PCIe",
    "0x2321": "NVIDIA H100 NVL",
    "0x2335": "NVIDIA H200",
    "0x2237": "NVIDIA A10G",
}
_NVIDIA = "0x10de"


def nvswitch_fabric(gpu: str | None) -> BoardFabric | None:
    """The NVSwitch fabric the part `gpu` ships on; None for PCIe/NVL parts and unknown models."""
    if not gpu:
        return None
    up = gpu.upper().replace("_", " ")
    if _NOT_ON_NVSWITCH.search(up):
        return None
    return next((f for key, f in _SXM_FABRICS if key in up), None)


def gpu_from_pci_ids(system: NcclSystem) -> str | None:
    """The NVML name of the GPUs when every GPU element carries the same known NVIDIA device id."""
    ids = set()
    for g in system.gpus:
        pci = g.chain[-1]
        vendor = (pci.get("vendor") or _NVIDIA).lower()
        ids.add((pci.get("device") or "").lower() if vendor == _NVIDIA else "")
    return PCI_DEVICE_NAMES.get(ids.pop()) if len(ids) == 1 else None


def lacks_nvlink(system: NcclSystem) -> bool:
    """The file has GPUs that could talk over NVLink but not one `<nvlink>` element."""
    return len(system.gpus) >= 2 and not any(g.nvlinks for g in system.gpus)


def apply_nvswitch(node: NodeTopology, fabric: BoardFabric) -> None:
    """Every GPU pair of `node` talks through the NVSwitches: one all-to-all NVLink domain."""
    bw, lat = estimate("nvlink", nvlinks=fabric.lanes_per_gpu, nvlink_gen=fabric.nvlink_gen, name=fabric.part)
    node.links = [
        Link(a=l.a, b=l.b, kind="nvlink", nvlinks=fabric.lanes_per_gpu, nvlink_gen=fabric.nvlink_gen,
             bandwidth_gbps=bw, latency_us=lat, via_switch=True)
        for l in node.links
    ]
    node.nvlink_domains = nvlink_domains([d.index for d in node.devices], node.links)


def complete_xml(node: NodeTopology, text: str, gpu_name: str | None, source: str) -> NodeTopology:
    """`node`, parsed from the NCCL XML `text`, with what the file cannot say said out loud and,
    where the GPU model (given, or named by the PCI device id) implies it, the NVSwitch fabric."""
    system = read_nccl_system(text, source)
    if not lacks_nvlink(system):
        return node
    missing = (f"{source}: NVLink is not in this file (NCCL topology XML of a VM describes the PCI tree; "
               f"NCCL reads NVLink from NVML at run time)")
    named = gpu_name or gpu_from_pci_ids(system)
    if not named:
        node.warnings.append(
            f"{missing}, so its {len(node.devices)} GPUs are linked by PCIe paths only; give the GPU model "
            f"(--gpu 'NVIDIA H100 80GB HBM3', cluster.gpu) or a `nvidia-smi topo -m` of the same machine "
            f"to add the NVLink an NVSwitch board has"
        )
        return node
    if not gpu_name:
        for d in node.devices:
            d.name = d.name or named
    how = "given" if gpu_name else "named by the file's PCI device id"
    fabric = nvswitch_fabric(named)
    if fabric is None:
        node.warnings.append(f"{missing}; {named} ({how}) does not ship on an NVSwitch board, so the PCIe paths stand")
        return node
    apply_nvswitch(node, fabric)
    node.warnings.append(
        f"{missing}; {named} ({how}) ships on NVSwitch boards: assumed NVLink {fabric.nvlink_gen} with "
        f"{fabric.lanes_per_gpu} links per GPU through NVSwitch between all {len(node.devices)} GPUs"
    )
    return node
