"""`nvidia-smi topo -m` captures as people paste them: under a shell prompt, with a comment or
quote mark on every line, in a Markdown code fence, with CRLF line ends, with an abridged `NUMA`
column; each reads exactly as the clean capture does. Other tools' output is named in one line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from orchestrator.errors import TopologyError
from orchestrator.topology.files import load_topology_file

FIX = Path(__file__).parent / "fixtures" / "topology"
COMPLETE = sorted(p for p in FIX.glob("topo_*.txt") if "PARTIAL" not in p.name)


def _prefixed(mark: str):
    return lambda text: "".join(f"{mark}{line}" for line in text.splitlines(keepends=True))


PASTES = {
    "user prompt": lambda t: "[alice@gpu-node-07 ~]$ nvidia-smi topo -m\n" + t,
    "root prompt": lambda t: "root@gpu-node-07:~# nvidia-smi topo -m\n" + t,
    "hash on every line": _prefixed("# "),
    "bare hash": _prefixed("#"),
    "markdown quote": _prefixed("> "),
    "nested quote": _prefixed(">> "),
    "code fence, indented": lambda t: "```text\n" + _prefixed("    ")(t) + "```\n",
    "crlf": lambda t: t.replace("\n", "\r\n"),
}


def _what(path: Path) -> dict:
    """Everything the wiring says: devices, links, NICs and their paths, NUMA nodes."""
    d = load_topology_file(path).to_dict()
    return {k: d[k] for k in ("devices", "links", "nics", "numa_nodes", "nvlink_domains")}


@pytest.mark.parametrize("paste", list(PASTES))
@pytest.mark.parametrize("path", COMPLETE, ids=lambda p: p.stem)
def test_a_pasted_capture_reads_as_the_clean_one(path, paste, tmp_path):
    pasted = tmp_path / path.name
    pasted.write_text(PASTES[paste](path.read_text()), newline="")
    assert _what(pasted) == _what(path)


def _numa_only(text: str) -> str:
    """The capture with its trailing columns cut to an abridged `NUMA` (CPU affinity dropped)."""
    out = []
    for line in text.splitlines(keepends=True):
        if re.match(r"^\s+GPU0\s", line):
            line = re.sub(r"CPU Affinity\s+NUMA Affinity", "NUMA", line)
        elif re.match(r"^GPU\d+\s", line):
            line = re.sub(r"\s(\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*)(\s+\d+\s*)$", r"\2", line)
        out.append(line)
    return "".join(out)


@pytest.mark.parametrize("name", ["topo_h100_8gpu_mlengineering.txt", "topo_4gpu_pcie_pxb_pix_nccl667.txt"])
def test_an_abridged_numa_column_alone_gives_each_gpus_numa_node(name, tmp_path):
    clean = load_topology_file(FIX / name)
    pasted = tmp_path / name
    pasted.write_text(_numa_only((FIX / name).read_text()))
    assert "CPU Affinity" not in pasted.read_text()
    node = load_topology_file(pasted)
    assert [d.numa_node for d in node.devices] == [d.numa_node for d in clean.devices]
    assert all(d.numa_node is not None for d in node.devices)
    assert all(d.cpu_affinity is None for d in node.devices)
    assert [(l.a, l.b, l.kind, l.nvlinks) for l in node.links] == [(l.a, l.b, l.kind, l.nvlinks) for l in clean.links]


ROCM = """\
============================ ROCm System Management Interface ============================
=============================== Weight between two GPUs =================================
       GPU0         GPU1
GPU0   0            15
GPU1   15           0
"""

LSTOPO = """\
Machine (503GB total)
  Package L#0
    NUMANode L#0 (P#0 251GB)
    L3 L#0 (32MB)
      L2 L#0 (512KB) + L1d L#0 (32KB) + L1i L#0 (32KB) + Core L#0
        PU L#0 (P#0)
