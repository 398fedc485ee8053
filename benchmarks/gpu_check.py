"""GPU check: the planner's predictions and the runtime's behaviour on one real GPU, in one command.

    python benchmarks/gpu_check.py [--quick] [--only PART ...] [--device cuda|cpu] [--out DIR]

Results go to $OUT when it is set, else to DIR, else to benchmarks/results/gpu/: two files,
gpu_check.json (every part's figures under `parts`, beside the command, machine and versions)
and gpu_check.log (what the check and each part printed). Each part runs in a process of its
own under its own time limit, so a part that hangs or crashes the device loses itself, not the
others; the SM and memory clocks and the device's whole used memory (NVML) are read before and
after each. The parts, in the order they run (those that need no Ray first):

* torch_api: every torch API the other parts' paths call, imported and looked up on the torch
  that runs; the torch against the floor pyproject.toml states.
* memory_model: a ~1B Llama-shaped model at 4,096 tokens, micro-batch 1, bf16, one rank; for
  ddp and zero3 (FSDP2) under each recompute mode, the plan's per-rank memory against
  `torch.cuda.max_memory_allocated()` over a training step of the runtime's Trainer (the
  second, once AdamW's state exists; the first step's peak is recorded beside it), and the
  device's whole footprint then (`torch.cuda.mem_get_info`: the CUDA context, the cuBLAS and
  NCCL workspaces and the allocator's cache beside the tensors).
* step_time: the plan's step time against the Trainer's steady step (mean and median) for the
  built-in GPT at 6/512, 12/768 and 24/1024 (layers/width), 1,024 tokens, DDP on one rank.
* dcp: a ~100M-parameter GPT with AdamW state under FSDP2, saved by `runtime.checkpoint.save`
  and loaded into a fresh Trainer by `Trainer.load_checkpoint`; whether every tensor came back
  equal, the seconds and the bytes.
* compile: the built-in GPT at 12/768, 1,024 tokens, DDP on one rank, eager and then with its
  blocks compiled as the runtime compiles them: the steady steps of each (named: the compiled
  figure is of compiled steps only), their ratio, the first compiled step's time over the
  steady one (the compile), against the planner's `COMPILE_SPEEDUP['gpu']` and `COMPILE_S['gpu']`.
* real_loop: memory_model's Llama at 4,096 tokens, bf16, FSDP2 (zero3) on one rank, trained by
  the runtime's own step loop (`runtime.loop.run_steps`, as `runtime/launch.py` runs it, its
  messages kept by a collecting sink), eager and then compiled (`train.compile=true`): from the
  loop's rows, tokens/s, MFU and step time (median and mean of the steady steps, named: the
  first LOOP_WARMUP_STEPS and the compile gain's eager steps left out, those listed), the
  loop's `overhead_s_per_step` and its share of a step, `torch.cuda.max_memory_allocated()`
  over the loop beside the device's footprint, against the plan's step time and per-rank memory.
* doctor (needs Ray): `python -m orchestrator doctor`; its exit code, output tails and report.
* default_job (needs Ray): `python -m orchestrator submit jobs/llm.yaml cluster.num_workers=1
  ...`, short; launch to the end of the first step, steady tokens/s, MFU against the peak the
  plan assumed (plan.json), the backend the worker used (placement.json).

Where Ray is not installed, the parts that need it say so in one line and are skipped. Each
part that fails records its failure as `error` (one line) and the others still run; the exit
code is 1 when any part failed or the torch is older than the floor. Sized for one H100 to
finish in under 6 minutes (`--quick`: under 3), each part's time limit included. Nothing is
written outside the results folder and one temporary folder (scratch, run directories and the
compilers' and the orchestrator's caches). `--device cpu` is the smoke mode the tests run:
every part on CPU with gloo, fp32, tiny models and a few steps, the measured memory then being
torch's MemTracker peak, and `doctor` recorded as whatever the CLI returned.
benchmarks/gpu_check.sh carries what the GPU machine's image lacks and runs this there.
"""

from __future__ import annotations

import argparse
import gc
import getpass
import importlib
import importlib.util
import inspect
import json
import math
import os
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from _common import (
    RESULTS,
    ROOT,
    child_env,
    free_port,
    parse_args,
    print_table,
    python,
    rel_error,
    run,
    steady_mean,
    write_result,
)

OUT = RESULTS / "gpu"
OUT_ENV = "OUT"
"""The folder the GPU machine brings back: where results go when it is set."""
RESULT_FILE = "gpu_check.json"
LOG_FILE = "gpu_check.log"
JOB = "jobs/llm.yaml"
# What a part's figures hold, beside part, device and seconds, when the part did not fail.
FIGURES: dict[str, tuple[str, ...]] = {
    "torch_api": ("torch", "floor", "apis", "modules"),
    "doctor": ("cli_command", "returncode", "stderr_tail"),
    "default_job": ("cli_command", "first_step_s", "tokens_per_s", "step_s", "mfu", "backend", "plan"),
    "memory_model": ("model", "params", "cases", "max_rel_error"),
    "step_time": ("steps", "cases", "mean_abs_rel_error"),
    "dcp": ("params", "bytes", "save_s", "load_s", "tensors", "equal"),
    "compile": ("eager_step_s", "compiled_step_s", "speedup", "compile_s", "predicted_speedup", "predicted_compile_s",
                "compiled_steps"),
    "real_loop": ("params", "steps", "runs", "compiled_speedup"),
}
STRATEGIES = ("ddp", "zero3")
RECOMPUTE = ("none", "selective", "full")
TAIL_LINES = 20
LLAMA = "model.factory=orchestrator.workloads.llama:build"
CPU_PART_TIMEOUT_S = 300
"""Each part's time limit in the CPU smoke mode, whose parts take seconds: only a hang reaches it."""
STOP_GRACE_S = 10
"""Seconds a part past its time limit has after SIGTERM before SIGKILL."""
NO_RAY = "skipped: Ray is not installed here, and this part goes through the CLI, which starts Ray"
# Every torch API the parts' paths call that an older torch may lack: (module, attribute).
TORCH_APIS: tuple[tuple[str, str], ...] = (
    ("torch.compiler", "set_stance"),
    ("torch.nn.utils", "get_total_norm"),
    ("torch.nn.utils", "clip_grads_with_norm_"),
    ("torch.distributed.fsdp", "fully_shard"),
    ("torch.distributed.fsdp", "FSDPModule"),
    ("torch.distributed.fsdp", "MixedPrecisionPolicy"),
    ("torch.distributed.tensor", "DTensor"),
    ("torch.distributed.tensor", "distribute_tensor"),
    ("torch.distributed.device_mesh", "init_device_mesh"),
    ("torch.distributed", "reduce_scatter_tensor"),
    ("torch.distributed", "all_gather_into_tensor"),
    ("torch.distributed", "get_process_group_ranks"),
    ("torch.distributed.checkpoint", "async_save"),
    ("torch.distributed.checkpoint.state_dict_saver", "AsyncSaveResponse"),
    ("torch.distributed.checkpoint.state_dict", "get_state_dict"),
    ("torch.distributed.checkpoint.state_dict", "set_state_dict"),
    ("torch.distributed.checkpoint.state_dict", "StateDictOptions"),
    ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "checkpoint_wrapper"),
    ("torch.distributed._tools.mem_tracker", "MemTracker"),
    ("torch.distributed._tools.mem_tracker", "_MemRefType"),
    ("torch.distributed.pipelining", "PipelineStage"),
    ("torch.utils.flop_counter", "FlopCounterMode"),
    ("torch.amp", "GradScaler"),
    ("torch.cuda", "mem_get_info"),
)
# Keyword arguments of those APIs that an older torch may not take: (module, function, keyword).
TORCH_KEYWORDS: tuple[tuple[str, str, str], ...] = (
    ("torch.distributed", "init_process_group", "device_id"),
    ("torch.distributed.fsdp", "fully_shard", "mp_policy"),
    ("torch.distributed.checkpoint", "load", "no_dist"),
    ("torch.distributed.checkpoint", "async_save", "process_group"),
    ("torch.distributed.checkpoint.state_dict", "StateDictOptions", "flatten_optimizer_state_dict"),
    ("torch.distributed.fsdp", "fully_shard", "reshard_after_forward"),
)
# The orchestrator modules the parts import: one that fails to import names its cause first.
MODULES = ("orchestrator.runtime.trainer", "orchestrator.runtime.checkpoint", "orchestrator.runtime.parallelize",
           "orchestrator.planning", "orchestrator.config", "orchestrator.control.preflight")


