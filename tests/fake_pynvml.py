"""A fake `pynvml` (nvidia-ml-py) that reproduces real machines from their captures.

Each machine is built from its `nvidia-smi topo -m` capture in tests/fixtures/topology, but
expressed the way NVML exposes it, which is not the way nvidia-smi prints it: on NVSwitch
systems every NVLink ends at a switch (never at the peer GPU), NV# bridges are counted per
link from both ends, and PCIe paths are common-ancestor levels. The probe has to turn this
back into the capture's matrix. Constants mirror nvidia-ml-py 13, including its
`NVML_P2P_CAPS_INDEX_READ = (0,)` tuple.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

FIXTURES = Path(__file__).parent / "fixtures" / "topology"

NVML_SUCCESS = 0
NVML_FEATURE_DISABLED = 0
NVML_FEATURE_ENABLED = 1
NVML_NVLINK_MAX_LINKS = 36
NVML_P2P_CAPS_INDEX_READ = (0,)  # as in nvidia-ml-py: a stray trailing comma
NVML_P2P_CAPS_INDEX_WRITE = 1
NVML_P2P_CAPS_INDEX_NVLINK = 2
NVML_P2P_STATUS_OK = 0
NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED = 1
NVML_P2P_STATUS_NOT_SUPPORTED = 5
NVML_NVLINK_DEVICE_TYPE_GPU = 0
NVML_NVLINK_DEVICE_TYPE_IBMNPU = 1
NVML_NVLINK_DEVICE_TYPE_SWITCH = 2
NVML_AFFINITY_SCOPE_NODE = 0
NVML_DEVICE_MIG_ENABLE = 1
NVML_GPU_FABRIC_STATE_COMPLETED = 3
LEVEL = {"pix": 10, "pxb": 20, "phb": 30, "node": 40, "sys": 50}
# nvmlNvlinkVersion_t values per generation.
VERSION = {2: 3, 3: 4, 4: 6, 5: 7}


class NVMLError(Exception):
    text = "Unknown Error"

    def __str__(self) -> str:
        return self.text


class NVMLError_NotSupported(NVMLError):
    text = "Not Supported"


class NVMLError_NoPermission(NVMLError):
    text = "Insufficient Permissions"


class NVMLError_FunctionNotFound(NVMLError):
    text = "Function Not Found"


class NVMLError_InvalidArgument(NVMLError):
    text = "Invalid Argument"


class NVMLError_NotFound(NVMLError):
    text = "Not Found"


class NVMLError_DriverNotLoaded(NVMLError):
    text = "Driver Not Loaded"


@dataclass
class FakeLink:
    remote_type: int
    remote_bus: str
    version: int
    active: bool = True


@dataclass
class FakeGpu:
    name: str
    memory: int
    uuid: str
    bus_id: str
    cpus: list[int]
    numa: int | None
    pcie_gen: int = 4
    pcie_width: int = 16
    nvlinks: list[FakeLink] = field(default_factory=list)
    mig: bool = False
    fabric: tuple[bytes, int] | None = None
    """(cluster uuid, clique id) when the GPU is in a multi-node NVLink fabric."""
    mig_uuids: list[str] = field(default_factory=list)
    """The UUIDs of the MIG instances carved from this GPU."""


@dataclass(frozen=True)
class MigHandle:
    """A MIG instance's handle: its GPU's index and its own place among the GPU's instances."""

    gpu: int
    instance: int


# NVML's versioned structs must carry their version, or the call fails (as real NVML does).
nvmlGpuFabricInfo_v2 = 0x2000024


class NVMLError_ArgumentVersionMismatch(NVMLError):
    text = "Argument Version Mismatch"


class c_nvmlGpuFabricInfoV_t(ctypes.Structure):
    """nvidia-ml-py's struct: a ctypes Structure, so a caller can (and must) pass it by reference."""

    _fields_ = [("version", ctypes.c_uint), ("clusterUuid", ctypes.c_uint8 * 16), ("status", ctypes.c_uint),
                ("cliqueId", ctypes.c_uint32), ("state", ctypes.c_uint)]


def _pointee(arg: object) -> c_nvmlGpuFabricInfoV_t:
    """The struct behind `ctypes.byref(struct)`, as the C library sees it; anything else is what
    nvidia-ml-py would hand NVML as a stray address, refused here as NVML cannot."""
    obj = getattr(arg, "_obj", None)
    if type(arg).__name__ != "CArgObject" or not isinstance(obj, c_nvmlGpuFabricInfoV_t):
        raise TypeError(f"the fabric info must be passed as ctypes.byref(struct), not {type(arg).__name__}")
    return obj


