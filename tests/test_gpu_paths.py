"""The paths that only run on GPUs or NCCL, checked on a CPU: what they would hand CUDA,
NVML or NCCL, with those mocked."""

from __future__ import annotations

import pytest


def test_no_worker_starts_early_when_the_probe_measures_the_links(monkeypatch):
    # The measurement's actors take every GPU (and on a CPU node, a CPU each): workers started
    # early would hold them, and the probe would wait for devices that never come free.
    from orchestrator.control import placement

    gpu_node = {"NodeID": "n1", "Alive": True, "Resources": {"GPU": 8.0, "CPU": 32.0}}
    monkeypatch.setattr(placement.ray, "nodes", lambda: [gpu_node])

    def no_group(*args, **kwargs):
        raise AssertionError("no placement group may be reserved before a measured probe")

    monkeypatch.setattr(placement, "placement_group", no_group)
    kw = dict(job="j", num_workers=2, max_workers=0, cpus_per_worker=1.0, threads_per_worker=1)
    assert placement.start_early(measure=True, **kw) is None
    with pytest.raises(AssertionError, match="no placement group"):
        placement.start_early(measure=False, **kw)  # unmeasured, the same node starts its workers early
