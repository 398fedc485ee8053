"""The capture parsers against the real captures in tests/fixtures/topology."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from orchestrator.errors import TopologyError
from orchestrator.topology.files import load_cluster_file, load_topology_file
from orchestrator.topology.model import ClusterTopology, all_pairs
from orchestrator.topology.nccl_xml import parse_nccl_xml, read_nccl_system
from orchestrator.topology.nvlink_status import parse_nvlink_status, refine_nvlink_bandwidth
from orchestrator.topology.render import render_svg, render_text
from orchestrator.topology.smi import parse_topo_matrix

FIX = Path(__file__).parent / "fixtures" / "topology"
COMPLETE = sorted(p for p in FIX.glob("topo_*.txt") if "PARTIAL" not in p.name)
KINDS = {"PIX": "pix", "PXB": "pxb", "PHB": "phb", "NODE": "node", "SYS": "sys"}
PCIE_GEN4_X16 = 31.5


def _file_matrix(text: str) -> tuple[list[str], dict[str, list[str]], dict[str, str]]:
    """Columns, row cells and NIC legend, read straight off the capture's text."""
    lines = text.splitlines()
    header = next(l for l in lines if l.split()[:1] == ["GPU0"] and "X" not in l.split())
    columns = [t for t in header.split("CPU Affinity")[0].split()]
    rows = {}
    for l in lines:
        t = l.split()
        if t and t[0] in columns and t[0] not in rows and "X" in t:
            rows[t[0]] = t[1 : 1 + len(columns)]
    legend = dict(re.findall(r"^\s*(NIC\d+):\s*(\S+)\s*$", text, flags=re.M))
    return columns, rows, legend


@pytest.mark.parametrize("path", COMPLETE, ids=lambda p: p.stem)
def test_complete_capture_parses_to_exactly_its_matrix(path):
    text = path.read_text()
    node = parse_topo_matrix(text, source=path.name)
    columns, rows, legend = _file_matrix(text)
    gpus = [c for c in columns if c.startswith("GPU")]
    nics = [c for c in columns if not c.startswith("GPU")]

    assert [d.index for d in node.devices] == list(range(len(gpus)))
    assert len(node.links) == len(gpus) * (len(gpus) - 1) // 2
    for a, b in all_pairs(range(len(gpus))):
        cell = rows[f"GPU{a}"][b]
        link = node.link(a, b)
        if cell.startswith("NV"):
            assert (link.kind, link.nvlinks) == ("nvlink", int(cell[2:])), (a, b, cell)
            assert link.bandwidth_gbps == pytest.approx(25.0 * link.nvlinks)
        else:
            assert (link.kind, link.nvlinks) == (KINDS[cell], 0), (a, b, cell)
            assert 5.0 <= link.bandwidth_gbps <= PCIE_GEN4_X16
        assert link.latency_us > 0
    assert [n.name for n in node.nics] == [legend.get(c, c) for c in nics]
    for col, nic in zip(nics, node.nics):
        assert nic.gpu_paths == {g: KINDS[rows[f"GPU{g}"][columns.index(col)]] for g in range(len(gpus))}
    assert not [w for w in node.warnings if "partial" in w]


def test_nvswitch_and_nvlink_figures_match_the_reference_table():
    a100 = parse_topo_matrix((FIX / "topo_a100_8gpu_mlengineering.txt").read_text(), gpu_names="NVIDIA A100-SXM4-80GB")
    h100 = parse_topo_matrix((FIX / "topo_h100_8gpu_mlengineering.txt").read_text(), gpu_names="NVIDIA H100 80GB HBM3")
    assert {(l.bandwidth_gbps, l.nvlink_gen, l.via_switch) for l in a100.links} == {(300.0, 3, True)}
    assert {(l.bandwidth_gbps, l.nvlink_gen, l.via_switch) for l in h100.links} == {(450.0, 4, True)}
    assert a100.nvlink_domains == [list(range(8))] == h100.nvlink_domains
    assert not a100.warnings  # the model was named, so no rate was assumed
    quad = parse_topo_matrix((FIX / "topo_4x_a100_nv4_nccltests331.txt").read_text())
    assert quad.nvlink_domains == [[0, 1, 2, 3]]
    assert not any(l.via_switch for l in quad.links)  # 3 peers x NV4 = 12 lanes: direct links
    assert any("does not name the GPU model" in w for w in quad.warnings)


