"""The cluster topology: model, probes, parsers and pictures."""

from .model import ClusterTopology, Device, Link, Network, Nic, NodeTopology, cpu_node

__all__ = ["ClusterTopology", "Device", "Link", "Network", "Nic", "NodeTopology", "cpu_node"]