class FakeNvml:
    """Module-like object: pass it as `probe_nvml(pynvml_module=...)`."""

    NVMLError = NVMLError
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_NoPermission = NVMLError_NoPermission
    NVMLError_FunctionNotFound = NVMLError_FunctionNotFound
    NVMLError_InvalidArgument = NVMLError_InvalidArgument
    c_nvmlGpuFabricInfoV_t = c_nvmlGpuFabricInfoV_t
    nvmlGpuFabricInfo_v2 = nvmlGpuFabricInfo_v2
    NVMLError_ArgumentVersionMismatch = NVMLError_ArgumentVersionMismatch

    def __init__(
        self,
        gpus: list[FakeGpu],
        ancestor: dict[tuple[int, int], int],
        p2p_read: dict[tuple[int, int], int] | None = None,
        failing: dict[str, type[NVMLError]] | None = None,
    ) -> None:
        self.gpus = gpus
        self.ancestor = ancestor
        self.p2p_read = p2p_read or {}
        self.failing = failing or {}
        self.initialized = False
        for k, v in globals().items():
            if k.startswith("NVML_"):
                setattr(self, k, v)

    def _check(self, fn: str) -> None:
        if not self.initialized:
            raise NVMLError()
        if fn in self.failing:
            raise self.failing[fn]()

    def _gpu(self, h: int) -> FakeGpu:
        return self.gpus[h]

    def nvmlInit(self) -> None:
        if "nvmlInit" in self.failing:
            raise self.failing["nvmlInit"]()
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self.initialized = False

    def nvmlDeviceGetCount(self) -> int:
        self._check("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        self._check("nvmlDeviceGetHandleByIndex")
        if not 0 <= i < len(self.gpus):
            raise NVMLError_InvalidArgument()
        return i

    def nvmlDeviceGetName(self, h: int) -> bytes:
        self._check("nvmlDeviceGetName")
        return self._gpu(h).name.encode()

    def nvmlDeviceGetMemoryInfo(self, h: int):
        self._check("nvmlDeviceGetMemoryInfo")
        return SimpleNamespace(total=self._gpu(h).memory, free=self._gpu(h).memory, used=0)

    def nvmlDeviceGetUUID(self, h: int) -> str:
        self._check("nvmlDeviceGetUUID")
        return self._gpu(h).uuid

    def nvmlDeviceGetHandleByUUID(self, uuid: bytes) -> int | MigHandle:
        self._check("nvmlDeviceGetHandleByUUID")
        if not isinstance(uuid, bytes):  # nvidia-ml-py hands it to ctypes as a char pointer
            raise TypeError(f"nvmlDeviceGetHandleByUUID takes bytes, not {type(uuid).__name__}")
        for i, gpu in enumerate(self.gpus):
            if gpu.uuid == uuid.decode():
                return i
            if uuid.decode() in gpu.mig_uuids:
                return MigHandle(i, gpu.mig_uuids.index(uuid.decode()))
        raise NVMLError_NotFound()

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, h: MigHandle) -> int:
        self._check("nvmlDeviceGetDeviceHandleFromMigDeviceHandle")
        if not isinstance(h, MigHandle):
            raise NVMLError_InvalidArgument()
        return h.gpu

    def nvmlDeviceGetIndex(self, h: int) -> int:
        self._check("nvmlDeviceGetIndex")
        if not isinstance(h, int):  # a MIG instance's handle has no device index
            raise NVMLError_InvalidArgument()
        return h

    def nvmlDeviceGetPciInfo(self, h: int):
        self._check("nvmlDeviceGetPciInfo")
        return SimpleNamespace(busId=self._gpu(h).bus_id.encode())

    def nvmlDeviceGetCpuAffinity(self, h: int, words: int) -> list[int]:
        self._check("nvmlDeviceGetCpuAffinity")
        out = [0] * max(words, max(self._gpu(h).cpus) // 64 + 1)
        for c in self._gpu(h).cpus:
            out[c // 64] |= 1 << (c % 64)
        return out

    def nvmlDeviceGetMemoryAffinity(self, h: int, words: int, scope: int) -> list[int]:
        self._check("nvmlDeviceGetMemoryAffinity")
        numa = self._gpu(h).numa
        return [0 if numa is None else 1 << numa] + [0] * (words - 1)

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: int) -> int:
        self._check("nvmlDeviceGetMaxPcieLinkGeneration")
        return self._gpu(h).pcie_gen

    def nvmlDeviceGetMaxPcieLinkWidth(self, h: int) -> int:
        self._check("nvmlDeviceGetMaxPcieLinkWidth")
        return self._gpu(h).pcie_width

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: int) -> int:
        self._check("nvmlDeviceGetCurrPcieLinkGeneration")
        return self._gpu(h).pcie_gen

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: int) -> int:
        self._check("nvmlDeviceGetCurrPcieLinkWidth")
        return self._gpu(h).pcie_width

    def nvmlDeviceGetMigMode(self, h: int) -> list[int]:
        self._check("nvmlDeviceGetMigMode")
        if "A100" not in self._gpu(h).name and "H100" not in self._gpu(h).name:
            raise NVMLError_NotSupported()
        return [int(self._gpu(h).mig), int(self._gpu(h).mig)]

    def nvmlDeviceGetGpuFabricInfoV(self, h: int, ref: object) -> int:
        info = _pointee(ref)
        self._check("nvmlDeviceGetGpuFabricInfoV")
        if info.version != nvmlGpuFabricInfo_v2:
            raise NVMLError_ArgumentVersionMismatch()
        fabric = self._gpu(h).fabric
        if fabric is None:
            raise NVMLError_NotSupported()
        info.clusterUuid = (ctypes.c_uint8 * 16)(*fabric[0])
        info.cliqueId = fabric[1]
        info.state = NVML_GPU_FABRIC_STATE_COMPLETED
        info.status = NVML_SUCCESS
        return NVML_SUCCESS

    def _link(self, h: int, link: int) -> FakeLink:
        links = self._gpu(h).nvlinks
        if not links:
            raise NVMLError_NotSupported()
        if link >= len(links):
            raise NVMLError_InvalidArgument()
        return links[link]

    def nvmlDeviceGetNvLinkState(self, h: int, link: int) -> int:
        self._check("nvmlDeviceGetNvLinkState")
        if link >= NVML_NVLINK_MAX_LINKS:
            raise NVMLError_InvalidArgument()
        return int(self._link(h, link).active)

    def nvmlDeviceGetNvLinkVersion(self, h: int, link: int) -> int:
        self._check("nvmlDeviceGetNvLinkVersion")
        return self._link(h, link).version

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: int, link: int):
        self._check("nvmlDeviceGetNvLinkRemotePciInfo")
        return SimpleNamespace(busId=self._link(h, link).remote_bus.encode())

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h: int, link: int) -> int:
        self._check("nvmlDeviceGetNvLinkRemoteDeviceType")
        return self._link(h, link).remote_type

    def nvmlDeviceGetTopologyCommonAncestor(self, h1: int, h2: int) -> int:
        self._check("nvmlDeviceGetTopologyCommonAncestor")
        return self.ancestor[(min(h1, h2), max(h1, h2))]

    def nvmlDeviceGetP2PStatus(self, h1: int, h2: int, index: int) -> int:
        self._check("nvmlDeviceGetP2PStatus")
        if not isinstance(index, int):
            raise TypeError(f"ctypes cannot convert {index!r} to an int")  # what the tuple trap does
        if index == NVML_P2P_CAPS_INDEX_NVLINK:
            gpu = self._gpu(h1)
            return NVML_P2P_STATUS_OK if gpu.nvlinks and not gpu.mig else NVML_P2P_STATUS_NOT_SUPPORTED
        return self.p2p_read.get((min(h1, h2), max(h1, h2)), NVML_P2P_STATUS_OK)