def test_rtx_a6000_bridges_pair_up_and_carry_14_gbps_per_lane():
    text = (FIX / "topo_8x_rtxa6000_nvlink_pairs_unige3741.txt").read_text()
    node = parse_topo_matrix(text, gpu_names="NVIDIA RTX A6000")
    assert node.nvlink_domains == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert node.link(0, 1).bandwidth_gbps == pytest.approx(4 * 14.0625)
    assert node.link(0, 2).kind == "node" and node.link(0, 4).kind == "sys"
    assert node.link(0, 2).bandwidth_gbps > node.link(0, 4).bandwidth_gbps  # NODE beats SYS
    assert [d.numa_node for d in node.devices] == [0] * 4 + [1] * 4
    assert node.devices[4].cpu_affinity == "64-127"
    assert node.numa_nodes == [0, 1]
    mlx = node.nics[0]
    assert mlx.name == "mlx5_0" and mlx.gpu_paths[6] == "phb" and mlx.numa_node == 1


def test_hgx_h100_one_pix_nic_per_gpu_and_tab_separated_columns():
    node = parse_topo_matrix((FIX / "topo_hgx_h100_nics_nccl1264.txt").read_text())
    pix = {g: n.name for n in node.nics for g, k in n.gpu_paths.items() if k == "pix"}
    assert pix == {0: "NIC0", 1: "NIC1", 2: "NIC2", 3: "NIC5", 4: "NIC6", 5: "NIC7", 6: "NIC8", 7: "NIC9"}
    assert {n.name for n in node.nics if set(n.gpu_paths.values()) == {"sys"}} == {"NIC3", "NIC4"}
    assert node.devices[7].cpu_affinity == "56-111,168-223" and node.devices[7].numa_node == 1


def test_pcie_only_machines():
    node = parse_topo_matrix((FIX / "topo_4gpu_pcie_pxb_pix_nccl667.txt").read_text())
    assert (node.link(0, 1).kind, node.link(2, 3).kind, node.link(1, 2).kind) == ("pxb", "pix", "sys")
    assert node.link(2, 3).bandwidth_gbps > node.link(0, 1).bandwidth_gbps > node.link(1, 2).bandwidth_gbps
    assert node.nvlink_domains == []
    rtx = parse_topo_matrix((FIX / "topo_8x4090_pcie_gpuallocator17.txt").read_text())
    assert {l.kind for l in rtx.links} == {"sys"}
    # Only the affinity columns tell the halves apart; the empty GPU NUMA ID field must not shift them.
    assert [d.cpu_affinity for d in rtx.devices] == ["0-55,112-167"] * 4 + ["56-111,168-223"] * 4
    assert [d.numa_node for d in rtx.devices] == [0] * 4 + [1] * 4


def test_partial_capture_gives_its_whole_rows_and_a_warning():
    node = parse_topo_matrix((FIX / "topo_dgx_a100_40gb_nics_nccl1505_PARTIAL.txt").read_text(), source="dgx")
    assert [d.index for d in node.devices] == [0, 1, 2, 3]
    node.check()
    assert {(l.kind, l.nvlinks) for l in node.links} == {("nvlink", 12)}
    assert all(l.via_switch for l in node.links)  # each GPU shows NV12 to 7 peers: an NVSwitch board
    assert len(node.nics) == 12 and node.nics[2].gpu_paths == {0: "sys", 1: "sys", 2: "pxb", 3: "pxb"}
    (partial,) = [w for w in node.warnings if "partial" in w]
    assert "8 GPUs" in partial and "GPU4-GPU7" in partial and "NIC rows" in partial


def test_capture_cut_inside_a_row_keeps_the_rows_before_it():
    text = (FIX / "topo_hgx_h100_nics_nccl1264.txt").read_text()
    cut = text[: text.index("\nGPU5\t") + 40]
    node = parse_topo_matrix(cut, source="cut")
    assert [d.index for d in node.devices] == [0, 1, 2, 3, 4]
    assert any("ends inside row GPU5" in w and "GPU5-GPU7" in w for w in node.warnings)


