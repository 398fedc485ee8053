"""Resident memory of every rank while `submit` trains on a token file far larger than memory.

Writes a nanoGPT `.bin` of `--gb` GiB (sparse by default: zeros that take no disk; `--dense`
writes random ids below the vocabulary for real), trains jobs/llm.yaml on it with 2 CPU workers,
and samples each rank's peak resident set size (/proc/PID/status VmHWM) and the resident part of its mapping of the
file (/proc/PID/smaps) while it runs. The claim: both stay far below the file's size, because a
rank maps the file and touches only the samples of its steps.

    python benchmarks/token_file_memory.py [--quick] [--gb N] [--dense] [--steps N]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, child_env, parse_args, print_table, run, write_result  # noqa: E402

VOCAB = 4096  # ids of the dense file; small, so the run measures the data path, not a large output layer


def options(ap) -> None:
    ap.add_argument("--gb", type=float, default=None, help="size of the token file in GiB (default 32, quick 16)")
    ap.add_argument("--dense", action="store_true", help="write real random ids instead of a sparse file")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default 60, quick 20)")


def _make_file(path: Path, size: int, dense: bool) -> None:
    with open(path, "wb") as f:
        if not dense:
            f.truncate(size)
            return
        rng = np.random.default_rng(0)
        chunk = 64 << 20
        for start in range(0, size, chunk):
            f.write(rng.integers(0, VOCAB, min(chunk, size - start) // 2, dtype=np.uint16).tobytes())


def _mapped_rss(pid: int, path: Path) -> int:
    total, inside = 0, False
    try:
        lines = Path(f"/proc/{pid}/smaps").read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:
            inside = line.rstrip().endswith(str(path))
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


def _peak_rss(pid: int) -> int | None:
    """VmHWM: the peak resident set size of the process so far."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _run(size: int, dense: bool, steps: int) -> dict:
    """Train on a fresh token file of `size` bytes; each rank's peaks, sampled while it runs."""
    # Under the project, not /tmp: a tmpfs /tmp would hold the file in memory itself.
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
        tmp = Path(tmp)
        data = (tmp / "big.bin").resolve()
        t0 = time.monotonic()
        _make_file(data, size, dense)
        write_s = time.monotonic() - t0
        cmd = [sys.executable, "-m", "orchestrator", "submit", "jobs/llm.yaml", f"data.path={data}",
               f"model.vocab_size={VOCAB}", f"train.max_steps={steps}", "train.eval_interval=50",
               "monitor.progress=false", "monitor.dashboard=false", f"monitor.runs_dir={tmp / 'runs'}"]
        log = tmp / "submit.log"  # a file, not a pipe: a full pipe would stall the run
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=open(log, "w"), stderr=subprocess.STDOUT)
        peak_rss: dict[int, int] = {}
        peak_mapped: dict[int, int] = {}
        pids: list[int] = []
        while proc.poll() is None:
            if not pids:
                found = list((tmp / "runs").glob("llm-*/placement.json"))
                if found:
                    try:
                        pids = [r["pid"] for r in json.loads(found[0].read_text())]
                    except (json.JSONDecodeError, KeyError):
                        pids = []
            for rank, pid in enumerate(pids):
                hwm = _peak_rss(pid)
                if hwm is None:
                    continue
                peak_rss[rank] = max(peak_rss.get(rank, 0), hwm)
                peak_mapped[rank] = max(peak_mapped.get(rank, 0), _mapped_rss(pid, data))
            time.sleep(0.2)
        if proc.returncode != 0:
            print(log.read_text()[-3000:])
            raise SystemExit(f"submit failed with exit code {proc.returncode}")
        (run_dir,) = (tmp / "runs").glob("llm-*")
        summary = json.loads((run_dir / "summary.json").read_text())
    ranks = sorted(peak_rss)
    return {"file_bytes": size, "write_s": write_s, "peak_rss_bytes": [peak_rss[r] for r in ranks],
            "peak_mapped_resident_bytes": [peak_mapped.get(r, 0) for r in ranks],
            "final_val_loss": summary.get("final_val_loss")}


def main(argv=None) -> int:
    args = parse_args(__doc__, argv, options)
    gb = args.gb or (16 if args.quick else 32)
    steps = args.steps or (20 if args.quick else 60)
    size = int(gb * (1 << 30)) // 2 * 2
    # The same run on a 1 MiB file first: what a rank holds anyway (Ray, torch, the model).
    results = [_run(1 << 20, False, steps), _run(size, args.dense, steps)]
    read_per_step = 32 * 129 * 2  # global batch x (block_size + 1) x uint16, over all ranks
    rows = [(f"{r['file_bytes'] / 2**20:,.0f}", rank, rss / 2**20, mapped / 2**20)
            for r in results for rank, (rss, mapped) in enumerate(zip(r["peak_rss_bytes"],
                                                                     r["peak_mapped_resident_bytes"]))]
    print_table(f"peak memory per rank, {steps} steps of jobs/llm.yaml on 2 CPU workers "
                f"({'dense' if args.dense else 'sparse'} token file)",
                ["file MiB", "rank", "peak RSS MiB", "resident part of the file's mapping MiB"], rows,
                caption=f"sample bytes read over the run, all ranks: {steps * read_per_step / 2**20:.2f} MiB")
    figures = {"dense": args.dense, "steps": steps, "baseline": results[0], "large": results[1],
               "sample_bytes_read_all_ranks": steps * read_per_step}
    path = write_result("token_file_memory", figures, args)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    run(main)
