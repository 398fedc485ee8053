"""`monitor.trackers`: the driver logs the run to TensorBoard, MLflow and W&B, each step once,
across a restart, with what the run's record holds; a tracker that fails is one note, and
nothing it does waits in the driver's loop."""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.config import load_config
from orchestrator.errors import ConfigError
from orchestrator.record.run_state import RunState
from orchestrator.record.rundir import RunDir
from orchestrator.record.trackers import STATE, Trackers, flatten

ROOT = Path(__file__).resolve().parent.parent


def _row(step: int, val: float | None = None) -> dict:
    return {"step": step, "time": 0.0, "loss": 10.0 - step, "lr": 1e-3, "tokens_per_s": 100.0 + step,
            "step_s": 0.1, "exposed_comm_s": None, "grad_norm": 1.0, "mfu": 0.01, "val_loss": val}


class _Fake:
    """A tracker that records what it is given; `fails`: raises on every call after start."""

    def __init__(self, name: str, log: list, fails: bool = False, slow_s: float = 0.0) -> None:
        self.name, self._log, self._fails, self._slow_s = name, log, fails, slow_s

    def start(self, run_id):
        self._log.append(("start", run_id))
        return run_id or f"{self.name}-id"

    def params(self, params):
        self._call()
        self._log.append(("params", dict(params)))

    def metrics(self, step, values):
        self._call()
        self._log.append(("metrics", step, dict(values)))

    def finish(self, artifacts):
        self._log.append(("finish", [p.name for p in artifacts]))

    def _call(self):
        time.sleep(self._slow_s)
        if self._fails:
            raise ConnectionError("connection refused\nsecond line")


def test_trackers_default_to_none_and_an_unknown_one_is_one_line():
    assert load_config(None).monitor.trackers == []
    assert load_config(None, ["monitor.trackers=[tensorboard,mlflow,wandb]"]).monitor.trackers == [
        "tensorboard", "mlflow", "wandb"]
    with pytest.raises(ConfigError, match=r"^key 'monitor.trackers': unknown tracker 'neptune'; each must be one of "
                                          r"tensorboard, mlflow, wandb$"):
        load_config(None, ["monitor.trackers=[tensorboard,neptune]"])


def test_params_hold_no_secret():
    params = flatten({"checkpoint": {"path": "s3://AKIAXXXX:hunter2@bucket/run"}, "auth": {"api_token": "t0k"},
                      "train": {"lr": 0.1}})
    assert params == {"checkpoint.path": "s3://bucket/run", "train.lr": "0.1"}


def test_each_step_is_logged_once_across_a_rewind_and_a_restarted_driver(tmp_path):
    cfg = load_config(None, ["monitor.trackers=[tensorboard]", "name=fake"])
    run = RunDir(tmp_path)
    calls: list = []
    notes: list[str] = []
    trackers = Trackers(cfg, run, notes.append, make=lambda name, c, r: _Fake(name, calls))
    state = RunState()
    state.val.append((0, 5.5))
    state.rows = [_row(s) for s in (1, 2, 3)]
    trackers.log(state)
    state.rows = [_row(s) for s in (1, 2, 3, 4, 5)]
    trackers.log(state)
    state.rows = state.rows[:3]  # a restart rewinds to the checkpoint of step 3 and recomputes
    state.restarts.append({"reason": "died"})
    state.rows += [_row(4), _row(5), _row(6, val=4.0)]
    trackers.log(state)
    trackers.close()
    # A driver started again on the same run directory continues the same tracker run.
    again = Trackers(cfg, run, notes.append, make=lambda name, c, r: _Fake(name, calls))
    state.rows += [_row(7)]
    again.log(state)
    again.finish({"strategy": "ddp", "world_size": 2, "mesh": {"dp_replicate": 2}, "predicted": {"step_s": 0.2},
                  "measured": {"peak_memory_bytes_per_rank": [10, 30]}})
    assert notes == []
    assert [c for c in calls if c[0] == "start"] == [("start", None), ("start", "tensorboard-id")]
    steps = [(c[1], sorted(c[2])) for c in calls if c[0] == "metrics"]
    assert [s for s, _ in steps if "loss" in _] == [1, 2, 3, 4, 5, 6, 7]
    assert [s for s, keys in steps if "val_loss" in keys] == [0, 6]
    restarts = {c[1]: c[2]["restarts"] for c in calls if c[0] == "metrics" and "restarts" in c[2]}
    assert restarts == {1: 0, 2: 0, 3: 0, 4: 0, 5: 0, 6: 1, 7: 1}
    assert next(c[2] for c in calls if c[0] == "metrics" and "peak_memory_bytes" in c[2]) == {"peak_memory_bytes": 30}
    params = [c[1] for c in calls if c[0] == "params"]
    assert params[0]["train.max_steps"] == "300" and params[-1]["plan.strategy"] == "ddp"
    assert params[-1]["plan.mesh.dp_replicate"] == "2" and params[-1]["plan.predicted.step_s"] == "0.2"
    assert json.loads((tmp_path / STATE).read_text())["runs"] == {"tensorboard": "tensorboard-id"}
    (tmp_path / STATE).write_text("{torn")
    Trackers(cfg, run, notes.append, make=lambda name, c, r: _Fake(name, calls)).close()
    assert notes == [f"monitor.trackers: {tmp_path / STATE} is unreadable; the trackers start new runs"]
    assert [c for c in calls if c[0] == "start"][-1] == ("start", None)


