"""The NVML probe reproduces real machines' matrices from what NVML (faked) reports."""

from __future__ import annotations

import json

import fake_pynvml as fake
import pytest

from orchestrator.topology.model import NodeTopology
from orchestrator.topology.nvml import NvmlUnavailable, cpu_list, normalize_bus_id, probe_nvml

MACHINES = {
    "topo_a100_8gpu_mlengineering.txt": fake.a100_nvswitch,
    "topo_h100_8gpu_mlengineering.txt": fake.h100_nvswitch,
    "topo_8x_rtxa6000_nvlink_pairs_unige3741.txt": fake.rtxa6000_pairs,
    "topo_4x_a100_nv4_nccltests331.txt": fake.a100_nv4_quad,
    "topo_4gpu_pcie_pxb_pix_nccl667.txt": fake.pcie_pxb_pix,
    "topo_8x4090_pcie_gpuallocator17.txt": fake.rtx4090_restricted,
}


def cell(node: NodeTopology, a: int, b: int) -> str:
    link = node.link(a, b)
    return f"nv{link.nvlinks}" if link.kind == "nvlink" else link.kind


@pytest.mark.parametrize("capture", sorted(MACHINES))
def test_probe_reproduces_capture_matrix(capture: str) -> None:
    node = probe_nvml(MACHINES[capture]())
    rows, cpus, _ = fake.read_capture(fake.FIXTURES / capture)
    node.check()
    assert node.source == "nvml"
    assert [d.index for d in node.devices] == list(range(len(rows)))
    for a in range(len(rows)):
        for b in range(a + 1, len(rows)):
            assert cell(node, a, b) == rows[a][b], f"{capture}: GPU{a}-GPU{b}"
        assert node.devices[a].cpu_affinity == cpus[a]
    for link in node.links:
        assert link.bandwidth_gbps > 0 and link.latency_us > 0
        assert (link.nvlinks == 0) == (link.kind != "nvlink")


def test_nvswitch_a100_every_pair_nv12_through_switch() -> None:
    node = probe_nvml(fake.a100_nvswitch())
    assert len(node.links) == 28
    for link in node.links:
        assert (link.kind, link.nvlinks, link.nvlink_gen, link.via_switch) == ("nvlink", 12, 3, True)
        assert link.bandwidth_gbps == pytest.approx(300.0)
        assert link.p2p is True
    assert node.nvlink_domains == [list(range(8))]
    assert node.devices[0].memory_bytes == 80 << 30
    assert node.devices[0].numa_node == 0 and node.devices[7].numa_node == 1
    assert node.numa_nodes == [0, 1]
    assert node.warnings == []


def test_nvswitch_h100_nv18_is_450_gbps() -> None:
    node = probe_nvml(fake.h100_nvswitch())
    link = node.link(3, 6)
    assert (link.nvlinks, link.nvlink_gen, link.bandwidth_gbps) == (18, 4, pytest.approx(450.0))
    assert node.devices[0].pcie_gen == 5


def test_a6000_bridges_pair_domains_and_remote_type_inferred() -> None:
    node = probe_nvml(fake.rtxa6000_pairs())
    assert node.nvlink_domains == [[0, 1], [2, 3], [4, 5], [6, 7]]
    bridge = node.link(0, 1)
    assert (bridge.kind, bridge.nvlinks, bridge.via_switch) == ("nvlink", 4, False)
    assert bridge.bandwidth_gbps == pytest.approx(56.25)
    assert node.link(0, 2).kind == "node" and node.link(0, 4).kind == "sys"
    assert node.link(0, 2).bandwidth_gbps > node.link(0, 4).bandwidth_gbps
    assert node.devices[3].uuid == fake.A6000_UUIDS[3]
    # The driver lacks the remote-type call: inferred from the remote bus id, and said so once.
    assert [w for w in node.warnings if "RemoteDeviceType" in w] == [
        "NVML nvmlDeviceGetNvLinkRemoteDeviceType: Function Not Found (GPU0, GPU1, GPU2, GPU3, GPU4, GPU5, GPU6, GPU7)"
    ]


