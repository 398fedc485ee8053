"""The GPU check (benchmarks/gpu_check.py) without a GPU.

Its in-process parts run for real in the CPU smoke mode (`--device cpu --quick`: gloo, fp32,
tiny models), through the same Trainer, planner and checkpoint code the GPU run takes; what
only the GPU run decides (a doctor report or backend that fails the check, the GPU sizes
planning on an H200) is checked with stand-ins for the commands and the device. No timing is
asserted. Results go to tmp_path, never to benchmarks/results/.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

import gpu_check  # noqa: E402
from test_benchmark_results import problems  # noqa: E402

IN_PROCESS = ("memory_model", "step_time", "dcp", "compile")


def _smoke(out: Path, parts: tuple[str, ...], timeout: int) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(BENCH / "gpu_check.py"), "--device", "cpu", "--quick", "--out", str(out)]
    for p in parts:
        cmd += ["--only", p]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _result(out: Path, part: str) -> dict:
    return json.loads((out / f"gpu_check_{part}.json").read_text())


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu")
    res = _smoke(out, IN_PROCESS, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return out, res


def _positive(*values) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values)


@pytest.mark.slow
def test_cpu_smoke_writes_every_part_through_write_result(smoke):
    out, res = smoke
    for part in IN_PROCESS:
        path = out / f"gpu_check_{part}.json"
        # The same checks every stored result passes: command, machine, versions, figures.
        assert problems(path) == [], part
        data = _result(out, part)
        assert (data["part"], data["device"], data["quick"]) == (part, "cpu", True)
        assert "error" not in data, data["error"]
        for key in gpu_check.FIGURES[part]:
            assert data.get(key) not in (None, [], {}, ""), (part, key)
        assert data["command"].startswith("python benchmarks/gpu_check.py --device cpu --quick --out ")
    assert "gpu check on cpu (quick)" in res.stdout
    assert not (out / "doctor.json").exists()  # doctor was not asked for


@pytest.mark.slow
def test_cpu_smoke_memory_model_sets_the_plan_against_a_measured_peak(smoke):
    data = _result(smoke[0], "memory_model")
    got = {(c["strategy"], c["recompute"]) for c in data["cases"]}
    assert got == {(s, r) for s in gpu_check.STRATEGIES for r in gpu_check.RECOMPUTE}
    assert _positive(data["params"], data["max_rel_error"])
    for c in data["cases"]:
        pred, meas = c["predicted"]["total"], c["measured_peak_bytes"]
        assert _positive(pred, meas, c["ratio"], c["ratio_without_buffers"])
        assert c["ratio"] == pytest.approx(meas / pred)
        assert c["rel_error"] == pytest.approx(abs(pred - meas) / meas)
        assert c["planned"]["strategy"] == c["strategy"] and c["planned"]["recompute"] == c["recompute"]
        # Memory does not depend on timing: the tracker's peak is of the plan's order.
        assert 0.5 < c["ratio_without_buffers"] < 2.0, c
        assert sum(c["state_bytes"].values()) > 0
    assert data["max_rel_error"] == max(c["rel_error"] for c in data["cases"])


@pytest.mark.slow
def test_cpu_smoke_step_time_measures_every_size(smoke):
    data = _result(smoke[0], "step_time")
    assert [c["case"] for c in data["cases"]] == list(gpu_check.sizes("cpu", True)["step_models"])
    for c in data["cases"]:
        assert len(c["step_s_each"]) == data["steps"]
        assert _positive(c["predicted_step_s"], c["measured_step_s"], c["ratio"], c["tokens_per_s"], c["mfu"])
        assert c["ratio"] == pytest.approx(c["measured_step_s"] / c["predicted_step_s"])
    assert [c["params"] for c in data["cases"]] == sorted(c["params"] for c in data["cases"])


@pytest.mark.slow
def test_cpu_smoke_compile_times_both_modes_and_the_compile(smoke):
    data = _result(smoke[0], "compile")
    assert len(data["eager_step_s_each"]) == len(data["compiled_step_s_each"]) == data["steps"]
    assert data["speedup"] == pytest.approx(data["eager_step_s"] / data["compiled_step_s"])
    # The first compiled step compiles: it is the slowest of them by the compile itself.
    assert data["compiled_step_s_each"][0] == max(data["compiled_step_s_each"])
    assert data["compile_s"] == pytest.approx(data["compiled_step_s_each"][0] - data["compiled_step_s"])


@pytest.mark.slow
def test_cpu_smoke_dcp_loads_back_exactly_what_it_saved(smoke):
    data = _result(smoke[0], "dcp")
    assert data["equal"] is True and data["mismatched"] == []
    assert data["step"] == 2 and data["strategy"] == "zero3"
    # The fresh trainer started from other weights and empty moments, so equality means the load.
    assert data["differed_before_load"] > 0
    assert _positive(data["params"], data["bytes"], data["save_s"], data["load_s"], data["tensors"])
    # Weights and both AdamW moments in fp32: 12 bytes a parameter at least, all of it on disk.
    assert data["state_bytes"] >= 3 * 4 * data["params"]
    assert data["bytes"] >= data["state_bytes"]


class _Boom(BaseException):
    """As DCP's collective failure: a BaseException, not an Exception."""


