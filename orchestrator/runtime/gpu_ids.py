"""Ray's GPU ids for a worker as NVML's device indices, which the plan's ranks name.

Ray hands a worker the ids its node listed in CUDA_VISIBLE_DEVICES: indices ("0") as a rule,
but UUIDs where the node's GPUs were listed by UUID ("GPU-…", or "MIG-…" for a MIG instance).
A UUID is looked up through NVML: a GPU's own index, a MIG instance's parent GPU's index.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

UUID_PREFIXES = ("GPU-", "MIG-")
"""How NVML's UUIDs begin: a whole GPU's, a MIG instance's."""


def gpu_indices(gpu_ids: Sequence[str | int], nvml: Any | None = None) -> list[int]:
    """The NVML index of each of `gpu_ids` (what `ray.get_gpu_ids()` returns), in order. NVML
    (`nvml`, else `pynvml`) is opened only where an id is a UUID."""
    indices = [int(g) for g in gpu_ids if not str(g).startswith(UUID_PREFIXES)]
    if len(indices) == len(gpu_ids):
        return indices
    nv = nvml
    if nv is None:
        try:
            nv = importlib.import_module("pynvml")
        except ImportError as e:
            raise RuntimeError(f"GPU ids {list(gpu_ids)} are UUIDs and NVML (nvidia-ml-py) is not installed to "
                               "map them to device indices") from e
    nv.nvmlInit()
    try:
        return [int(g) if not str(g).startswith(UUID_PREFIXES) else _index_of(nv, str(g)) for g in gpu_ids]
    finally:
        nv.nvmlShutdown()


def _index_of(nvml: Any, uuid: str) -> int:
    try:
        handle = nvml.nvmlDeviceGetHandleByUUID(uuid.encode())
        if uuid.startswith("MIG-"):
            # A MIG instance has no device index of its own: the GPU it is carved from has.
            handle = nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)
        return int(nvml.nvmlDeviceGetIndex(handle))
    except nvml.NVMLError as e:
        raise RuntimeError(f"GPU id {uuid} names no device NVML knows on this node ({e})") from e


def cuda_visible(assigned_id: str | int, own_index: int, job_indices: Sequence[int]) -> tuple[str, int]:
    """`CUDA_VISIBLE_DEVICES` for a rank Ray gave `assigned_id` (NVML index `own_index`), and the
    rank's device number under it. A whole GPU: every GPU of the job on its node (`job_indices`),
    by index, since NCCL needs its peers visible for P2P and NVLink and other jobs' GPUs stay out
    of reach. A MIG instance: its own UUID only, since an index would name the whole parent GPU
    (two ranks on two instances of one GPU would share the first) and CUDA enumerates one MIG
    instance per process anyway."""
    if str(assigned_id).startswith("MIG-"):
        return str(assigned_id), 0
    visible = sorted(set(job_indices) | {own_index})
    return ",".join(map(str, visible)), visible.index(own_index)