def llama(dim: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int) -> list[str]:
    return [LLAMA, f"model.args={{dim: {dim}, n_layers: {layers}, n_heads: {heads}, n_kv_heads: {kv_heads}, "
                   f"ffn_dim: {ffn}, vocab_size: {vocab}}}"]


def gpt(layers: int, width: int, heads: int) -> list[str]:
    return [f"model.n_layer={layers}", f"model.n_embd={width}", f"model.n_head={heads}"]


def sizes(device: str, quick: bool) -> dict[str, Any]:
    """Models, batches, steps and time limits of every part on `device`."""
    if device == "cuda":
        return {
            "job_steps": 50 if quick else 100, "job_extra": [], "doctor_timeout_s": 120, "job_timeout_s": 180,
            # 0.89B parameters (TinyLlama's width, FFN and vocabulary, 16 layers); --quick keeps 8 layers.
            # About 0.2 TFLOP a step: the six cases' steps take seconds, their trainers' setup the rest.
            "memory_model": llama(2048, 8 if quick else 16, 16, 8, 5632, 32000), "memory_seq": 4096,
            "step_models": {"gpt 6/512": gpt(6, 512, 8), "gpt 12/768": gpt(12, 768, 12),
                            "gpt 24/1024": gpt(24, 1024, 16)},
            # The largest, 0.35B parameters x 32,768 tokens, is ~70 TFLOP a step: ~0.15 s at 450 TFLOP/s.
            "step_block": 1024, "step_batch": 32, "step_steps": 12 if quick else 30,
            # 14 x 768 wide: 100M parameters (29M with --quick).
            "dcp_model": gpt(4 if quick else 14, 768, 12), "dcp_block": 1024, "dcp_batch": 8,
            "compile_model": gpt(12, 768, 12), "compile_block": 1024, "compile_batch": 16,
            "compile_steps": 10 if quick else 20,
            # memory_model's Llama: ~22 TFLOP a step, ~50 ms at 450 TFLOP/s; at least COMPILE_GAIN_STEPS.stop
            # steps, so the compiled run times its gain on named steps as a user's run does.
            "loop_model": llama(2048, 8 if quick else 16, 16, 8, 5632, 32000), "loop_steps": 12 if quick else 30,
        }
    return {
        "job_steps": 5 if quick else 10, "job_extra": ["train.eval_iters=1"], "doctor_timeout_s": 120,
        "job_timeout_s": 240,
        "memory_model": llama(64, 2, 4, 2, 176, 256), "memory_seq": 64,
        "step_models": {"gpt 1/64": gpt(1, 64, 4), "gpt 2/64": gpt(2, 64, 4), "gpt 2/128": gpt(2, 128, 4)},
        "step_block": 64, "step_batch": 8, "step_steps": 5 if quick else 12,
        "dcp_model": gpt(2, 128, 4), "dcp_block": 64, "dcp_batch": 4,
        "compile_model": gpt(1, 32, 4), "compile_block": 32, "compile_batch": 4, "compile_steps": 3,
        "loop_model": llama(64, 2, 4, 2, 176, 256), "loop_steps": 10,
    }


class PartFailed(Exception):
    """A part that failed after gathering figures worth keeping (a command's output tails)."""

    def __init__(self, message: str, figures: dict[str, Any]) -> None:
        super().__init__(message)
        self.figures = figures


def one_line(e: BaseException) -> str:
    text = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


@dataclass
class Check:
    """What every part needs: the device, the sizes, where results and scratch files go."""

    device: str
    """cuda or cpu."""
    quick: bool
    """The smaller sizes."""
    out: Path
    """The results folder."""
    work: Path
    """This part's scratch folder, inside the check's temporary folder."""
    t0: float
    """time.perf_counter() at the check's start, for the log's timestamps."""

    @property
    def size(self) -> dict[str, Any]:
        return sizes(self.device, self.quick)

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    @property
    def precision(self) -> str:
        return "bf16" if self.cuda else "fp32"

    def torch_device(self):
        import torch

        return torch.device("cuda", 0) if self.cuda else torch.device("cpu")

    def log(self, message: str) -> None:
        print(f"[{time.perf_counter() - self.t0:6.1f} s] {message}", file=sys.stderr, flush=True)