def read_capture(path: Path) -> tuple[list[list[str]], list[str], list[str]]:
    """GPU rows of a `nvidia-smi topo -m` capture: (cells per GPU, CPU affinity, NUMA affinity)."""
    lines = path.read_text().splitlines()
    header = next(l for l in lines if l.split() and l.split()[0] == "GPU0")
    n = sum(1 for t in header.split() if t.startswith("GPU") and t[3:].isdigit())
    rows, cpus, numas = [], [], []
    for line in lines:
        tok = line.split()
        if tok and tok[0] == f"GPU{len(rows)}" and len(tok) > n and tok[1] != "GPU1":
            rows.append([t.lower() for t in tok[1:n + 1]])
            rest = tok[n + 1:]
            # NIC columns sit between the GPU columns and the affinities.
            rest = [t for t in rest if t.upper() not in ("PIX", "PXB", "PHB", "NODE", "SYS")]
            cpus.append(rest[0])
            numas.append(rest[1] if len(rest) > 1 else "")
    return rows, cpus, numas


def _cpus(spec: str) -> list[int]:
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def machine(
    capture: str,
    name: str,
    memory_gib: int,
    *,
    nvswitch: bool = False,
    nvlink_gen: int = 3,
    pcie_gen: int = 4,
    uuids: list[str] | None = None,
    **kwargs,
) -> FakeNvml:
    """A FakeNvml reproducing the capture's matrix, with NVLinks wired the way NVML sees them."""
    rows, cpu_specs, numa_specs = read_capture(FIXTURES / capture)
    n = len(rows)
    bus = [f"00000000:{0x18 + 0x10 * i:02X}:00.0" for i in range(n)]
    gpus = []
    for i in range(n):
        numa = int(numa_specs[i]) if numa_specs[i].isdigit() else None
        gpus.append(FakeGpu(
            name=name, memory=memory_gib << 30,
            uuid=uuids[i] if uuids else f"GPU-{i:08x}-0000-0000-0000-{n:012x}",
            bus_id=bus[i], cpus=_cpus(cpu_specs[i]), numa=numa, pcie_gen=pcie_gen,
        ))
    ancestor: dict[tuple[int, int], int] = {}
    switches = [f"00000000:{0xC0 + s:02X}:00.0" for s in range(6)]
    for a in range(n):
        for b in range(a + 1, n):
            cell = rows[a][b]
            if cell.startswith("nv"):
                same = gpus[a].numa is not None and gpus[a].numa == gpus[b].numa
                ancestor[(a, b)] = LEVEL["node" if same else "sys"]
            else:
                ancestor[(a, b)] = LEVEL[cell]
    for a in range(n):
        if nvswitch:
            count = max(int(c[2:]) for c in rows[a] if c.startswith("nv"))
            gpus[a].nvlinks = [
                FakeLink(NVML_NVLINK_DEVICE_TYPE_SWITCH, switches[k % len(switches)], VERSION[nvlink_gen])
                for k in range(count)
            ]
        else:
            for b, cell in enumerate(rows[a]):
                if cell.startswith("nv"):
                    gpus[a].nvlinks += [
                        FakeLink(NVML_NVLINK_DEVICE_TYPE_GPU, bus[b], VERSION[nvlink_gen]) for _ in range(int(cell[2:]))
                    ]
    return FakeNvml(gpus, ancestor, **kwargs)