def test_an_moe_run_logs_each_layers_imbalance_and_the_most_of_them(tmp_path):
    cfg = load_config(None, ["monitor.trackers=[tensorboard]", "name=moe"])
    calls: list = []
    trackers = Trackers(cfg, RunDir(tmp_path), [].append, make=lambda name, c, r: _Fake(name, calls))
    state = RunState()
    state.rows = [{**_row(1), "memory_bytes": 123, "expert_tokens": [[3, 1], [2, 2]], "expert_imbalance": [1.5, 1.0]},
                  {**_row(2), "memory_bytes": 125, "expert_imbalance": [float("nan"), 1.25]}]
    trackers.log(state)
    trackers.close()
    logged = {c[1]: c[2] for c in calls if c[0] == "metrics"}
    assert {k: v for k, v in logged[1].items() if k.startswith("expert") or k == "memory_bytes"} == {
        "memory_bytes": 123, "expert_imbalance/layer_0": 1.5, "expert_imbalance/layer_1": 1.0,
        "expert_imbalance/max": 1.5}
    assert logged[2]["expert_imbalance/max"] == 1.25 and "expert_imbalance/layer_0" not in logged[2]
    assert not any("expert_tokens" in k for values in logged.values() for k in values)


def test_a_failing_tracker_is_one_note_the_others_go_on_and_the_loop_never_waits(tmp_path):
    cfg = load_config(None, ["monitor.trackers=[mlflow,tensorboard]"])
    calls: list = []
    notes: list[str] = []
    make = {"mlflow": lambda: _Fake("mlflow", [], fails=True, slow_s=0.2),
            "tensorboard": lambda: _Fake("tensorboard", calls, slow_s=0.02)}
    trackers = Trackers(cfg, RunDir(tmp_path), notes.append, make=lambda name, c, r: make[name]())
    state = RunState()
    t0 = time.perf_counter()
    for step in range(1, 11):
        state.rows.append(_row(step))
        trackers.log(state)
    handing_over_s = time.perf_counter() - t0
    trackers.close()
    assert handing_over_s < 0.05  # the trackers' 0.2 s and 0.02 s calls ran on their own thread
    assert notes == ["monitor.trackers: mlflow failed (ConnectionError: connection refused); "
                     "the run goes on without it"]
    assert [c[1] for c in calls if c[0] == "metrics"] == list(range(1, 11))


