"""The worker actor: one per GPU (or CPU slot), a thin Ray shell around the Trainer and the
step loop (`loop.py`).

The actor runs its whole step range in one call and pushes each step's metrics to the
driver's sink without waiting for an answer, so the training loop never blocks on Ray and the
driver can watch progress and failures at the same time.
"""

from __future__ import annotations

import importlib
import os
import resource
import signal
import socket
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import ray

from ..planning import Plan
from ..topology.local import TOPOLOGY_FILE_ENV
from .cpu_rate import keep_measured_cpu_rate
from .device_choice import rank_device
from .gpu_ids import cuda_visible, gpu_indices
from .messages import Message
from .metrics import TrainMetrics
from .nccl_env import NcclSetup
from .nccl_env import apply as apply_nccl
from .outbox import Outbox
from .peer_state import Held, PeerRestore, hold

if TYPE_CHECKING:  # imported where used: the runtime's import runs while the driver plans (`Worker.__init__`)
    from torch.distributed import TCPStore

    from .step_timer import StepTimer
    from .trainer import Trainer


def _pci_bus_id(gpu: int | None) -> str | None:
    if gpu is None:
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            info = pynvml.nvmlDeviceGetPciInfo(pynvml.nvmlDeviceGetHandleByIndex(gpu))
            bus = info.busId
            return bus.decode() if isinstance(bus, bytes) else bus
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML here (fake GPUs, containers): the id is simply unknown
        return None


def device_report(cpu_slot: int) -> dict[str, Any]:
    """Where this process runs, as Ray and the OS see it (placement.json records it)."""
    ctx = ray.get_runtime_context()
    gpu_ids = gpu_indices(ray.get_gpu_ids())
    gpu = gpu_ids[0] if gpu_ids else None
    return {
        "node_id": ctx.get_node_id(),
        "hostname": socket.gethostname(),
        "ip": ray.util.get_node_ip_address(),
        "pid": os.getpid(),
        "gpu_ids": gpu_ids,
        "gpu": gpu,
        "cpu_slot": None if gpu_ids else cpu_slot,
        "pci_bus_id": _pci_bus_id(gpu),
        "actor_id": ctx.get_actor_id(),
    }


def _bind_cpus(cpu_affinity: str, rank: int) -> list[str]:
    """Pin this process to the CPUs nearest its GPU (host-to-device copies and the data loader
    then stay on the GPU's NUMA node). Only CPUs this process may already use are taken, so a
    container's cpuset or Ray's own isolation is never widened."""
    from ..topology.model import parse_cpu_list

    allowed = os.sched_getaffinity(0)
    near = parse_cpu_list(cpu_affinity) & allowed
    if not near:
        return [f"rank {rank}: none of the CPUs near its GPU ({cpu_affinity}) are available here; not pinned"]
    os.sched_setaffinity(0, near)
    return []


def _normal_priority() -> str | None:
    """Run this rank at niceness 0, where Ray started it lower (its default for workers is 15):
    a training process that yields to every daemon on its host loses steps to them, and every
    other rank waits for it at the next collective. None when done; else why not, in one
    sentence (lowering niceness needs CAP_SYS_NICE, which a cluster may not grant)."""
    was = os.getpriority(os.PRIO_PROCESS, 0)
    if was <= 0:
        return None
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 0)
    except PermissionError:
        return (f"this rank runs at niceness {was} (the cluster's worker_niceness) and may not lower it: Ray's own "
                f"processes take the CPU first on a busy host (start the nodes with RAY_worker_niceness=0)")
    return None


@dataclass(frozen=True)
class MemoryUse:
    """What one rank's process held over its run, reported in its final answer (summary.json)."""

    peak_bytes: int
    """The most it held: the device's peak allocation on a GPU rank, the process's peak resident
    set on a CPU rank (which includes `baseline_bytes`)."""
    baseline_bytes: int
    """What it held before the model was built, after imports and the process group: on a CPU
    rank the interpreter and torch's own libraries, which the plan does not count."""
    peak_reserved_bytes: int | None
    """GPU ranks: the most the caching allocator reserved (allocations plus its cache); None on CPU."""
    source: str
    """What the figures measure: `cuda` (device allocations) or `rss` (resident process memory)."""


