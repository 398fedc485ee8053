"""What the driver says about watching the run: how to open the Ray dashboard (under Ray's
token authentication), the Grafana dashboard installed beside Ray's own, and one line on how
to start a Prometheus or Grafana that is not there. Nothing here can stop a run: monitoring
that is missing is said once and the run goes on."""

from __future__ import annotations

import os
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from . import grafana

PROMETHEUS_HOST_ENV = "RAY_PROMETHEUS_HOST"
GRAFANA_HOST_ENV = "RAY_GRAFANA_HOST"
DEFAULT_PROMETHEUS = "http://localhost:9090"
DEFAULT_GRAFANA = "http://localhost:3000"
PROBE_TIMEOUT_S = 1.0


def token_auth_on() -> bool:
    """Whether this Ray cluster asks for a token (Ray's token authentication, on by default for
    a cluster `ray.init` starts)."""
    try:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled
    except ImportError:  # a Ray without token authentication
        return False
    return bool(is_token_auth_enabled())


def token_hint(environ: dict[str, str] | None = None) -> str:
    """Where the dashboard's token comes from, never the token itself: Ray reads
    $RAY_AUTH_TOKEN, else the file $RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token."""
    env = os.environ if environ is None else environ
    if env.get("RAY_AUTH_TOKEN"):
        where = "$RAY_AUTH_TOKEN"
    elif env.get("RAY_AUTH_TOKEN_PATH"):
        where = env["RAY_AUTH_TOKEN_PATH"]
    else:
        where = "~/.ray/auth_token"
    return f"it asks for a token: `ray get-auth-token` prints it (from {where})"


def dashboard_line(url: str, auth: bool) -> str:
    url = url if "://" in url else f"http://{url}"
    return f"Ray dashboard: {url}" + (f"  ({token_hint()})" if auth else "")


def _answers(url: str, path: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/{path}", timeout=PROBE_TIMEOUT_S) as r:
            return r.status == 200
    except Exception:  # refused, timed out, not HTTP: not there, as far as charts are concerned
        return False


def missing_backends_line(session_dir: str | None) -> str | None:
    """One line naming the Prometheus and Grafana that do not answer where Ray's dashboard
    looks for them, with how to start each; None when both answer."""
    prometheus = os.environ.get(PROMETHEUS_HOST_ENV, DEFAULT_PROMETHEUS)
    grafana_url = os.environ.get(GRAFANA_HOST_ENV, DEFAULT_GRAFANA)
    missing = []
    if not _answers(prometheus, "api/v1/query?query=vector(1)"):
        missing.append(f"no Prometheus at {prometheus} (start one with `ray metrics launch-prometheus`)")
    if grafana_url != "DISABLED" and not _answers(grafana_url, "api/health"):
        ini = (Path(session_dir) / "metrics" / "grafana" / "grafana.ini") if session_dir else None
        how = (f"`grafana server --config {ini} --homepath /usr/share/grafana`" if ini
               else "Grafana with the head's session_latest/metrics/grafana/grafana.ini")
        missing.append(f"no Grafana at {grafana_url} (start one with {how})")
    if not missing:
        return None
    return "metrics charts: " + "; ".join(missing) + "; the run goes on and its metrics stay on every node's /metrics"


def session_dir() -> str | None:
    """This driver's Ray session directory (on the head for an embedded or Jobs API driver)."""
    try:
        import ray._private.worker as worker

        node = worker._global_node
        return node.get_session_dir_path() if node is not None else None
    except Exception:  # the private API moved: the Grafana install and hint go without it
        return None


def announce(console: Console, dashboard_url: str | None) -> None:
    """The dashboard's address and how to open it, the Grafana dashboard installed where Ray
    provisions its own, and one line for a Prometheus or Grafana that is not there."""
    if not dashboard_url:
        return
    console.print(escape(dashboard_line(dashboard_url, token_auth_on())))
    session = session_dir()
    installed = grafana.install(session) if session else None
    if installed:
        console.print(f"Grafana dashboard: {escape(str(installed))} (in Grafana's Ray folder, uid {grafana.UID})")
    line = missing_backends_line(session)
    if line:
        console.print(f"[yellow]note:[/] {escape(line)}")
