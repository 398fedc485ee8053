"""Probe this machine's GPUs and the paths between them through NVML (nvidia-ml-py).

NVML knows more than `nvidia-smi topo -m` prints: the PCIe common ancestor of every pair,
each NVLink's state, version and remote end, P2P status, CPU/memory affinity, PCIe generation
and GPU fabric (NVL72 clique) membership. Each of those calls is missing somewhere (GeForce
boards, old drivers, containers without permission, bindings older than the driver), so every
call is guarded on its own: a failure costs that one fact and becomes a warning, never the
probe. The traps this module handles:

* ``NVML_NVLINK_MAX_LINKS`` grew from 6 to 12, 18 and now 36; it is read from the module.
* In some nvidia-ml-py releases ``NVML_P2P_CAPS_INDEX_READ`` is the tuple ``(0,)`` (a stray
  comma in the binding); passing it on as-is makes ctypes fail.
* On NVSwitch systems no NVLink ends at another GPU: every link ends at a switch. Two GPUs
  that both reach switches talk over min(their active links).
* "P2P supported" is the driver's claim, not a measurement: `Link.p2p` records the claim and
  a claim across the inter-socket link is called out in the warnings. Only
  :mod:`orchestrator.topology.measure` shows whether the path delivers.
"""

from __future__ import annotations

import ctypes
import os
import socket
from collections import defaultdict
from typing import Any

from .bandwidth import estimate, nvlink_gen_for
from .model import Device, Link, NodeTopology, all_pairs, nvlink_domains

