"""What one node is, and what it does, measured on the node itself: the `doctor`'s per-node part.

- **Inventory** from NVML: driver and CUDA driver versions, each GPU's name, memory, UUID, and
  the state of every NVLink it has (a link that is down while its siblings are up is named).
- **Software**: torch, its CUDA and NCCL versions.
- **Wiring**: the probe's topology, NVML's against `nvidia-smi topo -m`'s where both answer
  (a pair they disagree on is named), and the checks of `wiring.py`.
- **Compute**: each GPU's bf16 and fp32 matmul rate and its device-memory copy bandwidth, each
  beside the planner's table figure as a ratio, timed warm (`WARMUP_S`, `MEASURE_S`) with the SM
  clock before and after; on a machine without a GPU the host's fp32
  matmul rate and memory bandwidth.

Every part that fails costs only its own figures and says why in `errors`; torch and NVML are
imported here, on the node, never by the driver.
"""

from __future__ import annotations

import importlib
import math
import socket
import time
from collections.abc import Callable
from typing import Any

from .local import probe_local, probe_smi
from .model import NodeTopology
from .nvml import probe_nvml
from .wiring import check_wiring

_NOT_A_LINK = ("NVMLError_NotSupported", "NVMLError_InvalidArgument")
_MAX_LINKS_FALLBACK = 18


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def inventory(pynvml_module: Any = None) -> dict[str, Any]:
    """NVML's view of this node: {"driver", "cuda_driver", "gpus": [{index, name, memory_bytes,
    uuid, nvlinks: [{"link", "active"}]}]}; {"error": one line} when NVML cannot start."""
    try:
        nv = pynvml_module if pynvml_module is not None else importlib.import_module("pynvml")  # nvidia-ml-py
        nv.nvmlInit()
    except ImportError as e:
        return {"error": f"nvidia-ml-py is not installed ({e})"}
    except Exception as e:  # noqa: BLE001 - NVMLError and its subclasses, whatever the binding
        return {"error": f"NVML cannot start: {e}"}
    try:
        out: dict[str, Any] = {"driver": _call(nv, "nvmlSystemGetDriverVersion"),
                               "cuda_driver": _cuda_version(_call(nv, "nvmlSystemGetCudaDriverVersion_v2")
                                                            or _call(nv, "nvmlSystemGetCudaDriverVersion")),
                               "gpus": []}
        max_links = int(getattr(nv, "NVML_NVLINK_MAX_LINKS", _MAX_LINKS_FALLBACK))
        for i in range(int(nv.nvmlDeviceGetCount())):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            mem = _call(nv, "nvmlDeviceGetMemoryInfo", h)
            out["gpus"].append({"index": i, "name": _text(_call(nv, "nvmlDeviceGetName", h) or ""),
                                "memory_bytes": int(mem.total) if mem is not None else None,
                                "uuid": _text(_call(nv, "nvmlDeviceGetUUID", h) or ""),
                                "nvlinks": _link_states(nv, h, max_links)})
        return out
    except Exception as e:  # noqa: BLE001 - a GPU off the bus mid-query: the node's one line
        return {"error": f"NVML failed while listing GPUs: {e}"}
    finally:
        try:
            nv.nvmlShutdown()
        except Exception:  # noqa: BLE001 - nothing depends on a clean shutdown
            pass


def _call(nv: Any, name: str, *args: Any) -> Any:
    fn = getattr(nv, name, None)
    if fn is None:
        return None
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - an unsupported query leaves its field empty
        return None


def _cuda_version(v: Any) -> str | None:
    return None if v is None else f"{int(v) // 1000}.{int(v) % 1000 // 10}"


def _link_states(nv: Any, handle: Any, max_links: int) -> list[dict[str, Any]]:
    enabled = int(getattr(nv, "NVML_FEATURE_ENABLED", 1))
    out = []
    for link in range(max_links):
        try:
            state = nv.nvmlDeviceGetNvLinkState(handle, link)
        except Exception as e:  # noqa: BLE001 - past the last link, or a board without NVLink
            if type(e).__name__ in _NOT_A_LINK:
                break
            out.append({"link": link, "active": False, "error": str(e)})
            continue
        out.append({"link": link, "active": int(state) == enabled})
    return out