def median(values: list[float]) -> float:
    """The median of the steady steps (`steady_mean`'s rule for which steps count)."""
    return statistics.median(values[min(len(values) // 5, 10):] or values)


def device_footprint(cuda: Any) -> dict[str, int]:
    """The device's whole used memory as the driver counts it (`mem_get_info`: the CUDA context,
    library workspaces and the allocator's cache beside the tensors) and the allocator's own
    figures; `cuda` is torch.cuda."""
    free, total = cuda.mem_get_info()
    return {"device_used_bytes": int(total - free), "device_total_bytes": int(total),
            "allocated_bytes": int(cuda.memory_allocated()), "reserved_bytes": int(cuda.memory_reserved())}


# --- commands ---------------------------------------------------------------------------------

def _size(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.2f} MB"


def _tail(text: str, n: int = TAIL_LINES) -> list[str]:
    return text.rstrip().splitlines()[-n:] if text.strip() else []


def _stop(proc: subprocess.Popen, grace_s: float = 30) -> None:
    """SIGTERM to the command's own session (submit then stops its workers and its Ray cluster),
    SIGKILL to what is left after `grace_s`."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_command(cmd: list[str], timeout_s: float, work: Path) -> dict[str, Any]:
    """Run `cmd` from the repository root in a session of its own, its output to files (not
    pipes, which a daemon it leaves behind could hold open); stopped past `timeout_s`."""
    work.mkdir(parents=True, exist_ok=True)
    out_path, err_path = work / "stdout.log", work / "stderr.log"
    started = time.time()
    timed_out = False
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=out, stderr=err, start_new_session=True)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _stop(proc)
    stdout, stderr = out_path.read_text(errors="replace"), err_path.read_text(errors="replace")
    return {"cli_command": shlex.join(cmd), "returncode": proc.returncode, "timed_out": timed_out,
            "started": started, "wall_s": time.time() - started, "stdout": stdout, "stderr": stderr,
            "stdout_tail": _tail(stdout), "stderr_tail": _tail(stderr)}


def _said(res: dict[str, Any]) -> str:
    """Why a command failed, in one line: its time limit, or its last line of output."""
    if res["timed_out"]:
        return f"ran past its time limit ({res['wall_s']:.0f} s)"
    last = (res["stderr_tail"] or res["stdout_tail"] or [""])[-1].strip()
    return f"exited with {res['returncode']}" + (f": {last}" if last else "")


def _kept(res: dict[str, Any]) -> dict[str, Any]:
    # Not "command": write_result's own key, the command line of the check itself.
    return {k: res[k] for k in ("cli_command", "returncode", "timed_out", "wall_s", "stdout_tail", "stderr_tail")}


# --- doctor -----------------------------------------------------------------------------------

def doctor_command(report: Path) -> list[str]:
    return [python(), "-m", "orchestrator", "doctor", "--out", str(report)]


def verdicts(report: Any) -> list[str]:
    """`name: verdict (reasons)` of each node the report names; none where it says otherwise."""
    nodes = report.get("nodes") if isinstance(report, dict) else None
    out = []
    for n in nodes if isinstance(nodes, list) else []:
        if isinstance(n, dict) and "verdict" in n:
            reasons = [str(r) for r in n.get("reasons") or []]
            out.append(f"{n.get('name', '?')}: {n['verdict']}" + (f" ({'; '.join(reasons)})" if reasons else ""))
    return out


def doctor(check: Check) -> dict[str, Any]:
    """The doctor CLI as a user runs it. On CUDA a missing report or a non-zero exit (a node
    that fails its checks) is a failure; on CPU the check only records what the CLI did."""
    report = check.work / "doctor.json"
    report.unlink(missing_ok=True)  # a report left by an earlier check must not pass for this one's
    res = run_command(doctor_command(report), check.size["doctor_timeout_s"], check.work / "doctor")
    figures = {**_kept(res), "report_path": str(report), "report": None, "verdicts": []}
    if report.is_file():
        try:
            figures["report"] = json.loads(report.read_text())
        except ValueError as e:
            figures["report"] = {"unreadable": one_line(e)}
        figures["verdicts"] = verdicts(figures["report"])
    if check.cuda and (res["returncode"] != 0 or figures["report"] is None):
        failing = [v for v in figures["verdicts"] if ": fail" in v]
        why = _said(res) if res["returncode"] != 0 else "exited with 0 but wrote no report"
        raise PartFailed(f"doctor {why}" + (f"; {failing[0]}" if failing else ""), figures)
    if not check.cuda and res["returncode"] != 0:
        figures["note"] = f"on CPU the doctor's outcome is recorded, not judged: it {_said(res)}"
    return figures


# --- default_job ------------------------------------------------------------------------------

def run_directory(stdout: str) -> Path | None:
    """The run directory `submit` printed (its first `run directory: ` line)."""
    from orchestrator.connect.remote import RUN_DIR_LINE

    for line in stdout.splitlines():
        if line.startswith(RUN_DIR_LINE):
            return Path(line.split(RUN_DIR_LINE, 1)[1].split("  (")[0].strip())
    return None


def read_run(run_dir: Path, launched: float) -> dict[str, Any]:
    """What the run directory says of the run that `launched` (a time.time()) started."""
    plan = json.loads((run_dir / "plan.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    placement = json.loads((run_dir / "placement.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "step_s" in r]
    if not rows:
        raise RuntimeError(f"{run_dir / 'metrics.jsonl'} records no step")
    step_s = steady_mean([r["step_s"] for r in rows])
    model = plan["model"]
    # MFU against the datasheet peak, which a plan priced from a measured rate states apart.
    peak = (model.get("datasheet_tflops_per_rank") or model["peak_tflops_per_rank"]) * 1e12
    mfu = model["flops_per_step"] / plan["world_size"] / step_s / peak if peak else None
    metric_mfu = [r["mfu"] for r in rows if r.get("mfu") is not None]
    return {
        "run_dir": str(run_dir), "steps": len(rows),
        # The worker stamps each step's row with time.time() when the step ends, on this machine.
        "first_step_s": rows[0]["time"] - launched,
        "tokens_per_s": steady_mean([r["tokens_per_s"] for r in rows]), "step_s": step_s,
        "step_s_median": median([r["step_s"] for r in rows]),
        "predicted_step_s": plan["step_time"]["total_s"], "mfu": mfu,
        "mfu_from_metrics": steady_mean(metric_mfu) if metric_mfu else None,
        "flops_per_step": model["flops_per_step"], "peak_tflops_per_rank": model["peak_tflops_per_rank"],
        "backend": placement[0].get("backend") if placement else summary.get("backend"),
        # What the worker's own loop (metrics, the driver's sink) adds per step: the orchestration tax.
        "orchestration_overhead_s_per_step": summary.get("measured", {}).get("orchestration_overhead_s_per_step"),
        "gpus": [p.get("gpu") for p in placement],
        "plan": {k: plan[k] for k in ("strategy", "mesh", "micro_batch_size", "recompute", "world_size")},
        "params": model["params"], "final_val_loss": summary.get("final_val_loss"),
        "val_loss_drop": summary.get("val_loss_drop"), "warnings": summary.get("warnings", []),
        # The run directory is scratch, gone after the check: what explains its figures is kept.
        "plan_explanation": plan.get("explanation", []), "summary": summary,
    }


def default_job(check: Check) -> dict[str, Any]:
    """jobs/llm.yaml through `submit`, as a user starts it, on one worker."""
    s = check.size
    work = check.work / "default_job"
    runs = work / "runs"
    cmd = [python(), "-m", "orchestrator", "submit", JOB, "cluster.num_workers=1", f"monitor.runs_dir={runs}",
           f"train.max_steps={s['job_steps']}", "monitor.progress=false", "monitor.dashboard=false", *s["job_extra"]]
    res = run_command(cmd, s["job_timeout_s"], work)
    figures = _kept(res)
    if res["returncode"] != 0:
        raise PartFailed(f"submit {_said(res)}", figures)
    run_dir = run_directory(res["stdout"])
    if run_dir is None:
        raise PartFailed("submit printed no `run directory: ` line", figures)
    figures.update(read_run(run_dir, res["started"]))
    if check.cuda and figures["backend"] != "nccl":
        raise PartFailed(f"the worker ran on {figures['backend']}, not nccl", figures)
    return figures


# --- in-process parts: one rank, the runtime's Trainer ----------------------------------------

def _group(check: Check) -> None:
    """The process group of one rank every in-process part runs in, started on first use."""
    import torch
    import torch.distributed as dist

    from orchestrator.runtime.trainer import init_process_group

    if dist.is_initialized():
        return
    if check.cuda:
        torch.cuda.set_device(0)  # before NCCL starts, so its communicator binds this device
    init_process_group(0, 1, "127.0.0.1", free_port(), "nccl" if check.cuda else "gloo")


def _close_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _free(check: Check) -> None:
    """Drop what the last case left: its trainer is gone, so its memory goes back to the device."""
    import torch

    gc.collect()
    # Only where this process already uses the GPU: a context made here for nothing would sit
    # beside the subprocess parts' own on the device.
    if check.cuda and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def topology(check: Check):
    """One rank's cluster: this GPU as itself (name and memory, so the planner takes its row of
    the table), or one CPU slot."""
    from orchestrator.topology.model import ClusterTopology, Device, NodeTopology, cpu_node

    if not check.cuda:
        return ClusterTopology(nodes=[cpu_node(1)])
    import torch

    props = torch.cuda.get_device_properties(0)
    gpu = Device(index=0, kind="gpu", name=props.name, memory_bytes=int(props.total_memory))
    return ClusterTopology(nodes=[NodeTopology(hostname=socket.gethostname(), source="gpu_check", devices=[gpu])])


def plan_for(check: Check, overrides: list[str], spec=None):
    """(config, plan) of `overrides` on this one-rank cluster; `spec` the model measured once."""
    from orchestrator.config import load_config
    from orchestrator.planning import plan_job

    cfg = load_config(None, overrides)
    return cfg, plan_job(cfg, topology(check), spec)


def measured_spec(overrides: list[str]):
    from orchestrator.config import load_config
    from orchestrator.control.preflight import measure_model

    return measure_model(load_config(None, overrides))


def trainer(check: Check, cfg, plan):
    """The runtime's Trainer for `plan`, handed over as its plan.json contract, as every launcher does."""
    from orchestrator.planning import Plan
    from orchestrator.runtime.trainer import Trainer

    _group(check)
    return Trainer(cfg, Plan.from_dict(plan.to_dict()), check.torch_device())


def _peak_bytes(check: Check, tr) -> dict[str, Any]:
    """Peak bytes over a training step of `tr` once AdamW's state exists; on CUDA the first
    step's peak too. The trainer stays the caller's, so it is freed when the caller returns."""
    import torch

    if check.cuda:
        torch.cuda.reset_peak_memory_stats()
        tr.train_step(0)
        first = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        tr.train_step(1)
        return {"measured_peak_bytes": torch.cuda.max_memory_allocated(), "first_step_peak_bytes": first,
                "reserved_peak_bytes": torch.cuda.max_memory_reserved(),
                "measured_by": "torch.cuda.max_memory_allocated",
                # What decides whether a plan that fits is safe: the whole device, not the tensors.
                "footprint": device_footprint(torch.cuda)}
    from torch.distributed._tools.mem_tracker import MemTracker

    tr.train_step(0)
    tracker = MemTracker()
    tracker.track_external(tr.par.model, tr.par.optimizer)
    with tracker:
        tr.train_step(1)
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    return {"measured_peak_bytes": int(peak), "first_step_peak_bytes": None, "reserved_peak_bytes": None,
            "measured_by": "torch MemTracker (CPU)", "footprint": None}


def _measure_memory(check: Check, cfg, plan) -> dict[str, Any]:
    import torch

    baseline = torch.cuda.memory_allocated() if check.cuda else 0
    tr = trainer(check, cfg, plan)
    got = _peak_bytes(check, tr)
    got["state_bytes"] = tr.par.state_bytes()
    # What an earlier case may have left allocated is not this one's.
    got["baseline_bytes"] = baseline
    got["measured_peak_bytes"] -= baseline
    if got["first_step_peak_bytes"] is not None:
        got["first_step_peak_bytes"] -= baseline
    return got


def memory_case(check: Check, overrides: list[str], spec) -> dict[str, Any]:
    """One strategy and recompute mode: the plan's per-rank bytes against one step's peak."""
    cfg, plan = plan_for(check, overrides, spec)
    m = plan.memory_per_rank
    row: dict[str, Any] = {"strategy": str(cfg.parallel.strategy), "recompute": str(cfg.parallel.recompute),
                           "planned": {"strategy": str(plan.strategy), "recompute": str(plan.execution.recompute),
                                       "mesh": plan.mesh.to_dict(), "fits": plan.fits},
                           "predicted": m.to_dict()}
    try:
        row.update(_measure_memory(check, cfg, plan))
    except Exception as e:  # noqa: BLE001 - a case that fails (out of memory) leaves the others to run
        row["error"] = one_line(e)
    _free(check)
    if "error" in row:
        return row
    measured = row["measured_peak_bytes"]
    without_buffers = m.total - m.buffers
    row.update(ratio=measured / m.total, rel_error=rel_error(m.total, measured),
               ratio_without_buffers=measured / without_buffers)
    return row


def memory_model(check: Check) -> dict[str, Any]:
    s = check.size
    base = [*s["memory_model"], f"model.block_size={s['memory_seq']}", "train.global_batch_size=1",
            "train.micro_batch_size=1", f"train.precision={check.precision}", "parallel.tp=1", "parallel.pp=1",
            "checkpoint.enabled=false", "train.eval_iters=1"]
    spec = measured_spec(base)  # the strategies and recompute modes share one measured model
    params = plan_for(check, base, spec)[1].model.params
    cases = []
    for strategy in STRATEGIES:
        for recompute in RECOMPUTE:
            check.log(f"memory_model: {strategy}, recompute {recompute}")
            cases.append(memory_case(check, [*base, f"parallel.strategy={strategy}", f"parallel.recompute={recompute}"],
                                     spec))
            c = cases[-1]
            check.log(f"memory_model: {strategy}/{recompute}: " + (c["error"] if "error" in c else
                      f"predicted {_size(c['predicted']['total'])}, measured {_size(c['measured_peak_bytes'])}, "
                      f"ratio {c['ratio']:.3f}"))
    done = [c for c in cases if "error" not in c]
    figures = {"model": base, "params": params, "seq": s["memory_seq"], "micro_batch_size": 1,
               "precision": check.precision, "cases": cases,
               "max_rel_error": max((c["rel_error"] for c in done), default=None)}
    unit, per = ("GB", 1e9) if check.cuda else ("MB", 1e6)
    print_table(f"per-rank memory, {params / 1e6:.1f}M-parameter Llama, {s['memory_seq']} tokens, "
                f"micro-batch 1, {check.precision}, one rank on {check.device}",
                ["strategy", "recompute", f"pred {unit}", f"pred w/o buffers {unit}", f"measured {unit}",
                 "measured / pred"],
                [[c["strategy"], c["recompute"], c["predicted"]["total"] / per,
                  (c["predicted"]["total"] - c["predicted"]["buffers"]) / per,
                  c.get("measured_peak_bytes", math.nan) / per, c.get("ratio", math.nan)] for c in cases])
    failed = [c for c in cases if "error" in c]
    if failed:
        raise PartFailed(f"{len(failed)} of {len(cases)} cases failed; "
                         f"{failed[0]['strategy']}/{failed[0]['recompute']}: {failed[0]['error']}", figures)
    return figures


def _measure_steps(check: Check, cfg, plan, steps: int) -> dict[str, Any]:
    import torch

    tr = trainer(check, cfg, plan)
    times = [tr.train_step(i).step_s for i in range(steps)]
    return {"step_s_each": times, "measured_step_s": steady_mean(times), "median_step_s": median(times),
            "tokens_per_step": tr.tokens_per_step,
            "footprint": device_footprint(torch.cuda) if check.cuda else None}


def step_case(check: Check, label: str, overrides: list[str], steps: int) -> dict[str, Any]:
    """The plan's step time against the steady step of `steps` real ones."""
    cfg, plan = plan_for(check, overrides, measured_spec(overrides))
    row: dict[str, Any] = {"case": label, "overrides": overrides, "params": plan.model.params,
                           "strategy": str(plan.strategy), "micro_batch_size": plan.micro_batch_size,
                           "grad_accum_steps": plan.sync.grad_accum_steps, "recompute": str(plan.execution.recompute),
                           "predicted_step_s": plan.step_time.total_s}
    try:
        row.update(_measure_steps(check, cfg, plan, steps))
    except Exception as e:  # noqa: BLE001 - one size that fails leaves the others to run
        row["error"] = one_line(e)
    _free(check)
    if "error" in row:
        return row
    measured = row["measured_step_s"]
    peak = plan.model.mfu_peak_tflops_per_rank * 1e12
    row.update(ratio=measured / row["predicted_step_s"], rel_error=rel_error(row["predicted_step_s"], measured),
               tokens_per_s=row["tokens_per_step"] / measured,
               mfu=plan.model.flops_per_step / measured / peak if peak else None)
    return row


def step_time(check: Check) -> dict[str, Any]:
    s = check.size
    steps = s["step_steps"]
    common = [f"model.block_size={s['step_block']}", f"train.global_batch_size={s['step_batch']}",
              f"train.max_steps={steps}", "train.warmup_steps=1", f"train.precision={check.precision}",
              "parallel.strategy=ddp", "parallel.tp=1", "parallel.pp=1", "checkpoint.enabled=false"]
    cases = []
    for label, model in s["step_models"].items():
        check.log(f"step_time: {label}, {steps} steps")
        cases.append(step_case(check, label, [*model, *common], steps))
        c = cases[-1]
        check.log(f"step_time: {label}: " + (c["error"] if "error" in c else
                  f"predicted {c['predicted_step_s'] * 1e3:.1f} ms, measured {c['measured_step_s'] * 1e3:.1f} ms"))
    done = [c for c in cases if "error" not in c]
    figures = {"steps": steps, "block_size": s["step_block"], "global_batch_size": s["step_batch"],
               "precision": check.precision, "cases": cases,
               "mean_abs_rel_error": sum(c["rel_error"] for c in done) / len(done) if done else None}
    print_table(f"step time, built-in GPT, {s['step_block']} tokens x {s['step_batch']} sequences, one rank on "
                f"{check.device}, {steps} steps",
                ["case", "params", "micro-batch", "predicted ms", "measured ms", "measured / pred", "MFU"],
                [[c["case"], c["params"], c["micro_batch_size"], c["predicted_step_s"] * 1e3,
                  c.get("measured_step_s", math.nan) * 1e3, c.get("ratio", math.nan), c.get("mfu")]
                 for c in cases])
    failed = [c for c in cases if "error" in c]
    if failed:
        raise PartFailed(f"{len(failed)} of {len(cases)} sizes failed; {failed[0]['case']}: {failed[0]['error']}",
                         figures)
    return figures


def flatten(state: Any, prefix: str = "") -> dict[str, Any]:
    """Every leaf of a nested state dict by its dotted path; tensors whole (a DTensor gathered)
    and on the CPU, so a state can be kept after its trainer is gone."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        out: dict[str, Any] = {}
        for k, v in state.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    if isinstance(state, DTensor):
        state = state.full_tensor()
    if isinstance(state, torch.Tensor):
        state = state.detach().to("cpu", copy=True)
    return {prefix[:-1]: state}


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The keys whose values differ (in dtype, shape or any element), or that only one side has."""
    import torch

    diff = sorted(set(a) ^ set(b))
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            same = (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype
                    and x.shape == y.shape and torch.equal(x, y))
        else:
            same = x == y
        if not same:
            diff.append(k)
    return diff


def _sync(check: Check) -> None:
    if check.cuda:
        import torch

        torch.cuda.synchronize()


def _save(check: Check, cfg, plan, root: Path) -> dict[str, Any]:
    """Train two steps (weights moved, AdamW's moments filled), save; the state as saved."""
    from orchestrator.runtime import checkpoint

    tr = trainer(check, cfg, plan)
    for step in range(2):
        tr.train_step(step)
    state = tr.state_dict()
    _sync(check)
    t0 = time.perf_counter()
    path = checkpoint.save(str(root), 2, state, tr.checkpoint_meta(), keep_last=1)
    _sync(check)
    return {"path": path, "save_s": time.perf_counter() - t0, "saved": flatten(state), "params": tr.num_params}


def _load(check: Check, cfg, plan, path: str) -> dict[str, Any]:
    """A fresh trainer (its own initial weights) loads `path`; its state before and after."""
    tr = trainer(check, cfg, plan)
    before = flatten(tr.state_dict())
    _sync(check)
    t0 = time.perf_counter()
    step = tr.load_checkpoint(path)
    _sync(check)
    return {"load_s": time.perf_counter() - t0, "step": step, "before": before, "loaded": flatten(tr.state_dict())}


def dcp(check: Check) -> dict[str, Any]:
    s = check.size
    overrides = [*s["dcp_model"], f"model.block_size={s['dcp_block']}", f"train.global_batch_size={s['dcp_batch']}",
                 f"train.micro_batch_size={s['dcp_batch']}", f"train.precision={check.precision}",
                 "parallel.strategy=zero3", "parallel.tp=1", "parallel.pp=1", "train.max_steps=10"]
    cfg, plan = plan_for(check, overrides, measured_spec(overrides))
    root = check.work / "dcp"
    saved = _save(check, cfg, plan, root)
    _free(check)
    check.log(f"dcp: saved {saved['params'] / 1e6:.1f}M parameters + AdamW in {saved['save_s']:.2f} s")
    loaded = _load(check, cfg, plan, saved["path"])
    _free(check)
    files = [p for p in Path(saved["path"]).rglob("*") if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    tensors = {k: v for k, v in saved["saved"].items() if hasattr(v, "numel")}
    state_bytes = sum(v.numel() * v.element_size() for v in tensors.values())
    mismatched = differences(saved["saved"], loaded["loaded"])
    figures = {"params": saved["params"], "strategy": str(plan.strategy), "precision": check.precision,
               "overrides": overrides, "bytes": size, "state_bytes": state_bytes, "files": len(files),
               "save_s": saved["save_s"], "load_s": loaded["load_s"],
               "save_gb_per_s": size / 1e9 / saved["save_s"], "load_gb_per_s": size / 1e9 / loaded["load_s"],
               "step": loaded["step"], "keys": len(saved["saved"]), "tensors": len(tensors),
               # The comparison has teeth only if the fresh trainer started elsewhere.
               "differed_before_load": len(differences(saved["saved"], loaded["before"])),
               "mismatched": mismatched[:20], "equal": not mismatched}
    if mismatched:
        raise PartFailed(f"{len(mismatched)} of {len(saved['saved'])} entries differ after loading, "
                         f"first {mismatched[0]}", figures)
    if figures["differed_before_load"] == 0:
        raise PartFailed("the fresh trainer already held the saved state, so the load proved nothing", figures)
    return figures


# --- torch_api --------------------------------------------------------------------------------

def _version(text: str) -> tuple[int, int]:
    """(major, minor) of a version string such as 2.11.0+cu130."""
    found = re.match(r"(\d+)\.(\d+)", text)
    if found is None:
        raise ValueError(f"a version starts with MAJOR.MINOR, got {text!r}")
    return int(found.group(1)), int(found.group(2))


def torch_floor(pyproject: Path = ROOT / "pyproject.toml") -> str:
    """The oldest torch the project says it works with: the `"torch>=X` of its dependencies
    (read as text: Python 3.10, which the project supports, has no TOML reader)."""
    found = re.search(r"""["']torch\s*>=\s*([0-9][0-9.]*)""", pyproject.read_text())
    if found is None:
        raise ValueError(f"{pyproject} names no `torch>=` dependency")
    return found.group(1).rstrip(".")


def below_floor(version: str, floor: str) -> str | None:
    """One line saying that torch `version` is older than `floor`; None when it is not."""
    if _version(version) >= _version(floor):
        return None
    return f"torch {version} is older than the floor {floor} that pyproject.toml states; the parts run on regardless"


def missing_apis() -> list[str]:
    """`module.name` of each of TORCH_APIS and TORCH_KEYWORDS this torch lacks, why beside it."""
    missing = []
    for module, name in TORCH_APIS:
        try:
            if not hasattr(importlib.import_module(module), name):
                missing.append(f"{module}.{name}")
        except ImportError as e:
            missing.append(f"{module}.{name} ({one_line(e)})")
    for module, name, keyword in TORCH_KEYWORDS:
        fn = getattr(importlib.import_module(module), name, None)
        if fn is None or keyword not in inspect.signature(fn).parameters:
            missing.append(f"{module}.{name}({keyword}=)")
    return missing


def torch_api(check: Check) -> dict[str, Any]:
    """What the other parts would otherwise find one failure at a time: an API this torch lacks,
    or an orchestrator module that does not import here."""
    import torch

    missing = missing_apis()
    broken = []
    for module in MODULES:
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - every module's failure is recorded, not only the first
            broken.append(f"{module}: {one_line(e)}")
    floor = torch_floor()
    figures = {"torch": torch.__version__, "floor": floor, "below_floor": below_floor(torch.__version__, floor),
               "apis": [f"{m}.{n}" for m, n in TORCH_APIS] + [f"{m}.{n}({k}=)" for m, n, k in TORCH_KEYWORDS],
               "missing": missing, "modules": list(MODULES), "modules_failing": broken,
               "cuda": torch.version.cuda, "nccl": _nccl_version(torch) if check.cuda else None}
    if missing:
        raise PartFailed(f"torch {torch.__version__} lacks {len(missing)} of {len(figures['apis'])} APIs the check "
                         f"calls: {', '.join(missing)}", figures)
    if broken:
        raise PartFailed(f"{len(broken)} of {len(MODULES)} modules do not import: {broken[0]}", figures)
    return figures


def _nccl_version(torch) -> str | None:
    try:
        return ".".join(str(v) for v in torch.cuda.nccl.version())
    except Exception as e:  # noqa: BLE001 - a torch built without NCCL says so here, not as a crash
        return one_line(e)


# --- compile ----------------------------------------------------------------------------------

def compile_part(check: Check) -> dict[str, Any]:
    """Eager against per-block compiled steps of one GPT, and what the first compiled step cost.
    The compiled run is planned as priced from a measured gain, so the runtime trains every
    step compiled instead of timing some eager; the figures name the steps they are of."""
    from dataclasses import replace

    from orchestrator.planning.compile import COMPILE_S, COMPILE_SPEEDUP, CompilePlan

    s = check.size
    steps = s["compile_steps"]
    overrides = [*s["compile_model"], f"model.block_size={s['compile_block']}",
                 f"train.global_batch_size={s['compile_batch']}", f"train.max_steps={steps}", "train.warmup_steps=1",
                 f"train.precision={check.precision}", "parallel.strategy=ddp", "parallel.tp=1", "parallel.pp=1",
                 "checkpoint.enabled=false", "train.compile=false"]
    cfg, plan = plan_for(check, overrides)
    check.log(f"compile: eager, {steps} steps")
    eager = _measure_steps(check, cfg, plan, steps)
    _free(check)
    check.log(f"compile: compiled, {steps} steps")
    compiled_plan = replace(plan, compile=CompilePlan(True, "true", COMPILE_S[plan.execution.device], 0.0, steps,
                                                      "compiled for the check", measured=True))
    compiled = _measure_steps(check, cfg, compiled_plan, steps)
    device = plan.execution.device
    # Step 0 compiles; the steady figures are of the steps after it, each run's own.
    timed = list(range(1, steps))
    e_times = [eager["step_s_each"][i] for i in timed]
    c_times = [compiled["step_s_each"][i] for i in timed]
    e, c = statistics.median(e_times), statistics.median(c_times)
    figures = {"overrides": overrides, "steps": steps, "params": plan.model.params,
               "eager_steps": timed, "compiled_steps": timed,
               "eager_step_s": e, "compiled_step_s": c, "speedup": e / c,
               "eager_step_s_mean": statistics.fmean(e_times), "compiled_step_s_mean": statistics.fmean(c_times),
               "compile_s": max(0.0, compiled["step_s_each"][0] - c),
               "eager_step_s_each": eager["step_s_each"], "compiled_step_s_each": compiled["step_s_each"],
               "footprint": compiled["footprint"],
               "predicted_speedup": COMPILE_SPEEDUP[device], "predicted_compile_s": COMPILE_S[device]}
    print_table(f"per-block compile, GPT {s['compile_model']}, one rank on {check.device}, medians of steps "
                f"{timed[0]}-{timed[-1]}",
                ["eager ms", "compiled ms", "speedup (whole step)", "predicted (blocks)", "compile s", "predicted s"],
                [[e * 1e3, c * 1e3, e / c, COMPILE_SPEEDUP[device], figures["compile_s"], COMPILE_S[device]]])
    return figures


# --- real_loop --------------------------------------------------------------------------------

LOOP_WARMUP_STEPS = 2
"""Completed steps of a loop run left out of its steady figures: the first allocates AdamW's
state (and, compiled, may still specialise a graph), the second settles the allocator's cache."""


class CollectingSink:
    """The step loop's messages to the driver, kept in the order the loop added them."""

    def __init__(self) -> None:
        self.messages: list[Any] = []
        """Every message added (rows, evaluations, timings), in order."""
        self.ended = False
        """Whether the loop closed its step range (`end`)."""

    def add(self, item: Any, urgent: bool = False) -> None:
        self.messages.append(item)

    def flush(self) -> None:
        """Nothing waits: every message is kept as it is added."""

    def end(self) -> None:
        self.ended = True

    def rows(self) -> list[dict[str, Any]]:
        """The metrics rows of the steps, in order."""
        from orchestrator.runtime.messages import Stepped

        return [m.row for m in self.messages if isinstance(m, Stepped)]


def _centre(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "mean": None}
    return {"median": statistics.median(values), "mean": statistics.fmean(values)}


def loop_figures(rows: list[dict[str, Any]], overhead_s_per_step: float, eager_gain_steps: list[int]) -> dict[str, Any]:
    """What the loop's own rows say of its steady steps: those after LOOP_WARMUP_STEPS, the gain's
    eager steps (`eager_gain_steps`, completed-step numbers) left out so a compiled figure is of
    compiled steps only. The overhead's share is of a steady step as the loop runs it: the
    loop's own work per step over that work plus the mean steady step."""
    if not rows:
        raise ValueError("the loop reported no steps")
    steady = [r for r in rows if r["step"] > LOOP_WARMUP_STEPS and r["step"] not in eager_gain_steps]
    if not steady:
        raise ValueError(f"no steady step among {len(rows)}: the first {LOOP_WARMUP_STEPS} warm up and "
                         f"{len(eager_gain_steps)} time the compile gain eager")
    step_s = _centre([r["step_s"] for r in steady])
    mfus = [r["mfu"] for r in steady if r.get("mfu") is not None]
    warmup = [r["step"] for r in rows if r["step"] <= LOOP_WARMUP_STEPS]
    return {"steps": [r["step"] for r in rows], "warmup_steps": warmup,
            "steady_steps": [r["step"] for r in steady], "step_s_each": [r["step_s"] for r in rows],
            "step_s_median": step_s["median"], "step_s_mean": step_s["mean"],
            **{f"tokens_per_s_{k}": v for k, v in _centre([r["tokens_per_s"] for r in steady]).items()},
            **{f"mfu_{k}": v for k, v in _centre(mfus).items()},
            "overhead_s_per_step": overhead_s_per_step,
            "overhead_share": overhead_s_per_step / (overhead_s_per_step + step_s["mean"])}


def loop_run(check: Check, cfg, plan) -> dict[str, Any]:
    """The runtime's own step loop (`runtime.loop.run_steps`) over `plan` as a launch without Ray
    runs it (`runtime/launch.py`): start, calibrate, train every step of `train.max_steps`;
    its rows, answer and memory, with the steps named by what they ran."""
    import torch

    from orchestrator.runtime.loop import run_steps
    from orchestrator.runtime.step_timer import StepTimer
    from orchestrator.runtime.validator import Validator

    baseline = torch.cuda.memory_allocated() if check.cuda else 0
    tr = trainer(check, cfg, plan)
    start = tr.start()
    timer = StepTimer(tr)
    timer.calibrate()
    if check.cuda:
        torch.cuda.reset_peak_memory_stats()
    sink = CollectingSink()
    t = cfg.train
    end = run_steps(tr, range(start, t.max_steps), timer, Validator(tr.evaluate, t.eval_interval, t.max_steps), sink)
    if not sink.ended:
        raise RuntimeError("the loop returned without closing its step range")
    eager_gain = timer.gain_steps_trained["eager"]
    figures = loop_figures(sink.rows(), end.overhead_s_per_step, eager_gain)
    figures.update(
        compiled=tr.compiled, gain_steps_eager=eager_gain, gain_steps_compiled=timer.gain_steps_trained["compiled"],
        gain_step_s=timer.compile_steps, calibration=timer.compile_times, compute_micro_s=timer.compute_micro_s,
        last_val_loss=end.last_val_loss, tokens_per_step=tr.tokens_per_step,
        predicted_step_s=plan.step_time.total_s, predicted_memory_bytes=plan.memory_per_rank.total,
        predicted_compile={"enabled": plan.compile.enabled, "measured": plan.compile.measured},
        messages=len(sink.messages))
    if check.cuda:
        figures.update(allocator_peak_bytes=torch.cuda.max_memory_allocated() - baseline, baseline_bytes=baseline,
                       measured_by="torch.cuda.max_memory_allocated", footprint=device_footprint(torch.cuda))
    else:
        figures.update(allocator_peak_bytes=None, baseline_bytes=0, measured_by=None, footprint=None)
    return figures


def loop_overrides(check: Check) -> list[str]:
    """real_loop's job but for `train.compile`: one sequence a step, evaluated at the end only."""
    s = check.size
    steps = s["loop_steps"]
    return [*s["loop_model"], f"model.block_size={s['memory_seq']}", "train.global_batch_size=1",
            "train.micro_batch_size=1", f"train.precision={check.precision}", "parallel.strategy=zero3",
            "parallel.tp=1", "parallel.pp=1", "checkpoint.enabled=false", f"train.max_steps={steps}",
            "train.warmup_steps=1", f"train.eval_interval={steps}", "train.eval_iters=1"]


def real_loop(check: Check) -> dict[str, Any]:
    """A Llama trained by the runtime's step loop under FSDP2 on one rank, eager and then with its
    blocks compiled: the loop's tokens/s, MFU, steady step and own overhead, the allocator's peak
    beside the device's footprint, against the plan's step time and per-rank memory."""
    s = check.size
    steps = s["loop_steps"]
    base = loop_overrides(check)
    spec = measured_spec(base)
    runs: dict[str, Any] = {}
    for mode, compile_flag in (("eager", "false"), ("compiled", "true")):
        check.log(f"real_loop: {mode}, {steps} steps")
        cfg, plan = plan_for(check, [*base, f"train.compile={compile_flag}"], spec)
        try:
            runs[mode] = loop_run(check, cfg, plan)
        except Exception as e:  # noqa: BLE001 - the compiled run still runs where the eager one fails
            runs[mode] = {"error": one_line(e)}
        _free(check)
        r = runs[mode]
        check.log(f"real_loop: {mode}: " + (r["error"] if "error" in r else
                  f"{r['tokens_per_s_median']:,.0f} tokens/s, step {r['step_s_median'] * 1e3:.1f} ms (median), "
                  f"overhead {r['overhead_s_per_step'] * 1e3:.2f} ms/step"))
    figures = {"model": base, "params": spec.params, "seq": s["memory_seq"],
               "steps": steps, "strategy": "zero3", "precision": check.precision, "runs": runs}
    done = {m: r for m, r in runs.items() if "error" not in r}
    if len(done) == 2:
        figures["compiled_speedup"] = done["eager"]["step_s_median"] / done["compiled"]["step_s_median"]
    unit, per = ("GB", 1e9) if check.cuda else ("MB", 1e6)
    print_table(f"the runtime's step loop, Llama {s['loop_model'][1]}, {s['memory_seq']} tokens, zero3 on one rank "
                f"on {check.device}, {check.precision}, steady steps' median (mean)",
                ["mode", "tokens/s", "MFU", "step ms", "pred ms", "overhead ms", "share", f"peak {unit}",
                 f"device {unit}", f"pred {unit}"],
                [[m, r["tokens_per_s_median"], r["mfu_median"], r["step_s_median"] * 1e3,
                  r["predicted_step_s"] * 1e3, r["overhead_s_per_step"] * 1e3, r["overhead_share"],
                  (r["allocator_peak_bytes"] or math.nan) / per,
                  (r["footprint"] or {}).get("device_used_bytes", math.nan) / per,
                  r["predicted_memory_bytes"] / per] for m, r in done.items()])
    failed = [m for m, r in runs.items() if "error" in r]
    if failed:
        raise PartFailed(f"{', '.join(failed)} failed: {runs[failed[0]]['error']}", figures)
    return figures


# --- the parts and their runner ---------------------------------------------------------------

@dataclass(frozen=True)
class Part:
    """One part of the check: what it runs and under which limit."""

    name: str
    """Its name on the command line (`--only`) and in the results."""
    function: Callable[[Check], dict[str, Any]]
    """Runs the part in its own process and returns its figures; raises PartFailed (or anything) on failure."""
    timeout_s: tuple[float, float]
    """Seconds the part's process may take on the GPU: (full run, --quick). Setup included."""
    needs_ray: bool = False
    """The part goes through the CLI, which starts Ray: skipped where Ray is not installed."""


PART_TABLE: tuple[Part, ...] = (
    Part("torch_api", torch_api, (20, 10)),
    Part("memory_model", memory_model, (90, 40)),
    Part("step_time", step_time, (50, 25)),
    Part("dcp", dcp, (50, 25)),
    Part("compile", compile_part, (60, 35)),
    Part("real_loop", real_loop, (90, 45)),
    Part("doctor", doctor, (150, 150), needs_ray=True),
    Part("default_job", default_job, (240, 200), needs_ray=True),
)
PARTS = tuple(p.name for p in PART_TABLE)
PART_FUNCTIONS: dict[str, Callable[[Check], dict[str, Any]]] = {p.name: p.function for p in PART_TABLE}


def part_timeout_s(part: Part, device: str, quick: bool) -> float:
    if device != "cuda":
        return CPU_PART_TIMEOUT_S
    return part.timeout_s[1] if quick else part.timeout_s[0]


def figures_of(name: str, check: Check) -> dict[str, Any]:
    """One part's figures, its failure caught and recorded as `error` in one line."""
    check.log(f"{name}: start")
    try:
        figures = PART_FUNCTIONS[name](check)
    except PartFailed as e:
        figures = {**e.figures, "error": str(e)}  # already one line, said by the part
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - one part's failure must not stop the others (DCP's is a BaseException)
        figures = {"error": one_line(e)}
    _free(check)
    return figures


def scratch_env(tmp: Path, device: str) -> dict[str, str]:
    """A part's environment: every cache and scratch file it or a compiler writes lands in `tmp`
    (the GPU machine keeps nothing else), and no Python bytecode beside the sources. On CPU the
    compiler's cache stays where inductor keeps it by default (in the system's temporary
    folder), so that a smoke run compiles from what the last one left, as a user's runs do."""
    env = child_env()
    folders = {"TMPDIR": "tmp", "XDG_CACHE_HOME": "cache", "ORCHESTRATOR_CACHE_DIR": "cache/orchestrator",
               "ORCHESTRATOR_MEASURE_CACHE": "cache/orchestrator-measure", "TORCHINDUCTOR_CACHE_DIR": "inductor",
               "TRITON_CACHE_DIR": "triton/cache", "TRITON_HOME": "triton", "CUDA_CACHE_PATH": "cuda-cache",
               "TORCH_HOME": "torch", "RAY_TMPDIR": "tmp"}
    for var, sub in folders.items():
        (tmp / sub).mkdir(parents=True, exist_ok=True)
        env[var] = str(tmp / sub)
    if device != "cuda":
        env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.pop(OUT_ENV, None)  # a part writes only its figures, where the runner says
    return env


def part_command(name: str, device: str, quick: bool, figures_path: Path) -> list[str]:
    """The command that runs one part in a process of its own and writes its figures as JSON."""
    return [python(), str(Path(__file__).resolve()), "--device", device, *(["--quick"] if quick else []),
            "--part", name, "--part-figures", str(figures_path)]


def nvml_reading(nvml: Any) -> dict[str, Any]:
    """Device 0's SM and memory clocks, temperature and whole used memory by NVML (no CUDA
    context needed); what NVML does not answer is recorded as such. `nvml` is pynvml."""
    try:
        nvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - no driver, no NVML: the reading says so
        return {"error": one_line(e)}
    try:
        h = nvml.nvmlDeviceGetHandleByIndex(0)
        out: dict[str, Any] = {}
        for key, read in (("sm_mhz", lambda: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM)),
                          ("memory_mhz", lambda: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_MEM)),
                          ("temperature_c", lambda: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)),
                          ("used_bytes", lambda: int(nvml.nvmlDeviceGetMemoryInfo(h).used))):
            try:
                out[key] = read()
            except Exception as e:  # noqa: BLE001 - a reading this driver does not give
                out[key] = None
                out.setdefault("unanswered", []).append(f"{key}: {one_line(e)}")
        return out
    except Exception as e:  # noqa: BLE001
        return {"error": one_line(e)}
    finally:
        nvml.nvmlShutdown()


