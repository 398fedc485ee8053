"""A real two-node Ray cluster (separate `ray start` processes) driven through the Jobs API.

The head and the workers are each started with `ray start --block` in their own process group
and ports, with fake GPUs and a declared topology, and with token authentication on and their
own token. The GPU nodes join with no temp dir of their own, so they share the head's session
directory, as nodes started on one host do. Nothing here touches another Ray cluster on the
machine, and teardown ends exactly the processes these nodes started.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from ray_nodes import Node, _free_ports, _start_node, _stop_node, _wait

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
TOPOLOGY = ROOT / "tests/fixtures/topology/topo_4gpu_pcie_pxb_pix_nccl667.txt"
GPUS_PER_NODE = 4


@dataclass
class TwoNodeCluster:
    dashboard: str
    gcs: str
    token: str
    home: Path
    """HOME of every node's processes."""
    nodes: list[Node] = field(default_factory=list)
    """The GPU-less head first, then two GPU nodes."""

    def node_ids(self) -> dict[str, int]:
        """Ray node id -> metrics export port, for the alive nodes."""
        import requests

        r = requests.get(f"{self.dashboard}/nodes?view=summary", headers={"authorization": f"Bearer {self.token}"},
                         timeout=10)
        r.raise_for_status()
        out = {}
        for n in r.json()["data"]["summary"]:
            raylet = n.get("raylet", {})
            if raylet.get("state") == "ALIVE":
                out[raylet["nodeId"]] = int(raylet.get("metricsExportPort", 0))
        return out



@pytest.fixture(scope="module")
def cluster():
    token = secrets.token_hex(32)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=token,
        # Export application metrics every second instead of every ten, so a scrape sees them.
        RAY_metrics_report_interval_ms="1000",
        ORCHESTRATOR_TOPOLOGY_FILE=str(TOPOLOGY),
    )
    (gcs_port, dash_port, client_port, head_metrics, h_agent, h_agent_grpc, h_rtenv) = _free_ports(7)
    # Short paths: Ray's unix sockets live under the temp dir and must stay under 108 bytes.
    head_tmp = Path(tempfile.mkdtemp(prefix="orxh-", dir="/tmp"))
    # The drivers' home: a relative monitor.runs_dir of a remote submit lands under it.
    home = Path(tempfile.mkdtemp(prefix="orx-head-home-"))
    env["HOME"] = str(home)
    gpu_args = [f"--num-gpus={GPUS_PER_NODE}", f"--num-cpus={GPUS_PER_NODE}",
                '--resources={"accelerator_type:fake": 1}']
    c = TwoNodeCluster(dashboard=f"http://127.0.0.1:{dash_port}", gcs=f"127.0.0.1:{gcs_port}", token=token, home=home)
    try:
        c.nodes.append(_start_node(
            ["--head", "--node-ip-address=127.0.0.1", f"--port={gcs_port}", "--dashboard-host=127.0.0.1",
             f"--dashboard-port={dash_port}", f"--ray-client-server-port={client_port}",
             f"--dashboard-agent-listen-port={h_agent}", f"--dashboard-agent-grpc-port={h_agent_grpc}",
             f"--runtime-env-agent-port={h_rtenv}", "--num-gpus=0", "--num-cpus=2"],
            env, head_tmp, head_metrics, "head", head=True))
        _wait(lambda: len(c.node_ids()) == 1, 60, "the head node and its dashboard")
        # The head has no GPU, as in every recipe of deploy/: the GPU nodes join it.
        for i in range(2):
            metrics, agent, agent_grpc, rtenv = _free_ports(4)
            c.nodes.append(_start_node(
                [f"--address={c.gcs}", "--node-ip-address=127.0.0.1",
                 f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
                 f"--runtime-env-agent-port={rtenv}", *gpu_args],
                env, head_tmp, metrics, f"worker{i}"))
            # One at a time: two raylets starting at once can overload a small machine's GCS.
            _wait(lambda n=2 + i: len(c.node_ids()) == n, 90, f"GPU node {i} to join")
        yield c
    except BaseException:
        for n in c.nodes:
            sys.stderr.write(f"--- {n.log}\n{n.log.read_text(errors='replace')[-4000:]}\n")
        raise
    finally:
        for n in reversed(c.nodes):
            _stop_node(n)
        shutil.rmtree(head_tmp, ignore_errors=True)
        for log in head_tmp.parent.glob(head_tmp.name + ".*.log"):
            log.unlink()
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
def authed(cluster, monkeypatch):
    """The client side holds the cluster's token the way a user would: RAY_AUTH_TOKEN."""
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN", cluster.token)
    return cluster


def _scrape(port: int) -> str:
    import requests

    return requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text


