"""The cluster topology model: what every probe produces and what the planner reads.

Pure data, no Ray, torch or NVML import. Every node carries one :class:`Link` for every
unordered pair of its devices, so a consumer never has to guess what an absent pair means.
Bandwidths are GB/s in one direction (the convention of ``nvidia-smi nvlink -s`` and of
nccl-tests' bus bandwidth), latencies microseconds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterable

from ..serialize import from_plain, to_plain
from .bandwidth import NETWORK_DEFAULT, estimate

# Link kinds, fastest first. The PCIe kinds are the path names of `nvidia-smi topo -m`:
#   pix  - at most one PCIe bridge between the two ends
#   pxb  - several PCIe bridges, no host bridge
#   phb  - through a PCIe host bridge (the CPU root complex)
#   node - across host bridges inside one NUMA node
#   sys  - across the inter-socket link (QPI/UPI/xGMI)
# `shm` joins two CPU slots of one host (gloo over shared memory); `net` is between nodes.
LINK_KINDS = ("nvlink", "pix", "pxb", "phb", "node", "sys", "shm", "net")
DEVICE_KINDS = ("gpu", "cpu")


@dataclass
class Device:
    """One accelerator (or CPU slot) of a node."""

    index: int
    """Index on the node, as `nvidia-smi` and NVML number it (CUDA_DEVICE_ORDER=PCI_BUS_ID)."""
    kind: str = "gpu"
    """`gpu`, or `cpu` for a CPU slot on a machine with no GPU."""
    name: str = ""
    """Product name, e.g. `NVIDIA H100 80GB HBM3`; empty when the source does not say."""
    memory_bytes: int | None = None
    """Device memory; None when the source does not say."""
    uuid: str | None = None
    """NVML UUID (`GPU-...`); None when unknown."""
    pci_bus_id: str | None = None
    """PCI bus id, `00000000:18:00.0` style; None when unknown."""
    numa_node: int | None = None
    """NUMA node closest to the device; None when unknown."""
    cpu_affinity: str | None = None
    """CPU list closest to the device, in `taskset` syntax (`0-47,96-143`); None when unknown."""
    pcie_gen: int | None = None
    """Maximum PCIe link generation (an idle GPU drops its current link to Gen1); None when unknown."""
    pcie_width: int | None = None
    """Maximum PCIe link width (lanes); None when unknown."""
    fabric_clique: str | None = None
    """`<cluster uuid>/<clique id>` for multi-node NVLink (GB200 NVL72); None otherwise."""
    mig: bool = False
    """True when MIG mode is enabled (the device is then split and NVLink P2P is off)."""
    measured_tflops: float | None = None
    """Dense matmul TFLOP/s this device reached when probed; the planner prefers it to its table."""


@dataclass
class Link:
    """The path between two devices of one node (a < b)."""

    a: int
    b: int
    kind: str
    """One of LINK_KINDS."""
    nvlinks: int = 0
    """Number of NVLink lanes joining a and b directly or through NVSwitch; 0 for PCIe paths."""
    nvlink_gen: int | None = None
    """NVLink generation (2 = V100, 3 = A100, 4 = H100/H200, 5 = B200); None for PCIe."""
    bandwidth_gbps: float = 0.0
    """Estimated (or measured, see `measured`) bandwidth in GB/s per direction."""
    latency_us: float = 0.0
    """Estimated (or measured) one-way latency in microseconds."""
    via_switch: bool = False
    """True when the NVLinks go through an NVSwitch rather than joining the two GPUs directly."""
    p2p: bool | None = None
    """Whether peer-to-peer access works on this path; None when the source does not say."""
    measured: bool = False
    """True when bandwidth/latency come from the measured probe, not from the link tables."""
    degraded: bool = False
    """True when measurement found this link far below its expected bandwidth."""

    def __post_init__(self) -> None:
        if self.kind not in LINK_KINDS:
            raise ValueError(f"link kind must be one of {', '.join(LINK_KINDS)}, got {self.kind!r}")
        if self.a == self.b:
            raise ValueError(f"a link joins two different devices, got {self.a} and {self.b}")
        if self.a > self.b:
            self.a, self.b = self.b, self.a


@dataclass
class Nic:
    """A network interface used for traffic between nodes."""

    name: str
    """Device name, e.g. `mlx5_0` (InfiniBand/RoCE), `rdmap16s27` (EFA) or `eth0`."""
    speed_gbps: float | None = None
    """Line rate in Gbit/s (network convention, bits not bytes); None when unknown."""
    kind: str = "unknown"
    """`infiniband`, `roce`, `efa`, `ethernet` or `unknown`."""
    numa_node: int | None = None
    """NUMA node of the NIC; None when unknown."""
    pci_bus_id: str | None = None
    """PCI bus id; None when unknown."""
    gpu_paths: dict[int, str] = field(default_factory=dict)
    """PCIe path kind (`pix`, `pxb`, `phb`, `node`, `sys`) from the NIC to each device index."""


@dataclass
class NodeTopology:
    """One machine: its devices, the link between each pair, its NICs."""

    hostname: str = ""
    """Host name as the probe saw it (not unique in simulated clusters; use node_id)."""
    node_id: str | None = None
    """Ray node id; None for a capture read from a file."""
    source: str = ""
    """Where this came from: `nvml`, `nvidia-smi`, `nccl-xml`, `declared:<path>`, `cpu`, ..."""
    devices: list[Device] = field(default_factory=list)
    links: list[Link] = field(default_factory=list)
    """One entry per unordered pair of devices."""
    nics: list[Nic] = field(default_factory=list)
    nvlink_domains: list[list[int]] = field(default_factory=list)
    """Groups of device indices in which every pair is joined by NVLink (an NVSwitch island,
    an NV4 bridge pair, a fully connected quad). Devices on no NVLink are in no domain."""
    numa_nodes: list[int] = field(default_factory=list)
    """NUMA node ids present on the host."""
    warnings: list[str] = field(default_factory=list)
    """What the probe could not tell (a partial capture, an NVML call that failed, ...)."""
    ray_gpus: int | None = None
    """GPUs Ray offers on this node (its `GPU` resource: 0 on a head started with
    `--num-gpus=0` on a GPU machine); None for a capture read from a file."""

    def __post_init__(self) -> None:
        self._index: dict[tuple[int, int], Link] = {}

    # The index is derived state: rebuild it on demand so a caller may append links freely.
    def link(self, a: int, b: int) -> Link:
        """The link between devices a and b (in either order)."""
        key = (a, b) if a < b else (b, a)
        if key not in self._index or self._index[key].a != key[0] or self._index[key].b != key[1]:
            self._index = {(l.a, l.b): l for l in self.links}
        try:
            return self._index[key]
        except KeyError:
            raise KeyError(f"node {self.hostname or self.node_id}: no link between devices {a} and {b}") from None

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def gpu_name(self) -> str:
        """The product name shared by the node's devices ('' if mixed or unknown)."""
        names = {d.name for d in self.devices}
        return names.pop() if len(names) == 1 else ""

    def check(self) -> None:
        """Raise ValueError unless every pair of devices has exactly one link."""
        idx = [d.index for d in self.devices]
        if len(set(idx)) != len(idx):
            raise ValueError(f"device indices must be unique, got {idx}")
        want = {(a, b) for i, a in enumerate(sorted(idx)) for b in sorted(idx)[i + 1:]}
        have = [(l.a, l.b) for l in self.links]
        if len(set(have)) != len(have):
            raise ValueError("a pair of devices has more than one link")
        if set(have) != want:
            missing = sorted(want - set(have))[:4]
            extra = sorted(set(have) - want)[:4]
            raise ValueError(f"every pair of devices needs one link; missing {missing}, unknown {extra}")

    def to_dict(self) -> dict[str, Any]:
        # Links in pair order, whatever order a probe appended them in.
        return {**to_plain(self), "links": to_plain(sorted(self.links, key=lambda link: (link.a, link.b)))}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "NodeTopology":
        return from_plain(cls, d)


