"""The GPU check (benchmarks/gpu_check.py) without a GPU.

Its in-process parts run for real in the CPU smoke mode (`--device cpu --quick`: gloo, fp32,
tiny models), through the same Trainer, planner and checkpoint code the GPU run takes; what
only the GPU run decides (a doctor report or backend that fails the check, the GPU sizes
planning on an H200) is checked with stand-ins for the commands and the device. No timing is
asserted. Results go to tmp_path, never to benchmarks/results/. Each part runs in a process of
its own; the runner that starts them is checked with stand-in commands that hang, crash or
fail, and with Ray hidden as the GPU machine's image lacks it.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

import gpu_check  # noqa: E402
from test_benchmark_results import problems  # noqa: E402

IN_PROCESS = ("torch_api", "memory_model", "step_time", "dcp", "compile", "real_loop")
RAY = ("doctor", "default_job")
FILES = sorted((gpu_check.RESULT_FILE, gpu_check.LOG_FILE))  # all that comes back from the GPU machine


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != gpu_check.OUT_ENV}
    return {**env, **extra}


def _smoke(out: Path, parts: tuple[str, ...], timeout: int, env: dict[str, str] | None = None,
           ) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(BENCH / "gpu_check.py"), "--device", "cpu", "--quick", "--out", str(out)]
    for p in parts:
        cmd += ["--only", p]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env or _env())


def _combined(out: Path) -> dict:
    return json.loads((out / gpu_check.RESULT_FILE).read_text())


def _result(out: Path, part: str) -> dict:
    return _combined(out)["parts"][part]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu")
    res = _smoke(out, IN_PROCESS, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return out, res


def _positive(*values) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values)


@pytest.mark.slow
def test_cpu_smoke_writes_every_part_through_write_result(smoke):
    out, res = smoke
    # The same checks every stored result passes: command, machine, versions, figures.
    assert problems(out / gpu_check.RESULT_FILE) == []
    top = _combined(out)
    assert (top["device"], top["quick"], top["problems"]) == ("cpu", True, [])
    assert top["command"].startswith("python benchmarks/gpu_check.py --device cpu --quick --out ")
    assert list(top["parts"]) == list(IN_PROCESS)  # the order they ran in
    for part in IN_PROCESS:
        data = _result(out, part)
        assert (data["part"], data["device"]) == (part, "cpu")
        assert "error" not in data, data["error"]
        for key in gpu_check.FIGURES[part]:
            assert data.get(key) not in (None, [], {}, ""), (part, key)
        assert data["nvml_before"] is None and data["timeout_s"] == gpu_check.CPU_PART_TIMEOUT_S
    assert "gpu check on cpu (quick)" in res.stdout
    # What the GPU machine brings back: two files, no folder; each part's output in the log.
    assert sorted(p.name for p in out.iterdir()) == FILES
    log = (out / gpu_check.LOG_FILE).read_text()
    assert all(f"{part}: done" in log for part in IN_PROCESS) and "per-rank memory" in log


@pytest.mark.slow
def test_cpu_smoke_checks_the_torch_apis_the_parts_call(smoke):
    data = _result(smoke[0], "torch_api")
    assert data["missing"] == [] and data["modules_failing"] == []
    assert data["floor"] == gpu_check.torch_floor() and data["below_floor"] is None
    assert len(data["apis"]) == len(gpu_check.TORCH_APIS) + len(gpu_check.TORCH_KEYWORDS)


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
        assert c["median_step_s"] == pytest.approx(gpu_check.median(c["step_s_each"]))
        assert c["footprint"] is None  # the device's footprint is a GPU figure
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
    # The compiled figure is of the named steps, every one of them compiled: the median of those.
    assert data["compiled_steps"] == list(range(1, data["steps"]))
    assert data["compiled_step_s"] == statistics.median(data["compiled_step_s_each"][i] for i in data["compiled_steps"])
    assert data["eager_step_s"] == statistics.median(data["eager_step_s_each"][i] for i in data["eager_steps"])


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


@pytest.mark.slow
def test_cpu_smoke_real_loop_reports_the_loops_own_figures_eager_and_compiled(smoke):
    from orchestrator.runtime.step_timer import COMPILE_GAIN_STEPS

    data = _result(smoke[0], "real_loop")
    assert data["strategy"] == "zero3" and _positive(data["params"], data["compiled_speedup"])
    eager, compiled = data["runs"]["eager"], data["runs"]["compiled"]
    assert (eager["compiled"], compiled["compiled"]) == (False, True)
    steps = list(range(1, data["steps"] + 1))
    for run in (eager, compiled):
        # Every step reported by the loop, a baseline and a final evaluation beside them.
        assert run["steps"] == steps and len(run["step_s_each"]) == data["steps"]
        assert run["warmup_steps"] == [1, 2] and math.isfinite(run["last_val_loss"])
        assert _positive(run["step_s_median"], run["step_s_mean"], run["tokens_per_s_median"], run["mfu_median"],
                         run["overhead_s_per_step"], run["predicted_step_s"], run["predicted_memory_bytes"])
        assert 0 < run["overhead_share"] < 1
        assert run["allocator_peak_bytes"] is None and run["footprint"] is None  # CPU: no allocator to ask
    assert eager["steady_steps"] == steps[2:] and eager["gain_steps_eager"] == []
    # The compiled run times its gain on the runtime's named steps: its figure is of compiled steps only.
    gain = [s + 1 for s in COMPILE_GAIN_STEPS]
    assert compiled["gain_steps_eager"] == gain[::2] and compiled["gain_steps_compiled"] == gain[1::2]
    assert compiled["steady_steps"] == [s for s in steps[2:] if s not in gain[::2]]
    assert compiled["step_s_median"] == statistics.median(compiled["step_s_each"][s - 1]
                                                          for s in compiled["steady_steps"])
    assert data["compiled_speedup"] == pytest.approx(eager["step_s_median"] / compiled["step_s_median"])


def _row(step: int, step_s: float, mfu: float | None = None) -> dict:
    return {"step": step, "step_s": step_s, "tokens_per_s": 100 / step_s, **({"mfu": mfu} if mfu else {})}


def test_loop_figures_are_of_the_steady_steps_without_the_gains_eager_ones():
    rows = [_row(1, 9.0, 0.01), _row(2, 3.0, 0.03), _row(3, 2.0, 0.05), _row(4, 1.0, 0.1), _row(5, 4.0, 0.025),
            _row(6, 1.0, 0.1)]
    got = gpu_check.loop_figures(rows, overhead_s_per_step=0.25, eager_gain_steps=[5])
    assert got["warmup_steps"] == [1, 2] and got["steady_steps"] == [3, 4, 6]
    assert got["step_s_each"] == [9.0, 3.0, 2.0, 1.0, 4.0, 1.0]
    assert (got["step_s_median"], got["step_s_mean"]) == (1.0, pytest.approx(4 / 3))
    assert (got["tokens_per_s_median"], got["tokens_per_s_mean"]) == (100.0, pytest.approx(250 / 3))
    assert (got["mfu_median"], got["mfu_mean"]) == (0.1, pytest.approx(0.25 / 3))
    assert got["overhead_s_per_step"] == 0.25
    assert got["overhead_share"] == pytest.approx(0.25 / (0.25 + 4 / 3))
    # Without a peak the loop's rows carry no MFU, and the figures say so.
    assert gpu_check.loop_figures([_row(3, 2.0)], 0.0, [])["mfu_median"] is None
    with pytest.raises(ValueError, match="no steady step among 2"):
        gpu_check.loop_figures(rows[:2], 0.0, [])
    with pytest.raises(ValueError, match="reported no steps"):
        gpu_check.loop_figures([], 0.0, [])


def test_the_collecting_sink_keeps_the_loops_messages_in_order():
    from orchestrator.runtime.messages import Evaluated, RankTimes, Stepped

    sink = gpu_check.CollectingSink()
    sink.add(Evaluated(step=0, val_loss=5.0), urgent=True)
    sink.add(Stepped(row={"step": 1}))
    sink.add(RankTimes(rank=0, times=((0.1, None),)))
    sink.add(Stepped(row={"step": 2}))
    sink.flush()
    assert not sink.ended
    sink.end()
    assert sink.ended and len(sink.messages) == 4 and sink.rows() == [{"step": 1}, {"step": 2}]


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
    check = _check(tmp_path, "cpu")
    assert gpu_check.figures_of("doctor", check)["error"] == "RuntimeError: it broke"
    job = gpu_check.figures_of("default_job", check)
    assert job["error"] == "submit exited with 1: no" and job["stderr_tail"] == ["no"]
    assert gpu_check.figures_of("memory_model", check)["error"] == "_Boom: collective failed"
    assert "error" not in gpu_check.figures_of("dcp", check)


DCP_FIGURES = {"params": 10, "bytes": 100, "save_s": 0.1, "load_s": 0.1, "tensors": 3, "equal": True}
WRITES_DCP = f"import json, sys; json.dump({DCP_FIGURES!r}, open(sys.argv[1], 'w'))"


def _stand_in(monkeypatch, scripts: dict[str, str]) -> None:
    """Each part's process replaced by a script given the figures' path as argv[1]."""
    def command(name, device, quick, figures_path):
        return [sys.executable, "-c", scripts[name], str(figures_path)]

    monkeypatch.setattr(gpu_check, "part_command", command)


def test_a_part_that_hangs_crashes_or_dies_loses_itself_and_the_others_still_run(tmp_path, monkeypatch):
    _stand_in(monkeypatch, {
        "torch_api": "import sys; print('no such module', file=sys.stderr); sys.exit(3)",
        "memory_model": "import time; print('working', flush=True); time.sleep(120)",
        "step_time": "import os; print('about to crash', flush=True); os.abort()",
        "dcp": WRITES_DCP,
    })
    monkeypatch.setattr(gpu_check, "CPU_PART_TIMEOUT_S", 3)
    monkeypatch.delenv(gpu_check.OUT_ENV, raising=False)
    argv = ["--device", "cpu", "--out", str(tmp_path)]
    for part in ("dcp", "step_time", "memory_model", "torch_api"):
        argv += ["--only", part]
    assert gpu_check.main(argv) == 1
    got = _combined(tmp_path)
    assert list(got["parts"]) == ["torch_api", "memory_model", "step_time", "dcp"]  # the table's order
    assert _result(tmp_path, "torch_api")["error"] == (
        "its process exited with 3 before writing its figures: no such module")
    hung = _result(tmp_path, "memory_model")
    assert hung["error"] == "ran past its time limit of 3 s and was stopped" and hung["seconds"] < 30
    assert _result(tmp_path, "step_time")["error"] == (
        "its process killed by SIGABRT before writing its figures: about to crash")
    dcp = _result(tmp_path, "dcp")
    assert "error" not in dcp and dcp["equal"] is True and dcp["part"] == "dcp"
    assert problems(tmp_path / gpu_check.RESULT_FILE) == []
    log = (tmp_path / gpu_check.LOG_FILE).read_text()
    assert "working" in log and "memory_model: FAILED: ran past its time limit" in log
    assert sorted(p.name for p in tmp_path.iterdir()) == FILES
    assert gpu_check.main(["--device", "cpu", "--out", str(tmp_path), "--only", "dcp"]) == 0


def test_results_go_to_out_when_it_is_set(tmp_path, monkeypatch):
    _stand_in(monkeypatch, {"dcp": WRITES_DCP})
    monkeypatch.setenv(gpu_check.OUT_ENV, str(tmp_path / "out"))
    assert gpu_check.main(["--device", "cpu", "--out", str(tmp_path / "given"), "--only", "dcp"]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == FILES
    assert not (tmp_path / "given").exists()


def test_each_part_writes_its_caches_and_scratch_into_the_temporary_folder(tmp_path):
    env = gpu_check.scratch_env(tmp_path, "cuda")
    for var in ("TMPDIR", "XDG_CACHE_HOME", "ORCHESTRATOR_CACHE_DIR", "ORCHESTRATOR_MEASURE_CACHE",
                "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TRITON_HOME", "CUDA_CACHE_PATH", "TORCH_HOME",
                "RAY_TMPDIR"):
        assert Path(env[var]).is_relative_to(tmp_path) and Path(env[var]).is_dir(), var
    assert env["PYTHONDONTWRITEBYTECODE"] == "1" and gpu_check.OUT_ENV not in env
    # On CPU the compiler's cache is inductor's own, so that a smoke run compiles from the last one's.
    cpu = gpu_check.scratch_env(tmp_path, "cpu")
    assert not Path(cpu["TORCHINDUCTOR_CACHE_DIR"]).is_relative_to(tmp_path) and Path(cpu["TMPDIR"]).is_relative_to(
        tmp_path)


def test_without_ray_the_parts_that_need_it_are_skipped_in_one_line(tmp_path):
    # sys.modules["ray"] = None: `import ray` fails and find_spec answers None, as where Ray is absent.
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['ray'] = None\n")
    env = _env(PYTHONPATH=os.pathsep.join([str(hide), str(ROOT)]))
    res = _smoke(tmp_path / "out", RAY, timeout=120, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    for part in RAY:
        assert _result(tmp_path / "out", part)["skipped"] == gpu_check.NO_RAY
    assert res.stderr.count(gpu_check.NO_RAY) == 2


def test_the_torch_floor_is_read_from_pyproject_and_an_older_torch_is_named_in_one_line(tmp_path):
    floor = gpu_check.torch_floor()
    assert f'"torch>={floor}"' in (ROOT / "pyproject.toml").read_text()
    toml = tmp_path / "pyproject.toml"
    toml.write_text('[project]\ndependencies = ["ray>=2", "torch>=2.9,<3", "numpy"]\n')
    assert gpu_check.torch_floor(toml) == "2.9"
    toml.write_text('[project]\ndependencies = ["numpy"]\n')
    with pytest.raises(ValueError, match="names no `torch>=`"):
        gpu_check.torch_floor(toml)
    assert gpu_check.below_floor("2.11.0+cu130", "2.9") is None and gpu_check.below_floor("2.10.1", "2.10") is None
    assert gpu_check.below_floor("2.8.0", "2.9") == (
        "torch 2.8.0 is older than the floor 2.9 that pyproject.toml states; the parts run on regardless")
    with pytest.raises(ValueError, match="MAJOR.MINOR"):
        gpu_check.below_floor("nightly", "2.9")


def test_an_older_torch_fails_the_check_in_one_line_while_the_parts_run(tmp_path, monkeypatch):
    import torch

    _stand_in(monkeypatch, {"dcp": WRITES_DCP})
    monkeypatch.setattr(torch, "__version__", "2.1.0")
    monkeypatch.delenv(gpu_check.OUT_ENV, raising=False)
    assert gpu_check.main(["--device", "cpu", "--out", str(tmp_path), "--only", "dcp"]) == 1
    got = _combined(tmp_path)
    assert got["problems"] == [gpu_check.below_floor("2.1.0", gpu_check.torch_floor())]
    assert "error" not in got["parts"]["dcp"]


def test_a_missing_torch_api_fails_the_torch_api_part_naming_it(tmp_path, monkeypatch):
    import torch

    monkeypatch.delattr(torch.compiler, "set_stance")
    with pytest.raises(gpu_check.PartFailed, match=r"lacks 1 of \d+ APIs the check calls: torch.compiler.set_stance$"):
        gpu_check.torch_api(_check(tmp_path, "cpu"))
    monkeypatch.setattr(gpu_check, "TORCH_KEYWORDS", (("torch.distributed", "init_process_group", "no_such"),))
    assert gpu_check.missing_apis() == ["torch.compiler.set_stance", "torch.distributed.init_process_group(no_such=)"]


class _FakeNvml:
    NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU = 1, 2, 0

    def __init__(self, fail_init: bool = False) -> None:
        self.fail_init, self.shut = fail_init, False

    def nvmlInit(self):
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self):
        self.shut = True

    def nvmlDeviceGetHandleByIndex(self, i):
        return 7

    def nvmlDeviceGetClockInfo(self, h, clock):
        return {1: 1980, 2: 2619}[clock]

    def nvmlDeviceGetTemperature(self, h, sensor):
        raise RuntimeError("Not Supported")

    def nvmlDeviceGetMemoryInfo(self, h):
        return type("Memory", (), {"used": 1_500_000_000})()


def test_clocks_and_used_memory_are_read_by_nvml_and_what_it_does_not_answer_is_said():
    nvml = _FakeNvml()
    assert gpu_check.nvml_reading(nvml) == {"sm_mhz": 1980, "memory_mhz": 2619, "temperature_c": None,
                                            "used_bytes": 1_500_000_000,
                                            "unanswered": ["temperature_c: RuntimeError: Not Supported"]}
    assert nvml.shut
    assert gpu_check.nvml_reading(_FakeNvml(fail_init=True)) == {"error": "RuntimeError: NVML Shared Library Not Found"}
    assert gpu_check.reading("cpu") is None


def test_the_device_footprint_is_the_drivers_used_memory_beside_the_allocators():
    class Cuda:
        def mem_get_info(self):
            return 60 * 2**30, 80 * 2**30

        def memory_allocated(self):
            return 12 * 2**30

        def memory_reserved(self):
            return 16 * 2**30

    assert gpu_check.device_footprint(Cuda()) == {"device_used_bytes": 20 * 2**30, "device_total_bytes": 80 * 2**30,
                                                  "allocated_bytes": 12 * 2**30, "reserved_bytes": 16 * 2**30}


def test_each_part_has_a_time_limit_inside_the_runs_budget():
    # A full run within 6 minutes on the GPU and --quick within 3, each part's limit included,
    # for the parts that run where Ray is absent (the GPU machine's image).
    parts = [p for p in gpu_check.PART_TABLE if not p.needs_ray]
    assert sum(gpu_check.part_timeout_s(p, "cuda", False) for p in parts) <= 6 * 60
    assert sum(gpu_check.part_timeout_s(p, "cuda", True) for p in parts) <= 3 * 60
    assert gpu_check.PARTS.index("compile") < gpu_check.PARTS.index("doctor")  # those without Ray first
    assert set(gpu_check.FIGURES) == set(gpu_check.PARTS)


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
    (tmp_path / "work").mkdir(exist_ok=True)
    (tmp_path / "work" / "doctor.json").write_text(json.dumps(report))
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
    assert got["step_s_median"] == pytest.approx(0.1)
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
    from orchestrator.runtime.step_timer import COMPILE_GAIN_STEPS

    assert s["loop_steps"] >= COMPILE_GAIN_STEPS.stop  # the compiled run times its gain on named steps
    for compile_flag in ("false", "true"):
        _, plan = gpu_check.plan_for(check, [*gpu_check.loop_overrides(check), f"train.compile={compile_flag}"], spec)
        assert plan.fits and str(plan.strategy) == "zero3" and plan.compile.enabled == (compile_flag == "true")
    assert 0.8e9 < plan.model.params < 1.2e9
    _, plan = gpu_check.plan_for(check, [*s["dcp_model"], f"model.block_size={s['dcp_block']}"])
    assert 0.08e9 < plan.model.params < 0.12e9  # ~100M


@pytest.mark.slow
@pytest.mark.ray
def test_cpu_smoke_of_doctor_and_the_default_job(tmp_path):
    res = _smoke(tmp_path, ("doctor", "default_job"), timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    job = _result(tmp_path, "default_job")
    assert problems(tmp_path / gpu_check.RESULT_FILE) == []
    assert job["backend"] == "gloo" and job["steps"] == gpu_check.sizes("cpu", True)["job_steps"]
    assert _positive(job["first_step_s"], job["tokens_per_s"], job["step_s"], job["mfu"])
    assert Path(job["run_dir"]).name.startswith("llm-")
    doctor = _result(tmp_path, "doctor")
    assert isinstance(doctor["returncode"], int) and "orchestrator doctor --out" in doctor["cli_command"]
    # The report is written to the check's scratch folder and kept whole in the results.
    assert doctor["verdicts"] == (gpu_check.verdicts(doctor["report"]) if doctor["report"] is not None else [])
    assert sorted(p.name for p in tmp_path.iterdir()) == FILES


# --- gpu_check.sh: the wheels that travel, the size, the run on an image without Ray or omegaconf ---

SCRIPT = BENCH / "gpu_check.sh"
WHEEL = "omegaconf-2.4.0-py3-none-any.whl"
# As the GPU machine's image: no Ray, and omegaconf only where the script installed it (a folder
# outside any site-packages), never the one of the Python running the tests.
IMAGE = """import importlib.machinery, sys
sys.modules["ray"] = None


