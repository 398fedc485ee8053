"""Topology-aware distributed training on Ray."""

__version__ = "0.1.0"