def links_down(inv: dict[str, Any]) -> list[str]:
    """One line per NVLink that is down on a GPU whose other links are up."""
    out = []
    for g in inv.get("gpus", []):
        states = g.get("nvlinks", [])
        down = [s["link"] for s in states if not s["active"]]
        if down and len(down) < len(states):
            out.append(f"GPU{g['index']} NVLink {', '.join(map(str, down))} down "
                       f"({len(states) - len(down)} of {len(states)} up)")
    return out


def _pairs(node: NodeTopology) -> dict[tuple[int, int], tuple[str, int]]:
    return {(l.a, l.b): (l.kind, l.nvlinks) for l in node.links}


def _said(link: tuple[str, int] | None) -> str:
    if link is None:
        return "absent"
    return f"NV{link[1]}" if link[0] == "nvlink" else link[0].upper()


def wiring_disagreements(nvml: NodeTopology, smi: NodeTopology) -> list[str]:
    """GPU pairs NVML and `nvidia-smi topo -m` describe differently."""
    a, b = _pairs(nvml), _pairs(smi)
    return [f"GPU{x}-GPU{y}: NVML says {_said(a.get((x, y)))}, nvidia-smi topo -m says {_said(b.get((x, y)))}"
            for x, y in sorted(set(a) | set(b)) if a.get((x, y)) != b.get((x, y))]


WARMUP_S = 0.2
"""Seconds of calls before a rate is timed: a GPU idling at its base clock needs about this long
to reach its boost clock, and the first calls load kernels and caches; a cold sample of a few
milliseconds can read a healthy GPU as a slow one."""
MEASURE_S = 0.05
"""At least this much work is timed, so a timer's resolution and one call's jitter do not count."""


def timed_seconds(fn: Callable[[], Any], sync: Callable[[], None], timer: Callable[[Callable[[], Any], int], float],
                  now: Callable[[], float] = time.perf_counter, warmup_s: float = WARMUP_S,
                  measure_s: float = MEASURE_S, min_iters: int = 5) -> float:
    """Seconds per call of `fn`: called until `warmup_s` of wall time has passed (each call
    waited for with `sync`, so queued work is not mistaken for done), then timed by
    `timer(fn, iters)` (the seconds `iters` calls took) over enough calls to fill `measure_s`."""
    sync()
    t0, calls = now(), 0
    while True:
        fn()
        sync()
        calls += 1
        elapsed = now() - t0
        if elapsed >= warmup_s:
            break
    per_call = elapsed / calls
    iters = max(min_iters, math.ceil(measure_s / max(per_call, 1e-9)))
    while True:
        total = timer(fn, iters)
        if total >= measure_s:  # a warm-up slower than the timed calls asks for too few: more
            return total / iters
        iters *= 2


def _sm_clock_mhz(device: int, pynvml_module: Any = None) -> int | None:
    """GPU `device`'s current SM clock, as NVML reports it (None where NVML cannot say)."""
    try:
        nv = pynvml_module if pynvml_module is not None else importlib.import_module("pynvml")
        nv.nvmlInit()
        try:
            return int(nv.nvmlDeviceGetClockInfo(nv.nvmlDeviceGetHandleByIndex(device), nv.NVML_CLOCK_SM))
        finally:
            nv.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVML (a container, a fake GPU): the clock is simply unknown
        return None


