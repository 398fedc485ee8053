"""Random and mutated captures: the parsers return a consistent topology or raise TopologyError."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.errors import TopologyError
from orchestrator.topology.files import load_cluster_file
from orchestrator.topology.model import ClusterTopology
from orchestrator.topology.nccl_xml import parse_nccl_xml
from orchestrator.topology.nvlink_status import parse_nvlink_status, refine_nvlink_bandwidth
from orchestrator.topology.render import render_svg, render_text
from orchestrator.topology.smi import parse_topo_matrix

FIX = Path(__file__).parent / "fixtures" / "topology"
SMI = [p.read_text() for p in sorted(FIX.glob("topo_*.txt"))]
XML = [p.read_text() for p in sorted(FIX.glob("*.xml"))]
STATUS = [p.read_text() for p in sorted(FIX.glob("nvlink_status_*.txt"))]
TOKENS = ["X", " X ", "NV4", "NV18", "NV0", "PIX", "PXB", "PHB", "NODE", "SYS", "SOC", "GPU0", "GPU9", "NIC0",
          "mlx5_0", "\t", "  ", "\n", "0-23", "N/A", "CPU Affinity", "NUMA Affinity", "<", ">", "<pci", "/>",
          'class="0x030200"', "<gpu", "<nvlink", 'count="6"', "Link 0:", "<inactive>", "GB/s", "GPU 1:"]
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def mutated(draw, corpus: list[str]) -> str:
    """A real capture with a few random edits: cuts, deletions, insertions, swapped lines."""
    text = draw(st.sampled_from(corpus))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["truncate", "delete", "insert", "swap", "dup"]))
        n = len(text)
        if op == "truncate":
            text = text[: draw(st.integers(0, n))]
        elif op == "delete" and n:
            i = draw(st.integers(0, n - 1))
            text = text[:i] + text[i + draw(st.integers(1, 12)):]
        elif op == "insert":
            i = draw(st.integers(0, n))
            piece = draw(st.one_of(st.sampled_from(TOKENS), st.text(max_size=6)))
            text = text[:i] + piece + text[i:]
        elif op in ("swap", "dup"):
            lines = text.split("\n")
            i, j = draw(st.integers(0, len(lines) - 1)), draw(st.integers(0, len(lines) - 1))
            if op == "swap":
                lines[i], lines[j] = lines[j], lines[i]
            else:
                lines.insert(j, lines[i])
            text = "\n".join(lines)
    return text


def _consistent(node) -> None:
    node.check()
    idx = {d.index for d in node.devices}
    for l in node.links:
        assert l.bandwidth_gbps > 0 and l.latency_us > 0
        assert (l.nvlinks > 0) == (l.kind == "nvlink")
    for dom in node.nvlink_domains:
        assert all(node.link(a, b).kind == "nvlink" for i, a in enumerate(dom) for b in dom[i + 1:])
    for nic in node.nics:
        assert set(nic.gpu_paths) == idx
    render_text(ClusterTopology(nodes=[node]))
    render_svg(ClusterTopology(nodes=[node]))


@SETTINGS
@given(mutated(SMI))
def test_mutated_smi_matrix(text):
    try:
        node = parse_topo_matrix(text, source="fuzz")
    except TopologyError as e:
        assert str(e).startswith("fuzz") and "\n" not in str(e)
        return
    _consistent(node)


@SETTINGS
@given(st.lists(st.sampled_from(TOKENS), max_size=60).map("".join) | st.text(max_size=200))
def test_random_text_in_every_parser(text):
    for parse in (parse_topo_matrix, parse_nccl_xml, parse_nvlink_status):
        try:
            result = parse(text)
        except TopologyError:
            continue
        if parse is not parse_nvlink_status:
            _consistent(result)


@SETTINGS
@given(mutated(XML))
def test_mutated_nccl_xml(text):
    try:
        node = parse_nccl_xml(text, source="fuzz")
    except TopologyError as e:
        assert str(e).startswith("fuzz") and "\n" not in str(e)
        return
    _consistent(node)


@SETTINGS
@given(mutated(STATUS), st.sampled_from(SMI[:3]))
def test_mutated_nvlink_status_refines_or_errors(text, matrix):
    try:
        status = parse_nvlink_status(text, source="fuzz")
    except TopologyError as e:
        assert str(e).startswith("fuzz")
        return
    assert all(s.active_lanes + len(s.inactive) > 0 or not s.rates_gbps for s in status.values())
    try:
        node = parse_topo_matrix(matrix)
    except TopologyError:
        return
    _consistent(refine_nvlink_bandwidth(node, status))


@settings(max_examples=60, deadline=None)
@given(mutated(SMI + XML) | st.binary(max_size=80).map(lambda b: b.decode("latin-1")))
def test_files_loader_never_raises_anything_else(text):
    fd, path = tempfile.mkstemp(suffix=".topo")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        try:
            cluster = load_cluster_file(path)
        except TopologyError as e:
            assert str(e).startswith(path)
            return
        for node in cluster.nodes:
            _consistent(node)
    finally:
        os.unlink(path)
