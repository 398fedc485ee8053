"""`doctor` on a live node: NVML's inventory and link states (a fake NVML reproducing real
machines), the verdict each finding earns, a node whose check fails, and the whole command on
this GPU-less machine (CPU figures, exit 0, a report that replaces an earlier one whole)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import fake_pynvml as fake
import pytest
from capture_edit import set_cell

from orchestrator.control.doctor import judge_health
from orchestrator.topology.files import load_topology_file
from orchestrator.topology.health import inventory, links_down, wiring_disagreements

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures" / "topology"


def test_inventory_lists_every_gpu_and_the_state_of_its_links():
    nv = fake.h100_nvswitch()
    inv = inventory(nv)
    assert [g["name"] for g in inv["gpus"]] == ["NVIDIA H100 80GB HBM3"] * 8
    assert all(len(g["nvlinks"]) == 18 and all(s["active"] for s in g["nvlinks"]) for g in inv["gpus"])
    assert links_down(inv) == []
    nv.gpus[3].nvlinks[4].active = False
    nv.gpus[3].nvlinks[11].active = False
    assert links_down(inventory(nv)) == ["GPU3 NVLink 4, 11 down (16 of 18 up)"]


def test_inventory_says_in_one_line_when_nvml_cannot_start():
    nv = fake.h100_nvswitch()
    nv.failing = {"nvmlInit": fake.NVMLError_DriverNotLoaded}
    inv = inventory(nv)
    assert inv == {"error": "NVML cannot start: Driver Not Loaded"}


def test_nvml_and_topo_m_disagreeing_is_named_by_pair(tmp_path):
    clean = load_topology_file(FIX / "topo_8x_rtxa6000_nvlink_pairs_unige3741.txt")
    text = (FIX / "topo_8x_rtxa6000_nvlink_pairs_unige3741.txt").read_text()
    changed = tmp_path / "topo.txt"
    changed.write_text(set_cell(text, "GPU6", "GPU7", "NODE"))
    assert wiring_disagreements(clean, load_topology_file(changed)) == [
        "GPU6-GPU7: NVML says NV4, nvidia-smi topo -m says NODE"]


def _health(**over) -> dict:
    base = {"hostname": "gpu-07", "errors": [], "links_down": [], "wiring": [], "wiring_disagreements": [],
            "inventory": {"driver": "560.35", "cuda_driver": "12.6",
                          "gpus": [{"index": 0, "name": "NVIDIA H100 80GB HBM3"},
                                   {"index": 1, "name": "NVIDIA H100 80GB HBM3"}]},
            "topology": {"devices": [{"kind": "gpu"}]},
            "compute": [{"device": 0, "bf16_tflops": 720.0, "fp32_tflops": 50.0, "mem_gbps": 3000.0},
                        {"device": 1, "bf16_tflops": 710.0, "fp32_tflops": 50.0, "mem_gbps": 2990.0}]}
    base.update(over)
    return base


def test_a_healthy_node_is_ok_with_its_ratios_recorded():
    rep = judge_health(_health(), "gpu-07")
    assert rep.verdict == "ok" and rep.reasons == []
    assert rep.details["health"]["compute"][0]["bf16_ratio"] == pytest.approx(720 / 989, abs=1e-3)


@pytest.mark.parametrize("bf16, verdict", [(500.0, "warn"), (250.0, "fail")])
def test_a_slow_gpu_is_named_with_its_share_of_the_datasheet(bf16, verdict):
    h = _health()
    h["compute"][1]["bf16_tflops"] = bf16
    rep = judge_health(h, "gpu-07")
    assert rep.verdict == verdict
    assert rep.reasons == [f"{verdict}: GPU1 bf16 matmul {bf16:.0f} TFLOP/s is {bf16 / 989:.0%} of the H100's 989"]


def test_links_down_errors_and_wiring_are_failures_disagreements_warnings():
    rep = judge_health(_health(links_down=["GPU3 NVLink 4 down (17 of 18 up)"],
                               wiring_disagreements=["GPU0-GPU1: NVML says NV18, nvidia-smi topo -m says SYS"],
                               errors=["NVML sees 8 GPU(s) but torch cannot use CUDA (torch 2.13.0, built for "
                                       "CUDA 12.8; driver 535 supports CUDA 12.2)"]), "gpu-07")
    assert rep.verdict == "fail"
    assert [r.split(":")[0] for r in rep.to_dict()["reasons"]] == ["fail", "fail", "warn"]


def test_an_unlisted_gpu_is_a_warning_planned_from_its_measured_rate():
    h = _health()
    h["inventory"]["gpus"] = [{"index": 0, "name": "NVIDIA Future X1"}]
    h["compute"] = h["compute"][:1]
    rep = judge_health(h, "gpu-07")
    assert rep.verdict == "warn" and rep.reasons == [
        "warn: GPU0 (NVIDIA Future X1) is not in the planner's table: plans use its measured 720 TFLOP/s"]


@pytest.mark.ray
@pytest.mark.slow
def test_doctor_on_a_gpu_less_machine_reports_cpu_figures_and_exits_0(tmp_path):
    out = tmp_path / "doctor.json"
    out.write_text("an earlier report")
    p = subprocess.run([sys.executable, "-m", "orchestrator", "doctor", "--out", str(out)], capture_output=True,
                       text=True, cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "no GPU: CPU figures only" in p.stdout
    report = json.loads(out.read_text())
    (node,) = report["nodes"]
    assert node["verdict"] == "ok"
    (cpu,) = node["health"]["compute"]
    assert cpu["device"] == "cpu" and cpu["fp32_tflops"] > 0 and cpu["mem_gbps"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doctor.json"]  # nothing else written


@pytest.mark.ray
@pytest.mark.slow
def test_a_node_whose_check_fails_is_one_line_and_the_others_are_checked(tmp_path, monkeypatch):
    import ray
    from ray.cluster_utils import Cluster

    from orchestrator.control.doctor import check_cluster
    from orchestrator.topology.local import TOPOLOGY_FILE_ENV

    monkeypatch.delenv(TOPOLOGY_FILE_ENV, raising=False)
    broken = tmp_path / "broken.txt"
    broken.write_text("GPU0 GPU1\nGPU0 X what\n")
    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=1, include_dashboard=False))
    worker = cluster.add_node(num_cpus=1, env_vars={TOPOLOGY_FILE_ENV: str(broken)})
    head_id, worker_id = cluster.head_node.node_id, worker.node_id
    try:
        ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
        reports, figures = check_cluster(quick=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
    by_node = {r.details["node_id"]: r for r in reports}
    bad, good = by_node[worker_id], by_node[head_id]
    assert bad.verdict == "fail" and len(bad.reasons) == 1
    assert bad.reasons[0].startswith("fail: the check did not finish:") and "broken.txt" in bad.reasons[0]
    assert good.verdict == "ok" and good.details["note"] == "no GPU: CPU figures only"
    assert figures["links"].startswith("not measured:")


class _Clock:
    """A wall clock that only the calls under test move: each costs `cost(n)` seconds."""

    def __init__(self, cost) -> None:
        self.t, self.calls, self.cost = 0.0, 0, cost

    def now(self) -> float:
        return self.t

    def call(self) -> None:
        self.calls += 1
        self.t += self.cost(self.calls)


def test_a_rate_is_timed_warm_over_enough_work():
    from orchestrator.topology.health import MEASURE_S, WARMUP_S, timed_seconds

    # A 0.2 ms matmul on a GPU that starts at a third of its speed and is at full speed after
    # 100 calls: a cold 10-call sample would read it three times slower than it is.
    clock = _Clock(lambda n: 0.0006 if n <= 100 else 0.0002)
    timed = []

    def timer(fn, iters):
        t0 = clock.now()
        for _ in range(iters):
            fn()
        timed.append(iters)
        return clock.now() - t0

    per_call = timed_seconds(clock.call, lambda: None, timer, now=clock.now)
    assert per_call == pytest.approx(0.0002)
    warm_calls = clock.calls - sum(timed)
    assert warm_calls * 0.0002 + 100 * 0.0004 >= WARMUP_S  # the warm-up ran at least WARMUP_S
    assert sum(timed) * 0.0002 >= MEASURE_S  # and at least MEASURE_S of calls were timed


def test_a_warm_up_slower_than_the_timed_calls_still_times_enough_work():
    from orchestrator.topology.health import MEASURE_S, timed_seconds

    # One 0.25 s first call (kernel load), then 1 ms calls: the warm-up's mean asks for too few.
    clock = _Clock(lambda n: 0.25 if n == 1 else 0.001)

    def timer(fn, iters):
        t0 = clock.now()
        for _ in range(iters):
            fn()
        return clock.now() - t0

    assert timed_seconds(clock.call, lambda: None, timer, now=clock.now) == pytest.approx(0.001)
    assert clock.calls - 1 >= MEASURE_S / 0.001


def test_the_sm_clock_is_read_from_nvml_and_unknown_without_it():
    from types import SimpleNamespace

    from orchestrator.topology.health import _sm_clock_mhz

    nv = SimpleNamespace(nvmlInit=lambda: None, nvmlShutdown=lambda: None, NVML_CLOCK_SM=1,
                         nvmlDeviceGetHandleByIndex=lambda i: ("h", i),
                         nvmlDeviceGetClockInfo=lambda h, kind: 1980 if (h, kind) == (("h", 3), 1) else 0)
    assert _sm_clock_mhz(3, nv) == 1980

    def no_nvml():
        raise RuntimeError("NVML Shared Library Not Found")

    assert _sm_clock_mhz(0, SimpleNamespace(nvmlInit=no_nvml)) is None