@pytest.mark.parametrize(
    "text, where",
    [
        ("", "line 1, column 1"),
        ("\n\n   \n", "line 1, column 1"),
        ("hello world\nthis is not a matrix\n", "line 1, column 1"),
        ("  GPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV4\t0-3\nGPU1\tNV4\t X \t0-3\n".replace("NV4\t0", "FOO\t0", 1),
         "line 2, column 10"),
        ("\tGPU0\tGPU1\nGPU0\t X \tPIX\nGPU1\tPIX\tPIX\n", "line 3, column 10"),
        ("\tGPU0\tGPU1\n", "line 1, column 1"),
        ("\tGPU0\tGPU2\nGPU0\t X \tPIX\n", "line 1, column 1"),
    ],
)
def test_bad_matrix_names_line_and_column(text, where):
    with pytest.raises(TopologyError, match=re.escape(f"cap: {where}")):
        parse_topo_matrix(text, source="cap")


def test_short_row_followed_by_more_rows_is_an_error_not_a_partial_capture():
    text = "\tGPU0\tGPU1\tGPU2\nGPU0\t X \tPIX\tSYS\nGPU1\tPIX\t X\nGPU2\tSYS\tSYS\t X \n"
    with pytest.raises(TopologyError, match="line 3.*row GPU1 has 2 of 3 cells"):
        parse_topo_matrix(text, source="cap")


def test_old_driver_names_nics_in_the_header_and_prints_soc():
    text = ("\tGPU0\tGPU1\tmlx5_0\tCPU Affinity\nGPU0\t X \tSOC\tPHB\t0-9\nGPU1\tSOC\t X \tSOC\t10-19\n"
            "mlx5_0\tPHB\tSOC\t X \t\n")
    node = parse_topo_matrix(text)
    assert node.link(0, 1).kind == "sys"
    assert node.nics[0].name == "mlx5_0" and node.nics[0].gpu_paths == {0: "phb", 1: "sys"}


# ---------------------------------------------------------------- nvidia-smi nvlink -s


def test_nvlink_status_reads_rates_and_inactive_lanes():
    h100 = parse_nvlink_status((FIX / "nvlink_status_h100_bottlerocket4418_gpu0.txt").read_text())
    assert h100[0].active_lanes == 18 and h100[0].lane_gbps == pytest.approx(26.562)
    assert h100[0].name == "NVIDIA H100 80GB HBM3"
    a100 = parse_nvlink_status((FIX / "nvlink_status_a100_nccltests228_gpu0.txt").read_text())
    assert (a100[0].active_lanes, a100[0].lane_gbps) == (12, 25.0)
    v100 = parse_nvlink_status((FIX / "nvlink_status_v100_degraded_azhpcdiag73.txt").read_text())
    assert list(v100) == [3] and v100[3].inactive == [3, 5] and v100[3].active_lanes == 4 and v100[3].uuid is None
    rtx = parse_nvlink_status((FIX / "nvlink_status_8x_rtxa6000_unige3741.txt").read_text())
    assert sorted(rtx) == list(range(8)) and {s.lane_gbps for s in rtx.values()} == {14.062}


def test_nvlink_status_refines_the_matrix():
    node = parse_topo_matrix((FIX / "topo_8x_rtxa6000_nvlink_pairs_unige3741.txt").read_text())
    assert node.link(0, 1).bandwidth_gbps == 100.0  # 25 GB/s per lane assumed: the matrix has no model
    refine_nvlink_bandwidth(node, parse_nvlink_status((FIX / "nvlink_status_8x_rtxa6000_unige3741.txt").read_text()))
    assert node.link(0, 1).bandwidth_gbps == pytest.approx(4 * 14.062)
    assert node.devices[0].name == "NVIDIA RTX A6000" and node.devices[0].uuid.startswith("GPU-1b574915")
    assert not node.warnings
    assert node.link(0, 2).kind == "node"  # PCIe paths untouched


def test_inactive_lanes_lower_the_link_and_warn():
    text = ("\tGPU0\tGPU1\tGPU2\tGPU3\nGPU0\t X \tNV6\tNV6\tNV6\nGPU1\tNV6\t X \tNV6\tNV6\n"
            "GPU2\tNV6\tNV6\t X \tNV6\nGPU3\tNV6\tNV6\tNV6\t X \n")
    node = parse_topo_matrix(text)
    status = parse_nvlink_status((FIX / "nvlink_status_v100_degraded_azhpcdiag73.txt").read_text())
    refine_nvlink_bandwidth(node, status)
    assert node.link(2, 3).nvlinks == 4 and node.link(2, 3).bandwidth_gbps == pytest.approx(4 * 25.781)
    assert node.link(0, 1).nvlinks == 6  # no status for GPUs 0 and 1: unchanged
    assert any("GPU 3: NVLink lane(s) 3, 5 inactive; 4 of 6 active" in w for w in node.warnings)