def reading(device: str) -> dict[str, Any] | None:
    """The clocks and used memory of the GPU around a part; None on CPU."""
    if device != "cuda":
        return None
    try:
        import pynvml
    except ImportError as e:
        return {"error": one_line(e)}
    return nvml_reading(pynvml)


class Runner:
    """Runs each part in a process of its own, under its own time limit, its output appended to
    the log; what a part that crashed or hung leaves is one line of `error`."""

    def __init__(self, device: str, quick: bool, tmp: Path, log: IO[str], t0: float) -> None:
        self.device, self.quick, self.tmp, self.log_file, self.t0 = device, quick, tmp, log, t0
        self.env = scratch_env(tmp, device)

    def log(self, message: str) -> None:
        line = f"[{time.perf_counter() - self.t0:6.1f} s] {message}"
        print(line, file=sys.stderr, flush=True)
        print(line, file=self.log_file, flush=True)

    def part(self, part: Part) -> dict[str, Any]:
        t0 = time.perf_counter()
        before = reading(self.device)
        figures = self._figures(part)
        result = {"part": part.name, "device": self.device, "seconds": time.perf_counter() - t0,
                  "timeout_s": part_timeout_s(part, self.device, self.quick), **figures,
                  "nvml_before": before, "nvml_after": reading(self.device)}
        said = result.get("error") or result.get("skipped")
        self.log(f"{part.name}: {'FAILED: ' + said if 'error' in result else said or 'done'}"
                 f" ({result['seconds']:.1f} s)")
        return result

    def _figures(self, part: Part) -> dict[str, Any]:
        if part.needs_ray and importlib.util.find_spec("ray") is None:
            return {"skipped": NO_RAY}
        path = self.tmp / "figures" / f"{part.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        timeout_s = part_timeout_s(part, self.device, self.quick)
        self.log_file.flush()
        start = self.log_file.tell()
        cmd = part_command(part.name, self.device, self.quick, path)
        proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=self.log_file, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop(proc, STOP_GRACE_S)
            return {"error": f"ran past its time limit of {timeout_s:.0f} s and was stopped"}
        if path.is_file():
            return json.loads(path.read_text())
        return {"error": self._died(proc.returncode, start)}

    def _died(self, code: int, start: int) -> str:
        """Why a part's process ended without its figures, in one line."""
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with {code}"
        with open(self.log_file.name, errors="replace") as f:
            f.seek(start)
            lines = [ln.strip() for ln in f.read().splitlines() if ln.strip()]
        return f"its process {how} before writing its figures" + (f": {lines[-1]}" if lines else "")