# A job that stands in for one rank: records a step from an actor pinned to the worker node,
# then stays up until stopped, so the test can scrape the export and stop it.
METRICS_JOB = textwrap.dedent(
    """
    import time, ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    ray.init(address="auto")

    @ray.remote(num_cpus=0)
    class Rank:
        def record(self):
            from orchestrator.runtime.metrics import TrainMetrics
            m = TrainMetrics("metricsjob", rank=1)
            m.record_step({"step": 7, "loss": 2.5, "lr": 1e-3, "step_s": 0.2, "tokens_per_s": 1234.0,
                           "grad_norm": 0.5, "val_loss": None, "mfu": 0.31})
            return ray.get_runtime_context().get_node_id()

    a = Rank.options(scheduling_strategy=NodeAffinitySchedulingStrategy(NODE, soft=False)).remote()
    print("recorded on", ray.get(a.record.remote()), flush=True)
    while True:
        time.sleep(1)
    """
)


def test_unreachable_address_is_one_line_user_error():
    from orchestrator.connect.remote import RemoteError, job_status

    with pytest.raises(RemoteError, match=r"^cannot reach a Ray dashboard at http://127\.0\.0\.1:\d+") as e:
        job_status(f"127.0.0.1:{_free_ports(1)[0]}")
    assert "\n" not in str(e.value)


def test_wrong_or_missing_token_is_refused_with_advice(cluster, monkeypatch):
    from orchestrator.connect.remote import RemoteError, job_status

    home = Path(tempfile.mkdtemp(prefix="orx-home-"))
    try:
        # No token anywhere: RAY_AUTH_TOKEN unset and an empty home without ~/.ray/auth_token.
        monkeypatch.setenv("HOME", str(home))
        monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
        monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
        with pytest.raises(RemoteError, match="requires authentication .*no token is set here.*RAY_AUTH_TOKEN") as e:
            job_status(cluster.dashboard)
        assert "\n" not in str(e.value)
        monkeypatch.setenv("RAY_AUTH_TOKEN", "0" * 64)
        with pytest.raises(RemoteError, match="refused the token"):
            job_status(cluster.dashboard)
        # The token in a file, as `ray get-auth-token` users keep it.
        token_file = home / "token"
        token_file.write_text(cluster.token)
        monkeypatch.delenv("RAY_AUTH_TOKEN")
        monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token_file))
        assert isinstance(job_status(cluster.dashboard), list)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_submit_with_a_wrong_token_is_one_line_within_seconds(cluster):
    home = Path(tempfile.mkdtemp(prefix="orx-home-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_AUTH_TOKEN="0" * 64, HOME=str(home))
    try:
        t0 = time.monotonic()
        p = subprocess.run(
            [sys.executable, "-m", "orchestrator", "submit", "jobs/llm.yaml", "--address", cluster.dashboard],
            capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
        took = time.monotonic() - t0
    finally:
        shutil.rmtree(home, ignore_errors=True)
    lines = [l for l in (p.stdout + p.stderr).splitlines() if l.strip()]
    assert p.returncode == 2 and took < 15 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: Ray cluster at {cluster.dashboard} refused the token")


@pytest.mark.parametrize("mode, token, said", [
    (None, None, "the cluster asks for a token (Ray's token authentication); export RAY_AUTH_MODE=token with"),
    ("token", "0" * 64, "the cluster refused this process's token; set it with"),
])
def test_joining_a_token_cluster_without_its_token_is_one_line_within_seconds(cluster, mode, token, said):
    """`cluster.address` to a cluster that asks for a token (as `ray start --head` makes one by
    default), from a driver that sends none or a wrong one: one line saying what to set, not
    ray.init's 20 s of retries ending in "failed to connect"."""
    home = Path(tempfile.mkdtemp(prefix="orx-home-"))  # no ~/.ray/auth_token of this machine's
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["HOME"] = str(home)
    env.update({"RAY_AUTH_MODE": mode, "RAY_AUTH_TOKEN": token} if mode else {})
    try:
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-m", "orchestrator", "submit", "jobs/llm.yaml",
                            f"cluster.address={cluster.gcs}", f"monitor.runs_dir={home / 'runs'}"],
                           capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
        took = time.monotonic() - t0
        assert not (home / "runs").exists() or not any((home / "runs").iterdir())  # no run directory left behind
    finally:
        shutil.rmtree(home, ignore_errors=True)
    lines = [l for l in (p.stdout + p.stderr).splitlines() if l.strip()]
    assert p.returncode == 2 and took < 15 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: cluster.address={cluster.gcs}: {said}")
    assert "ray get-auth-token" in lines[0]


def test_metrics_exported_with_tags_then_stop_ends_job(authed):
    from orchestrator.connect.remote import client, job_logs, job_status, stop_job

    c = authed
    worker_node = next(n for n, port in c.node_ids().items() if port == c.nodes[1].metrics_port)
    code = METRICS_JOB.replace("NODE", repr(worker_node))
    job_id = client(c.dashboard).submit_job(
        entrypoint=shlex.join([sys.executable, "-c", code]),
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}},
    )
    _wait(lambda: "recorded on" in next(job_logs(c.dashboard, job_id)), 60, "the job to record its metrics")
    assert job_status(c.dashboard, job_id)[0].status == "RUNNING"

    def loss_line() -> str | None:
        for line in _scrape(c.nodes[1].metrics_port).splitlines():
            if line.startswith("ray_orchestrator_loss{") and 'job_name="metricsjob"' in line:
                return line
        return None

    line = _wait(loss_line, 30, "ray_orchestrator_loss on the worker node's metrics endpoint")
    assert 'rank="1"' in line and f'node="{worker_node}"' in line
    assert float(line.rsplit(" ", 1)[1]) == pytest.approx(2.5)
    text = _scrape(c.nodes[1].metrics_port)
    for name in ("ray_orchestrator_tokens_per_second", "ray_orchestrator_mfu", "ray_orchestrator_memory_bytes",
                 "ray_orchestrator_step_time_seconds_bucket", "ray_orchestrator_steps_total"):
        assert re.search(rf'^{name}{{[^}}]*rank="1"', text, re.M), f"{name} missing from the export"
    assert not re.search(r'^ray_orchestrator_val_loss\{[^}]*job_name="metricsjob"', text, re.M), \
        "a None val_loss was exported"

    assert stop_job(c.dashboard, job_id, wait_s=30) == "STOPPED"
    listed = {j.job_id: j.status for j in job_status(c.dashboard)}
    assert listed[job_id] == "STOPPED"


