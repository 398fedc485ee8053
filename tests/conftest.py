"""Fixtures more than one test module shares."""

from __future__ import annotations

import socket

import pytest


@pytest.fixture(scope="module")
def one_rank():
    """A one-rank gloo process group for the module's tests, on a free local port."""
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