def headline(name: str, r: dict[str, Any]) -> str:
    """The figure a reader wants first from a part."""
    if "error" in r:
        return r["error"]
    if "skipped" in r:
        return r["skipped"]
    if name == "torch_api":
        return f"torch {r['torch']} (floor {r['floor']}): all {len(r['apis'])} APIs there"
    if name == "doctor":
        said = "; ".join(r["verdicts"]) or f"report {'written' if r['report'] is not None else 'missing'}"
        return f"exit {r['returncode']}, {said}"
    if name == "default_job":
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        return (f"first step after {r['first_step_s']:.1f} s, {r['tokens_per_s']:,.0f} tokens/s, MFU {mfu}, "
                f"{r['backend']}")
    if name == "memory_model":
        ratios = [c["ratio"] for c in r["cases"]]
        return f"measured / predicted {min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} cases"
    if name == "step_time":
        return "measured / predicted " + ", ".join(f"{c['case']} {c['ratio']:.2f}" for c in r["cases"])
    if name == "compile":
        return (f"compiled {r['speedup']:.2f}x eager (blocks predicted {r['predicted_speedup']:.2f}x), compile "
                f"{r['compile_s']:.1f} s (predicted {r['predicted_compile_s']:.1f} s)")
    if name == "real_loop":
        return "; ".join(f"{mode} {run['tokens_per_s_median']:,.0f} tokens/s, step {run['step_s_median'] * 1e3:.1f} "
                         f"ms (plan {run['predicted_step_s'] * 1e3:.1f}), overhead {run['overhead_share']:.2%}"
                         for mode, run in r["runs"].items())
    if name == "dcp":
        return (f"{r['bytes'] / 1e9:.2f} GB, save {r['save_s']:.2f} s, load {r['load_s']:.2f} s, "
                f"{r['tensors']} tensors {'equal' if r['equal'] else 'DIFFER'}")
    return "done"