def test_status_and_logs_of_unknown_job(authed):
    from orchestrator.connect.remote import RemoteError, job_logs, job_status, stop_job

    for call in (lambda: job_status(authed.dashboard, "nosuchjob"),
                 lambda: list(job_logs(authed.dashboard, "nosuchjob", follow=True)),
                 lambda: stop_job(authed.dashboard, "nosuchjob")):
        with pytest.raises(RemoteError, match="no job 'nosuchjob' on the Ray cluster at"):
            call()


def test_submit_remote_trains_across_both_nodes(authed, tmp_path, monkeypatch):
    """The whole path: ship the project, run `submit` on the head, train on 2 nodes, follow to the
    end; then submit the unchanged project again."""
    from orchestrator.connect.remote import client, job_logs, job_status, run_directory, submit_remote

    c = authed
    monkeypatch.chdir(ROOT)
    job = ROOT / "jobs" / "llm.yaml"
    overrides = ["name=remote", "model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.block_size=32",
                 "train.max_steps=5", "train.global_batch_size=8", "train.eval_interval=5", "train.eval_iters=1",
                 "checkpoint.enabled=false", "monitor.progress=false", "cluster.gpu=A100", "parallel.tp=2"]
    # monitor.runs_dir left at its default (relative `runs`): it lands in the head's home.
    job_id, _ = submit_remote(c.dashboard, str(job), overrides)
    assert job_id.startswith("remote-")
    scraped: dict[int, str] = {}
    done = threading.Event()

    def scrape_while_running() -> None:
        # Each rank's metrics live on its own node's endpoint while the run lasts.
        while not done.is_set():
            for n in c.nodes:
                try:
                    text = _scrape(n.metrics_port)
                except Exception:  # the agent may restart its exporter; try again
                    continue
                if re.search(r'^ray_orchestrator_loss\{[^}]*job_name="remote"', text, re.M):
                    scraped[n.metrics_port] = text
            done.wait(0.5)

    scraper = threading.Thread(target=scrape_while_running, daemon=True)
    scraper.start()
    try:
        seen = list(job_logs(c.dashboard, job_id, follow=True))
    finally:
        done.set()
        scraper.join(timeout=10)
    info = job_status(c.dashboard, job_id)[0]
    assert info.status == "SUCCEEDED", "".join(seen)[-3000:]
    assert info.name == "remote"
    assert "cluster.address=auto" in info.entrypoint
    assert len(scraped) == 2, f"orchestrator metrics seen on {len(scraped)} of the 2 GPU nodes' endpoints"
    ranks, nodes = set(), set()
    for text in scraped.values():
        for m in re.finditer(r'^ray_orchestrator_loss\{([^}]*)\}', text, re.M):
            tags = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            if tags.get("job_name") == "remote":
                ranks.add(tags["rank"])
                nodes.add(tags["node"])
    head = next(n for n, port in c.node_ids().items() if port == c.nodes[0].metrics_port)
    assert nodes == set(c.node_ids()) - {head}, "every GPU node's ranks are tagged with their node"
    assert ranks and all(r.isdigit() for r in ranks)
    # The run directory is where a user finds it afterwards, and `status` names it.
    run_dir = Path(run_directory(c.dashboard, job_id))
    assert run_dir.parent == c.home / "runs" and (run_dir / "summary.json").is_file()
    # The job's record names the run directory before the run starts (the dashboard's Jobs page).
    metadata = client(c.dashboard).get_job_info(job_id).metadata
    assert metadata["job_name"] == "remote" and run_dir.name == job_id
    assert metadata["run_dir"] == f"~/runs/{job_id}"
    plan = json.loads((run_dir / "plan.json").read_text())
    assert [x["node"] for x in plan["left_out"]] == [head]
    placement = json.loads((run_dir / "placement.json").read_text())
    where = {p["rank"]: (p["node_id"], p["gpu"]) for p in placement}
    for group in plan["groups"]["tp"]:  # TP pairs on the PCIe-switch pairs, as planned
        assert len({where[r][0] for r in group}) == 1 and {where[r][1] for r in group} in ({0, 1}, {2, 3})

    # The same project again, unchanged since: the package is already on the cluster.
    again, _ = submit_remote(c.dashboard, str(job), [*overrides, "train.max_steps=2", "train.eval_interval=2"])
    seen = list(job_logs(c.dashboard, again, follow=True))
    assert job_status(c.dashboard, again)[0].status == "SUCCEEDED", "".join(seen)[-3000:]
    # Each driver ran from its own snapshot of the shipped files and removed it at exit.
    unpacked = c.nodes[0].temp_dir / "session_latest" / "runtime_resources" / "working_dir_files"
    assert list(unpacked.glob("_ray_pkg_*")) and not list(unpacked.glob("*.driver-*"))


