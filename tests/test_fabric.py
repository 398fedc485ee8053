"""NCCL XML of NVSwitch VMs has no NVLink: probe and plan say so, and the GPU model (or a
`topo -m` of the same machine) puts the NVSwitch fabric back; PCIe parts stay PCIe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.cli import main
from orchestrator.topology.fabric import nvswitch_fabric
from orchestrator.topology.files import load_topology_file

FIX = Path(__file__).parent / "fixtures" / "topology"
P4D = str(FIX / "nccl_xml_aws_p4d-24xl-topo.xml")
P5 = str(FIX / "nccl_xml_aws_p5.48xl-topo.xml")
G5 = str(FIX / "nccl_xml_aws_g5.48xl-topo.xml")
H100_MATRIX = str(FIX / "topo_h100_8gpu_mlengineering.txt")
JOB = str(Path(__file__).parent.parent / "jobs" / "llm.yaml")


def _run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("name, fabric", [
    ("NVIDIA A100-SXM4-40GB", (3, 12)), ("NVIDIA A100-SXM4-80GB", (3, 12)), ("A100-40GB", (3, 12)),
    ("NVIDIA H100 80GB HBM3", (4, 18)), ("H100", (4, 18)), ("NVIDIA H200", (4, 18)), ("NVIDIA B200", (5, 18)),
    ("NVIDIA A100-PCIE-40GB", None), ("NVIDIA A100 80GB PCIe", None), ("NVIDIA H100 PCIe", None),
    ("H100-PCIe", None), ("NVIDIA H100 NVL", None), ("NVIDIA A10G", None), ("Tesla V100-SXM2-16GB", None),
])
def test_sxm_parts_imply_nvswitch_and_pcie_parts_do_not(name, fabric):
    got = nvswitch_fabric(name)
    assert ((got.nvlink_gen, got.lanes_per_gpu) if got else None) == fabric


def test_p5_xml_says_nvlink_is_missing_and_the_gpu_model_adds_the_fabric(capsys):
    code, out, _ = _run(capsys, "probe", "--from", P5)
    assert code == 0
    assert "NVLink domains: none" in out
    assert "NVLink is not in this file" in out and "--gpu" in out
    code, out, _ = _run(capsys, "probe", "--from", P5, "--gpu", "NVIDIA H100 80GB HBM3", "--json")
    node = json.loads(out)["nodes"][0]
    assert node["nvlink_domains"] == [list(range(8))]
    assert {(l["kind"], l["nvlinks"], l["bandwidth_gbps"], l["via_switch"]) for l in node["links"]} == {
        ("nvlink", 18, 450.0, True)}
    assert len(node["nics"]) == 32  # the XML's NICs stay
    assert any("NVLink is not in this file" in w and "assumed NVLink 4" in w for w in node["warnings"])


def test_p4d_xml_is_named_by_its_pci_device_id_and_a_pcie_part_stays_pcie():
    node = load_topology_file(P4D)
    assert {d.name for d in node.devices} == {"NVIDIA A100-SXM4-40GB"}
    assert node.nvlink_domains == [list(range(8))]
    assert node.link(0, 7).kind == "nvlink" and node.link(0, 7).bandwidth_gbps == pytest.approx(300.0)
    assert any("PCI device id" in w for w in node.warnings)
    pcie = load_topology_file(P4D, gpu_name="NVIDIA A100-PCIE-40GB")
    assert pcie.nvlink_domains == [] and {l.kind for l in pcie.links} == {"pix", "phb", "sys"}
    assert any("does not ship on an NVSwitch board" in w for w in pcie.warnings)


def test_g5_a10g_stays_pcie():
    node = load_topology_file(G5, gpu_name="NVIDIA A10G")
    assert node.nvlink_domains == [] and not any(l.kind == "nvlink" for l in node.links)
    assert not any("NVSwitch" in w or "NVLink" in w for w in node.warnings)


def test_plan_on_p5_xml_says_what_it_assumed_and_plans_on_nvlink(capsys):
    def comm_ms(gpu: str) -> tuple[float, str]:
        code, out, err = _run(capsys, "plan", JOB, "--topology", P5, "--gpu", gpu, "--json")
        assert code == 0
        return json.loads(out)["step_time"]["comm_s"] * 1e3, err

    nvswitch, err = comm_ms("NVIDIA H100 80GB HBM3")
    assert "topology warning:" in err and "ships on NVSwitch boards" in err
    pcie, err = comm_ms("NVIDIA H100 PCIe")
    assert "does not ship on an NVSwitch board" in err
    assert pcie > 5 * nvswitch
    code, out, _ = _run(capsys, "plan", JOB, "--topology", P5, "--gpu", "H100")
    assert code == 0 and "topology warning:" in out and "NVLink is not in this file" in out


def test_xml_and_topo_matrix_of_one_machine_merge(capsys):
    code, out, _ = _run(capsys, "probe", "--from", P5, "--from", H100_MATRIX, "--json")
    assert code == 0
    node = json.loads(out)["nodes"][0]
    assert node["nvlink_domains"] == [list(range(8))]
    assert {l["kind"] for l in node["links"]} == {"nvlink"} and {l["nvlinks"] for l in node["links"]} == {18}
    assert len(node["nics"]) == 32 and node["devices"][0]["pci_bus_id"] == "0000:4f:00.0"
    assert not any("NVLink is not in this file" in w for w in node["warnings"])
    assert any("NVLink from" in w for w in node["warnings"])
    code, _, err = _run(capsys, "probe", "--from", P5, "--from", str(FIX / "topo_4gpu_pcie_pxb_pix_nccl667.txt"))
    assert code == 2 and "8 and 4 GPUs" in err and len(err.strip().splitlines()) == 1
    code, _, err = _run(capsys, "probe", "--from", P5, "--from", P4D)
    assert code == 2 and "xml and xml" in err


def test_the_aws_p4d_shape_plans_from_aws_xml_on_the_nvswitch(capsys, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("name: p4d\ndefaults: [cluster/aws-p4d]\n")
    code, out, err = _run(capsys, "plan", str(job), "--json")
    assert code == 0 and json.loads(out)["world_size"] == 8
    assert "aws-p4d-24xl-nccl.xml" in err and "NVIDIA A100-SXM4-40GB (given) ships on NVSwitch boards" in err
