"""What keeps the path to the first step short: the driver of the default job never imports
torch (a second of CPU the workers need while they start), and a CPU node's probe measures
its slot's speed only once per kind of host (test_cluster_probe)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
