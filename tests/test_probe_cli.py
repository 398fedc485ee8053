"""`python -m orchestrator probe --from FILE`: the JSON contract, the pictures, bad input."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from orchestrator import cli
from orchestrator.cli import main
from orchestrator.topology.bandwidth import estimate

FIX = Path(__file__).parent / "fixtures" / "topology"


@pytest.fixture(autouse=True)
def _only_probe(monkeypatch):
    # The parser imports every command module; these tests are about `probe` alone.
    monkeypatch.setattr(cli, "COMMANDS", {"probe": cli.COMMANDS["probe"]})


def _probe(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["probe", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_contract(capsys):
    code, out, _ = _probe(capsys, "--from", str(FIX / "topo_4x_a100_nv4_nccltests331.txt"), "--json")
    assert code == 0
    data = json.loads(out)
    assert set(data) == {"nodes", "network"}
    (node,) = data["nodes"]
    assert [d["index"] for d in node["devices"]] == [0, 1, 2, 3]
    pairs = [(l["a"], l["b"]) for l in node["links"]]
    assert pairs == [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
    assert node["links"][0] | {"kind": "nvlink", "nvlinks": 4, "bandwidth_gbps": 100.0} == node["links"][0]
    assert [n["name"] for n in node["nics"]] == ["mlx5_0", "mlx5_1", "NIC2", "NIC3"]
    assert node["nics"][0]["gpu_paths"] == {"0": "pxb", "1": "sys", "2": "sys", "3": "sys"}
    assert node["nvlink_domains"] == [[0, 1, 2, 3]]


def test_json_pcie_paths_have_zero_nvlinks_and_warnings_go_to_stderr(capsys):
    code, out, err = _probe(capsys, "--from", str(FIX / "topo_dgx_a100_40gb_nics_nccl1505_PARTIAL.txt"), "--json")
    assert code == 0
    node = json.loads(out)["nodes"][0]
    assert len(node["devices"]) == 4 and len(node["links"]) == 6
    assert any("partial capture" in w for w in node["warnings"])
    assert "warning:" in err and "partial capture" in err
    # p5's XML names no GPU model: its PCI paths stand, and stderr says NVLink is not in the file.
    code, out, err = _probe(capsys, "--from", str(FIX / "nccl_xml_aws_p5.48xl-topo.xml"), "--json")
    links = json.loads(out)["nodes"][0]["links"]
    assert len(links) == 28 and {l["nvlinks"] for l in links} == {0}
    assert {l["kind"] for l in links} == {"phb"}
    assert "NVLink is not in this file" in err and "--gpu" in err


def test_gpu_name_and_nvlink_status_refine_a_capture(capsys):
    code, out, _ = _probe(capsys, "--from", str(FIX / "topo_8x_rtxa6000_nvlink_pairs_unige3741.txt"),
                          "--nvlink-status", str(FIX / "nvlink_status_8x_rtxa6000_unige3741.txt"), "--json")
    assert code == 0
    node = json.loads(out)["nodes"][0]
    assert node["links"][0]["bandwidth_gbps"] == pytest.approx(56.248)
    assert node["devices"][0]["name"] == "NVIDIA RTX A6000"
    code, out, _ = _probe(capsys, "--from", str(FIX / "topo_h100_8gpu_mlengineering.txt"),
                          "--gpu-name", "NVIDIA B200", "--json")
    assert json.loads(out)["nodes"][0]["links"][0]["bandwidth_gbps"] == 900.0  # 18 lanes of NVLink 5


def test_default_text_output(capsys):
    code, out, _ = _probe(capsys, "--from", str(FIX / "topo_4gpu_pcie_pxb_pix_nccl667.txt"))
    assert code == 0
    assert "4 GPU(s)" in out and "NVLink domains: none (PCIe only)" in out
    row = [l for l in out.splitlines() if l.startswith("GPU2 ")][-1]  # the matrix follows the device table
    assert row.split()[1:] == ["SYS", "12.6", "SYS", "12.6", "X", "PIX", "31.5"]


def test_svg_is_written_and_parses(capsys, tmp_path):
    out_svg = tmp_path / "topo.svg"
    code, out, _ = _probe(capsys, "--from", str(FIX / "topo_hgx_h100_nics_nccl1264.txt"), "--svg", str(out_svg))
    assert code == 0 and f"picture written to {out_svg}" in out
    root = ET.parse(out_svg).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    ns = {"s": "http://www.w3.org/2000/svg"}
    assert len(root.findall(".//s:rect[@class='dev']", ns)) == 8
    assert len(root.findall(".//s:g/s:rect[@class='nic']", ns)) == 10


@pytest.mark.parametrize("content, message", [
    ("", "line 1, column 1: the file is empty"),
    ("garbage\x00\x01 here\n", "line 1, column 1: no `nvidia-smi topo -m` header"),
    ("\tGPU0\tGPU1\nGPU0\t X \tPIX\nGPU1\tPIX\tQQQ\n", "line 3, column 10: GPU1/GPU1 is 'QQQ'"),
    ('{"nodes": [{"devices": [', "invalid JSON"),
    ("<system><cpu numaid='0'>\n<pci", "line 2, column 1: not well-formed XML: unclosed token"),
])
def test_bad_file_exits_2_with_one_line(capsys, tmp_path, content, message):
    f = tmp_path / "capture.txt"
    f.write_text(content)
    code, out, err = _probe(capsys, "--from", str(f), "--json")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"error: {f}") and message in err
    assert "Traceback" not in err


def test_missing_file_and_flags_that_need_a_live_cluster(capsys, tmp_path):
    code, _, err = _probe(capsys, "--from", str(tmp_path / "none.txt"))
    assert code == 2 and err == f"error: {tmp_path / 'none.txt'}: topology file not found\n"
    code, _, err = _probe(capsys, "--from", str(FIX / "topo_4gpu_pcie_pxb_pix_nccl667.txt"), "--measure")
    assert code == 2 and "--measure and --address probe a live cluster" in err


@pytest.mark.skipif(
    any(importlib.util.find_spec(f"orchestrator.commands.{m}") is None for m, _ in cli.COMMANDS.values()),
    reason="python -m orchestrator needs every command module",
)
def test_module_entry_point_prints_no_traceback(tmp_path):
    bad = tmp_path / "bad.xml"
    bad.write_text("<system>")
    done = subprocess.run([sys.executable, "-m", "orchestrator", "probe", "--from", str(bad)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().count("\n") == 0 and "Traceback" not in done.stderr


def test_without_from_probes_the_cluster_it_connects_to(capsys, monkeypatch):
    import contextlib

    import orchestrator.connect.cluster
    import orchestrator.topology.cluster_probe as cp
    from orchestrator.topology.model import ClusterTopology, cpu_node

    calls = []

    @contextlib.contextmanager
    def fake_connect(address, **_):
        calls.append(("connect", address))
        yield None
        calls.append(("disconnect", address))

    def fake_probe(measure=False, num_cpu_slots=0):
        calls.append(("probe", measure))
        return ClusterTopology(nodes=[cpu_node(2, hostname="a", node_id="n1"), cpu_node(3, hostname="a", node_id="n2")])

    monkeypatch.setattr(orchestrator.connect.cluster, "connect", fake_connect)
    monkeypatch.setattr(cp, "probe_cluster", fake_probe)
    code, out, _ = _probe(capsys, "--address", "auto", "--measure", "--json")
    assert code == 0
    assert calls == [("connect", "auto"), ("probe", True), ("disconnect", "auto")]
    data = json.loads(out)
    assert [n["node_id"] for n in data["nodes"]] == ["n1", "n2"]
    assert [len(n["links"]) for n in data["nodes"]] == [1, 3]
    code, out, _ = _probe(capsys)
    shm_gbps, _ = estimate("shm")
    assert code == 0 and calls[-2] == ("probe", False) and "3 CPU slot(s)" in out and f"SHM {shm_gbps:g}" in out
