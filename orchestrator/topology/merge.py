"""Two captures of one machine read as one node: NCCL XML for the PCI tree and NICs, the
`nvidia-smi topo -m` matrix for NVLink (which a VM's XML cannot show, see `fabric`)."""

from __future__ import annotations

import os

from ..errors import TopologyError
from .files import _read, _sniff, load_topology_file
from .model import NodeTopology, nvlink_domains


def merge_nvlink(pci: NodeTopology, matrix: NodeTopology, where: str) -> NodeTopology:
    """`pci`'s devices, PCIe paths and NICs, with every NVLink `matrix` shows between the same GPUs
    (both number GPUs as CUDA does, in PCI bus order)."""
    if len(pci.devices) != len(matrix.devices):
        raise TopologyError(
            f"{where}: the captures have {len(pci.devices)} and {len(matrix.devices)} GPUs; "
            f"merge two captures of the same machine"
        )
    nv = {(l.a, l.b): l for l in matrix.links if l.kind == "nvlink"}
    merged = NodeTopology.from_dict(pci.to_dict())
    merged.links = [nv.get((l.a, l.b), l) for l in merged.links]
    merged.nvlink_domains = nvlink_domains([d.index for d in merged.devices], merged.links)
    # The XML's "NVLink is not in this file" is answered by the matrix: say where NVLink came from.
    merged.warnings = [w for w in merged.warnings if "NVLink is not in this file" not in w]
    merged.warnings += [w for w in matrix.warnings if w not in merged.warnings]
    merged.warnings.append(
        f"{where}: NVLink from {matrix.source} ({len(nv)} GPU pairs), PCI tree and NICs from {pci.source}"
    )
    merged.source = f"{pci.source}+{matrix.source}"
    return merged


def load_merged(paths: list[str | os.PathLike], gpu_name: str | None = None) -> NodeTopology:
    """One node from one capture, or from an NCCL XML and a `topo -m` matrix of the same machine."""
    if len(paths) == 1:
        return load_topology_file(paths[0], gpu_name)
    where = " + ".join(os.fspath(p) for p in paths)
    if len(paths) != 2:
        raise TopologyError(f"{where}: give one capture, or two of the same machine (an NCCL XML and a `topo -m`)")
    nodes = [load_topology_file(p, gpu_name) for p in paths]
    kinds = [_sniff(_read(p)) for p in paths]
    if sorted(kinds) != ["smi", "xml"]:
        raise TopologyError(
            f"{where}: two captures merge only as an NCCL topology XML (PCI tree, NICs) and an "
            f"`nvidia-smi topo -m` (NVLink) of the same machine; got {kinds[0]} and {kinds[1]}"
        )
    xml, matrix = (nodes[0], nodes[1]) if kinds[0] == "xml" else (nodes[1], nodes[0])
    return merge_nvlink(xml, matrix, where)