class OnlyCarried:
    def find_spec(self, name, path=None, target=None):
        if name != "omegaconf":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, [p for p in sys.path if "site-packages" not in p])
        if spec is None:
            raise ModuleNotFoundError("No module named 'omegaconf'", name=name)
        return spec


sys.meta_path.insert(0, OnlyCarried())
"""


def _script(args: list[str], timeout: int = 60, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=_env(PYTHON=sys.executable, **env))


def test_the_dry_run_prints_the_recipe_its_header_states(tmp_path):
    res = _script(["--dry-run"])
    lines = res.stdout.splitlines()
    assert lines[0].startswith("pip download: python3 -m pip download --no-deps --only-binary=:all: "
                               "--python-version 3.12 ") and lines[0].endswith(" -d .whl omegaconf==2.4.0")
    assert lines[1:3] == ['carry: [".whl"]', "command: bash benchmarks/gpu_check.sh"]
    header = SCRIPT.read_text()
    for line in lines[:3]:
        assert line.split(": ", 1)[1] in header
    assert "/.whl/" in (ROOT / ".gitignore").read_text().splitlines()  # carried, never committed


def test_the_dry_run_names_a_missing_wheel_and_checks_the_size_that_travels(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    res = _script(["--dry-run"], GPU_CHECK_WHEELS=str(wheels))
    assert res.returncode == 1
    assert [ln for ln in res.stdout.splitlines() if "missing" in ln] == [
        f"missing carried wheel: {wheels}/{WHEEL} (make it with: {res.stdout.splitlines()[0].split(': ', 1)[1]})"]
    (wheels / WHEEL).write_bytes(b"x" * 1000)
    res = _script(["--dry-run"], GPU_CHECK_WHEELS=str(wheels))
    assert res.returncode == 0, res.stdout
    size = res.stdout.splitlines()[-1]
    assert size.startswith(f"size: the working tree and {wheels}/ hold ")
    assert size.endswith(" of the 64 MiB that travel")
    assert 0 < float(size.split(" hold ")[1].split(" MiB")[0]) < 64
    with open(wheels / "big.whl", "wb") as f:  # sparse: counted at its size, as it would travel
        f.truncate(65 * 2**20)
    res = _script(["--dry-run"], GPU_CHECK_WHEELS=str(wheels))
    assert res.returncode == 1 and res.stdout.splitlines()[-1].startswith("too large to travel: ")


def _image(tmp_path: Path) -> str:
    folder = tmp_path / "image"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(IMAGE)
    return str(folder)


@pytest.mark.slow  # ~5 s: the image check in a fresh interpreter
def test_on_the_image_a_missing_wheel_is_one_line_and_the_parts_say_what_they_lack(tmp_path):
    out = tmp_path / "out"
    res = _script(["--device", "cpu", "--quick", "--only", "torch_api", "--only", "doctor"], timeout=300,
                  GPU_CHECK_WHEELS=str(tmp_path / "none"), PYTHONPATH=_image(tmp_path), OUT=str(out))
    assert res.returncode == 1
    assert [ln for ln in res.stderr.splitlines() if ln.startswith("missing carried wheel: ")] == [
        f"missing carried wheel: {tmp_path / 'none'}/{WHEEL} (make it with: python3 -m pip download "
        + res.stderr.split("(make it with: python3 -m pip download ", 1)[1].split("\n", 1)[0]]
    api = _result(out, "torch_api")
    assert "No module named 'omegaconf'" in api["error"] and "\n" not in api["error"]
    assert _result(out, "doctor")["skipped"] == gpu_check.NO_RAY
    assert sorted(p.name for p in out.iterdir()) == FILES


@pytest.mark.skipif(not (ROOT / ".whl" / WHEEL).is_file(), reason="the carried wheel is not downloaded here")
def test_on_the_image_the_carried_wheel_is_installed_and_the_parts_run(tmp_path):
    out = tmp_path / "out"
    res = _script(["--device", "cpu", "--quick", "--only", "torch_api"], timeout=300,
                  PYTHONPATH=_image(tmp_path), OUT=str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "missing" not in res.stderr
    assert _result(out, "torch_api")["modules_failing"] == []


@pytest.mark.slow  # ~5 s: compiled steps on CPU
def test_the_compiled_figure_is_of_compiled_steps_only(tmp_path, monkeypatch):
    # Ten steps: a compiled run that long would time steps 2-9 alternately eager to measure its
    # gain, and those eager steps would sit in the compiled figure.
    import torch

    cpu = gpu_check.sizes("cpu", True)
    monkeypatch.setattr(gpu_check, "sizes", lambda device, quick: {**cpu, "compile_steps": 10})
    stances = []
    set_stance = torch.compiler.set_stance

    def spy(*args, **kwargs):
        stances.append(args[0] if args else kwargs.get("stance"))
        return set_stance(*args, **kwargs)

    monkeypatch.setattr(torch.compiler, "set_stance", spy)
    try:
        data = gpu_check.compile_part(_check(tmp_path, "cpu"))
    finally:
        gpu_check._close_group()
    assert stances == []  # no step of either run trained with its blocks forced eager
    assert data["compiled_steps"] == list(range(1, 10))
    assert data["compiled_step_s"] == statistics.median(data["compiled_step_s_each"][1:])


def _untracked() -> set[str]:
    res = subprocess.run(["git", "status", "--porcelain", "--ignored", "--untracked-files=all"], capture_output=True,
                         text=True, cwd=ROOT, check=True)
    return set(res.stdout.splitlines())


@pytest.mark.slow
def test_nothing_is_written_outside_the_results_and_the_temporary_folder(tmp_path):
    # A home of its own (caches such as ~/.cache/orchestrator would land there) and the working
    # tree's files, ignored ones too (bytecode, run directories), before and after.
    home = tmp_path / "home"
    home.mkdir()
    before = _untracked()
    out = tmp_path / "out"
    res = _script(["--device", "cpu", "--quick", "--only", "dcp", "--only", "compile"], timeout=400,
                  GPU_CHECK_WHEELS=str(tmp_path / "none"), HOME=str(home), OUT=str(out))
    assert "error" not in _result(out, "dcp") and "error" not in _result(out, "compile"), res.stderr[-3000:]
    assert list(home.iterdir()) == []
    assert _untracked() == before
    assert sorted(p.name for p in out.iterdir()) == FILES
