"""The shipped Grafana dashboard proved against a real Prometheus: a real `submit` of the default
job on its embedded cluster, scraped by Debian's `prometheus` with the scrape configuration Ray
writes into the session, and every PromQL expression of the dashboard run over the job's time.
A panel whose query returns nothing, or that should split by rank or node and does not, fails.
The same run shows the Ray dashboard naming the job, the token hint, the Grafana dashboard
installed where Ray provisions its own, the one line for a Grafana that is not there, and its
report.html opened in real headless Chromium."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from orchestrator.record import grafana

ROOT = Path(__file__).resolve().parent.parent
RAY_TMP = Path("/tmp/ray")
pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"`{name}` is not installed; .ci/run installs Debian's package")
        pytest.skip(f"needs `{name}` (apt-get install {name})")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _session_of(pid: int) -> Path | None:
    # The session a process started is named after its pid. Not `session_latest`: Ray leaves
    # that link as it is once its target has been deleted.
    found = sorted(RAY_TMP.glob(f"session_*_{pid}"))
    return found[-1] if found else None


def _get_json(url: str, headers: dict[str, str] | None = None) -> dict:
    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read())


def _query_range(prom: str, expr: str, start: float, end: float) -> list[dict]:
    q = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": "1"})
    out = _get_json(f"{prom}/api/v1/query_range?{q}")
    assert out["status"] == "success", (expr, out)
    return out["data"]["result"]


def _grafana_fill(expr: str, job: str) -> str:
    # What Grafana substitutes: the variables as picked (this job, all nodes) and the rate window
    # it derives from the 1 s scrape interval (at least 4 scrapes).
    return expr.replace("$job_name", job).replace("$node", ".*").replace("$__rate_interval", "8s")


@pytest.fixture(scope="module")
def scraped_run(tmp_path_factory):
    """The default job (short), scraped by Prometheus from its first step to its last."""
    prometheus = _tool("prometheus")
    tmp = tmp_path_factory.mktemp("prom")
    (RAY_TMP / "ray_current_cluster").unlink(missing_ok=True)
    prom_port, grafana_port = _free_port(), _free_port()
    env = dict(os.environ,
               # Metrics leave each process every second instead of Ray's 10 s, so a run of
               # seconds has enough samples for rate() over a few scrapes.
               RAY_metrics_report_interval_ms="1000",
               RAY_PROMETHEUS_HOST=f"http://127.0.0.1:{prom_port}",
               RAY_GRAFANA_HOST=f"http://127.0.0.1:{grafana_port}")  # nothing there: the one-line hint
    log = tmp / "submit.log"
    job = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "submit", "jobs/llm.yaml", "train.max_steps=70",
         "train.eval_interval=35", "monitor.progress=false", f"monitor.runs_dir={tmp / 'runs'}"],
        cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    prom = None
    try:
        deadline = time.monotonic() + 120
        while True:  # Ray writes the session's prometheus.yml as its dashboard starts
            session = _session_of(job.pid)
            config = session / "metrics" / "prometheus" / "prometheus.yml" if session else None
            if config is not None and config.is_file():
                break
            assert job.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "no Ray session with a Prometheus configuration appeared"
            time.sleep(0.2)
        ray_config = config.read_text()
        assert "file_sd_configs" in ray_config and "job_name: 'ray'" in ray_config
        # Ray's configuration, scraping every second instead of every 10 s (the run is short).
        (tmp / "prometheus.yml").write_text(ray_config.replace("scrape_interval: 10s", "scrape_interval: 1s"))
        prom = subprocess.Popen(
            [prometheus, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{prom_port}"],
            stdout=open(tmp / "prometheus.log", "w"), stderr=subprocess.STDOUT)
        start = time.time()
        jobs_seen = _jobs_while_running(job, log)
        job.wait(timeout=300)
        end = time.time()
        out = log.read_text()
        assert job.returncode == 0, out[-4000:]
        time.sleep(2)  # the last scrape
        run_dir = Path(re.search(r"^run directory: (\S+)", out, re.M).group(1))
        yield {"prom": f"http://127.0.0.1:{prom_port}", "start": start, "end": end, "out": out,
               "session": session, "run_dir": run_dir, "jobs": jobs_seen}
    finally:
        if job.poll() is None:
            job.kill()
        if prom is not None:
            prom.terminate()
            prom.wait(timeout=30)


def _jobs_while_running(job: subprocess.Popen, log: Path) -> list[dict]:
    """What the dashboard's Jobs API lists while the run goes (the embedded cluster ends with it),
    at the address the console printed, with the token a user would paste."""
    token_file = Path.home() / ".ray" / "auth_token"
    headers = {"Authorization": f"Bearer {token_file.read_text().strip()}"} if token_file.is_file() else {}
    deadline = time.monotonic() + 120
    while job.poll() is None and time.monotonic() < deadline:
        found = re.search(r"^Ray dashboard: (http://\S+)", log.read_text(), re.M)
        if not found:
            time.sleep(0.2)
            continue
        try:
            jobs = _get_json(f"{found.group(1)}/api/jobs/", headers)
        except Exception:
            time.sleep(0.5)
            continue
        if any((j.get("metadata") or {}).get("job_name") for j in jobs):
            return jobs
        time.sleep(0.5)
    return []


def test_every_panel_query_returns_its_series(scraped_run):
    installed = scraped_run["session"] / "metrics" / "grafana" / "dashboards" / grafana.FILE_NAME
    assert installed.is_file(), "the Grafana dashboard was not installed where Ray provisions its own"
    board = json.loads(installed.read_text())
    placement = json.loads((scraped_run["run_dir"] / "placement.json").read_text())
    ranks = {str(p["rank"]) for p in placement}
    nodes = {p["node_id"] for p in placement}
    assert len(ranks) == 2
    empty, unsplit = [], []
    moe_only = {p.title for p in grafana.PANELS if p.moe_only}  # a dense run has no expert series
    for panel in board["panels"]:
        if panel["title"] in moe_only:
            continue
        for target in panel["targets"]:
            expr = _grafana_fill(target["expr"], "llm")
            series = _query_range(scraped_run["prom"], expr, scraped_run["start"], scraped_run["end"])
            if not series:
                empty.append(f"{panel['title']}: {target['expr']}")
                continue
            for label, want in (("rank", ranks), ("node", nodes)):
                if "{{" + label + "}}" in target["legendFormat"]:
                    got = {s["metric"].get(label) for s in series}
                    if got != want:
                        unsplit.append(f"{panel['title']}: {label}s {sorted(map(str, got))}, want {sorted(want)}")
    assert not empty, "panel queries that returned nothing:\n" + "\n".join(empty)
    assert not unsplit, "\n".join(unsplit)


def test_the_variables_list_the_job_and_its_nodes(scraped_run):
    prom, start, end = scraped_run["prom"], scraped_run["start"], scraped_run["end"]
    q = urllib.parse.urlencode({"match[]": "ray_orchestrator_step", "start": start, "end": end})
    names = _get_json(f"{prom}/api/v1/label/job_name/values?{q}")["data"]
    assert "llm" in names
    nodes = _get_json(f"{prom}/api/v1/label/node/values?{q}")["data"]
    placement = json.loads((scraped_run["run_dir"] / "placement.json").read_text())
    assert {p["node_id"] for p in placement} <= set(nodes)


def test_memory_against_the_plan_reads_the_plans_figure(scraped_run):
    plan = json.loads((scraped_run["run_dir"] / "plan.json").read_text())
    series = _query_range(scraped_run["prom"], 'ray_orchestrator_memory_planned_bytes{job_name="llm"}',
                          scraped_run["start"], scraped_run["end"])
    values = {float(v) for s in series for _, v in s["values"]}
    assert values == {float(plan["memory_per_rank"]["total"])}
    # Kept alive between steps: set once, it is still there in the run's last seconds.
    last = max(t for s in series for t, _ in s["values"])
    assert last >= scraped_run["end"] - 10


def test_the_console_says_how_to_open_the_dashboard_and_what_is_missing(scraped_run):
    out = scraped_run["out"]
    line = next(l for l in out.splitlines() if l.startswith("Ray dashboard: http://"))
    assert "`ray get-auth-token`" in line
    token = (Path.home() / ".ray" / "auth_token")
    if token.is_file():
        assert token.read_text().strip() not in out, "the token itself was printed"
    assert f"Grafana dashboard: {scraped_run['session']}" in out
    hints = [l for l in out.splitlines() if "metrics charts:" in l]
    assert len(hints) == 1 and "no Grafana at http://127.0.0.1:" in hints[0] and "no Prometheus" not in hints[0]
    assert "grafana.ini" in hints[0]


def test_the_jobs_page_names_the_run(scraped_run):
    named = [j for j in scraped_run["jobs"] if (j.get("metadata") or {}).get("job_name") == "llm"]
    assert named, f"no job named llm on the dashboard's Jobs API: {scraped_run['jobs']}"
    assert named[0]["metadata"]["run_dir"] == str(scraped_run["run_dir"])



def test_the_runs_report_opens_cleanly_in_chromium(scraped_run, tmp_path):
    from test_report import RANK_TIMES, REPORT, _said, check_in_chromium

    run = scraped_run["run_dir"]
    assert (run / RANK_TIMES).is_file()
    sections = check_in_chromium(run / REPORT, tmp_path / "report.png")
    assert "finished" in sections["run"] and not _said(sections["ranks"])
