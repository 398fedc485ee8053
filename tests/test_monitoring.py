"""Monitoring without a cluster: the shipped Grafana dashboard's queries and its installation,
the Ray dashboard's token hint, the one line for a Prometheus or Grafana that is not there, and
where a Jobs API run's directory is named before it starts. (Against a real Prometheus:
test_prometheus_dashboard.py.)"""

from __future__ import annotations

import http.server
import json
import re
import socket
import threading
from pathlib import Path

import pytest

from orchestrator.connect.remote import head_run_dir
from orchestrator.record import grafana, monitoring
from orchestrator.record.rundir import RunDir
from orchestrator.runtime.metrics import JOB_TAG, METRICS, TAG_KEYS

ROOT = Path(__file__).resolve().parent.parent


def _targets():
    for panel in grafana.dashboard()["panels"]:
        for t in panel["targets"]:
            yield panel["title"], t


def test_the_shipped_dashboard_file_is_the_one_installed():
    shipped = (ROOT / "deploy" / "grafana" / "orchestrator-dashboard.json").read_text()
    assert shipped == grafana.dashboard_json(), \
        "regenerate it: python -m orchestrator.record.grafana > deploy/grafana/orchestrator-dashboard.json"


def test_every_query_selects_the_job_by_a_label_that_survives_scraping():
    # Prometheus renames a scraped `job` label to `exported_job`: no query may rely on it.
    assert JOB_TAG == "job_name" and "job" not in TAG_KEYS
    for title, t in _targets():
        assert 'job_name=~"$job_name"' in t["expr"], title
        assert not re.search(r"[{,]\s*job\s*=", t["expr"]), title


def test_a_legend_that_names_a_label_keeps_that_label():
    for title, t in _targets():
        for label in re.findall(r"\{\{(\w+)\}\}", t["legendFormat"]):
            assert re.search(rf"by \((le, )?{label}\)", t["expr"]), f"{title}: legend names {label}, no `by ({label})`"


def test_every_exported_metric_has_a_panel_or_a_reason():
    queried = " ".join(t["expr"] for _, t in _targets())
    unshown = {m.name for m in METRICS if f"ray_{m.name}" not in queried}
    # The step counter is what the dashboard's variables list jobs and nodes by.
    assert unshown <= {"orchestrator_step", "orchestrator_steps_total"}, unshown
    variables = {v["name"]: v for v in grafana.dashboard()["templating"]["list"]}
    assert set(variables) == {"datasource", "job_name", "node"}
    assert "ray_orchestrator_step" in variables["node"]["query"]["query"]


def test_install_writes_where_ray_provisions_and_nowhere_else(tmp_path, monkeypatch):
    monkeypatch.delenv(grafana.DASHBOARDS_DIR_ENV, raising=False)
    assert grafana.install(tmp_path) is None  # Ray's dashboard made no folder: not ours to make
    folder = tmp_path / "metrics" / "grafana" / "dashboards"
    folder.mkdir(parents=True)
    path = grafana.install(tmp_path)
    assert path == folder / grafana.FILE_NAME
    assert json.loads(path.read_text())["uid"] == grafana.UID
    elsewhere = tmp_path / "custom"
    elsewhere.mkdir()
    monkeypatch.setenv(grafana.DASHBOARDS_DIR_ENV, str(elsewhere))
    assert grafana.install(tmp_path) == elsewhere / grafana.FILE_NAME


@pytest.mark.parametrize("env, where", [
    ({}, "~/.ray/auth_token"),
    ({"RAY_AUTH_TOKEN_PATH": "/etc/ray/token"}, "/etc/ray/token"),
    ({"RAY_AUTH_TOKEN": "s3cr3t-value"}, "$RAY_AUTH_TOKEN"),
])
def test_the_token_hint_says_where_the_token_is_never_what(env, where):
    hint = monitoring.token_hint(env)
    assert "`ray get-auth-token`" in hint and where in hint
    assert "s3cr3t-value" not in hint