def test_a_failing_part_is_one_line_and_the_others_still_run(tmp_path, monkeypatch):
    def raises(check):
        raise RuntimeError("it broke\nsecond line of the traceback text")

    def fails_with_figures(check):
        raise gpu_check.PartFailed("submit exited with 1: no", {"cli_command": "x", "stderr_tail": ["no"]})

    def base(check):
        raise _Boom("collective failed")

    def fine(check):
        return {"params": 10, "bytes": 100, "save_s": 0.1, "load_s": 0.1, "tensors": 3, "equal": True}

    for part, fn in {"doctor": raises, "default_job": fails_with_figures, "memory_model": base, "dcp": fine}.items():
        monkeypatch.setitem(gpu_check.PART_FUNCTIONS, part, fn)
    argv = ["--device", "cpu", "--out", str(tmp_path)]
    for part in ("dcp", "doctor", "memory_model", "default_job"):
        argv += ["--only", part]
    assert gpu_check.main(argv) == 1
    assert _result(tmp_path, "doctor")["error"] == "RuntimeError: it broke"
    job = _result(tmp_path, "default_job")
    assert job["error"] == "submit exited with 1: no" and job["stderr_tail"] == ["no"]
    assert _result(tmp_path, "memory_model")["error"] == "_Boom: collective failed"
    assert "error" not in _result(tmp_path, "dcp")
    assert not (tmp_path / "gpu_check_step_time.json").exists()
    for part in ("doctor", "default_job", "memory_model", "dcp"):
        assert problems(tmp_path / f"gpu_check_{part}.json") == []
    assert gpu_check.main(["--device", "cpu", "--out", str(tmp_path), "--only", "dcp"]) == 0


def test_options():
    import _common

    ap = _common.parser(gpu_check.__doc__, gpu_check.options)
    args = ap.parse_args(["--only", "dcp", "--only", "doctor", "--device", "cpu", "--quick"])
    assert args.only == ["dcp", "doctor"] and args.device == "cpu" and args.quick
    assert ap.parse_args([]).device == "cuda" and ap.parse_args([]).only is None
    with pytest.raises(SystemExit):
        ap.parse_args(["--only", "everything"])


def test_without_cuda_the_gpu_run_is_refused_in_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    res = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), "--only", "dcp"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "error: no CUDA device here; `--device cpu` runs every part on CPU (the smoke mode)"]


def test_run_command_keeps_exit_code_and_tails_and_stops_what_runs_too_long(tmp_path):
    res = gpu_check.run_command([sys.executable, "-c", "import sys; print('out'); print('bad', file=sys.stderr); "
                                 "sys.exit(3)"], 60, tmp_path / "a")
    assert (res["returncode"], res["timed_out"], res["stdout_tail"], res["stderr_tail"]) == (3, False, ["out"], ["bad"])
    assert gpu_check._said(res) == "exited with 3: bad"
    res = gpu_check.run_command([sys.executable, "-c", "import time; time.sleep(60)"], 1, tmp_path / "b")
    assert res["timed_out"] and res["returncode"] != 0 and res["wall_s"] < 30
    assert gpu_check._said(res).startswith("ran past its time limit")


