"""A wrong cluster address is one line within seconds, exit code 2, and no Ray log lines: a
closed GCS port, a port that is not a GCS, `auto` finding a stale address or nothing, a closed
dashboard port, a URL that is not a Ray dashboard. (A wrong token: tests/test_remote.py.)"""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from orchestrator.connect.reach import ClusterUnreachable, resolve_auto

ROOT = Path(__file__).resolve().parent.parent
JOB = str(ROOT / "jobs" / "llm.yaml")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def http_port():
    """A plain HTTP server on loopback: it answers, but it is neither a GCS nor a dashboard."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def _submit(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, float]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "orchestrator", "submit", JOB, *args], capture_output=True, text=True,
                       cwd=ROOT, env={**base, **(env or {})}, timeout=60)
    return p.returncode, p.stdout + p.stderr, time.monotonic() - t0


def _one_line(out: str) -> str:
    lines = [l for l in out.splitlines() if l.strip()]
    assert len(lines) == 1, out  # no Ray warning (rpc_client.h, gcs_client.cc), no traceback
    assert lines[0].startswith("error: ")
    return lines[0]


@pytest.mark.slow
def test_closed_gcs_port(tmp_path):
    port = _closed_port()
    code, out, took = _submit(f"cluster.address=127.0.0.1:{port}", f"monitor.runs_dir={tmp_path}")
    line = _one_line(out)
    assert code == 2 and took < 15
    assert f"cluster.address=127.0.0.1:{port}: nothing listens there (connection refused)" in line
    assert "6379" in line
    assert not any(tmp_path.iterdir())  # no empty run directory left behind


@pytest.mark.slow
def test_port_that_is_not_a_gcs(http_port):
    code, out, took = _submit(f"cluster.address=127.0.0.1:{http_port}")
    line = _one_line(out)
    assert code == 2 and took < 15
    assert "does not answer as a Ray GCS" in line and f"127.0.0.1:{http_port}" in line


@pytest.mark.slow
def test_auto_with_a_stale_address_file(tmp_path):
    port = _closed_port()
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{port}\n")
    code, out, took = _submit("cluster.address=auto", env={"RAY_TMPDIR": str(tmp_path)})
    line = _one_line(out)
    assert code == 2 and took < 15
    assert f"cluster.address=auto: 127.0.0.1:{port} (from {tmp_path}/ray/ray_current_cluster)" in line
    assert "ray start --head" in line


@pytest.mark.slow
def test_auto_with_ray_address_set_names_it():
    port = _closed_port()
    code, out, _ = _submit("cluster.address=auto", env={"RAY_ADDRESS": f"127.0.0.1:{port}"})
    assert code == 2 and f"127.0.0.1:{port} (from RAY_ADDRESS)" in _one_line(out)


def test_auto_with_nothing_running_says_what_was_looked_at(tmp_path, monkeypatch):
    import ray._private.services as services

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.setattr(services, "find_gcs_addresses", lambda: [])  # other people's clusters run here
    with pytest.raises(ClusterUnreachable, match="no Ray cluster to join .*RAY_ADDRESS is unset.*ray_current_cluster"):
        resolve_auto()
    monkeypatch.setattr(services, "find_gcs_addresses", lambda: ["10.0.0.1:6379", "10.0.0.2:6379"])
    with pytest.raises(ClusterUnreachable, match="2 Ray clusters run on this machine"):
        resolve_auto()


def test_closed_dashboard_port():
    port = _closed_port()
    code, out, took = _submit("--address", f"http://127.0.0.1:{port}")
    line = _one_line(out)
    assert code == 2 and took < 15
    assert f"cannot reach a Ray dashboard at http://127.0.0.1:{port} (connection refused)" in line


def test_url_that_is_not_a_ray_dashboard(http_port):
    code, out, took = _submit("--address", f"http://127.0.0.1:{http_port}")
    line = _one_line(out)
    assert code == 2 and took < 15
    assert f"http://127.0.0.1:{http_port} answers HTTP but is not a Ray dashboard" in line
