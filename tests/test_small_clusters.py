"""Small clusters as people start them: a head with few CPUs or none to spare, nodes with uneven
CPU counts, GPUs that exist only as Ray resources. Each offers the workers it can hold, and
what can never be held is said in one line within seconds, not after the placement timeout."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from ray_nodes import ROOT, _free_ports, _start_node, _stop_node, _wait

from orchestrator.connect.remote import RUN_DIR_LINE
from orchestrator.control.placement import NODE_ID_LABEL, never_fits
from orchestrator.topology.cluster_probe import HOLDS_NO_WORKER, RAY_GPUS_UNSEEN, _count_cpu_slots, cpu_slots
from orchestrator.topology.model import cpu_node


@pytest.mark.parametrize("cpus, per_worker, cap, slots", [
    (1, 1.0, 2, 1),  # a 1-CPU head: one worker, not cluster.num_workers of them
    (2, 1.0, 2, 2),
    (16, 1.0, 2, 2),  # capped by cluster.num_workers
    (16, 1.0, 0, 16),  # no cap: every CPU
    (3, 1.5, 0, 2),  # 3 / 1.5 is two workers, however the division rounds
    (1, 2.0, 2, 0),  # fewer CPUs than one worker needs
    (0, 1.0, 2, 0),  # a head started with --num-cpus=0
])
def test_a_node_offers_the_cpu_workers_its_cpus_hold(cpus, per_worker, cap, slots):
    assert cpu_slots(cpus, per_worker, cap) == slots


def test_a_node_that_holds_no_worker_keeps_no_device_and_says_why():
    node = cpu_node(1, hostname="head")
    _count_cpu_slots(node, node_cpus=1, cpus_per_worker=2.0, num_workers=2)
    assert node.devices == [] and node.links == []
    assert node.warnings == [f"its 1 CPU(s) {HOLDS_NO_WORKER}=2"]


def test_gpus_that_exist_only_as_ray_resources_are_named_and_the_node_runs_cpu_workers():
    node = cpu_node(2, hostname="gpu-box")
    node.ray_gpus = 2
    _count_cpu_slots(node, node_cpus=2, cpus_per_worker=1.0, num_workers=2)
    assert len(node.devices) == 2 and {d.kind for d in node.devices} == {"cpu"}
    assert node.warnings == [f"Ray offers 2 GPU(s) on this node {RAY_GPUS_UNSEEN}"]


NODES = [{"NodeID": "a" * 56, "Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": {"CPU": 1.0}},
         {"NodeID": "b" * 56, "Alive": True, "NodeManagerAddress": "10.0.0.2", "Resources": {"CPU": 2.0, "GPU": 2.0}},
         {"NodeID": "c" * 56, "Alive": False, "Resources": {"CPU": 8.0}}]


def test_a_group_no_wait_can_place_is_named_by_node_resource_need_and_total():
    two_on_head = [{"CPU": 1.0}, {"CPU": 1.0}]
    pinned = [{NODE_ID_LABEL: "a" * 56}] * 2
    assert never_fits(two_on_head, pinned, NODES) == (
        "node aaaaaaaaaaaa (10.0.0.1) needs CPU 2 for its workers and has 1 in total")
    assert never_fits([{"CPU": 1.0, "GPU": 1.0}] * 3, [{NODE_ID_LABEL: "b" * 56}] * 3, NODES) == (
        "node bbbbbbbbbbbb (10.0.0.2) needs CPU 3 for its workers and has 2 in total")
    assert never_fits([{"CPU": 1.0}], [{NODE_ID_LABEL: "c" * 56}], NODES) == "node cccccccccccc is not alive"
    assert never_fits([{"CPU": 4.0}], None, NODES) == "no node of the cluster holds one worker's CPU 4 in total"


def test_a_group_that_fits_once_other_work_frees_it_is_left_to_wait():
    # What is free now does not matter: the totals hold the group, so it waits as before.
    assert never_fits([{"CPU": 1.0}], [{NODE_ID_LABEL: "a" * 56}], NODES) is None
    assert never_fits([{"CPU": 1.0, "GPU": 1.0}] * 2, [{NODE_ID_LABEL: "b" * 56}] * 2, NODES) is None
    assert never_fits([{"CPU": 2.0}], None, NODES) is None


# --- real `ray start` clusters --------------------------------------------------------------

SHAPES = {
    # The shape a new user starts with: a GPU-less 1-CPU head and a node that told Ray about 2
    # GPUs it has no driver for.
    "head1_gpus_without_cuda": [["--num-cpus=1", "--num-gpus=0"], ["--num-cpus=2", "--num-gpus=2"]],
    # Uneven CPU counts, and a head started with none to spare.
    "head0_uneven": [["--num-cpus=0", "--num-gpus=0"], ["--num-cpus=3"], ["--num-cpus=1"]],
}


class SmallCluster:
    def __init__(self, shape: list[list[str]]) -> None:
        self.token = secrets.token_hex(32)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        self.env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.token)
        self.tmp = Path(tempfile.mkdtemp(prefix="orxs-", dir="/tmp"))
        self.home = Path(tempfile.mkdtemp(prefix="orxs-home-"))
        self.env["HOME"] = str(self.home)
        self.nodes = []
        gcs, dash, client, metrics, agent, agent_grpc, rtenv = _free_ports(7)
        self.gcs = f"127.0.0.1:{gcs}"
        head, *others = shape
        self.nodes.append(_start_node(
            ["--head", "--node-ip-address=127.0.0.1", f"--port={gcs}", "--include-dashboard=false",
             f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}",
             f"--dashboard-agent-grpc-port={agent_grpc}", f"--runtime-env-agent-port={rtenv}", *head],
            self.env, self.tmp, metrics, "head", head=True))
        self._wait_nodes(1)
        for i, args in enumerate(others):
            metrics, agent, agent_grpc, rtenv = _free_ports(4)
            self.nodes.append(_start_node(
                [f"--address={self.gcs}", "--node-ip-address=127.0.0.1", f"--dashboard-agent-listen-port={agent}",
                 f"--dashboard-agent-grpc-port={agent_grpc}", f"--runtime-env-agent-port={rtenv}", *args],
                self.env, self.tmp, metrics, f"node{i}"))
            self._wait_nodes(2 + i)

    def _wait_nodes(self, n: int) -> None:
        probe = ("import ray; ray.init(address='%s', logging_level='ERROR');"
                 "print(sum(1 for x in ray.nodes() if x['Alive']))" % self.gcs)
        _wait(lambda: subprocess.run([sys.executable, "-c", probe], env=self.env, capture_output=True, text=True,
                                     timeout=60).stdout.strip().endswith(str(n)), 90, f"{n} node(s) to join")

    def orchestrator(self, *args: str, timeout: float = 180) -> tuple[subprocess.CompletedProcess, float]:
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-m", "orchestrator", *args, f"cluster.address={self.gcs}"],
                           capture_output=True, text=True, cwd=ROOT, env=self.env, timeout=timeout)
        return p, time.monotonic() - t0

    def close(self) -> None:
        for n in reversed(self.nodes):
            _stop_node(n)
        shutil.rmtree(self.tmp, ignore_errors=True)
        for log in self.tmp.parent.glob(self.tmp.name + ".*.log"):
            log.unlink()
        shutil.rmtree(self.home, ignore_errors=True)


@pytest.fixture(scope="module", params=sorted(SHAPES))
def small(request):
    c = SmallCluster(SHAPES[request.param])
    c.shape = request.param
    try:
        yield c
    except BaseException:
        for n in c.nodes:
            sys.stderr.write(f"--- {n.log}\n{n.log.read_text(errors='replace')[-4000:]}\n")
        raise
    finally:
        c.close()


def _plan(small: SmallCluster, *overrides: str) -> tuple[dict, str]:
    p, _ = small.orchestrator("plan", "jobs/llm.yaml", "--json", *overrides)
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(p.stdout), p.stderr


@pytest.mark.ray
@pytest.mark.slow
def test_a_small_clusters_plan_counts_the_workers_its_nodes_hold(small):
    plan, said = _plan(small)
    per_node: dict[str, int] = {}
    for r in plan["ranks"]:
        per_node[r["node"]] = per_node.get(r["node"], 0) + 1
    # Every node of a plan runs as many ranks: the nodes hold 1 and 2 workers, so the plan runs
    # two on the node that holds two, as `submit` will, and says why.
    assert list(per_node.values()) == [2] and plan["world_size"] == 2, plan["ranks"]
    assert "note: 2 of 3 devices used" in said
    if small.shape == "head1_gpus_without_cuda":
        # The head's 1 CPU holds one worker; the node's 2 CPUs two, its Ray GPUs none.
        assert f"topology warning: Ray offers 2 GPU(s) on this node {RAY_GPUS_UNSEEN}" in said
    else:
        # The CPU-less head holds none; the 3-CPU node two (cluster.num_workers), the other one.
        assert f"{HOLDS_NO_WORKER}=1" in said
        assert len(plan["left_out"]) == 1


@pytest.mark.ray
@pytest.mark.slow
def test_workers_larger_than_a_nodes_cpus_leave_it_out_and_larger_than_every_node_fail_in_one_line(small):
    plan, _ = _plan(small, "cluster.cpus_per_worker=2")
    assert plan["world_size"] == 1 and len(plan["left_out"]) == len(small.nodes) - 1
    p, took = small.orchestrator("submit", "jobs/llm.yaml", "cluster.cpus_per_worker=4",
                                 f"monitor.runs_dir={small.home / 'runs'}")
    lines = [line for line in (p.stdout + p.stderr).splitlines() if line.startswith("error:")]
    assert p.returncode == 2 and took < 30, p.stdout + p.stderr
    largest = 3 if small.shape == "head0_uneven" else 2
    assert len(lines) == 1 and "key 'cluster.cpus_per_worker'" in lines[0] and f"has {largest}" in lines[0], lines


@pytest.mark.ray
@pytest.mark.slow
def test_a_small_cluster_trains_on_what_it_holds(small):
    p, _ = small.orchestrator("submit", "jobs/llm.yaml", "train.max_steps=4", "train.eval_interval=4",
                              "train.eval_iters=1", f"monitor.runs_dir={small.home / 'runs'}", timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    run = Path(next(line for line in p.stdout.splitlines() if line.startswith(RUN_DIR_LINE))[len(RUN_DIR_LINE):])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 4
    placement = json.loads((run / "placement.json").read_text())
    assert len(placement) == 2 and all(not p.get("gpu_ids") for p in placement)


def test_a_placement_that_waits_for_other_work_says_what_it_waits_for(monkeypatch):
    from orchestrator.control import placement

    answers = iter([([], ["pg"]), ([], ["pg"]), (["pg"], [])])  # free after two slices
    monkeypatch.setattr(placement.ray, "wait", lambda refs, timeout: next(answers))
    monkeypatch.setattr(placement, "_missing", lambda bundles, selectors: "node aaaa needs CPU 2 (has 1 free)")

    class Group:
        def ready(self):
            return "pg"

    said: list[str] = []
    placement._wait_ready(Group(), [{"CPU": 1.0}] * 2, None, 120, said.append)
    assert len(said) == 2 and all("for other work to free: node aaaa needs CPU 2 (has 1 free)" in s for s in said)
    assert said[0].startswith("waiting ") and "of 120 s (cluster.placement_timeout_s)" in said[0]