def test_pcie_machine_paths_and_bandwidth_order() -> None:
    node = probe_nvml(fake.pcie_pxb_pix())
    assert node.nvlink_domains == []
    pix, pxb, sys_ = node.link(2, 3), node.link(0, 1), node.link(1, 2)
    assert (pix.kind, pxb.kind, sys_.kind) == ("pix", "pxb", "sys")
    # PCIe Gen3 x16 is 15.75 GB/s; a single switch keeps it all.
    assert pix.bandwidth_gbps == pytest.approx(15.75)
    assert pix.bandwidth_gbps > pxb.bandwidth_gbps > sys_.bandwidth_gbps
    assert node.devices[2].cpu_affinity == "28-55,84-111"


def test_failing_calls_cost_only_their_fact() -> None:
    node = probe_nvml(fake.rtx4090_restricted())
    assert len(node.devices) == 8 and len(node.links) == 28
    assert all(l.kind == "sys" for l in node.links)
    assert node.devices[0].numa_node is None  # memory affinity was refused
    assert node.devices[0].cpu_affinity == "0-55,112-167"  # ...but CPU affinity still came
    assert node.devices[0].pcie_gen == 4  # from the current link state
    text = "\n".join(node.warnings)
    assert "nvmlDeviceGetMemoryAffinity: Insufficient Permissions" in text
    assert "nvmlDeviceGetGpuFabricInfoV: Function Not Found" in text
    assert "current link state" in text
    # NotSupported NVLink/MIG is the normal answer of a GeForce board, not a warning.
    assert "NvLinkState" not in text and "MigMode" not in text
    # The driver claims P2P across sockets: recorded, and flagged as unproven.
    assert node.link(0, 7).p2p is True
    assert "inter-socket" in text and "probe --measure" in text


def test_p2p_status_read_index_tuple_is_unwrapped() -> None:
    nv = fake.pcie_pxb_pix()
    nv.p2p_read = {(0, 1): fake.NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED}
    node = probe_nvml(nv)
    assert node.link(0, 1).p2p is False and node.link(2, 3).p2p is True


def test_mig_turns_nvlink_off() -> None:
    nv = fake.a100_nvswitch()
    nv.gpus[2].mig = True
    node = probe_nvml(nv)
    assert node.devices[2].mig is True
    assert node.link(2, 5).kind in ("node", "sys") and node.link(2, 5).nvlinks == 0
    assert node.link(1, 5).nvlinks == 12
    assert node.nvlink_domains == [[0, 1, 3, 4, 5, 6, 7]]
    assert any("MIG" in w for w in node.warnings)


def test_inactive_links_lower_the_switch_pair_count() -> None:
    nv = fake.h100_nvswitch()
    for link in nv.gpus[4].nvlinks[:6]:
        link.active = False
    node = probe_nvml(nv)
    assert node.link(4, 5).nvlinks == 12 and node.link(0, 5).nvlinks == 18


def test_fabric_clique_for_nvl72() -> None:
    nv = fake.h100_nvswitch()
    uuid = bytes(range(1, 17))
    for g in nv.gpus:
        g.fabric = (uuid, 7)
    node = probe_nvml(nv)
    assert node.devices[0].fabric_clique == "01020304-0506-0708-090a-0b0c0d0e0f10/7"


def test_topology_common_ancestor_missing_falls_back_to_numa() -> None:
    nv = fake.pcie_pxb_pix()
    nv.failing["nvmlDeviceGetTopologyCommonAncestor"] = fake.NVMLError_NoPermission
    node = probe_nvml(nv)
    assert node.link(0, 1).kind == "node" and node.link(1, 2).kind == "sys"
    assert any("assumed 'node'" in w for w in node.warnings)


def test_no_driver_is_unavailable() -> None:
    nv = fake.pcie_pxb_pix()
    nv.failing["nvmlInit"] = fake.NVMLError_DriverNotLoaded
    with pytest.raises(NvmlUnavailable, match="Driver Not Loaded"):
        probe_nvml(nv)


def test_json_round_trip_keeps_contract() -> None:
    node = probe_nvml(fake.a100_nv4_quad())
    d = json.loads(json.dumps(node.to_dict()))
    assert d["links"][0] == {**d["links"][0], "a": 0, "b": 1, "kind": "nvlink", "nvlinks": 4}
    assert NodeTopology.from_dict(d).link(2, 3).bandwidth_gbps == pytest.approx(100.0)


def test_helpers() -> None:
    assert cpu_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert normalize_bus_id("00000000:1A:00.0") == "0000:1a:00.0"
