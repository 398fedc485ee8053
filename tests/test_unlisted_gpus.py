"""No GPU is refused: a GPU the planner's table does not list, or one nothing names, is planned
from its measured figures or conservative stated defaults, and the plan says which in one line.
The table's newer parts are found by the names NVML reports."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from orchestrator.config import load_config
from orchestrator.errors import PlanError
from orchestrator.planning import job_context, plan_job
from orchestrator.planning.describe import describe_cluster
from orchestrator.planning.gpus import GB, UNLISTED_GPU, lookup
from orchestrator.topology.files import load_topology_file
from orchestrator.topology.model import ClusterTopology, Network

ROOT = Path(__file__).resolve().parent.parent
CAPTURE = ROOT / "tests" / "fixtures" / "topology" / "topo_4gpu_pcie_pxb_pix_nccl667.txt"
JOB = ROOT / "jobs" / "llm.yaml"
NET = Network(bandwidth_gbps=25.0, latency_us=10.0)


def _cluster(name: str | None, nodes: int = 2, **device) -> ClusterTopology:
    topo = describe_cluster(load_topology_file(CAPTURE, name), nodes, NET, name)
    for node in topo.nodes:
        node.devices = [replace(d, **device) for d in node.devices]
    return topo


def _said(plan) -> list[str]:
    return [line for line in plan.explanation if "not in the planner's table" in line]


def test_an_unnamed_gpu_is_planned_with_the_stated_defaults():
    cfg = load_config(JOB, [])
    plan = plan_job(cfg, _cluster(None))
    assert plan.world_size == 8 and plan.fits
    (line,) = _said(plan)
    assert line.startswith("GPU (unnamed) on 2 nodes is not in the planner's table: planned with conservative "
                           "default figures (100 TFLOP/s bf16, 15 TFLOP/s fp32, 16 GB, 900 GB/s)")
    ctx = job_context(cfg, _cluster(None))
    assert (ctx.speed.peak_tflops, ctx.speed.memory_bytes) == (UNLISTED_GPU.peak_tflops, 16 * GB)


def test_an_unlisted_gpu_is_planned_from_what_the_probe_measured_and_read():
    cfg = load_config(JOB, [])
    topo = _cluster("NVIDIA MI-Future 9000", measured_tflops=420.0, memory_bytes=64 * GB)
    (line,) = _said(plan_job(cfg, topo))
    assert "GPU NVIDIA MI-Future 9000 on 2 nodes" in line
    assert "planned from its measured matmul rate (420 TFLOP/s), 64 GB as the probe read it" in line
    ctx = job_context(cfg, topo)
    assert (ctx.speed.peak_tflops, ctx.speed.memory_bytes) == (420.0, 64 * GB)


def test_a_listed_gpu_says_nothing_and_a_misspelt_cluster_gpu_is_one_line():
    assert not _said(plan_job(load_config(JOB, ["cluster.gpu=A100"]), _cluster(None)))
    with pytest.raises(PlanError, match=r"^key 'cluster.gpu': 'A1OO' is not a listed GPU model; listed: .*A100") as e:
        plan_job(load_config(JOB, ["cluster.gpu=A1OO"]), _cluster(None))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("nvml, entry, tflops, memory_gb", [
    ("NVIDIA GB200", "GB200", 2500.0, 186),
    ("NVIDIA B300 SXM6 AC", "B300", 2250.0, 270),
    ("NVIDIA GH200 480GB", "GH200", 989.0, 96),
    ("NVIDIA H200", "H200", 989.0, 141),
    ("NVIDIA H20", "H20", 148.0, 96),
    ("NVIDIA H800", "H800", 989.0, 80),
    ("NVIDIA A800-SXM4-80GB", "A800", 312.0, 80),
    ("NVIDIA L20", "L20", 119.5, 48),
    ("NVIDIA GeForce RTX 5090", "RTX-5090", 209.5, 32),
    ("NVIDIA RTX 6000 Ada Generation", "RTX-6000-Ada", 364.2, 48),
    ("NVIDIA B200", "B200", 2250.0, 180),
    ("NVIDIA A100-SXM4-40GB", "A100-40GB", 312.0, 40),
])
def test_nvml_names_of_current_parts_find_their_datasheet_entries(nvml, entry, tflops, memory_gb):
    spec = lookup(nvml)
    assert spec is not None and spec.name == entry
    assert (spec.peak_tflops, spec.memory_bytes) == (tflops, memory_gb * GB)


def test_a_measured_rate_prices_the_plan_and_the_datasheet_peak_stays_mfus_yardstick():
    # A probe under cluster.measure=true that found an H100 at 750 TFLOP/s plans with 750, but
    # MFU divides by the datasheet's 989: against the measured rate it would read 989/750 high.
    from types import SimpleNamespace

    from orchestrator.runtime.step_timer import StepTimer

    topo = _cluster("NVIDIA H100 80GB HBM3", measured_tflops=750.0)
    plan = plan_job(load_config(JOB, ["train.precision=bf16"]), topo)
    assert plan.model.peak_tflops_per_rank == 750.0
    assert plan.model.mfu_peak_tflops_per_rank == lookup("H100").peak_tflops == 989.0
    assert plan.to_dict()["model"]["datasheet_tflops_per_rank"] == 989.0
    trainer = SimpleNamespace(plan=plan, compiled=False, cfg=SimpleNamespace(train=SimpleNamespace(max_steps=5)))
    step_s = plan.model.flops_per_step / plan.world_size / 989e12 / 0.4  # a step at 40% of the datasheet peak
    assert StepTimer(trainer).mfu(SimpleNamespace(step_s=step_s)) == pytest.approx(0.4)
    # Unmeasured, the two are one figure and plan.json reads as before.
    plain = plan_job(load_config(JOB, ["train.precision=bf16"]), _cluster("NVIDIA H100 80GB HBM3"))
    assert plain.model.mfu_peak_tflops_per_rank == plain.model.peak_tflops_per_rank == 989.0
    assert "datasheet_tflops_per_rank" not in plain.to_dict()["model"]
    # An unlisted GPU has no datasheet: its measured rate is all there is.
    unlisted = plan_job(load_config(JOB, []), _cluster("NVIDIA MI-Future 9000", measured_tflops=420.0))
    assert unlisted.model.mfu_peak_tflops_per_rank == 420.0
