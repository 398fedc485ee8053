"""The wiring checks `doctor --from` runs on a capture: healthy real captures raise nothing; the
same captures with a bridge removed, lanes down, a bridged pair across sockets or a GPU's NIC
moved away are each flagged, naming the GPUs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from capture_edit import set_cell, set_numa

from orchestrator.topology.files import load_topology_file
from orchestrator.topology.wiring import check_wiring

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures" / "topology"
CAPTURES = sorted(p for p in FIX.glob("*") if p.name.startswith(("topo_", "nccl_xml_")))
A6000 = FIX / "topo_8x_rtxa6000_nvlink_pairs_unige3741.txt"
H100 = FIX / "topo_h100_8gpu_mlengineering.txt"
HGX = FIX / "topo_hgx_h100_nics_nccl1264.txt"


def _findings(text: str, tmp_path: Path) -> list[tuple[str, str]]:
    path = tmp_path / "capture.txt"
    path.write_text(text)
    return [(f.level, f.text) for f in check_wiring(load_topology_file(path))]


@pytest.mark.parametrize("path", CAPTURES, ids=lambda p: p.stem)
def test_healthy_real_captures_show_no_fault(path):
    assert check_wiring(load_topology_file(path)) == []


def test_a_missing_bridge_is_a_failure_naming_both_gpus(tmp_path):
    found = _findings(set_cell(A6000.read_text(), "GPU6", "GPU7", "SYS"), tmp_path)
    assert found[0][0] == "fail" and found[0][1].startswith("GPU6, GPU7 have no NVLink while 6 other GPUs have 4")


def test_a_degraded_bridge_names_the_lanes_down(tmp_path):
    found = _findings(set_cell(A6000.read_text(), "GPU2", "GPU3", "NV2"), tmp_path)
    assert [f for f in found if f[0] == "fail"] == [
        ("fail", "GPU2 has 2 NVLink lanes where other GPUs have 4: 2 down or a bridge degraded"),
        ("fail", "GPU3 has 2 NVLink lanes where other GPUs have 4: 2 down or a bridge degraded")]


def test_lanes_down_behind_an_nvswitch(tmp_path):
    text = H100.read_text()
    for peer in range(8):  # every pair of GPU5 shows its 16 remaining lanes
        if peer != 5:
            text = set_cell(text, "GPU5", f"GPU{peer}", "NV16")
    found = _findings(text, tmp_path)
    assert found == [("fail", "GPU5 has 16 NVLink lanes where other GPUs have 18: 2 down or a bridge degraded")]
    one_pair = _findings(set_cell(H100.read_text(), "GPU1", "GPU2", "NV12"), tmp_path)
    assert one_pair == [("warn", "GPU1-GPU2 shows 12 NVLink lanes where other pairs show 18")]


def test_a_bridged_pair_across_sockets_is_a_warning(tmp_path):
    found = _findings(set_numa(A6000.read_text(), "GPU1", "1"), tmp_path)
    assert found == [("warn", "GPU0-GPU1 are bridged by NVLink but sit on NUMA nodes 0 and 1: their host "
                              "transfers cross the socket link")]


def test_a_gpu_without_its_near_nic_on_a_multi_nic_machine(tmp_path):
    # HGX H100: each GPU has a NIC on its own switch (PIX); GPU3's is moved across the host.
    text = HGX.read_text()
    lines = text.split("\n")
    header = next(l for l in lines if l.split()[:1] == ["GPU0"] and "X" not in l.split())
    row = next(l for l in lines if l.split()[:1] == ["GPU3"] and "X" in l.split())
    nic = next(c for c, tok in zip(header.split(), row.split()[1:]) if tok == "PIX")
    found = _findings(set_cell(text, "GPU3", nic, "NODE", both=False), tmp_path)
    assert found == [("warn", "GPU3 has no NIC on its PCIe switch (the nearest is NODE away) while other GPUs "
                              "do: its inter-node traffic crosses the host")]


def test_doctor_from_a_capture_prints_the_findings_and_fails(tmp_path):
    bad = tmp_path / "a6000.txt"
    bad.write_text(set_cell(A6000.read_text(), "GPU6", "GPU7", "SYS"))
    out = tmp_path / "doctor.json"
    p = subprocess.run([sys.executable, "-m", "orchestrator", "doctor", "--from", str(bad), "--from", str(H100),
                        "--out", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 1, p.stderr
    assert "fail" in p.stdout and "GPU6, GPU7 have no NVLink" in p.stdout
    import json

    report = json.loads(out.read_text())
    verdicts = {Path(n["source"]).name: n["verdict"] for n in report["nodes"]}
    assert verdicts == {"a6000.txt": "fail", H100.name: "ok"}
