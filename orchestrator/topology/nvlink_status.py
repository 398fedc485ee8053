"""Read `nvidia-smi nvlink -s` and refine a node's NVLink bandwidths with it.

`topo -m` gives the number of lanes between two GPUs but neither their rate nor the GPU model;
`nvlink -s` gives, per GPU, each lane's current rate (14.062 GB/s on an RTX A6000 bridge,
25 on A100, 26.562 on H100) and which lanes are down (`<inactive>`), which is how a degraded
NVLink shows up before any benchmark runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import TopologyError
from .bandwidth import NO_MODEL_WARNING, nvlink_gen_for
from .model import NodeTopology

_GPU = re.compile(r"^\s*GPU\s+(\d+)\s*:\s*(.*?)\s*(?:\(UUID:\s*([^)]*)\))?\s*$")
_LINK = re.compile(r"^\s*Link\s+(\d+)\s*:\s*(.*?)\s*$")
_RATE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)\s*GB/s$")


@dataclass
class GpuNvlinkStatus:
    """The NVLink lanes of one GPU as `nvidia-smi nvlink -s` reports them."""

    index: int
    """GPU index."""
    name: str = ""
    """Product name printed on the GPU line."""
    uuid: str | None = None
    """GPU UUID, None when the capture elides it."""
    rates_gbps: dict[int, float] = field(default_factory=dict)
    """Active lane id -> rate in GB/s per direction."""
    inactive: list[int] = field(default_factory=list)
    """Lane ids reported `<inactive>`."""

    @property
    def active_lanes(self) -> int:
        return len(self.rates_gbps)

    @property
    def lane_gbps(self) -> float | None:
        """The slowest active lane's rate: a bonded set runs at its slowest member."""
        return min(self.rates_gbps.values()) if self.rates_gbps else None


def parse_nvlink_status(text: str, source: str = "nvidia-smi nvlink -s") -> dict[int, GpuNvlinkStatus]:
    """GPU index -> its lanes. Raises TopologyError naming line and column for unreadable input."""
    out: dict[int, GpuNvlinkStatus] = {}
    current: GpuNvlinkStatus | None = None
    for n, line in enumerate(text.splitlines(), start=1):
        m = _GPU.match(line)
        if m:
            idx = int(m.group(1))
            if idx in out:
                raise TopologyError(f"{source}: line {n}, column {line.index('GPU') + 1}: GPU {idx} appears twice")
            uuid = m.group(3)
            current = out[idx] = GpuNvlinkStatus(
                index=idx, name=m.group(2), uuid=uuid if uuid and uuid.startswith("GPU-") else None
            )
            continue
        m = _LINK.match(line)
        if not m:
            continue  # shell prompts, elisions (`....`) and other GPUs' banners
        col = line.index("Link") + 1
        if current is None:
            raise TopologyError(f"{source}: line {n}, column {col}: a Link line before any `GPU <n>:` line")
        lane, value = int(m.group(1)), m.group(2)
        if lane in current.rates_gbps or lane in current.inactive:
            raise TopologyError(f"{source}: line {n}, column {col}: GPU {current.index} link {lane} appears twice")
        if value.lower() == "<inactive>":
            current.inactive.append(lane)
            continue
        r = _RATE.match(value)
        if not r:
            raise TopologyError(
                f"{source}: line {n}, column {line.index(value) + 1}: link rate is {value!r}; "
                "expected `<number> GB/s` or `<inactive>`"
            )
        current.rates_gbps[lane] = float(r.group(1))
    if not out:
        raise TopologyError(f"{source}: line 1, column 1: no `GPU <n>: <name>` line; "
                            "expected `nvidia-smi nvlink -s` output")
    return out


def refine_nvlink_bandwidth(node: NodeTopology, status: dict[int, GpuNvlinkStatus]) -> NodeTopology:
    """Set each NVLink link's bandwidth from the lanes' reported rates, in place; returns node.

    A link keeps its lane count from the matrix but no more than either end has active, since
    lanes reported inactive carry nothing; GPU names fill in devices that had none. Inactive
    lanes are recorded as warnings.
    """
    for d in node.devices:
        s = status.get(d.index)
        if s is not None and not d.name and s.name:
            d.name = s.name
        if s is not None and d.uuid is None:
            d.uuid = s.uuid
    for s in sorted(status.values(), key=lambda s: s.index):
        if s.inactive:
            ids = ", ".join(str(i) for i in sorted(s.inactive))
            node.warnings.append(
                f"GPU {s.index}: NVLink lane(s) {ids} inactive; {s.active_lanes} of "
                f"{s.active_lanes + len(s.inactive)} active"
            )
    names = {d.index: d.name for d in node.devices}
    for l in node.links:
        if l.kind != "nvlink":
            continue
        ends = [status[i] for i in (l.a, l.b) if i in status]
        if not ends:
            continue
        rates = [e.lane_gbps for e in ends if e.lane_gbps is not None]
        lanes = min([l.nvlinks] + [e.active_lanes for e in ends])
        if not rates or lanes == 0:
            node.warnings.append(
                f"GPU {l.a}-GPU {l.b}: the matrix shows NV{l.nvlinks} but an end has no active lane; "
                "kept the matrix figure"
            )
            continue
        name = names.get(l.a) or ends[0].name
        l.nvlink_gen = nvlink_gen_for(name) if name else l.nvlink_gen
        l.nvlinks = lanes
        l.bandwidth_gbps = round(lanes * min(rates), 3)
    if all(names.get(d.index) for d in node.devices):
        node.warnings = [w for w in node.warnings if not w.endswith(NO_MODEL_WARNING)]
    return node