def test_the_dashboard_line_adds_the_hint_only_under_token_auth():
    assert monitoring.dashboard_line("127.0.0.1:8265", auth=False) == "Ray dashboard: http://127.0.0.1:8265"
    assert "ray get-auth-token" in monitoring.dashboard_line("127.0.0.1:8265", auth=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def fake_prometheus():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            ok = self.path.startswith("/api/v1/query")
            self.send_response(200 if ok else 404)
            self.end_headers()
            self.wfile.write(b'{"status":"success","data":{"resultType":"vector","result":[]}}' if ok else b"")

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_missing_prometheus_and_grafana_are_one_line_with_how_to_start_them(monkeypatch, tmp_path):
    monkeypatch.setenv("RAY_PROMETHEUS_HOST", f"http://127.0.0.1:{_free_port()}")
    monkeypatch.setenv("RAY_GRAFANA_HOST", f"http://127.0.0.1:{_free_port()}")
    line = monitoring.missing_backends_line(str(tmp_path))
    assert "\n" not in line
    assert "no Prometheus at http://127.0.0.1:" in line and "`ray metrics launch-prometheus`" in line
    assert "no Grafana at http://127.0.0.1:" in line and str(tmp_path / "metrics/grafana/grafana.ini") in line


def test_a_prometheus_that_answers_is_not_mentioned(monkeypatch, fake_prometheus):
    monkeypatch.setenv("RAY_PROMETHEUS_HOST", fake_prometheus)
    monkeypatch.setenv("RAY_GRAFANA_HOST", "DISABLED")  # Ray's own way to turn the Metrics tab off
    assert monitoring.missing_backends_line(None) is None
    monkeypatch.setenv("RAY_GRAFANA_HOST", f"http://127.0.0.1:{_free_port()}")
    line = monitoring.missing_backends_line(None)
    assert "Prometheus" not in line and "no Grafana" in line


def test_a_jobs_api_run_is_named_by_its_submission_id(tmp_path):
    assert head_run_dir("runs", "llm-20261205-101500-3f2a") == "~/runs/llm-20261205-101500-3f2a"
    assert head_run_dir("/data/runs/", "x") == "/data/runs/x"
    first = RunDir.create(tmp_path, "llm", exact="llm-20261205-101500-3f2a")
    assert first.path.name == "llm-20261205-101500-3f2a"
    again = RunDir.create(tmp_path, "llm", exact="llm-20261205-101500-3f2a")
    assert again.path.name == "llm-20261205-101500-3f2a-1"  # the first is never reused


class _Recorded:
    """A stand-in for a Ray metric that keeps every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float]] = []

    def set(self, value, tags):
        self.calls.append(("set", value))

    def observe(self, value, tags):
        self.calls.append(("observe", value))

    def inc(self, value, tags):
        self.calls.append(("inc", value))


def test_a_step_only_hands_its_values_over_and_the_export_sets_them_all(monkeypatch):
    """The training loop pays a list append per step; the exporter (here called directly) puts
    every step time in the histogram, counts every step and sets each gauge to its last value."""
    from orchestrator.runtime import metrics

    fakes: dict[str, _Recorded] = {}
    monkeypatch.setattr(metrics, "_metric", lambda spec, keys: fakes.setdefault(spec.name, _Recorded()))
    monkeypatch.setattr(metrics, "_start_exporter", lambda: None)
    monkeypatch.setattr(metrics, "_live", [])
    monkeypatch.setattr(metrics, "_gauges", {})
    m = metrics.TrainMetrics("job", 0, node="n")
    for step, loss, val in ((1, 3.0, None), (2, 2.5, 2.7), (3, 2.0, None)):
        m.record_step({"step": step, "loss": loss, "val_loss": val, "step_s": 0.1 * step, "memory_bytes": 7})
    assert all(not f.calls for f in fakes.values()), "a step exported before the exporter ran"
    m.flush()
    assert fakes["orchestrator_step_time_seconds"].calls == [("observe", 0.1), ("observe", 0.2),
                                                             ("observe", pytest.approx(0.3))]
    assert fakes["orchestrator_steps_total"].calls == [("inc", 3.0)]
    assert fakes["orchestrator_loss"].calls == [("set", 2.0)]
    assert fakes["orchestrator_val_loss"].calls == [("set", 2.7)]  # the last evaluation, not a later None
    assert fakes["orchestrator_step"].calls == [("set", 3.0)]
    m.flush()  # nothing new: nothing exported again
    assert fakes["orchestrator_steps_total"].calls == [("inc", 3.0)]


class _Sink:
    """Stands in for the driver's sink actor: records each batch `put_many.remote` sends."""

    def __init__(self) -> None:
        self.batches: list[list[dict]] = []
        self.put_many = self

    def remote(self, items):
        self.batches.append(list(items))


def test_the_outbox_sends_steps_together_urgent_items_at_once_and_keeps_their_order(monkeypatch):
    from orchestrator.runtime import outbox

    now = [100.0]
    monkeypatch.setattr(outbox.time, "monotonic", lambda: now[0])
    sink = _Sink()
    box = outbox.Outbox(sink, interval_s=0.5)
    box.add({"step": 1})
    now[0] += 0.2
    box.add({"step": 2})
    assert sink.batches == []  # the oldest has waited 0.2 s of 0.5
    now[0] += 0.4
    box.add({"step": 3})  # the oldest is 0.6 s old: all three go, in order
    assert sink.batches == [[{"step": 1}, {"step": 2}, {"step": 3}]]
    box.add({"step": 4})
    box.add({"kind": "checkpoint"}, urgent=True)
    assert sink.batches[-1] == [{"step": 4}, {"kind": "checkpoint"}]
    box.flush()  # nothing waiting: nothing sent
    assert len(sink.batches) == 2
    box.add({"step": 5})
    box.flush()
    assert sink.batches[-1] == [{"step": 5}]


def test_an_moe_step_sets_one_imbalance_gauge_per_layer(monkeypatch):
    from orchestrator.runtime import metrics

    sets: list[tuple[str, float, dict]] = []

    class Gauge(_Recorded):
        def __init__(self, name):
            super().__init__()
            self.name = name

        def set(self, value, tags):
            sets.append((self.name, value, dict(tags)))

    fakes: dict[str, Gauge] = {}
    monkeypatch.setattr(metrics, "_metric", lambda spec, keys: fakes.setdefault(spec.name, Gauge(spec.name)))
    monkeypatch.setattr(metrics, "_start_exporter", lambda: None)
    monkeypatch.setattr(metrics, "_live", [])
    monkeypatch.setattr(metrics, "_gauges", {})
    m = metrics.TrainMetrics("job", 3, node="n")
    m.record_step({"step": 1, "loss": 3.0, "memory_bytes": 7, "expert_tokens": [[4, 4], [8, 0]],
                   "expert_imbalance": [1.0, 1.5]})
    m.record_step({"step": 2, "loss": 2.0, "memory_bytes": 7, "expert_tokens": [[6, 2], [4, 4]],
                   "expert_imbalance": [1.5, 1.0]})
    m.flush()
    got = {(t["layer"], t["rank"]): v for name, v, t in sets if name == "orchestrator_expert_imbalance"}
    assert got == {("0", "3"): 1.5, ("1", "3"): 1.0}  # the last step's, per layer
    dense = metrics.TrainMetrics("job", 0, node="n")
    sets.clear()
    dense.record_step({"step": 1, "loss": 3.0, "memory_bytes": 7})
    dense.flush()
    assert not [s for s in sets if s[0] == "orchestrator_expert_imbalance"]


def test_no_two_panels_overlap():
    cells = set()
    for panel in grafana.dashboard()["panels"]:
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24, panel["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"{panel['title']} overlaps another panel"
        cells |= mine