"""


@pytest.mark.parametrize("text, named", [(ROCM, "`rocm-smi --showtopo` output"), (LSTOPO, "`lstopo` output")])
def test_other_tools_output_is_named_in_one_line(text, named, tmp_path):
    path = tmp_path / "capture.txt"
    path.write_text(text)
    with pytest.raises(TopologyError) as e:
        load_topology_file(path)
    assert str(e.value).startswith(f"{path}: is {named}") and "\n" not in str(e.value)


def test_a_prompt_above_a_json_file_is_still_read_as_json_errors(tmp_path):
    # A JSON array that is not a prompt stays JSON, with JSON's own error.
    path = tmp_path / "topo.json"
    path.write_text("[1, 2,\n")
    with pytest.raises(TopologyError, match="invalid JSON"):
        load_topology_file(path)


# A Grace Blackwell compute tray as `nvidia-smi topo -m` prints it (made for this test in the
# shape of published GB200 captures): four GPUs on NVLink 5, six RDMA devices reached across the
# Grace CPU, and each GPU's memory exposed as NUMA nodes of its own (`GPU NUMA ID`), which NUMA
# Affinity lists beside the CPU's node.
_GB200_HEADER = ("        GPU0    GPU1    GPU2    GPU3    NIC0    NIC1    NIC2    NIC3    NIC4    NIC5    "
                 "CPU Affinity    NUMA Affinity   GPU NUMA ID\n")
GB200_TRAY = "NVIDIA Topology:\n" + _GB200_HEADER + """\
GPU0     X      NV18    NV18    NV18    SYS     SYS     SYS     SYS     SYS     SYS     0-71    0,2-9             2
GPU1    NV18     X      NV18    NV18    SYS     SYS     SYS     SYS     SYS     SYS     0-71    0,10-17           10
GPU2    NV18    NV18     X      NV18    SYS     SYS     SYS     SYS     SYS     SYS     72-143  1,18-25           18
GPU3    NV18    NV18    NV18     X      SYS     SYS     SYS     SYS     SYS     SYS     72-143  1,26-33           26
NIC0    SYS     SYS     SYS     SYS      X      PIX     SYS     SYS     SYS     SYS
NIC1    SYS     SYS     SYS     SYS     PIX      X      SYS     SYS     SYS     SYS
NIC2    SYS     SYS     SYS     SYS     SYS     SYS      X      SYS     SYS     SYS
NIC3    SYS     SYS     SYS     SYS     SYS     SYS     SYS      X      SYS     SYS
NIC4    SYS     SYS     SYS     SYS     SYS     SYS     SYS     SYS      X      PIX
NIC5    SYS     SYS     SYS     SYS     SYS     SYS     SYS     SYS     PIX      X

NIC Legend:

  NIC0: mlx5_0
  NIC1: mlx5_1
  NIC2: mlx5_2
  NIC3: mlx5_3
  NIC4: mlx5_4
  NIC5: mlx5_5
"""


def test_a_grace_blackwell_tray_reads_its_sockets_links_and_nics(tmp_path):
    from orchestrator.config import load_config
    from orchestrator.planning import plan_job
    from orchestrator.planning.describe import describe_cluster
    from orchestrator.topology.model import Network

    path = tmp_path / "gb200.txt"
    path.write_text(GB200_TRAY)
    node = load_topology_file(path, "NVIDIA GB200")
    assert [d.numa_node for d in node.devices] == [0, 0, 1, 1] and node.numa_nodes == [0, 1]
    assert {(l.kind, l.nvlinks, l.bandwidth_gbps) for l in node.links} == {("nvlink", 18, 900.0)}
    assert [n.name for n in node.nics] == [f"mlx5_{i}" for i in range(6)]
    # More RDMA devices than GPUs: every GPU still gets a NIC of its own.
    topo = describe_cluster(node, 2, Network(bandwidth_gbps=50.0, latency_us=5.0), "NVIDIA GB200")
    plan = plan_job(load_config(None, []), topo)
    per_node = [r.nic for r in plan.ranks if r.node == plan.ranks[0].node]
    assert len(per_node) == 4 and len(set(per_node)) == 4