@dataclass
class Network:
    """The network between nodes, as one figure per node (the planner's view of scale-out)."""

    bandwidth_gbps: float = NETWORK_DEFAULT[0]
    """Bandwidth out of one node in GB/s per direction (bytes; 4x100 Gbit EFA is 50)."""
    latency_us: float = NETWORK_DEFAULT[1]
    """One-way latency between two nodes in microseconds."""
    source: str = "default"
    """`default`, `config`, `nics` (summed from the NICs' line rates) or `measured`."""


@dataclass
class ClusterTopology:
    """All nodes of a cluster plus the network between them."""

    nodes: list[NodeTopology] = field(default_factory=list)
    network: Network = field(default_factory=Network)

    @property
    def num_devices(self) -> int:
        return sum(n.num_devices for n in self.nodes)

    def node(self, node_id: str) -> NodeTopology:
        for n in self.nodes:
            if n.node_id == node_id:
                return n
        raise KeyError(f"no node with id {node_id}")

    def limit(self, max_devices: int) -> "ClusterTopology":
        """The first `max_devices` devices: whole nodes while they fit, then the lowest
        indices of the next node (with the links and NVLink domains among those kept)."""
        nodes, left = [], max_devices
        for n in self.nodes:
            if left <= 0:
                break
            if n.num_devices <= left:
                nodes.append(n)
                left -= n.num_devices
                continue
            keep = {d.index for d in sorted(n.devices, key=lambda d: d.index)[:left]}
            nodes.append(NodeTopology(
                hostname=n.hostname, node_id=n.node_id, source=n.source,
                devices=[d for d in n.devices if d.index in keep],
                links=[l for l in n.links if l.a in keep and l.b in keep],
                nics=n.nics,
                nvlink_domains=[g for g in ([i for i in dom if i in keep] for dom in n.nvlink_domains) if len(g) > 1],
                numa_nodes=n.numa_nodes, warnings=n.warnings,
            ))
            left = 0
        return ClusterTopology(nodes=nodes, network=self.network)

    def to_dict(self) -> dict[str, Any]:
        return {"nodes": [n.to_dict() for n in self.nodes], "network": to_plain(self.network)}

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ClusterTopology":
        return from_plain(cls, d)

    @classmethod
    def from_json(cls, text: str) -> "ClusterTopology":
        return cls.from_dict(json.loads(text))


