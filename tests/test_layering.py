"""The planner stays pure Python: planning a job imports neither torch nor Ray (fast, and usable
on a laptop that has neither a GPU nor a cluster)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_PLAN_ONLY = r"""
import sys
from orchestrator.config import load_config
from orchestrator.planning import plan_job
from orchestrator.topology.files import load_topology_file
from orchestrator.topology.model import ClusterTopology
node = load_topology_file(sys.argv[1])
plan = plan_job(load_config(sys.argv[2], ["cluster.gpu=A100"]), ClusterTopology(nodes=[node]))
heavy = sorted(m for m in ("torch", "ray", "pynvml") if m in sys.modules)
print(plan.strategy, heavy)
"""


def test_planning_imports_neither_torch_nor_ray():
    out = subprocess.run(
        [sys.executable, "-c", _PLAN_ONLY, str(ROOT / "tests/fixtures/topology/topo_4gpu_pcie_pxb_pix_nccl667.txt"),
         str(ROOT / "jobs/llm.yaml")],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout.split()
    assert out[-1] == "[]", out