@pytest.mark.parametrize("text, where", [
    ("", "line 1, column 1"),
    ("\tLink 0: 25 GB/s\n", "line 1, column 2"),
    ("GPU 0: A100\n  Link 0: fast\n", "line 2, column 11"),
    ("GPU 0: A100\n  Link 0: 25 GB/s\n  Link 0: 25 GB/s\n", "line 3, column 3"),
])
def test_bad_nvlink_status_names_line_and_column(text, where):
    with pytest.raises(TopologyError, match=re.escape(f"st: {where}")):
        parse_nvlink_status(text, source="st")


# ---------------------------------------------------------------- NCCL topology XML


def test_p4d_xml_gives_gpus_switches_and_efa_nics():
    text = (FIX / "nccl_xml_aws_p4d-24xl-topo.xml").read_text()
    system = read_nccl_system(text)
    assert system.switches == ["ffff:ff:01.0", "ffff:ff:02.0", "ffff:ff:03.0", "ffff:ff:04.0"]
    node = parse_nccl_xml(text)
    assert [d.pci_bus_id for d in node.devices] == [
        "0000:10:1c.0", "0000:10:1d.0", "0000:20:1c.0", "0000:20:1d.0",
        "0000:90:1c.0", "0000:90:1d.0", "0000:a0:1c.0", "0000:a0:1d.0"]
    assert [d.numa_node for d in node.devices] == [0] * 4 + [1] * 4
    assert node.devices[0].cpu_affinity == "0-23,48-71" and node.devices[4].cpu_affinity == "24-47,72-95"
    assert (node.link(0, 1).kind, node.link(0, 2).kind, node.link(0, 4).kind) == ("pix", "phb", "sys")
    assert node.devices[0].pcie_gen == 3
    assert node.link(0, 1).bandwidth_gbps == pytest.approx(15.75)  # Gen3 x16, the file's link_speed
    assert [(n.kind, n.pci_bus_id) for n in node.nics] == [
        ("efa", "0000:10:1b.0"), ("efa", "0000:20:1b.0"), ("efa", "0000:90:1b.0"), ("efa", "0000:a0:1b.0")]
    assert node.nics[1].gpu_paths == {0: "phb", 1: "phb", 2: "pix", 3: "pix", 4: "sys", 5: "sys", 6: "sys", 7: "sys"}
    assert node.numa_nodes == [0, 1]


def test_p5_xml_gives_32_efa_nics_four_per_gpu():
    path = FIX / "nccl_xml_aws_p5.48xl-topo.xml"
    node = parse_nccl_xml(path.read_text())
    assert len(node.devices) == 8 and len(read_nccl_system(path.read_text()).switches) == 8
    assert len(node.nics) == 32 and {n.speed_gbps for n in node.nics} == {100.0}
    assert all(n.name.startswith("rdmap") and n.kind == "efa" for n in node.nics)
    for g in range(8):
        near = [n.name for n in node.nics if n.gpu_paths[g] == "pix"]
        assert len(near) == 4, (g, near)
    # GPUs hang off Gen4 switch uplinks: GPU-to-GPU traffic is bound by them, not the Gen5 GPU link.
    assert node.devices[0].pcie_gen == 5
    assert node.link(0, 1).kind == "phb" and node.link(0, 1).bandwidth_gbps == pytest.approx(31.5 * 0.75)
    assert load_cluster_file(path).network.bandwidth_gbps == pytest.approx(400.0)  # 32 x 100 Gbit


def test_g5_xml_without_classes_warns_instead_of_guessing():
    node = parse_nccl_xml((FIX / "nccl_xml_aws_g5.48xl-topo.xml").read_text())
    assert node.devices == [] and node.numa_nodes == [0, 1]
    assert any("9 PCI device(s) without a class" in w for w in node.warnings)