def test_a_fake_gpu_cluster_plans_without_naming_its_gpus(authed):
    # The nodes declare a capture that names no GPU model, and nothing sets cluster.gpu: the
    # plan is made with the stated default figures, and the GPU-less head is left out. (Run as
    # a user runs it, in a process of its own: this one's Ray must not join a token cluster.)
    p = subprocess.run([sys.executable, "-m", "orchestrator", "plan", "jobs/llm.yaml", f"cluster.address={authed.gcs}",
                        "--json"], capture_output=True, text=True, cwd=ROOT, timeout=180,
                       env={**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": authed.token})
    assert p.returncode == 0, p.stderr[-2000:]
    plan = json.loads(p.stdout)
    assert plan["world_size"] == 2 * GPUS_PER_NODE and len(plan["left_out"]) == 1
    said = [line for line in plan["explanation"] if "not in the planner's table" in line]
    assert len(said) == 1 and "on 2 nodes" in said[0] and "conservative default figures" in said[0], said


def test_entrypoint_joins_the_cluster_it_runs_on():
    from orchestrator.connect.remote import entrypoint

    cmd = entrypoint("jobs/my job.yaml", ["train.max_steps=10", "cluster.address=10.0.0.1:6379", "name=x"])
    assert shlex.split(cmd) == ["python", "-m", "orchestrator", "submit", "jobs/my job.yaml",
                                "train.max_steps=10", "name=x", "cluster.address=auto"]


def test_shipped_dir_and_job_file_outside_it(tmp_path, monkeypatch):
    from orchestrator.connect.remote import RemoteError, project_root, shipped_dir, submit_remote

    assert project_root() == ROOT
    assert shipped_dir(ROOT / "jobs") == ROOT  # anywhere inside the checkout ships the checkout
    assert shipped_dir(tmp_path) == tmp_path
    job = tmp_path / "job.yaml"
    job.write_text("name: outside\n")
    monkeypatch.chdir(ROOT)
    # Refused before any network call: the address below does not exist.
    with pytest.raises(RemoteError, match=f"job file {re.escape(str(job))} is outside {re.escape(str(ROOT))}"):
        submit_remote("http://127.0.0.1:9", str(job), [])


def test_default_address_and_bad_addresses(monkeypatch):
    from orchestrator.connect.remote import RemoteError, default_address, job_status

    monkeypatch.setenv("RAY_ADDRESS", "http://head:8265")
    assert default_address() == "http://head:8265"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # a GCS address is not a dashboard
    assert default_address() == "http://127.0.0.1:8265"
    with pytest.raises(RemoteError, match="not a Ray GCS or ray:// address"):
        job_status("ray://head:10001")
