"""NCCL's settings from the probe: the topology XML we write reads back to the same PCI tree,
which nodes get which variables, a user's NCCL_* kept; declared NICs a node lacks; where a
remote run's directory goes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from orchestrator.connect.remote import REMOTE_RUN_ENV
from orchestrator.record.rundir import anchored
from orchestrator.runtime import nccl_env
from orchestrator.topology.files import load_topology_file
from orchestrator.topology.local import MISSING_NIC_WARNING, TOPOLOGY_FILE_ENV, probe_local
from orchestrator.topology.model import Nic
from orchestrator.topology.nccl_write import nccl_topology_xml
from orchestrator.topology.nccl_xml import parse_nccl_xml

FIX = Path(__file__).parent / "fixtures" / "topology"


def _with_bus_ids_and_nics():
    """The 4-GPU PCIe capture (PXB pair, PIX pair, SYS between) with bus ids and three NICs."""
    node = load_topology_file(FIX / "topo_4gpu_pcie_pxb_pix_nccl667.txt")
    for d in node.devices:
        d.pci_bus_id = f"00000000:{0x18 + 0x20 * d.index:02X}:00.0"  # NVML's spelling
        d.pcie_gen, d.pcie_width = 4, 16
    for i, (kind, gpus) in enumerate((("pxb", (0, 1)), ("pxb", (0, 1)), ("pix", (2, 3)))):
        paths = {g: kind if g in gpus else "sys" for g in range(4)}
        node.nics.append(Nic(name=f"mlx5_{i}", kind="infiniband", pci_bus_id=f"0000:{0x1a + 0x40 * i:02x}:00.0",
                             numa_node=0 if gpus[0] < 2 else 1, gpu_paths=paths))
    return node


def _shape(node, pairs=None):
    """The PCI tree: PCIe path kinds between GPUs (of `pairs` only, when given) and NIC-to-GPU paths.
    NVLink is not part of it (the file leaves NVLink for NCCL to find through NVML)."""
    links = {(l.a, l.b): l.kind for l in node.links if l.kind != "nvlink"}
    if pairs is not None:
        links = {p: k for p, k in links.items() if p in pairs}
    return links, {n.pci_bus_id.lower(): n.gpu_paths for n in node.nics if n.pci_bus_id}


@pytest.mark.parametrize("node", [
    load_topology_file(FIX / "nccl_xml_aws_p4d-24xl-topo.xml"),
    load_topology_file(FIX / "nccl_xml_aws_p5.48xl-topo.xml"),
    _with_bus_ids_and_nics(),
], ids=["p4d", "p5", "declared-4gpu"])
def test_written_xml_reads_back_to_the_same_pci_tree(node):
    text = nccl_topology_xml(node)
    back = parse_nccl_xml(text)
    assert [d.pci_bus_id for d in back.devices] == [f"0000:{d.pci_bus_id.split(':', 1)[1].lower()}"
                                                    for d in node.devices]
    original = _shape(node)
    assert _shape(back, pairs=set(original[0])) == original
    # only <cpu> and <pci>: GPUs and NICs are for NCCL to discover, as its maintainers advise
    assert "<gpu" not in text and "<nic" not in text and "<nvlink" not in text


def test_an_xml_needs_every_gpus_bus_id():
    with pytest.raises(ValueError, match="GPU.s. 0, 1, 2, 3 have no PCI bus id"):
        nccl_topology_xml(load_topology_file(FIX / "topo_4gpu_pcie_pxb_pix_nccl667.txt"))


def test_which_nodes_get_which_settings():
    declared = _with_bus_ids_and_nics()
    declared.source = "declared:/etc/node.json"
    s = nccl_env.nccl_setup(declared, multi_node=True)
    assert s.topo_xml == nccl_topology_xml(declared) and s.socket_ifname and not s.note
    xml = load_topology_file(FIX / "nccl_xml_aws_p5.48xl-topo.xml")
    xml.source = "declared:/opt/p5-topo.xml"
    assert nccl_env.nccl_setup(xml, multi_node=False) == nccl_env.NcclSetup(topo_file="/opt/p5-topo.xml")
    no_ids = load_topology_file(FIX / "topo_4gpu_pcie_pxb_pix_nccl667.txt")
    no_ids.source = "declared:/etc/smi.txt"
    s = nccl_env.nccl_setup(no_ids, multi_node=True)
    assert s.topo_xml is None and s.topo_file is None and "gives no PCI bus id for GPU(s) 0, 1, 2, 3" in s.note
    probed = _with_bus_ids_and_nics()
    probed.source = "nvml"  # NCCL reads the same tree: nothing to tell it
    assert nccl_env.nccl_setup(probed, multi_node=False) == nccl_env.NcclSetup()


def test_apply_sets_what_the_user_did_not_and_reports_it(monkeypatch, tmp_path):
    for k in list(os.environ):
        if k.startswith("NCCL_"):
            monkeypatch.delenv(k)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    setup = nccl_env.nccl_setup(_declared(), multi_node=True)
    got, notes = nccl_env.apply(setup, "127.0.0.1")
    # NCCL matches a bare name as a prefix (eth0 would take eth0.100 too): `=` names exactly one.
    assert got["NCCL_SOCKET_IFNAME"] == "=lo" and not notes
    assert Path(got["NCCL_TOPO_FILE"]).read_text() == setup.topo_xml
    assert Path(got["NCCL_TOPO_FILE"]).parent.parent == tmp_path
    # A user's own setting wins, whatever we would have chosen.
    monkeypatch.setenv("NCCL_TOPO_FILE", "/mine.xml")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "=eth9")
    monkeypatch.setenv("NCCL_IB_HCA", "mlx5_0")
    got, _ = nccl_env.apply(setup, "127.0.0.1")
    assert got == {"NCCL_IB_HCA": "mlx5_0", "NCCL_SOCKET_IFNAME": "=eth9", "NCCL_TOPO_FILE": "/mine.xml"}


def test_a_declared_wiring_of_another_machine_is_not_handed_to_nccl(monkeypatch, tmp_path):
    for k in list(os.environ):
        if k.startswith("NCCL_"):
            monkeypatch.delenv(k)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    setup = nccl_env.nccl_setup(_declared(), multi_node=False)
    got, notes = nccl_env.apply(setup, "127.0.0.1", gpu_bus_id="00000000:18:00.0")  # GPU0 as NVML spells it
    assert "NCCL_TOPO_FILE" in got and not notes
    monkeypatch.delenv("NCCL_TOPO_FILE")
    got, notes = nccl_env.apply(setup, "127.0.0.1", gpu_bus_id="00000000:C1:00.0")
    assert "NCCL_TOPO_FILE" not in got and "does not name this GPU's PCI bus id 0000:c1:00.0" in notes[0]


def _declared():
    node = _with_bus_ids_and_nics()
    node.source = "declared:/etc/node.json"
    return node


def test_declared_nics_the_node_lacks_are_named(monkeypatch, tmp_path):
    path = tmp_path / "node.json"
    path.write_text(json.dumps(_with_bus_ids_and_nics().to_dict()))
    (tmp_path / "sys/class/infiniband/mlx5_0").mkdir(parents=True)
    (tmp_path / "sys/class/net/mlx5_2").mkdir(parents=True)
    monkeypatch.setenv(TOPOLOGY_FILE_ENV, str(path))
    node = probe_local(sysfs_root=tmp_path)
    warned = [w for w in node.warnings if MISSING_NIC_WARNING in w]
    assert len(warned) == 1 and ": mlx5_1 (" in warned[0]
    assert [n.name for n in node.nics] == ["mlx5_0", "mlx5_1", "mlx5_2"]  # kept: the plan is still made


def test_remote_runs_land_in_the_heads_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv(REMOTE_RUN_ENV, raising=False)
    assert anchored("runs") == "runs"  # a local run: relative to where `submit` runs
    monkeypatch.setenv(REMOTE_RUN_ENV, "1")
    assert anchored("runs") == str(tmp_path / "runs")
    assert anchored("/fsx/runs") == "/fsx/runs" and anchored("s3://b/runs") == "s3://b/runs"
    assert anchored("~/x") == str(tmp_path / "x") and anchored(None) is None