# NVML_TOPOLOGY_* common-ancestor levels -> the path names of `nvidia-smi topo -m`.
# INTERNAL (two GPUs on one board, e.g. K80) is the closest a PCIe path can be: pix.
_ANCESTOR_KIND = {0: "pix", 10: "pix", 20: "pxb", 30: "phb", 40: "node", 50: "sys"}
# nvmlNvlinkVersion_t -> NVLink generation (2.2 is the V100's second-generation variant).
_NVLINK_VERSION_GEN = {1: 1, 2: 2, 3: 2, 4: 3, 5: 3, 6: 4, 7: 5, 8: 6}
_FALLBACK_MAX_LINKS = 18
_DEVICE_TYPE_GPU, _DEVICE_TYPE_IBMNPU, _DEVICE_TYPE_SWITCH = 0, 1, 2
_FABRIC_STATE_COMPLETED = 3


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used on this machine at all (no binding, no driver, no GPU)."""


class _Guard:
    """Call NVML functions, turning each failure into a grouped warning instead of an error.

    Failures are grouped by (call, error) so eight GPUs without fabric info give one line.
    """

    def __init__(self, nv: Any) -> None:
        self.nv = nv
        self.failures: dict[tuple[str, str], list[str]] = defaultdict(list)

    def __call__(self, name: str, *args: Any, where: str = "", default: Any = None, normal: str = "") -> Any:
        """`normal` names an NVMLError subclass that is an answer here, not a failure."""
        fn = getattr(self.nv, name, None)
        if fn is None:
            self.failures[(name, "not in this nvidia-ml-py")].append(where)
            return default
        try:
            return fn(*args)
        except self.nv.NVMLError as e:
            if not (normal and isinstance(e, getattr(self.nv, normal, ()))):
                self.failures[(name, str(e) or type(e).__name__)].append(where)
            return default

    def quiet(self, name: str, *args: Any) -> tuple[Any, Exception | None]:
        """Call without recording: for probes where an error is an answer (no NVLink here)."""
        fn = getattr(self.nv, name, None)
        if fn is None:
            return None, AttributeError(name)
        try:
            return fn(*args), None
        except self.nv.NVMLError as e:
            return None, e

    def warnings(self) -> list[str]:
        out = []
        for (name, err), where in self.failures.items():
            places = sorted({w for w in where if w})
            suffix = f" ({', '.join(places)})" if places else ""
            out.append(f"NVML {name}: {err}{suffix}")
        return out


def _text(value: Any) -> str:
    """NVML strings are bytes in older bindings and str in newer ones."""
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return str(value)


def _constant(nv: Any, name: str, default: int) -> int:
    value = getattr(nv, name, default)
    # nvidia-ml-py declares some constants with a trailing comma, making them 1-tuples.
    if isinstance(value, tuple):
        value = value[0]
    return int(value)


def _bits(words: Any, word_bits: int = 64) -> list[int]:
    """Set bit positions of an NVML bitmask (a sequence of unsigned words, lowest first)."""
    out = []
    for w, word in enumerate(words):
        word = int(word)
        for b in range(word_bits):
            if word >> b & 1:
                out.append(w * word_bits + b)
    return out


def cpu_list(cpus: list[int]) -> str:
    """`[0, 1, 2, 5]` -> `0-2,5` (taskset syntax)."""
    parts: list[str] = []
    cpus = sorted(set(cpus))
    i = 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        parts.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(parts)


def normalize_bus_id(bus_id: str) -> str:
    """NVML pads the PCI domain to 8 hex digits, sysfs to 4; compare them as sysfs does."""
    bus_id = bus_id.strip().lower()
    domain, _, rest = bus_id.partition(":")
    if not rest:
        return bus_id
    return f"{int(domain, 16):04x}:{rest}"


def _fabric_clique(g: _Guard, handle: Any, where: str) -> str | None:
    """`<cluster uuid>/<clique id>` once the fabric manager has registered the GPU."""
    nv = g.nv
    info = None
    # GPUs outside a multi-node NVLink system answer NotSupported: that is no fabric, no fault.
    for call, struct in (("nvmlDeviceGetGpuFabricInfoV", "c_nvmlGpuFabricInfoV_t"),
                         ("nvmlDeviceGetGpuFabricInfo", "c_nvmlGpuFabricInfo_t")):
        if hasattr(nv, call) and hasattr(nv, struct):
            info = getattr(nv, struct)()
            if hasattr(info, "version"):
                # A versioned struct must say which version it is, or NVML refuses the call.
                info.version = getattr(nv, "nvmlGpuFabricInfo_v2", 0)
            # nvidia-ml-py hands the argument to the C call as it is: the struct must go by
            # reference (NVIDIA's own callers pass byref), or NVML writes through its contents.
            if g(call, handle, ctypes.byref(info), where=where, normal="NVMLError_NotSupported") is None:
                info = None
            break
    if info is None or int(info.state) != _FABRIC_STATE_COMPLETED or int(info.status) != 0:
        return None
    uuid_bytes = bytes(int(x) for x in info.clusterUuid)
    if not any(uuid_bytes):
        return None
    h = uuid_bytes.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}/{int(info.cliqueId)}"


def _device(g: _Guard, index: int, handle: Any, cpu_words: int) -> Device:
    nv = g.nv
    where = f"GPU{index}"
    dev = Device(index=index, kind="gpu")
    name = g("nvmlDeviceGetName", handle, where=where)
    dev.name = _text(name) if name is not None else ""
    mem = g("nvmlDeviceGetMemoryInfo", handle, where=where)
    dev.memory_bytes = int(mem.total) if mem is not None else None
    uuid = g("nvmlDeviceGetUUID", handle, where=where)
    dev.uuid = _text(uuid) if uuid is not None else None
    pci = g("nvmlDeviceGetPciInfo", handle, where=where)
    dev.pci_bus_id = _text(pci.busId) if pci is not None else None

    cpus = g("nvmlDeviceGetCpuAffinity", handle, cpu_words, where=where)
    if cpus is not None and _bits(cpus):
        dev.cpu_affinity = cpu_list(_bits(cpus))
    scope = _constant(nv, "NVML_AFFINITY_SCOPE_NODE", 0)
    nodes = g("nvmlDeviceGetMemoryAffinity", handle, 1, scope, where=where)
    if nodes is not None and _bits(nodes):
        dev.numa_node = _bits(nodes)[0]

    # The current PCIe generation drops to Gen1 when the GPU idles to save power, so the
    # link's capability (device and slot together) is what predicts transfer bandwidth.
    gen = g("nvmlDeviceGetMaxPcieLinkGeneration", handle, where=where)
    if gen is None:
        gen = g("nvmlDeviceGetCurrPcieLinkGeneration", handle, where=where)
        if gen is not None:
            g.failures[("PCIe generation", "taken from the current link state, which idles low")].append(where)
    width = g("nvmlDeviceGetMaxPcieLinkWidth", handle, where=where)
    if width is None:
        width = g("nvmlDeviceGetCurrPcieLinkWidth", handle, where=where)
    dev.pcie_gen = int(gen) if gen else None
    dev.pcie_width = int(width) if width else None

    # NotSupported is the normal answer of every GPU without MIG.
    mig = g("nvmlDeviceGetMigMode", handle, where=where, normal="NVMLError_NotSupported")
    if mig is not None:
        dev.mig = int(mig[0]) == _constant(nv, "NVML_DEVICE_MIG_ENABLE", 1)

    dev.fabric_clique = _fabric_clique(g, handle, where)
    return dev


class _NvLinks:
    """Active NVLinks of one GPU, by what sits at their far end."""

    def __init__(self) -> None:
        self.to_gpu: dict[str, int] = defaultdict(int)
        """Normalized remote PCI bus id -> active links ending at that GPU."""
        self.to_switch = 0
        self.gen: int | None = None


def _nvlinks(g: _Guard, index: int, handle: Any, gpu_bus_ids: set[str], max_links: int) -> _NvLinks:
    nv = g.nv
    where = f"GPU{index}"
    out = _NvLinks()
    for link in range(max_links):
        state, err = g.quiet("nvmlDeviceGetNvLinkState", handle, link)
        if err is not None:
            # Link ids past the device's last link answer NotSupported or InvalidArgument, and
            # so does link 0 of a board without NVLink: that is the end of the list, not a fault.
            benign = tuple(
                getattr(nv, n) for n in ("NVMLError_NotSupported", "NVMLError_InvalidArgument") if hasattr(nv, n)
            )
            if not isinstance(err, benign):
                g.failures[("nvmlDeviceGetNvLinkState", str(err) or type(err).__name__)].append(where)
            break
        if int(state) != _constant(nv, "NVML_FEATURE_ENABLED", 1):
            continue
        version = g("nvmlDeviceGetNvLinkVersion", handle, link, where=where)
        if version is not None and out.gen is None:
            out.gen = _NVLINK_VERSION_GEN.get(int(version))
        remote = g("nvmlDeviceGetNvLinkRemotePciInfo", handle, link, where=where)
        remote_bus = normalize_bus_id(_text(remote.busId)) if remote is not None else None
        rtype = g("nvmlDeviceGetNvLinkRemoteDeviceType", handle, link, where=where)
        if rtype is None:
            # Without the remote type, a far end that is none of our GPUs is a switch (or CPU).
            rtype = _DEVICE_TYPE_GPU if remote_bus in gpu_bus_ids else _DEVICE_TYPE_SWITCH
        rtype = int(rtype)
        if rtype == _DEVICE_TYPE_SWITCH:
            out.to_switch += 1
        elif rtype == _DEVICE_TYPE_GPU and remote_bus is not None:
            out.to_gpu[remote_bus] += 1
        # IBMNPU: an NVLink to a POWER9 CPU carries host traffic, not GPU-to-GPU.
    return out


def _load(pynvml_module: Any) -> Any:
    if pynvml_module is not None:
        return pynvml_module
    try:
        import pynvml  # nvidia-ml-py
    except ImportError as e:
        raise NvmlUnavailable(f"nvidia-ml-py is not installed ({e})") from e
    return pynvml


def probe_nvml(pynvml_module: Any = None) -> NodeTopology:
    """This machine's GPUs and the link between every pair, as NVML reports them.

    Raises NvmlUnavailable when NVML cannot start or sees no GPU; every other NVML failure
    costs only the fact it would have given and is listed in `NodeTopology.warnings`.
    """
    nv = _load(pynvml_module)
    try:
        nv.nvmlInit()
    except nv.NVMLError as e:
        raise NvmlUnavailable(f"NVML cannot start: {e}") from e
    try:
        return _probe(nv)
    finally:
        try:
            nv.nvmlShutdown()
        except nv.NVMLError:
            pass  # shutting down a library we could use has no consequence worth reporting


def _probe(nv: Any) -> NodeTopology:
    g = _Guard(nv)
    try:
        count = int(nv.nvmlDeviceGetCount())
    except nv.NVMLError as e:
        raise NvmlUnavailable(f"NVML cannot count GPUs: {e}") from e
    if count == 0:
        raise NvmlUnavailable("NVML sees no GPU")

    cpu_words = max(1, ((os.cpu_count() or 64) + 63) // 64)
    handles: dict[int, Any] = {}
    devices: list[Device] = []
    for i in range(count):
        h = g("nvmlDeviceGetHandleByIndex", i, where=f"GPU{i}")
        if h is None:
            continue
        handles[i] = h
        devices.append(_device(g, i, h, cpu_words))
    by_index = {d.index: d for d in devices}
    bus_to_index = {normalize_bus_id(d.pci_bus_id): d.index for d in devices if d.pci_bus_id}

    max_links = _constant(nv, "NVML_NVLINK_MAX_LINKS", _FALLBACK_MAX_LINKS)
    links_of = {i: _nvlinks(g, i, h, set(bus_to_index), max_links) for i, h in handles.items()}

    read_idx = _constant(nv, "NVML_P2P_CAPS_INDEX_READ", 0)
    nvlink_idx = _constant(nv, "NVML_P2P_CAPS_INDEX_NVLINK", 2)
    p2p_ok = _constant(nv, "NVML_P2P_STATUS_OK", 0)
    warnings: list[str] = []
    claimed_sys_p2p: list[str] = []
    links: list[Link] = []
    for a, b in all_pairs(handles):
        da, db = by_index[a], by_index[b]
        where = f"GPU{a}-GPU{b}"
        la, lb = links_of[a], links_of[b]
        # Direct links are counted from both ends; they disagree only when a link is half up.
        direct_ab = la.to_gpu.get(normalize_bus_id(db.pci_bus_id or ""), 0)
        direct_ba = lb.to_gpu.get(normalize_bus_id(da.pci_bus_id or ""), 0)
        direct = min(direct_ab, direct_ba) if direct_ab and direct_ba else max(direct_ab, direct_ba)
        switched = min(la.to_switch, lb.to_switch)
        nvlinks = direct + switched
        if nvlinks and (da.mig or db.mig):
            warnings.append(f"GPU{a}-GPU{b}: MIG is enabled, so NVLink P2P is off; using the PCIe path")
            nvlinks = 0

        level = g("nvmlDeviceGetTopologyCommonAncestor", handles[a], handles[b], where=where)
        pcie_kind = _ANCESTOR_KIND.get(int(level)) if level is not None else None
        if pcie_kind is None:
            same_numa = da.numa_node is not None and da.numa_node == db.numa_node
            pcie_kind = "node" if same_numa else "sys"
            warnings.append(f"GPU{a}-GPU{b}: PCIe path unknown, assumed {pcie_kind!r} from NUMA affinity")

        status = g("nvmlDeviceGetP2PStatus", handles[a], handles[b], nvlink_idx if nvlinks else read_idx, where=where)
        p2p = None if status is None else int(status) == p2p_ok

        if nvlinks:
            gen = nvlink_gen_for(da.name) or la.gen or lb.gen
            bw, lat = estimate("nvlink", nvlinks=nvlinks, nvlink_gen=gen, name=da.name)
            links.append(Link(a=a, b=b, kind="nvlink", nvlinks=nvlinks, nvlink_gen=gen, bandwidth_gbps=bw,
                              latency_us=lat, via_switch=switched > 0, p2p=p2p))
        else:
            gen = min((x for x in (da.pcie_gen, db.pcie_gen) if x), default=None)
            width = min((x for x in (da.pcie_width, db.pcie_width) if x), default=None)
            bw, lat = estimate(pcie_kind, pcie_gen=gen, pcie_width=width)
            links.append(Link(a=a, b=b, kind=pcie_kind, bandwidth_gbps=bw, latency_us=lat, p2p=p2p))
            if p2p and pcie_kind == "sys":
                claimed_sys_p2p.append(where)

    if claimed_sys_p2p:
        warnings.append(
            "the driver reports PCIe P2P across the inter-socket link for "
            f"{', '.join(claimed_sys_p2p[:4])}{' ...' if len(claimed_sys_p2p) > 4 else ''}; such P2P is often "
            "slow or broken: `probe --measure` shows what it delivers"
        )
    node = NodeTopology(
        hostname=socket.gethostname(),
        source="nvml",
        devices=devices,
        links=links,
        numa_nodes=sorted({d.numa_node for d in devices if d.numa_node is not None}),
        warnings=g.warnings() + warnings,
    )
    node.nvlink_domains = nvlink_domains([d.index for d in devices], links)
    node.check()
    return node