A6000_UUIDS = [
    "GPU-1b574915-9e55-3096-1fdb-d32d0754017c", "GPU-f0d29aba-53cd-2500-951e-21767ef0871d",
    "GPU-73e74607-9f67-c6a1-a713-81072f9aa686", "GPU-d10ff217-cca3-6530-0d49-4257fd2f221b",
    "GPU-0606b155-03ff-5431-a941-c5edff4461a2", "GPU-cf13b5b7-9865-4e81-e2c5-818a37ce63e8",
    "GPU-ea7d0f44-8883-589a-ca19-f92cdebccabd", "GPU-971d3b23-dc8f-0f96-5271-3eb4060cff19",
]


def a100_nvswitch() -> FakeNvml:
    """8x A100 SXM4 80GB on NVSwitch: 12 links per GPU, all to switches (NV12 everywhere)."""
    return machine("topo_a100_8gpu_mlengineering.txt", "NVIDIA A100-SXM4-80GB", 80, nvswitch=True, nvlink_gen=3)


def h100_nvswitch() -> FakeNvml:
    """8x H100 SXM5 on NVSwitch: 18 NVLink 4 links per GPU (NV18), PCIe Gen5."""
    return machine("topo_h100_8gpu_mlengineering.txt", "NVIDIA H100 80GB HBM3", 80, nvswitch=True, nvlink_gen=4,
                   pcie_gen=5)


def rtxa6000_pairs() -> FakeNvml:
    """8x RTX A6000: NV4 bridges join 0-1, 2-3, 4-5, 6-7; this driver lacks the remote device type call."""
    return machine("topo_8x_rtxa6000_nvlink_pairs_unige3741.txt", "NVIDIA RTX A6000", 48, nvlink_gen=3,
                   uuids=A6000_UUIDS, failing={"nvmlDeviceGetNvLinkRemoteDeviceType": NVMLError_FunctionNotFound})


def a100_nv4_quad() -> FakeNvml:
    """4x A100 joined directly (no switch), NV4 between every pair."""
    return machine("topo_4x_a100_nv4_nccltests331.txt", "NVIDIA A100-SXM4-40GB", 40, nvlink_gen=3)


def pcie_pxb_pix() -> FakeNvml:
    """4 PCIe GPUs: 0-1 behind two bridges (PXB), 2-3 behind one (PIX), SYS across sockets."""
    return machine("topo_4gpu_pcie_pxb_pix_nccl667.txt", "Tesla V100-PCIE-32GB", 32, pcie_gen=3)


def rtx4090_restricted() -> FakeNvml:
    """8x RTX 4090 (SYS everywhere) in a container: several calls fail, the driver claims SYS P2P."""
    return machine(
        "topo_8x4090_pcie_gpuallocator17.txt", "NVIDIA GeForce RTX 4090", 24,
        failing={
            "nvmlDeviceGetGpuFabricInfoV": NVMLError_FunctionNotFound,
            "nvmlDeviceGetMemoryAffinity": NVMLError_NoPermission,
            "nvmlDeviceGetMaxPcieLinkGeneration": NVMLError_FunctionNotFound,
            "nvmlDeviceGetMaxPcieLinkWidth": NVMLError_FunctionNotFound,
            "nvmlDeviceGetNvLinkState": NVMLError_NotSupported,
            "nvmlDeviceGetMigMode": NVMLError_NotSupported,
        },
    )