def _check(tmp_path: Path, device: str) -> gpu_check.Check:
    return gpu_check.Check(device=device, quick=True, out=tmp_path, work=tmp_path / "work", t0=0.0)


def _fake_doctor(monkeypatch, code: int, report: dict | None) -> None:
    script = "import json, sys\n"
    if report is not None:
        script += f"json.dump({report!r}, open(sys.argv[1], 'w'))\n"
    script += f"print('doctor said'); sys.exit({code})\n"
    monkeypatch.setattr(gpu_check, "doctor_command", lambda path: [sys.executable, "-c", script, str(path)])


def test_doctor_fails_the_gpu_check_on_a_failing_node_and_on_a_missing_report(tmp_path, monkeypatch):
    report = {"nodes": [{"name": "gpu0", "verdict": "fail", "reasons": ["NVLink 2 down"]},
                        {"name": "gpu1", "verdict": "ok", "reasons": []}]}
    _fake_doctor(monkeypatch, 1, report)
    with pytest.raises(gpu_check.PartFailed) as e:
        gpu_check.doctor(_check(tmp_path, "cuda"))
    assert str(e.value) == "doctor exited with 1: doctor said; gpu0: fail (NVLink 2 down)"
    assert e.value.figures["report"] == report and e.value.figures["returncode"] == 1
    # On CPU the same outcome is recorded, not judged.
    got = gpu_check.doctor(_check(tmp_path, "cpu"))
    assert got["verdicts"] == ["gpu0: fail (NVLink 2 down)", "gpu1: ok"] and "note" in got
    # A report an earlier check left behind does not count for this one.
    (tmp_path / "doctor.json").write_text(json.dumps(report))
    _fake_doctor(monkeypatch, 0, None)
    with pytest.raises(gpu_check.PartFailed, match="wrote no report"):
        gpu_check.doctor(_check(tmp_path, "cuda"))
    _fake_doctor(monkeypatch, 0, {"nodes": [{"name": "gpu0", "verdict": "ok"}]})
    got = gpu_check.doctor(_check(tmp_path, "cuda"))
    assert got["returncode"] == 0 and got["verdicts"] == ["gpu0: ok"] and "error" not in got