NVSWITCH_XML = """<system version="1">
  <cpu numaid="0" affinity="0000ffff">
    <pci busid="0000:07:00.0" class="0x030200" link_speed="16.0 GT/s PCIe" link_width="16">
      <gpu dev="0" sm="80" rank="0" gdr="1">
        <nvlink target="0000:c0:00.0" count="6" tclass="0x068000"/>
        <nvlink target="0000:c1:00.0" count="6" tclass="0x068000"/>
      </gpu>
    </pci>
    <pci busid="0000:0f:00.0" class="0x030200" link_speed="16.0 GT/s PCIe" link_width="16">
      <gpu dev="1" sm="80" rank="1" gdr="1">
        <nvlink target="0000:c0:00.0" count="6" tclass="0x068000"/>
        <nvlink target="0000:c1:00.0" count="6" tclass="0x068000"/>
      </gpu>
    </pci>
    <pci busid="0000:47:00.0" class="0x030200" link_speed="16.0 GT/s PCIe" link_width="16">
      <gpu dev="2" sm="80" rank="2" gdr="1"><nvlink target="0000:4e:00.0" count="4" tclass="0x030200"/></gpu>
    </pci>
    <pci busid="0000:4e:00.0" class="0x030200" link_speed="16.0 GT/s PCIe" link_width="16">
      <gpu dev="3" sm="80" rank="3" gdr="1"><nvlink target="0000:47:00.0" count="4" tclass="0x030200"/></gpu>
    </pci>
    <nic><net name="mlx5_0" dev="0" speed="200000" port="1" gdr="1"/></nic>
  </cpu>
</system>
"""


def test_xml_nvswitch_and_direct_nvlink():
    node = parse_nccl_xml(NVSWITCH_XML)
    sw = node.link(0, 1)
    assert (sw.kind, sw.nvlinks, sw.via_switch, sw.nvlink_gen, sw.bandwidth_gbps) == ("nvlink", 12, True, 3, 300.0)
    direct = node.link(2, 3)
    assert (direct.kind, direct.nvlinks, direct.via_switch, direct.bandwidth_gbps) == ("nvlink", 4, False, 100.0)
    assert node.link(0, 2).kind == "phb"
    assert node.nvlink_domains == [[0, 1], [2, 3]]
    assert read_nccl_system(NVSWITCH_XML).nvswitches == ["0000:c0:00.0", "0000:c1:00.0"]
    assert node.nics[0].name == "mlx5_0" and node.nics[0].speed_gbps == 200.0 and node.nics[0].kind == "infiniband"
    assert set(node.nics[0].gpu_paths.values()) == {"phb"}


@pytest.mark.parametrize("text, match", [
    ("<system><cpu numaid='0'>", r"line 1, column 25: not well-formed XML: no element found$"),
    ("<system>\n  <cpu numaid='0'></cpux>\n</system>", r"line 2, column 21: not well-formed XML: mismatched tag"),
    ("<topology/>", r"line 1, column 1: the root element is <topology>"),
    ("<system/>", r"no <cpu> element"),
    ("<system><cpu numaid='x'/></system>", r"numaid='x'"),
    ("<system><cpu numaid='0'><pci busid='0000:01:00.0' class='0x030200'/><pci busid='0000:01:00.0' class='0x030200'/>"
     "</cpu></system>", r"GPU bus id 0000:01:00.0 appears twice"),
    ("<system><cpu numaid='0'><pci busid='a' class='0x030200'><gpu dev='0'/></pci>"
     "<pci busid='b' class='0x030200'><gpu dev='0'/></pci></cpu></system>", r"share dev=0"),
])
def test_bad_xml_is_a_topology_error(text, match):
    with pytest.raises(TopologyError, match=match):
        parse_nccl_xml(text)


# ---------------------------------------------------------------- files


def test_files_sniff_every_format(tmp_path):
    smi = load_topology_file(FIX / "topo_4gpu_pcie_pxb_pix_nccl667.txt")
    xml = load_topology_file(FIX / "nccl_xml_aws_p4d-24xl-topo.xml")
    assert smi.num_devices == 4 and xml.num_devices == 8
    cluster = ClusterTopology(nodes=[smi, xml])
    (tmp_path / "c.json").write_text(cluster.to_json())
    (tmp_path / "n.json").write_text(json.dumps(xml.to_dict()))
    back = load_cluster_file(tmp_path / "c.json")
    assert back.to_dict() == cluster.to_dict()
    assert load_topology_file(tmp_path / "c.json").to_dict() == smi.to_dict()
    assert load_topology_file(tmp_path / "n.json").to_dict() == xml.to_dict()
    named = load_topology_file(FIX / "topo_8x_rtxa6000_nvlink_pairs_unige3741.txt", gpu_name="NVIDIA RTX A6000")
    assert named.link(0, 1).bandwidth_gbps == pytest.approx(56.25) and named.gpu_name == "NVIDIA RTX A6000"


