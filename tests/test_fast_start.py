"""What keeps the path to the first step short: the driver of the default job never imports
torch (a second of CPU the workers need while they start), and a CPU node's probe measures
its slot's speed only once per kind of host (test_cluster_probe)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_default_jobs_driver_plans_without_importing_torch():
    code = """
import sys
from orchestrator.config import load_config
from orchestrator.control import driver, follow, placement  # noqa: F401 - what submit runs
from orchestrator.control.preflight import measure_model
from orchestrator.planning import plan_job
from orchestrator.topology.model import ClusterTopology, cpu_node

cfg = load_config("jobs/llm.yaml", ["cluster.num_workers=2"])
spec = measure_model(cfg)
plan_job(cfg, ClusterTopology(nodes=[cpu_node(2)]), spec)
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


@pytest.mark.ray
@pytest.mark.slow
def test_a_private_clusters_start_asks_for_its_node_once_the_raylet_has_registered(monkeypatch):
    """Ray asks the GCS for the new node 0.1 s after starting its raylet and, where it is not
    listed yet, sleeps a fixed second: the start polls first, so Ray's one question is answered."""
    import ray
    import ray._private.services as services

    from orchestrator.connect.cluster import connect

    ray_get_node = services.get_node
    listed_when_asked = []

    def spy(gcs_address, node_id, *args, **kwargs):
        from ray._raylet import GcsClient

        listed = {n.hex() for n in GcsClient(address=gcs_address).get_all_node_info(timeout=5)}
        listed_when_asked.append(node_id in listed)
        return ray_get_node(gcs_address, node_id, *args, **kwargs)

    monkeypatch.setattr(services, "get_node", spy)
    with connect(None, num_cpus=1):
        assert ray.is_initialized()
        assert services.get_node is spy  # polled only while Ray starts: its own function is back
    assert listed_when_asked and all(listed_when_asked)


@pytest.mark.ray
@pytest.mark.slow
def test_a_private_cluster_starts_where_the_poll_cannot_ask_the_gcs(monkeypatch):
    """Another Ray's GCS client (here: one that fails) leaves Ray's own wait in charge."""
    import ray
    import ray._raylet

    from orchestrator.connect import cluster

    class Refusing:
        def __init__(self, *args, **kwargs):
            raise TypeError("this Ray's GcsClient takes other arguments")

    monkeypatch.setattr(ray._raylet, "GcsClient", Refusing)
    assert cluster.wait_registered("127.0.0.1:1", "00" * 28) is False
    with cluster.connect(None, num_cpus=1):
        assert ray.get(ray.put(7)) == 7