_imports_frozen = False


def freeze_imports() -> None:
    """Put what this process has built so far (the interpreter, torch, the runtime: about
    265,000 objects) out of the cyclic collector's sight, once, before any model exists. They
    live as long as the process, and a full collection then scans only what came after: each
    survivor's `leave` collects to close its old group's connections (0.12 s a rank on this
    host before, under 1 ms after, and 16 survivors share 2 cores), and Python's own full
    passes during training shrink alike. Later calls do nothing, so no model is ever frozen."""
    global _imports_frozen
    if not _imports_frozen:
        import gc

        gc.freeze()
        _imports_frozen = True


def _resident_bytes() -> int:
    import psutil

    return int(psutil.Process(os.getpid()).memory_info().rss)


def _peak_resident_bytes() -> int:
    # Linux: the address space's high-water mark, which `_forget_resident_peak` resets. Not
    # ru_maxrss, which that reset does not always clear.
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    # Elsewhere: the process's own mark, in kilobytes on Linux, bytes on macOS.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def _forget_resident_peak() -> None:
    # Whatever the process touched and released before now (an import, a loader's warm-up) would
    # otherwise stay in the high-water mark and count as the model's. Writing 5 to clear_refs
    # (Linux 4.0 and later) resets the mark to the current resident set; elsewhere the mark stays.
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def memory_baseline(device, kept: int | None = None) -> int:
    """Bytes this rank holds now, before its model exists: what `memory_use` subtracts; `kept`
    instead where the process took one at an earlier setup (a survivor joining a new group: what
    it holds now includes pages its allocator kept from the old one). Either way the peak
    `memory_use` reports counts from here on, so it never includes an earlier world's."""
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return int(torch.cuda.memory_allocated(device)) if kept is None else kept
    _forget_resident_peak()
    return _resident_bytes() if kept is None else kept


def memory_use(device, baseline: int) -> MemoryUse:
    """This rank's peak memory so far, beside the `baseline` taken before the model was built."""
    import torch

    if device.type == "cuda":
        return MemoryUse(peak_bytes=int(torch.cuda.max_memory_allocated(device)), baseline_bytes=baseline,
                         peak_reserved_bytes=int(torch.cuda.max_memory_reserved(device)), source="cuda")
    # The resident set can peak between two samples; the kernel's high-water mark cannot miss it.
    return MemoryUse(peak_bytes=_peak_resident_bytes(), baseline_bytes=baseline, peak_reserved_bytes=None,
                     source="rss")


class RankLeft(RuntimeError):
    """This rank's step loop failed (its text is the original traceback) and the rank left its
    process group; the process stays for the next `setup`."""


ROWS_KEPT = 4096
"""Metrics rows a rank keeps: a restore from memory needs those its rank 0 had not sent yet."""

@ray.remote
class MetricsSink:
    """Collects what ranks push; the driver drains it."""

    def __init__(self) -> None:
        self._items: list[Message] = []

    def put(self, item: Message) -> None:
        self._items.append(item)

    def put_many(self, items: list[Message]) -> None:
        self._items.extend(items)

    def drain(self) -> list[Message]:
        items, self._items = self._items, []
        return items