def _run_dir(path: Path, backend: str) -> Path:
    path.mkdir(parents=True)
    (path / "plan.json").write_text(json.dumps({
        "model": {"params": 1000, "flops_per_step": 4e12, "peak_tflops_per_rank": 100.0},
        "strategy": "ddp", "mesh": {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "tp": 1}, "micro_batch_size": 8,
        "recompute": "none", "world_size": 1, "step_time": {"total_s": 0.05}}))
    (path / "summary.json").write_text(json.dumps({"final_val_loss": 2.0, "val_loss_drop": 0.5, "backend": backend}))
    (path / "placement.json").write_text(json.dumps([{"rank": 0, "gpu": 0, "backend": backend}]))
    rows = [{"step": i + 1, "time": 1000.0 + 10 + i * 0.1, "step_s": 0.1, "tokens_per_s": 5000.0, "mfu": 0.4}
            for i in range(10)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_read_run_takes_first_step_throughput_mfu_and_backend_from_the_run_directory(tmp_path):
    got = gpu_check.read_run(_run_dir(tmp_path / "run", "nccl"), launched=1000.0)
    assert got["first_step_s"] == pytest.approx(10.0)
    assert got["tokens_per_s"] == 5000.0 and got["step_s"] == pytest.approx(0.1)
    assert got["mfu"] == pytest.approx(4e12 / 0.1 / 100e12) and got["mfu_from_metrics"] == pytest.approx(0.4)
    assert got["backend"] == "nccl" and got["steps"] == 10 and got["plan"]["strategy"] == "ddp"
    out = "plan: ...\nrun directory: /r/llm-1\nstep 1/2\nrun directory: /r/llm-1  (loss curve: /r/llm-1/loss.svg)\n"
    assert gpu_check.run_directory(out) == Path("/r/llm-1")
    assert gpu_check.run_directory("no such line\n") is None


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_default_job_on_cuda_must_run_on_nccl(tmp_path, monkeypatch, backend):
    run_dir = _run_dir(tmp_path / "runs" / "llm-1", backend)
    seen = {}

    def fake_run(cmd, timeout_s, work):
        seen["cmd"] = cmd
        return {"cli_command": " ".join(cmd), "returncode": 0, "timed_out": False, "started": 1000.0, "wall_s": 20.0,
                "stdout": f"run directory: {run_dir}\n", "stderr": "", "stdout_tail": [], "stderr_tail": []}

    monkeypatch.setattr(gpu_check, "run_command", fake_run)
    check = _check(tmp_path, "cuda")
    if backend == "gloo":
        with pytest.raises(gpu_check.PartFailed, match="ran on gloo, not nccl"):
            gpu_check.default_job(check)
    else:
        assert gpu_check.default_job(check)["backend"] == "nccl"
    assert seen["cmd"][2:5] == ["orchestrator", "submit", "jobs/llm.yaml"]
    assert "cluster.num_workers=1" in seen["cmd"] and "train.max_steps=50" in seen["cmd"]


def test_the_gpu_sizes_plan_and_fit_on_one_h200(tmp_path, monkeypatch):
    # What the GPU run will plan, planned here: a typo in an override or a model that does not
    # fit would otherwise show first on the GPU.
    from orchestrator.topology.model import ClusterTopology, Device, NodeTopology

    h200 = Device(index=0, kind="gpu", name="NVIDIA H200", memory_bytes=141 * 10**9)
    monkeypatch.setattr(gpu_check, "topology", lambda check: ClusterTopology(nodes=[NodeTopology(devices=[h200])]))
    check = gpu_check.Check(device="cuda", quick=False, out=tmp_path, work=tmp_path / "work", t0=0.0)
    s = check.size
    base = [*s["memory_model"], f"model.block_size={s['memory_seq']}", "train.global_batch_size=1",
            "train.micro_batch_size=1", "train.precision=bf16", "parallel.tp=1", "parallel.pp=1"]
    spec = gpu_check.measured_spec(base)
    for strategy in gpu_check.STRATEGIES:
        for recompute in gpu_check.RECOMPUTE:
            _, plan = gpu_check.plan_for(check, [*base, f"parallel.strategy={strategy}",
                                                 f"parallel.recompute={recompute}"], spec)
            assert plan.fits and (str(plan.strategy), str(plan.execution.recompute)) == (strategy, recompute)
            assert plan.model.peak_tflops_per_rank == 989.0  # the H200's row of the table
    assert 0.8e9 < plan.model.params < 1.2e9  # ~1B, as the check promises
    for model in s["step_models"].values():
        overrides = [*model, f"model.block_size={s['step_block']}", f"train.global_batch_size={s['step_batch']}",
                     "train.precision=bf16", "parallel.strategy=ddp"]
        assert gpu_check.plan_for(check, overrides)[1].fits
    _, plan = gpu_check.plan_for(check, [*s["dcp_model"], f"model.block_size={s['dcp_block']}"])
    assert 0.08e9 < plan.model.params < 0.12e9  # ~100M


@pytest.mark.slow
@pytest.mark.ray
def test_cpu_smoke_of_doctor_and_the_default_job(tmp_path):
    res = _smoke(tmp_path, ("doctor", "default_job"), timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    job = _result(tmp_path, "default_job")
    assert problems(tmp_path / "gpu_check_default_job.json") == []
    assert job["backend"] == "gloo" and job["steps"] == gpu_check.sizes("cpu", True)["job_steps"]
    assert _positive(job["first_step_s"], job["tokens_per_s"], job["step_s"], job["mfu"])
    assert Path(job["run_dir"]).name.startswith("llm-")
    doctor = _result(tmp_path, "doctor")
    assert problems(tmp_path / "gpu_check_doctor.json") == []
    assert isinstance(doctor["returncode"], int) and "orchestrator doctor --out" in doctor["cli_command"]
    assert (doctor["report"] is not None) == (tmp_path / "doctor.json").is_file()