@pytest.mark.parametrize("content, match", [
    ("", r"line 1, column 1: the file is empty"),
    ('{"nodes": [}', r"line 1, column 12: invalid JSON"),
    ('{"nodes": []}', r"`nodes` must be a non-empty list"),
    ('{"foo": 1}', r"has key `nodes` .* or `devices`"),
    ('{"devices": [{"index": 0, "colour": "red"}]}', r"unexpected keyword argument 'colour'"),
    ('{"devices": [{"index": 0}, {"index": 1}], "links": []}', r"every pair of devices needs one link"),
    ('{"devices": [{"index": 0}, {"index": 1}], "links": [{"a": 0, "b": 1, "kind": "warp"}]}',
     r"link kind must be one of"),
    ("GPU 0: A100\n\tLink 0: 25 GB/s\n", r"nvlink -s` output, which has lane rates but no topology"),
])
def test_bad_files_name_the_file_and_the_problem(tmp_path, content, match):
    f = tmp_path / "bad.topo"
    f.write_text(content)
    with pytest.raises(TopologyError, match=match) as e:
        load_cluster_file(f)
    assert str(e.value).startswith(str(f))


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(TopologyError, match="nope.json: topology file not found"):
        load_topology_file(tmp_path / "nope.json")
    with pytest.raises(TopologyError, match="is a directory"):
        load_topology_file(tmp_path)
    with pytest.raises(TopologyError, match="p2pBandwidthLatencyTest output"):
        load_topology_file(FIX / "p2pBandwidthLatencyTest_hgx_h100_nccl1264_PARTIAL.txt")


# ---------------------------------------------------------------- pictures


def test_render_text_shows_the_matrix_with_bandwidths():
    cluster = load_cluster_file(FIX / "topo_hgx_h100_nics_nccl1264.txt", gpu_name="NVIDIA H100 80GB HBM3")
    text = render_text(cluster)
    assert "8 GPU(s) · NVIDIA H100 80GB HBM3" in text
    assert "NVLink domains: [0-7]" in text
    assert "NUMA: 0: devices 0-3; 1: devices 4-7" in text
    matrix = [l for l in text.splitlines() if l.startswith("GPU3 ")]
    cells = matrix[-1].split()
    assert cells[:9] == ["GPU3", "NV18", "450", "NV18", "450", "NV18", "450", "X", "NV18"]
    assert cells[-10:] == ["SYS"] * 5 + ["PIX"] + ["SYS"] * 4
    assert re.search(r"NIC5\s+unknown\s+-\s+0\s+PIX to 3", text)


def test_render_svg_draws_devices_links_nics_and_numa(tmp_path):
    import xml.etree.ElementTree as ET

    ns = {"s": "http://www.w3.org/2000/svg"}
    pcie = load_cluster_file(FIX / "topo_8x_rtxa6000_nvlink_pairs_unige3741.txt")
    root = ET.fromstring(render_svg(pcie))
    assert len(root.findall(".//s:rect[@class='dev']", ns)) == 8
    assert len(root.findall(".//s:rect[@class='nic']", ns)) == 2 + 1  # two NICs and the legend swatch
    chords = root.findall(".//s:path[s:title]", ns)
    assert len(chords) == 28  # every pair drawn
    widths = {c.find("s:title", ns).text.split(":")[0]: float(c.get("stroke-width")) for c in chords}
    assert widths["0-1"] > widths["0-2"] > widths["0-4"]  # NVLink > NODE > SYS

    nvswitch = load_cluster_file(FIX / "topo_h100_8gpu_mlengineering.txt")
    root = ET.fromstring(render_svg(nvswitch))
    assert len(root.findall(".//s:rect[@class='hub']", ns)) == 1
    assert root.findall(".//s:path[s:title]", ns) == []  # the island is drawn as a hub, not 28 chords
    assert "NUMA 1: devices 4-7, CPUs 52-103" in ET.tostring(root, encoding="unicode")