# Liveness and stack dumps answer on their own thread: a rank busy in a step, or blocked in a
# collective waiting for a dead peer, still says it is alive (and where it is).
@ray.remote(concurrency_groups={"control": 1})
class Worker:
    def __init__(self, rank: int, world: int, cpu_slot: int, threads: int) -> None:
        import torch

        self.rank = rank
        self.world = world
        self.cpu_slot = cpu_slot
        torch.set_num_threads(max(1, threads))
        # The runtime (FSDP2, DTensor, DCP: about 0.6 s on one core) imports while the driver
        # probes and plans, or, for a rank replacing a dead one, while the survivors leave, so
        # the group that `setup` forms never waits for it (`setup`'s import waits for this one).
        threading.Thread(target=importlib.import_module, args=(f"{__package__}.trainer",),
                         name="import-runtime", daemon=True).start()
        self.niceness_note = _normal_priority()
        self.trainer: Trainer | None = None
        """The model and its step, built by `setup`; None until then and after `leave`."""
        self.timer: StepTimer | None = None
        """The trainer's step timer, made with it in `setup`."""
        # Held while the process group is torn down: an abort from the control thread racing a
        # `leave` on the main one leaves torch's group registry half cleared, and the next
        # group's names then collide with stale ones.
        self._group_lock = threading.Lock()
        self._held: Held | None = None
        """This rank's state as it left a broken group, until the next `setup` (peer_state.py)."""
        self._not_held: str | None = None
        """Why a rank of a replicated plan holds no state after a failure."""
        self._rows: deque[dict[str, Any]] = deque(maxlen=ROWS_KEPT)
        """The newest steps' metrics rows: those rank 0 had not yet sent when it failed."""
        self._completed = 0
        """The last step whose row this rank made (before its evaluation, which may follow)."""
        self._aborted = threading.Event()
        """Set when the group's collectives were aborted (`abort_collectives`), until the next
        `setup`: a step that then returns may hold partial sums and never counts."""
        self._stage = "idle"
        """Where `train` is: training; leaving, then holding (after a failure); idle."""
        self._served: TCPStore | None = None
        """The store of the group this actor is rank 0 of, from `rendezvous_address` to `setup`."""

    @ray.method(concurrency_group="control")
    def report(self) -> dict[str, Any]:
        return {"rank": self.rank, **device_report(self.cpu_slot)}

    @ray.method(concurrency_group="control")
    def stage(self) -> str:
        """Where `train` is (`_stage`), answered while a step is blocked in a collective."""
        return self._stage

    def probe(self, num_cpu_slots: int) -> dict[str, Any]:
        """This node's topology, probed in this process for the driver (`probe_cluster(on=...)`):
        a worker started before the plan saves its node the probe's own process."""
        from ..topology.local import probe_local

        return probe_local(num_cpu_slots).to_dict()

    @ray.method(concurrency_group="control")
    def fence(self) -> None:
        """Commit no checkpoint from now on (`checkpoint.fence`): the driver is about to choose
        where the next world resumes and kill this one."""
        from . import checkpoint

        checkpoint.fence()

    @ray.method(concurrency_group="control")
    def alive(self) -> int:
        return self.rank

    @ray.method(concurrency_group="control")
    def kill_peer(self, pid: int) -> bool:
        """SIGKILL a silent rank of this node (`pid`, from its placement report): Ray's own kill
        asks a stopped process to exit and waits seconds before it kills. Only a process that
        is still one of Ray's `Worker` actors is killed; True once it is gone."""
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if not f.read().startswith(b"ray::Worker"):
                    return False
            os.kill(pid, signal.SIGKILL)
        except (OSError, ValueError):
            return False
        return True

    @ray.method(concurrency_group="control")
    def stacks(self) -> str:
        """Every thread's Python stack in this process, as faulthandler writes it."""
        import faulthandler
        import tempfile

        with tempfile.TemporaryFile("w+") as f:  # faulthandler needs a real file descriptor
            faulthandler.dump_traceback(file=f, all_threads=True)
            f.seek(0)
            return f"rank {self.rank}, pid {os.getpid()}\n" + f.read()

    def rendezvous_address(self) -> tuple[str, int]:
        """Where the next group meets: a store this rank (its rank 0) serves from now on, so no
        rank that asks for it before this one joins finds nothing listening (rendezvous.py)."""
        from .rendezvous import serve

        self._served = serve(ray.util.get_node_ip_address())
        return ray.util.get_node_ip_address(), self._served.port

    def setup(self, cfg, plan: Plan, master: tuple[str, int], resume_from: str | PeerRestore | None = None,
              cpu_affinity: str | None = None, nccl: NcclSetup | None = None, model_fn=None,
              rank: int | None = None) -> dict[str, Any]:
        """Join the process group, build the model under the plan, and load `resume_from` if given
        (a checkpoint, or the survivors' memory, which this rank's held state may be part of).
        `cpu_affinity` is the CPU list closest to this rank's GPU, from the probed topology;
        `nccl` what NCCL should be told about this node (`nccl_env`). `rank`: this process's rank
        under `plan`, where it is not the one it was started as (a trial's other layouts)."""
        t_enter = time.monotonic()
        import torch

        from .rendezvous import join
        from .step_timer import StepTimer
        from .trainer import Trainer

        # What is left of the runtime's import (started with the actor) is part of building
        # the first model, so the breakdown counts it there rather than nowhere.
        importing_s = time.monotonic() - t_enter
        freeze_imports()

        if rank is not None:
            self.rank = rank
        # Held state serves only the restore it was kept for: otherwise it goes before the new
        # model is built, so the two never share the memory.
        held, self._held = (self._held, None) if isinstance(resume_from, PeerRestore) else (None, None)
        self._rows.clear()  # an earlier world's rows: a restore may have rewound past them
        self._aborted.clear()  # the abort was the old group's
        notes = [self.niceness_note] if self.niceness_note else []
        if cpu_affinity:
            notes += _bind_cpus(cpu_affinity, self.rank)
        assigned = ray.get_gpu_ids()
        gpus = gpu_indices(assigned)
        local_index = None
        if gpus:
            # Set before CUDA initialises in this process (placement verified our GPU is planned).
            node = ray.get_runtime_context().get_node_id()
            visible, local_index = cuda_visible(assigned[0], gpus[0], [r.gpu for r in plan.ranks if r.node == node])
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
        chosen = rank_device(gpus[0] if gpus else None, local_index,
                             torch.cuda.is_available(), os.environ.get(TOPOLOGY_FILE_ENV), self.rank)
        device = torch.device(chosen.kind, chosen.index) if chosen.index is not None else torch.device("cpu")
        if chosen.kind == "cuda":
            torch.cuda.set_device(device)
        backend = chosen.backend
        if chosen.note:
            notes.append(chosen.note)
        # Before the process group: NCCL reads its environment when the communicator starts.
        nccl_vars, nccl_notes = apply_nccl(nccl, ray.util.get_node_ip_address(), _pci_bus_id(gpus[0]) if gpus else None)
        notes += nccl_notes
        t0 = time.monotonic()
        # The store this actor served is the group's only where it is the group's rank 0.
        served, self._served = (self._served if self.rank == 0 else None), None
        join(self.rank, self.world, master, backend, served, device)
        del served  # the group holds it now, and closes it when the group goes
        t_group = time.monotonic()
        self.memory_baseline = memory_baseline(device, getattr(self, "memory_baseline", None))
        from . import checkpoint

        # A group of its own costs a rendezvous: made only where checkpoints will be written.
        self.writer_group = (checkpoint.writer_group() if cfg.checkpoint.enabled and cfg.checkpoint.async_save
                             else None)
        self.trainer = Trainer(cfg, plan, device, model_fn, resuming=resume_from is not None)
        t_build = time.monotonic()
        self.metrics = TrainMetrics(cfg.name, self.rank, planned_bytes=plan.memory_per_rank.total,
                                    baseline_bytes=self.memory_baseline, device=device)
        start = self.trainer.start(resume_from, held)
        del held
        # Measured on the loaded weights, before the first step: the compute-only baseline and,
        # for compiled blocks, what compiling gains.
        self.timer = StepTimer(self.trainer)
        self.timer.calibrate()
        if device.type == "cpu" and self.cpu_slot == 0:  # one rank per node keeps the host's rate
            keep_measured_cpu_rate(plan, self.timer.compute_micro_s)
        self._completed = start
        timings = {"process_group_s": t_group - t0, "model_build_s": importing_s + t_build - t_group,
                   "state_restore_s": time.monotonic() - t_build}
        return {"num_params": self.trainer.num_params, "timings": timings,
                "notes": notes + self.trainer.build_notes + list(self.trainer.par.notes),
                "state_bytes": self.trainer.par.state_bytes(), "backend": backend, "start_step": start,
                "compile_times": self.timer.compile_times, "compute_micro_s": self.timer.compute_micro_s,
                "visible_gpus": os.environ.get("CUDA_VISIBLE_DEVICES") if gpus else None, "nccl_env": nccl_vars,
                "cpus": sorted(os.sched_getaffinity(0))}

    def train(self, start: int, end: int, sink, checkpoint_dir: str | None) -> dict[str, Any]:
        """Run optimizer steps [start, end); rank 0 pushes each step's metrics to `sink`. On an
        error (a peer died in a collective) the rank leaves its process group at once and
        raises: its closed connections end its peers' waits too, so every survivor returns
        and can join a new group (`setup` again) without its process being replaced."""
        self._stage = "training"
        try:
            result = self._train(start, end, sink, checkpoint_dir)
        except Exception as e:  # noqa: BLE001 - re-raised below, as text
            self._stage = "leaving"
            failed = "".join(traceback.format_exception(e))
        else:
            self._stage = "idle"
            return result
        # Outside the except block, so the exception and its traceback are gone: their frames
        # hold the model, and through it the process group, whose connections close only once
        # nothing refers to it. Closed, they end the other ranks' waits on this one.
        kept = self._keep()
        # Leave first: the ranks behind this one wait on its connections, so they close before
        # the state is copied and hashed.
        self.leave()
        self._stage = "holding"
        self._hold(kept)
        self._stage = "idle"
        raise RankLeft(failed)

    def _keep(self) -> tuple[int, list] | None:
        """This rank's state tensors, for its replica group's restore (peer_state.py), where
        others hold the same (a replicated plan) and it is one whole step: the update applied and
        the step's row made. A rank torn between the two keeps nothing, and says why."""
        tr = self.trainer
        self._held, self._not_held = None, None
        if tr is None or tr.plan.mesh.dp_replicate < 2:
            return None
        if tr.applied != self._completed:
            self._not_held = f"its step {tr.applied} was applied but not done"
            return None
        try:
            return tr.applied, tr.held_tensors()
        except Exception as e:  # noqa: BLE001 - a state that cannot be taken is restored from a checkpoint
            self._not_held = f"its state could not be taken ({type(e).__name__}: {str(e)[:160]})"
            return None

    def _hold(self, kept: tuple[int, list] | None) -> None:
        """Copy (from a GPU) and hash what `_keep` took."""
        if kept is None:
            return
        try:
            self._held = hold(kept[1], kept[0])
        except Exception as e:  # noqa: BLE001 - as in _keep
            self._not_held = f"its state could not be copied ({type(e).__name__}: {str(e)[:160]})"

    def held_state(self, after_step: int) -> dict[str, Any] | None:
        """What this rank holds for a restore: its step and digest, and its rows of the steps
        after `after_step` (the driver's last), or None when it holds no whole step."""
        if self._held is None:
            return {"step": None, "why": self._not_held} if self._not_held else None
        rows = [r for r in self._rows if r["step"] > after_step]
        return {"step": self._held.step, "digest": self._held.digest, "rows": rows}

    def trial(self, steps: int) -> list[tuple[float, float | None]]:
        """Run `steps` optimizer steps of the model `setup` built, from step 0, with no
        evaluation, checkpoint or metrics, then leave the group: a trial measures a plan and
        forgets it (each step is seeded by its number, so the run after it starts as if none had
        run). Returns each step's (seconds, exposed communication seconds or None)."""
        failed = None
        try:
            tr, timer = self.trainer, self.timer
            assert tr is not None and timer is not None, "a trial runs the model `setup` built"
            times = []
            for step in range(steps):
                # As the run would train it: a compiled plan's gain steps with their blocks as the timer names.
                with timer.gain_stance(step):
                    result = tr.train_step(step)
                times.append((result.step_s, timer.exposed_comm_s(result)))
        except Exception as e:  # noqa: BLE001 - re-raised below, as text
            failed = "".join(traceback.format_exception(e))
        self.leave()  # outside the except block: see `train`
        if failed is not None:
            raise RankLeft(failed)
        return times

    @ray.method(concurrency_group="control")
    def abort_collectives(self) -> None:
        """Abort this rank's communicators from the control thread, so a step blocked in a
        collective behind a dead peer raises (NCCL's abort; a gloo wait ends when the dead
        peer's or a leaving survivor's connection closes, which abort cannot hasten)."""
        import torch.distributed as dist

        # Before the abort: a step it unblocks must find it set when it returns.
        self._aborted.set()
        with self._group_lock:
            if dist.is_initialized():
                try:
                    dist.distributed_c10d._abort_process_group()
                except Exception:  # already torn down by the failing step: nothing left to abort
                    pass

    def leave(self) -> None:
        """Drop the model and the process group and keep the process (its imports, its device
        context) for the next `setup`: what a survivor does before the group re-forms."""
        import gc

        import torch
        import torch.distributed as dist

        self.trainer = None
        self.timer = None
        self.writer_group = None
        with self._group_lock:
            if dist.is_initialized():
                try:
                    dist.destroy_process_group()
                except Exception:  # an aborted group is gone already
                    pass
        # Device meshes the model was sharded over are cached with their groups: forget them.
        from torch.distributed import device_mesh

        if hasattr(device_mesh, "_mesh_resources") and hasattr(device_mesh._mesh_resources, "mesh_stack"):
            device_mesh._mesh_resources.mesh_stack.clear()
        gc.collect()  # the last references to the groups go here, and with them their connections
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def _train(self, start: int, end: int, sink, checkpoint_dir: str | None) -> dict[str, Any]:
        from .checkpointer import Checkpointer
        from .compile import cache_counters
        from .loop import run_steps
        from .validator import Validator

        tr, timer = self.trainer, self.timer
        assert tr is not None and timer is not None, "a step range runs the model `setup` built"
        cfg = tr.cfg
        outbox = Outbox(sink)
        checkpointer = (Checkpointer(tr, checkpoint_dir, cfg.checkpoint, cfg.train.max_steps, outbox,
                                     announces=self.rank == 0, writer_group=self.writer_group)
                        if checkpoint_dir and cfg.checkpoint.enabled else None)
        validator = Validator(tr.evaluate, cfg.train.eval_interval, cfg.train.max_steps)
        end_of = run_steps(tr, range(start, end), timer, validator, outbox, checkpointer=checkpointer,
                           metrics=self.metrics, on_step=self._step_done)
        stepped = all(timer.compile_steps.values())
        return {"rank": self.rank, "last_val_loss": end_of.last_val_loss, "state_bytes": tr.par.state_bytes(),
                "memory": asdict(memory_use(tr.device, self.memory_baseline)),
                "overhead_s_per_step": end_of.overhead_s_per_step,
                "compile_cache": cache_counters() if tr.compiled else None,
                "compile_steps": timer.compile_steps if stepped else None,
                "compile_gain_steps": timer.gain_steps_trained if stepped else None}

    def _step_done(self, row: dict[str, Any]) -> None:
        """A step is whole (applied, its row made): a restore from memory may start after it. A step
        that returns after its group was aborted is not: a collective cut short may have handed
        it a partial sum (the loss's `.item()`), so it fails, before its row, checkpoint or held
        state can count it."""
        if self._aborted.is_set():
            raise RuntimeError(f"step {row['step']} returned after its group's collectives were aborted: its "
                               "reductions may be partial, so it does not count")
        self._rows.append(row)
        self._completed = row["step"]

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
