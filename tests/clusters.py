"""Clusters the planner tests price: real node captures joined by a stated network."""

from __future__ import annotations

from pathlib import Path

from orchestrator.planning.describe import describe_cluster
from orchestrator.topology.files import load_topology_file
from orchestrator.topology.model import ClusterTopology, Network

ROOT = Path(__file__).resolve().parent.parent
# A DGX A100's `nvidia-smi topo -m`: 8 A100s on NVSwitch, as shipped in conf/topologies.
A100_CAPTURE = ROOT / "conf" / "topologies" / "a100-8gpu-nvswitch.txt"


def dgx_a100(nodes: int) -> ClusterTopology:
    """`nodes` DGX A100s on 200 GB/s per node (8 x 200 Gbit/s HDR), as Narayanan et al. 2021 ran."""
    node = load_topology_file(A100_CAPTURE, "A100")
    return describe_cluster(node, nodes, Network(bandwidth_gbps=200.0, latency_us=3.0, source="config"), "A100")