def _gpu_rates(device: int, quick: bool) -> dict[str, Any]:
    """bf16 and fp32 (no TF32) matmul TFLOP/s and device-memory copy GB/s of CUDA device
    `device`, and its SM clock before and after (a rate read at a low clock says so)."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda", device)
    out: dict[str, Any] = {"sm_clock_mhz_before": _sm_clock_mhz(device)}
    out["bf16_tflops"] = _matmul_tflops(torch.bfloat16, 4096 if quick else 8192, dev)
    out["fp32_tflops"] = _matmul_tflops(torch.float32, 4096, dev)
    out["mem_gbps"] = _copy_gbps((1 if quick else 2) << 30, dev)
    out["sm_clock_mhz_after"] = _sm_clock_mhz(device)
    torch.cuda.empty_cache()
    return out


def _copy_gbps(size: int, dev) -> float:
    """Device-memory bandwidth of a copy of `size` bytes: each byte read once and written once."""
    import torch

    src = torch.empty(size, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    return 2 * size / _cuda_seconds(lambda: dst.copy_(src), dev) / 1e9


def _matmul_tflops(dtype, n: int, dev) -> float:
    import torch

    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    return 2 * n ** 3 / _cuda_seconds(lambda: a @ b, dev) / 1e12


def _cuda_seconds(fn, dev) -> float:
    import torch

    def timer(f, iters: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            f()
        end.record()
        torch.cuda.synchronize(dev)
        return start.elapsed_time(end) / 1000.0

    return timed_seconds(fn, lambda: torch.cuda.synchronize(dev), timer)


def _cpu_rates(quick: bool) -> dict[str, float]:
    """The host's fp32 matmul TFLOP/s (all its threads) and memory copy GB/s."""
    import torch

    n = 1024 if quick else 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = {"fp32_tflops": 2 * n ** 3 / _wall_seconds(lambda: a @ b) / 1e12}
    size = 256 << 20
    src = torch.empty(size, dtype=torch.uint8)
    dst = torch.empty_like(src)
    out["mem_gbps"] = 2 * size / _wall_seconds(lambda: dst.copy_(src)) / 1e9
    return out


def _wall_seconds(fn) -> float:
    def timer(f, iters: int) -> float:
        t0 = time.perf_counter()
        for _ in range(iters):
            f()
        return time.perf_counter() - t0

    return timed_seconds(fn, lambda: None, timer)


def software() -> dict[str, Any]:
    import torch

    nccl = None
    if torch.cuda.is_available():
        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:  # noqa: BLE001 - a torch built without NCCL
            nccl = None
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "nccl": nccl,
            "cuda_available": torch.cuda.is_available(), "cuda_devices": torch.cuda.device_count()}


def node_health(quick: bool = True) -> dict[str, Any]:
    """Everything `doctor` learns on this node (run it there: a Ray task pinned to the node)."""
    report: dict[str, Any] = {"hostname": socket.gethostname(), "errors": []}
    inv = inventory()
    report["inventory"] = inv
    report["links_down"] = links_down(inv)
    try:
        report["software"] = software()
    except Exception as e:  # noqa: BLE001
        report["software"] = {}
        report["errors"].append(f"torch cannot start: {e}")
    node = probe_local()
    report["topology"] = node.to_dict()
    report["wiring"] = [f.to_dict() for f in check_wiring(node)]
    report["wiring_disagreements"] = []
    if "error" not in inv:
        try:
            smi = probe_smi([])
            if smi is not None:
                report["wiring_disagreements"] = wiring_disagreements(probe_nvml(), smi)
        except Exception as e:  # noqa: BLE001 - NvmlUnavailable or a parse error: a comparison not made
            report["errors"].append(f"cannot compare NVML's wiring with nvidia-smi's: {e}")
    sw = report["software"]
    gpus = inv.get("gpus", [])
    if gpus and not sw.get("cuda_available"):
        report["errors"].append(f"NVML sees {len(gpus)} GPU(s) but torch cannot use CUDA "
                                f"(torch {sw.get('torch')}, built for CUDA {sw.get('cuda')}; driver "
                                f"{inv.get('driver')} supports CUDA {inv.get('cuda_driver')})")
    report["compute"] = []
    if sw.get("cuda_available"):
        for i in range(sw.get("cuda_devices", 0)):
            try:
                report["compute"].append({"device": i, **_gpu_rates(i, quick)})
            except Exception as e:  # noqa: BLE001 - a GPU that falls off the bus mid-check
                report["errors"].append(f"GPU{i}: the compute check failed: {str(e).splitlines()[0]}")
    elif not gpus:
        try:
            report["compute"].append({"device": "cpu", **_cpu_rates(quick)})
        except Exception as e:  # noqa: BLE001
            report["errors"].append(f"the CPU check failed: {e}")
    return report