def fabric_clique(node: NodeTopology) -> str | None:
    """The multi-node NVLink fabric clique (`<cluster uuid>/<clique id>`) all of the node's
    GPUs belong to; None when they have none or do not agree."""
    cliques = {d.fabric_clique for d in node.devices if d.kind == "gpu"}
    return cliques.pop() if len(cliques) == 1 and None not in cliques else None


def parse_cpu_list(text: str) -> set[int]:
    """The CPUs of a `taskset`-style list (`0-47,96-143`); ValueError on anything else."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        first, last = int(lo), int(hi or lo)
        if last < first:
            raise ValueError(f"CPU range {part!r} runs backwards")
        cpus.update(range(first, last + 1))
    return cpus


def all_pairs(indices: Iterable[int]) -> list[tuple[int, int]]:
    """Every unordered pair (a < b) of the given device indices."""
    idx = sorted(indices)
    return [(a, b) for i, a in enumerate(idx) for b in idx[i + 1:]]


def cpu_node(num_slots: int, hostname: str = "", node_id: str | None = None) -> NodeTopology:
    """A node of plain CPU slots (no GPU): every pair talks through shared memory."""
    devices = [Device(index=i, kind="cpu", name="cpu") for i in range(num_slots)]
    links = []
    for a, b in all_pairs(range(num_slots)):
        bw, lat = estimate("shm")
        links.append(Link(a=a, b=b, kind="shm", bandwidth_gbps=bw, latency_us=lat))
    return NodeTopology(hostname=hostname, node_id=node_id, source="cpu", devices=devices, links=links)


def nvlink_domains(indices: list[int], links: list[Link]) -> list[list[int]]:
    """Disjoint groups of devices in which every pair is joined by NVLink, largest first.

    Each connected NVLink component that is a clique is one domain (an NVSwitch island, a
    bridged pair, a fully connected quad). A component that is not a clique (the DGX-1 hybrid
    cube mesh) is split into its largest cliques, because collectives confined to a domain
    assume every member reaches every other over NVLink.
    """
    adj: dict[int, set[int]] = {i: set() for i in indices}
    for l in links:
        if l.kind == "nvlink" and l.a in adj and l.b in adj:
            adj[l.a].add(l.b)
            adj[l.b].add(l.a)
    remaining = {i for i in indices if adj[i]}
    domains: list[list[int]] = []
    while remaining:
        best = _max_clique(remaining, adj)
        if len(best) < 2:
            break
        domains.append(sorted(best))
        remaining -= best
    return sorted(domains, key=lambda d: (-len(d), d[0]))


def _max_clique(nodes: set[int], adj: dict[int, set[int]]) -> set[int]:
    """Largest clique of the subgraph on `nodes` (Bron-Kerbosch with pivoting)."""
    best: set[int] = set()

    def expand(r: set[int], p: set[int], x: set[int]) -> None:
        nonlocal best
        if not p and not x:
            if len(r) > len(best) or (len(r) == len(best) and min(r) < min(best)):
                best = r
            return
        if len(r) + len(p) <= len(best):
            return
        pivot = max(p | x, key=lambda v: len(adj[v] & p))
        for v in sorted(p - adj[pivot]):
            expand(r | {v}, p & adj[v], x & adj[v])
            p = p - {v}
            x = x | {v}

    expand(set(), set(nodes), set())
    return best
