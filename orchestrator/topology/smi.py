"""Read the text of `nvidia-smi topo -m` into a :class:`NodeTopology`.

The matrix is the most common capture people paste and the one every NVIDIA driver prints,
so this parser takes it as found in the wild: tab or space separated, preceded by a shell
prompt, followed by legends, inside a Markdown code fence, indented, or with a comment or quote
prefix on every line (`#`, `>`, `//`, as wrappers and issue trackers paste it), with NIC columns
named `NIC#` (and a `NIC Legend`) or by their device names (drivers before 470), and the
`CPU Affinity` / `NUMA Affinity` / `GPU NUMA ID` columns in whatever subset the driver printed
(an abridged `NUMA` alone included). A capture cut off inside the matrix keeps the GPUs whose
rows are whole and says in `warnings` what is missing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import TopologyError
from .bandwidth import NO_MODEL_WARNING, estimate, nvlink_gen_for
from .model import Device, Link, Nic, NodeTopology, all_pairs, nvlink_domains

# Matrix cells. SOC is the pre-2017 spelling of SYS.
_PCIE_CELLS = {"PIX": "pix", "PXB": "pxb", "PHB": "phb", "NODE": "node", "SYS": "sys", "SOC": "sys"}
_NV_CELL = re.compile(r"^NV(\d+)$")
_GPU_LABEL = re.compile(r"^GPU(\d+)$")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_TRAILING_LABEL = re.compile(r"\b(CPU Affinity|NUMA Affinity|GPU NUMA ID|NUMA)\b")
_TRAILING_ALIASES = {"NUMA": "NUMA Affinity"}
_LINE_PREFIX = re.compile(r"^[ \t]*(?:#+|>+|//)[ \t]?")
"""A comment or quote mark at the start of a pasted line (`# GPU0 ...`, `> GPU0 ...`)."""
_NIC_LEGEND = re.compile(r"^\s*(NIC\d+)\s*:\s*(\S+)\s*$")
"""Ends the warning given when NVLink rates had to be assumed (a refinement that names the GPUs drops it)."""
# The most NVLink lanes one GPU has (Hopper and Blackwell: 18).
_MAX_GPU_LANES = 18
_CPU_LIST = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")


@dataclass
class _Cell:
    """One parsed matrix cell: a link kind, or the diagonal."""

    kind: str
    """`self`, `nvlink` or a PCIe path kind."""
    nvlinks: int = 0
    """NVLink lanes for an `NV#` cell."""


@dataclass
class _Row:
    """One whole row of the matrix."""

    label: str
    """`GPU3`, `NIC0` or an old-style NIC name."""
    cells: dict[str, _Cell]
    """Column label -> cell."""
    extras: dict[str, str] = field(default_factory=dict)
    """Trailing column label (`CPU Affinity`, ...) -> raw value."""


def _where(source: str, line_no: int, col: int) -> str:
    return f"{source}: line {line_no}, column {col}"


def _parse_cell(token: str) -> _Cell | None:
    up = token.upper()
    if up == "X":
        return _Cell("self")
    if up in _PCIE_CELLS:
        return _Cell(_PCIE_CELLS[up])
    m = _NV_CELL.match(up)
    if m and int(m.group(1)) > 0:
        return _Cell("nvlink", int(m.group(1)))
    return None


def _find_header(lines: list[str], source: str) -> tuple[int, list[str], list[str]]:
    """(line index, column labels, trailing labels) of the matrix header."""
    for i, line in enumerate(lines):
        tokens = line.split()
        if not tokens or tokens[0] != "GPU0" or "X" in tokens:
            continue
        m = _TRAILING_LABEL.search(line)
        cols_part = line[: m.start()] if m else line
        trailing = ([_TRAILING_ALIASES.get(t, t) for t in _TRAILING_LABEL.findall(line[m.start():])]
                    if m else [])
        columns = cols_part.split()
        for c in columns:
            if c in columns[: columns.index(c)]:
                where = _where(source, i + 1, line.index(c) + 1)
                raise TopologyError(f"{where}: column {c} appears twice in the header")
        return i, columns, trailing
    first = next(((i, l) for i, l in enumerate(lines) if l.strip()), None)
    if first is None:
        raise TopologyError(f"{source}: line 1, column 1: the capture is empty; "
                            "expected the output of `nvidia-smi topo -m`")
    i, l = first
    col = len(l) - len(l.lstrip()) + 1
    shown = l.strip()[:40]
    raise TopologyError(
        f"{_where(source, i + 1, col)}: no `nvidia-smi topo -m` header (a line starting `GPU0 GPU1 ...`) "
        f"anywhere in the capture; first line is {shown!r}"
    )


def _parse_row(
    line: str, line_no: int, columns: list[str], trailing: list[str], source: str, cut: bool
) -> _Row | None:
    """A whole row, or None when it has fewer cells than columns (`cut`: the capture ends inside it)."""
    spans = [(m.group(0), m.start() + 1) for m in re.finditer(r"\S+", line)]
    label = spans[0][0]
    cells: dict[str, _Cell] = {}
    for col_label, (tok, col) in zip(columns, spans[1:]):
        cell = _parse_cell(tok)
        if cell is None:
            if cut and (tok, col) == spans[-1]:
                return None  # the capture ends inside this token
            raise TopologyError(
                f"{_where(source, line_no, col)}: {label}/{col_label} is {tok!r}; "
                "a cell is X, NV<n>, PIX, PXB, PHB, NODE or SYS"
            )
        if (cell.kind == "self") != (col_label == label):
            what = "the diagonal must be X" if col_label == label else "X belongs on the diagonal only"
            raise TopologyError(f"{_where(source, line_no, col)}: {label}/{col_label} is {tok!r}; {what}")
        cells[col_label] = cell
    if len(cells) < len(columns):
        return None
    rest = [t for t, _ in spans[1 + len(columns):]]
    extras = dict(zip(trailing, rest))
    return _Row(label, cells, extras)


def _int_or_none(value: str | None) -> int | None:
    return int(value) if value is not None and value.isdigit() else None


def _numa_range(value: str | None) -> list[int]:
    """NUMA ids named by an affinity value such as `0`, `0-1` or `0,2`."""
    if not value or not _CPU_LIST.match(value):
        return []
    out: list[int] = []
    for part in value.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def make_link(a: int, b: int, kind: str, nvlinks: int = 0, name: str = "", via_switch: bool = False,
              pcie_gen: int | None = None, pcie_width: int | None = None) -> Link:
    """A link with its bandwidth and latency from the link tables."""
    gen = nvlink_gen_for(name) if kind == "nvlink" and name else None
    bw, lat = estimate(kind, nvlinks=nvlinks, nvlink_gen=gen, pcie_gen=pcie_gen, pcie_width=pcie_width, name=name)
    return Link(a=a, b=b, kind=kind, nvlinks=nvlinks if kind == "nvlink" else 0, nvlink_gen=gen,
                bandwidth_gbps=bw, latency_us=lat, via_switch=via_switch)


def parse_topo_matrix(text: str, source: str = "nvidia-smi",
                      gpu_names: dict[int, str] | str | None = None) -> NodeTopology:
    """Parse `nvidia-smi topo -m` output.

    `gpu_names` (one name for all GPUs, or index -> name) supplies what the matrix does not
    print, the GPU model, which sets the NVLink generation and per-lane rate (an RTX A6000
    bridge lane carries 14 GB/s, an A100 lane 25). Raises TopologyError naming line and column
    for input that is not such a matrix.
    """
    lines = _without_line_prefix([_ANSI.sub("", l).rstrip("\r") for l in text.split("\n")])
    ends_cut = not text.endswith("\n")
    while lines and not lines[-1].strip():
        lines.pop()
    h, columns, trailing = _find_header(lines, source)
    gpu_cols = [c for c in columns if _GPU_LABEL.match(c)]
    nic_cols = [c for c in columns if not _GPU_LABEL.match(c)]
    expected = [f"GPU{i}" for i in range(len(gpu_cols))]
    if gpu_cols != expected:
        line = lines[h]
        raise TopologyError(
            f"{_where(source, h + 1, 1)}: GPU columns must run GPU0, GPU1, ... in order and precede the NICs; "
            f"found {' '.join(gpu_cols)} in {line.strip()[:60]!r}"
        )

    rows: dict[str, _Row] = {}
    cut_row: str | None = None
    legend: dict[str, str] = {}
    i = h + 1
    while i < len(lines):
        line = lines[i]
        tokens = line.split()
        if not tokens or tokens[0] not in columns:
            break
        label = tokens[0]
        if label in rows:
            raise TopologyError(f"{_where(source, i + 1, line.index(label) + 1)}: row {label} appears twice")
        last = i == len(lines) - 1
        row = _parse_row(line, i + 1, columns, trailing, source, cut=last and ends_cut)
        if row is None:
            if not last:
                short = len(tokens) - 1
                raise TopologyError(
                    f"{_where(source, i + 1, len(line) + 1)}: row {label} has {short} of {len(columns)} cells "
                    "but the capture goes on"
                )
            cut_row = label
            break
        rows[label] = row
        i += 1
    for line in lines[i:]:
        m = _NIC_LEGEND.match(line)
        if m:
            legend[m.group(1)] = m.group(2)

    whole = [g for g in gpu_cols if g in rows]
    if not whole:
        raise TopologyError(
            f"{_where(source, min(i, len(lines) - 1) + 1, 1)}: the capture has a header with "
            f"{len(gpu_cols)} GPU(s) but no whole GPU row"
        )
    # Rows are whole in order; a GPU row missing in the middle means the matrix was edited.
    if whole != gpu_cols[: len(whole)]:
        missing = [g for g in gpu_cols[: len(whole) + 1] if g not in rows]
        raise TopologyError(f"{source}: row {missing[0]} is missing from the matrix while later GPU rows are present")

    warnings: list[str] = []
    if len(whole) < len(gpu_cols):
        lost = gpu_cols[len(whole):]
        where = f"ends inside row {cut_row}" if cut_row else f"ends after row {whole[-1]}"
        warnings.append(
            f"{source}: partial capture: the matrix {where}; the header names {len(gpu_cols)} GPUs, "
            f"kept {whole[0]}-{whole[-1]}, missing rows {lost[0]}-{lost[-1]}"
            + (" and the NIC rows" if nic_cols else "")
        )

    names = _names(gpu_names, len(whole))
    devices: list[Device] = []
    numa_ids: set[int] = set()
    # Where GPUs expose their memory as NUMA nodes of their own (Grace Hopper and Grace Blackwell:
    # `GPU NUMA ID` 2, 10, ...), NUMA Affinity lists those beside the CPU's node ("0,2-9"): the
    # CPU nodes are the ones below every GPU's own.
    gpu_numa = [v for g in whole if (v := _int_or_none(rows[g].extras.get("GPU NUMA ID"))) is not None]
    below = min(gpu_numa) if gpu_numa else None
    for g in whole:
        idx = int(g[3:])
        extras = rows[g].extras
        affinity = extras.get("CPU Affinity")
        numa = extras.get("NUMA Affinity")
        cpu_numa = [n for n in _numa_range(numa) if below is None or n < below]
        numa_ids.update(cpu_numa)
        devices.append(
            Device(
                index=idx,
                name=names.get(idx, ""),
                numa_node=cpu_numa[0] if len(cpu_numa) == 1 else _int_or_none(numa),
                cpu_affinity=affinity if affinity and _CPU_LIST.match(affinity) else None,
            )
        )

    # Behind an NVSwitch every peer shows NV<lanes of the GPU>, so a GPU's NV counts summed over
    # its peers exceed the lanes any GPU has; direct NVLink meshes split their lanes among peers.
    lanes = {g: sum(c.nvlinks for col, c in rows[g].cells.items() if col in gpu_cols) for g in whole}
    links: list[Link] = []
    for a, b in all_pairs(range(len(whole))):
        ga, gb = f"GPU{a}", f"GPU{b}"
        cell, back = rows[ga].cells[gb], rows[gb].cells[ga]
        if (cell.kind, cell.nvlinks) != (back.kind, back.nvlinks):
            warnings.append(f"{source}: {ga}/{gb} and {gb}/{ga} disagree; used the {ga} row")
        name = names.get(a, "") if names.get(a) == names.get(b) else ""
        switched = cell.kind == "nvlink" and (lanes[ga] > _MAX_GPU_LANES or lanes[gb] > _MAX_GPU_LANES)
        links.append(make_link(a, b, cell.kind, cell.nvlinks, name, via_switch=switched))
    if any(l.kind == "nvlink" for l in links) and not names:
        warnings.append(f"{source}: {NO_MODEL_WARNING}")

    nics: list[Nic] = []
    dev_numa = {d.index: d.numa_node for d in devices}
    for n in nic_cols:
        paths = {int(g[3:]): rows[g].cells[n].kind for g in whole}
        # A NIC inherits the NUMA node of any GPU it reaches without crossing sockets.
        near = {dev_numa[g] for g, p in paths.items() if p != "sys" and dev_numa[g] is not None}
        nics.append(
            Nic(name=legend.get(n, n), numa_node=near.pop() if len(near) == 1 else None, gpu_paths=paths)
        )

    node = NodeTopology(
        source=source,
        devices=devices,
        links=links,
        nics=nics,
        numa_nodes=sorted(numa_ids),
        warnings=warnings,
    )
    node.nvlink_domains = nvlink_domains([d.index for d in devices], links)
    node.check()
    return node


def _is_header(line: str) -> bool:
    tokens = line.split()
    return bool(tokens) and tokens[0] == "GPU0" and "X" not in tokens


def _without_line_prefix(lines: list[str]) -> list[str]:
    """`lines` with the comment or quote mark every matrix line carries blanked out, when the
    header carries one (spaces of the same width: error columns stay those of the paste)."""
    if any(_is_header(line) for line in lines):
        return lines
    for line in lines:
        m = _LINE_PREFIX.match(line)
        if m and _is_header(line[m.end():]):
            return [_LINE_PREFIX.sub(lambda p: " " * len(p.group(0)), l, count=1) for l in lines]
    return lines


def _names(gpu_names: dict[int, str] | str | None, n: int) -> dict[int, str]:
    if gpu_names is None:
        return {}
    if isinstance(gpu_names, str):
        return {i: gpu_names for i in range(n)} if gpu_names else {}
    return {int(k): v for k, v in gpu_names.items() if v}
