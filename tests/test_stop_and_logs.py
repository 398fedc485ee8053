"""SIGTERM stops a real run cleanly (exit 143, summary marked stopped, checkpoints kept, no Ray
stack dump, workers gone), and workers' output goes to logs/rank-N.log with only each distinct
warning once on the console, never raw between the progress lines."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from orchestrator.record.rundir import RunDir
from orchestrator.record.worker_logs import WorkerLogs, classify

ROOT = Path(__file__).resolve().parent.parent
NOISY_WARNING = "noisy_lm: this model warns on every forward"
NOISY_LM = f"""
import warnings

from orchestrator.workloads.gpt import GPT, GPTConfig


class NoisyGPT(GPT):
    def forward(self, idx, *args, **kwargs):
        if not idx.is_meta:  # the driver measures the model on the meta device: workers only
            warnings.warn("{NOISY_WARNING}", UserWarning)
        return super().forward(idx, *args, **kwargs)


def build(**_):
    return NoisyGPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32))
"""
TINY = [
    "model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=32",
    "train.warmup_steps=2", "train.eval_iters=2", "train.eval_interval=1000",
    "monitor.progress=false", "monitor.dashboard=false",
]
DTENSOR = ("[rank0]:W1203 11:50:06.634000 17460 torch/distributed/tensor/_redistribute.py:390] While redistributing "
           "from (Replicate(), _NormPartial(2.0)) to (Replicate(), Replicate()), 2 sequential all_reduce operations")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for every purpose but the parent's wait.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.ray
@pytest.mark.slow
def test_sigterm_mid_run_and_worker_warnings(tmp_path):
    # global_batch_size=3 on 2 workers: tensor parallelism. The user's model warns on every step
    # (Python shows it once per process), as a model or a library of the user's may.
    src = tmp_path / "src"
    src.mkdir()
    (src / "noisy_lm.py").write_text(NOISY_LM)
    env = {**os.environ, "PYTHONPATH": str(src)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "submit", "jobs/llm.yaml", *TINY, "model.factory=noisy_lm:build",
         "train.global_batch_size=3", "train.max_steps=500", "checkpoint.interval=1", f"monitor.runs_dir={tmp_path}"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    t_start = time.monotonic()
    try:
        deadline = time.monotonic() + 240
        # Any committed checkpoint at step 2 or later: with a checkpoint every step and keep_last=2,
        # step 2's is pruned within two steps, which a busy machine's poll can miss.
        while not [m for m in tmp_path.glob("llm-*/checkpoints/step_*/meta.json") if int(m.parent.name[5:]) >= 2]:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no checkpoint within 240 s"
            time.sleep(0.5)
        (run_dir,) = tmp_path.glob("llm-*")
        pids = [r["pid"] for r in json.loads((run_dir / "placement.json").read_text())]
        t_signal = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
        print(f"reached a checkpoint in {t_signal - t_start:.1f} s, stopped in {time.monotonic() - t_signal:.1f} s")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-3000:]
    assert err.strip().splitlines()[-1] == "stopped (SIGTERM)"
    assert "SIGTERM received" not in err and "Traceback" not in err and "***" not in err, err[-3000:]

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped"] is True and summary["signal"] == "SIGTERM"
    assert 2 <= summary["steps"] < 500
    from orchestrator.runtime import checkpoint_files

    # Every whole checkpoint left on disk, newest last; steps may have passed step 2 before the
    # signal landed, and keep_last=2 then pruned it.
    committed = checkpoint_files.committed(str(run_dir / "checkpoints"))
    assert summary["checkpoints"] == committed and 1 <= len(committed) <= 2
    assert 2 <= checkpoint_files.step_of(committed[-1]) <= summary["steps"]
    for path in summary["checkpoints"]:
        checkpoint_files.verify(path)  # every checkpoint it names is whole
    assert "stopped by SIGTERM at step" in out and f"--resume {run_dir}" in out
    # The run report says so too (it was written while the run went, and again when it stopped).
    report = (run_dir / "report.html").read_text()
    assert re.search(r"\bstopped\b", re.search(r'<section id="run">(.*?)</section>', report, re.S).group(1))
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(_alive(p) for p in pids), "worker processes outlived the driver"

    # The warning: once on the console, with the rank and its log file; every rank's copy in its log.
    shown = [l for l in out.splitlines() if NOISY_WARNING in l]
    assert len(shown) == 1, out
    assert shown[0].startswith("warning from rank ") and "logs/rank-" in shown[0]
    assert "(Worker pid=" not in out + err and "UserWarning" not in err
    for rank in (0, 1):
        log = (run_dir / "logs" / f"rank-{rank}.log").read_text()
        assert log.count(f"UserWarning: {NOISY_WARNING}") == 1  # Python warns once per process and place


def _batch(pid, *lines, is_err=True):
    return {"ip": "10.0.0.1", "pid": pid, "lines": list(lines), "is_err": is_err, "actor_name": "Worker"}


@pytest.mark.parametrize("verbose", [False, True])
def test_worker_output_goes_to_rank_logs_and_the_console_shows_what_matters(tmp_path, verbose):
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    run = RunDir.create(tmp_path, "job")
    run.write_json("placement.json", [{"rank": 0, "pid": 111, "ip": "10.0.0.1"},
                                      {"rank": 1, "pid": 222, "ip": "10.0.0.1"}])
    buf = io.StringIO()
    with WorkerLogs(run, Console(file=buf, width=400), verbose=verbose):
        dispatcher.emit(_batch(111, DTENSOR, DTENSOR.replace("11:50:06", "11:50:07")))
        dispatcher.emit(_batch(222, DTENSOR.replace("[rank0]", "[rank1]"), "step took 3 ms", is_err=False))
        dispatcher.emit(_batch(222, "/x/data.py:12: UserWarning: the sampler wraps around"))
        dispatcher.emit(_batch(222, "Traceback (most recent call last):", '  File "t.py", line 3, in step',
                               "ValueError: loss is nan at step 17"))
        dispatcher.emit(_batch(333, "a task's own line"))
    assert not any(name == "orchestrator_worker_logs" for name, _ in dispatcher.handlers)
    console = buf.getvalue()
    rank0 = (run.path / "logs" / "rank-0.log").read_text().splitlines()
    rank1 = (run.path / "logs" / "rank-1.log").read_text().splitlines()
    assert rank0 == [DTENSOR, DTENSOR.replace("11:50:06", "11:50:07")]
    assert rank1[1] == "step took 3 ms" and rank1[-1] == "ValueError: loss is nan at step 17" and len(rank1) == 6
    assert "a task's own line" in (run.path / "logs" / "ray.log").read_text()
    if verbose:
        assert console.count("While redistributing") == 3 and "step took 3 ms" in console
        return
    assert console.count("While redistributing") == 1
    assert f"warning from rank 0 (first occurrence; see {run.path / 'logs' / 'rank-0.log'}): While redistributing" \
        in console
    assert "warning from rank 1" in console and "UserWarning: the sampler wraps around" in console
    assert f"error from rank 1 (see {run.path / 'logs' / 'rank-1.log'}): ValueError: loss is nan at step 17" in console
    assert "step took 3 ms" not in console and "Traceback" not in console and "a task's own line" not in console


@pytest.mark.parametrize("line, expected", [
    (DTENSOR, "warning"),
    ("[rank1]:E1203 11:50:06.634000 17460 x.cc:12] NCCL watchdog timeout", "error"),
    ("[rank1]:I1203 11:50:06.634000 17460 x.cc:12] init done", None),
    ("/a/b.py:3: FutureWarning: `x` is deprecated", "warning"),
    ("torch.OutOfMemoryError: CUDA out of memory", "error"),
    ("WARNING:root:slow data loader", "warning"),
    ("step 10 loss 2.3", None),
    ("During handling of the above exception, another exception occurred:", None),
])
def test_classify(line, expected):
    found = classify(line)
    assert (found[0] if found else None) == expected


def test_a_stopped_summary_counts_the_step_its_newest_checkpoint_proves(tmp_path):
    # The signal can land after a step's checkpoint is committed and before the driver wrote
    # that step's metrics line: the checkpoint says how far the run got.
    from orchestrator.config import load_config
    from orchestrator.record.stopped import stopped_summary

    cfg = load_config(ROOT / "jobs" / "llm.yaml", [f"monitor.runs_dir={tmp_path}"])
    run = RunDir.create(cfg.monitor.runs_dir, cfg.name)
    run.write_text("metrics.jsonl", json.dumps({"step": 1, "loss": 5.0}) + "\n")
    for step in (1, 2):
        (run.checkpoints / f"step_{step:08d}").mkdir(parents=True)
        (run.checkpoints / f"step_{step:08d}" / "meta.json").write_text(json.dumps({"step": step}))
    (run.checkpoints / "step_00000003").mkdir()  # being written: not committed, proves nothing
    summary = stopped_summary(cfg, run, "SIGTERM", 1.0)
    assert summary["steps"] == 2 and len(summary["checkpoints"]) == 2


def test_releasing_the_actors_fences_every_rank_before_killing_any(monkeypatch):
    # Ray's kill is asynchronous: a rank killed mid-commit could commit a checkpoint after the
    # driver chose where the next world resumes (seen as a grown world refusing to overwrite
    # the step it reached). Every rank is told to commit nothing more first.
    import ray

    from orchestrator.control import placement as pl

    calls = []

    class Rank:
        def __init__(self, r):
            self.r = r
            self.fence = type("M", (), {"remote": lambda _: calls.append(("fence", r)) or f"ref{r}"})()

    waited = []
    monkeypatch.setattr(ray, "kill", lambda a, **k: calls.append(("kill", a.r)))
    monkeypatch.setattr(ray, "wait", lambda refs, **k: waited.append((list(refs), k.get("timeout"))) or (refs, []))
    monkeypatch.setattr(pl, "remove_placement_group", lambda group: None)
    ranks = [Rank(r) for r in range(3)]
    monkeypatch.setattr(ray, "get_runtime_context", lambda: None)
    pl.Placement(group=None, actors=[], reports=[]).release()  # nothing placed: nothing to fence
    assert calls == []
    waited.clear()
    for r in ranks:
        r.__ray_ready__ = type("M", (), {"remote": lambda _: "ready"})()
    pl.Placement(group=None, actors=ranks, reports=[]).release(wait_s=1.0)
    assert calls == [("fence", 0), ("fence", 1), ("fence", 2), ("kill", 0), ("kill", 1), ("kill", 2)]
    assert waited[0] == (["ref0", "ref1", "ref2"], pl.FENCE_S)


def test_releasing_the_actors_waits_until_their_processes_have_exited(monkeypatch):
    # Ray calls a killed actor dead before its process exits; in between, a rank's checkpoint
    # thread committed a checkpoint (and pruned another) after the stopped run's summary had
    # listed them (found by the SIGTERM test above, rarely).
    import ray

    from orchestrator.control import placement as pl

    class Here:
        def get_node_id(self):
            return "this-node"

    monkeypatch.setattr(ray, "kill", lambda *a, **k: None)
    monkeypatch.setattr(ray, "wait", lambda *a, **k: ([], []))
    monkeypatch.setattr(ray, "get_runtime_context", lambda: Here())
    monkeypatch.setattr(pl, "remove_placement_group", lambda group: None)
    lingering = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.0)"])
    elsewhere = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        reports = [{"pid": lingering.pid, "node_id": "this-node"}, {"pid": elsewhere.pid, "node_id": "another-node"}]
        t0 = time.monotonic()
        pl.Placement(group=None, actors=[], reports=reports).release(wait_s=10.0)
        waited = time.monotonic() - t0
        # It returned once this node's process was gone (reaped or a zombie), and did not wait
        # for a process it cannot see (another node's) until the limit.
        assert lingering.poll() is not None or not pl._running(lingering.pid)
        assert 0.5 < waited < 5.0, waited
    finally:
        lingering.kill()
        elsewhere.kill()