# --- the real trackers --------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real MLflow tracking server on 127.0.0.1 with a sqlite backend; yields its URI."""
    pytest.importorskip("mlflow")
    d = tmp_path_factory.mktemp("mlflow")
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{d / 'mlflow.db'}",
         "--default-artifact-root", str(d / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1"], stdout=open(d / "server.log", "w"), stderr=subprocess.STDOUT)
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300  # a loaded machine takes minutes
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert server.poll() is None, (d / "server.log").read_text()
            time.sleep(0.5)
    else:
        server.kill()
        pytest.fail(f"mlflow server did not start: {(d / 'server.log').read_text()[-2000:]}")
    yield uri
    server.terminate()
    server.wait(30)


def _wandb_records(path: Path) -> list:
    """Every record of a W&B offline run's `.wandb` file (a LevelDB-style log: a 7-byte
    header, then 32 KiB blocks of records with 7-byte headers)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pos, chunk = [], 7, b""
    while pos + 7 <= len(data):
        left_in_block = 32768 - pos % 32768
        if left_in_block < 7:
            pos += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left_in_block  # the rest of the block is padding
            continue
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b""
    return records


def _wandb_history(run_dir: Path) -> tuple[set[str], list[tuple[int, dict]]]:
    """The run ids and the history of the offline runs under `run_dir`, oldest first (offline,
    a resumed run writes a directory of its own under the same id; `wandb sync` joins them)."""
    files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    out = []
    for record in (r for path in files for r in _wandb_records(path)):
        if record.WhichOneof("record_type") == "history":
            items = {i.key or ".".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            out.append((record.history.step.num, items))
    return {path.stem for path in files}, out


@pytest.mark.slow
def test_the_real_trackers_hold_each_step_once_across_a_restarted_driver(tmp_path, mlflow_server, monkeypatch):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(None, ["monitor.trackers=[tensorboard,mlflow,wandb]", "name=trackers-unit"])
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    notes: list[str] = []
    state = RunState()
    state.val.append((0, 5.5))
    first = Trackers(cfg, run, notes.append)
    state.rows = [_row(s) for s in (1, 2, 3, 4)]
    first.log(state)
    first.close()  # the driver stops here; another one goes on from the run directory
    second = Trackers(cfg, run, notes.append)
    state.rows = state.rows[:2] + [_row(3), _row(4), _row(5), _row(6, val=4.0)]  # from the checkpoint of step 2
    second.log(state)
    for name in ("plan.json", "summary.json", "report.html", "loss.svg"):
        run.write_text(name, "{}")
    second.finish({"strategy": "ddp", "world_size": 2, "mesh": {"dp_replicate": 2}, "predicted": {"step_s": 0.2},
                   "measured": {"peak_memory_bytes_per_rank": [10, 30]}})
    assert notes == []

    client = MlflowClient(mlflow_server)
    (mlrun,) = client.search_runs([client.get_experiment_by_name("trackers-unit").experiment_id])
    assert mlrun.info.run_id == json.loads((run.path / STATE).read_text())["runs"]["mlflow"]
    assert mlrun.info.status == "FINISHED"
    assert [(m.step, m.value) for m in client.get_metric_history(mlrun.info.run_id, "loss")] == [
        (s, 10.0 - s) for s in range(1, 7)]
    assert [m.step for m in client.get_metric_history(mlrun.info.run_id, "val_loss")] == [0, 6]
    assert mlrun.data.params["train.max_steps"] == "300" and mlrun.data.params["plan.strategy"] == "ddp"
    assert sorted(a.path for a in client.list_artifacts(mlrun.info.run_id)) == [
        "loss.svg", "plan.json", "report.html", "summary.json"]

    events = EventAccumulator(str(run.path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(s, 10.0 - s) for s in range(1, 7)]

    ids, history = _wandb_history(run.path)
    assert ids == {f"run-{json.loads((run.path / STATE).read_text())['runs']['wandb']}"}
    assert [(step, items["loss"]) for step, items in history if "loss" in items] == [
        (s, 10.0 - s) for s in range(1, 7)]


@pytest.mark.slow
def test_an_unreachable_mlflow_server_is_one_note_and_the_other_trackers_go_on(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{_free_port()}")  # nothing listens there
    for key in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.delenv(key, raising=False)
    cfg = load_config(None, ["monitor.trackers=[mlflow,tensorboard]"])
    notes: list[str] = []
    run = RunDir(tmp_path)
    trackers = Trackers(cfg, run, notes.append)
    state = RunState()
    t0 = time.perf_counter()
    for step in range(1, 6):
        state.rows.append(_row(step))
        trackers.log(state)
    assert time.perf_counter() - t0 < 0.1
    trackers.finish({"strategy": "ddp", "measured": {}})
    assert len(notes) == 1 and notes[0].startswith("monitor.trackers: mlflow failed (") and "goes on" in notes[0]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3, 4, 5]


@pytest.mark.slow
@pytest.mark.ray
def test_a_run_is_logged_to_every_tracker_from_the_driver(tmp_path, mlflow_server, monkeypatch):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from orchestrator.cli import main

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    runs = tmp_path / "runs"
    assert main(["submit", str(ROOT / "jobs" / "llm.yaml"), "name=tracked",
                 "monitor.trackers=[tensorboard,mlflow,wandb]", "model.n_layer=1", "model.n_head=2",
                 "model.n_embd=32", "model.block_size=32",
                 "train.max_steps=4", "train.global_batch_size=4", "train.warmup_steps=1", "train.eval_iters=1",
                 "train.eval_interval=2", "parallel.strategy=ddp", "cluster.num_workers=2",
                 "monitor.progress=false", "monitor.dashboard=false", f"monitor.runs_dir={runs}"]) == 0
    (run,) = runs.glob("tracked-*")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [(r["step"], r["loss"]) for r in rows]
    summary = json.loads((run / "summary.json").read_text())

    client = MlflowClient(mlflow_server)
    (mlrun,) = client.search_runs([client.get_experiment_by_name("tracked").experiment_id])
    assert mlrun.info.run_name == run.name and mlrun.info.status == "FINISHED"
    history = client.get_metric_history(mlrun.info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == losses
    memory = [(r["step"], r["memory_bytes"]) for r in rows]
    assert all(isinstance(b, int) and b > 50 * 2**20 for _, b in memory), memory  # rank 0's resident set
    assert [(m.step, m.value) for m in client.get_metric_history(mlrun.info.run_id, "memory_bytes")] == memory
    assert [m.step for m in client.get_metric_history(mlrun.info.run_id, "val_loss")] == [0, 2, 4]
    assert mlrun.data.params["plan.strategy"] == summary["strategy"] == "ddp"
    assert mlrun.data.params["model.n_embd"] == "32"
    assert sorted(a.path for a in client.list_artifacts(mlrun.info.run_id)) == [
        "loss.svg", "plan.json", "report.html", "summary.json"]

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [(e.step, pytest.approx(e.value)) for e in events.Scalars("loss")] == losses
    _, wandb_history = _wandb_history(run)
    assert [(s, items["loss"]) for s, items in wandb_history if "loss" in items] == losses