def options(ap) -> None:
    ap.add_argument("--only", action="append", choices=PARTS, metavar="PART",
                    help=f"run this part only (repeatable): {', '.join(PARTS)}")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cuda (the check); cpu: every part on CPU, tiny sizes (the tests' smoke mode)")
    # How the runner starts one part in its own process: not for a user's command line.
    ap.add_argument("--part", choices=PARTS, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--part-figures", type=Path, default=None, help=argparse.SUPPRESS)


def run_one_part(args: argparse.Namespace) -> int:
    """The process of one part: its figures to `--part-figures`, its scratch beside them."""
    work = Path(tempfile.mkdtemp(prefix=f"{args.part}-"))  # TMPDIR: the runner's temporary folder
    check = Check(device=args.device, quick=args.quick, out=args.part_figures.parent, work=work,
                  t0=time.perf_counter())
    try:
        figures = figures_of(args.part, check)
    finally:
        _close_group()
    # The clocks as the part's work left them, before its process ends and the device idles.
    figures["nvml_at_end"] = reading(args.device)
    tmp = args.part_figures.with_name(args.part_figures.name + ".tmp")
    tmp.write_text(json.dumps(figures, indent=1, default=str))
    tmp.replace(args.part_figures)
    return 0


def results_folder(args: argparse.Namespace) -> Path:
    """$OUT when set (the folder the GPU machine brings back), else `--out`, else results/gpu/."""
    return Path(os.environ[OUT_ENV]) if os.environ.get(OUT_ENV) else args.out or OUT


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__, argv, options)
    if args.part is not None:
        if args.part_figures is None:
            raise SystemExit("--part needs --part-figures")
        return run_one_part(args)
    names = [p for p in PARTS if p in (args.only or PARTS)]
    import torch

    if args.device == "cuda":
        from orchestrator.errors import UserError

        if not torch.cuda.is_available():
            raise UserError("no CUDA device here; `--device cpu` runs every part on CPU (the smoke mode)")
    out = results_folder(args)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    floor = torch_floor()
    problems = [p for p in [below_floor(torch.__version__, floor)] if p]
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp, open(out / LOG_FILE, "w") as log:
        runner = Runner(args.device, args.quick, Path(tmp), log, t0)
        runner.log(f"gpu check on {args.device}{' (quick)' if args.quick else ''}: {', '.join(names)}; "
                   f"torch {torch.__version__}, results in {out}")
        for problem in problems:
            runner.log(problem)
        for part in PART_TABLE:
            if part.name in names:
                results[part.name] = runner.part(part)
    seconds = time.perf_counter() - t0
    path = write_result("gpu_check", {"device": args.device, "seconds": seconds, "torch_floor": floor,
                                      "problems": problems, "parts": results},
                        argparse.Namespace(**{**vars(args), "out": out / RESULT_FILE}))
    print_table(f"gpu check on {args.device}{' (quick)' if args.quick else ''}, {seconds:.0f} s, results in {path}",
                ["part", "status", "seconds", "result"],
                [[n, "FAILED" if "error" in r else "skipped" if "skipped" in r else "ok", r["seconds"],
                  headline(n, r)] for n, r in results.items()])
    return 1 if problems or any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    run(main)
