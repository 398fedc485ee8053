"""A 2-node Ray cluster whose raylets declare different topologies is probed node by node."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.errors import TopologyError
from orchestrator.topology.cluster_probe import probe_cluster
from orchestrator.topology.local import TOPOLOGY_FILE_ENV, probe_local
from orchestrator.topology.model import Nic, NodeTopology
from orchestrator.topology.network import network_from_nodes

FIXTURES = Path(__file__).parent / "fixtures" / "topology"
PCIE4 = FIXTURES / "topo_4gpu_pcie_pxb_pix_nccl667.txt"
A6000 = FIXTURES / "topo_8x_rtxa6000_nvlink_pairs_unige3741.txt"


@pytest.fixture()
def two_nodes(monkeypatch: pytest.MonkeyPatch):
    import ray
    from ray.cluster_utils import Cluster

    # Raylets inherit this process's environment: only env_vars may declare a topology.
    monkeypatch.delenv(TOPOLOGY_FILE_ENV, raising=False)
    cluster = Cluster(
        initialize_head=True,
        head_node_args=dict(num_cpus=1, num_gpus=4, include_dashboard=False,
                            env_vars={TOPOLOGY_FILE_ENV: str(PCIE4)}),
    )
    worker = cluster.add_node(num_cpus=1, num_gpus=8, env_vars={TOPOLOGY_FILE_ENV: str(A6000)})
    try:
        # An explicit address: a stale /tmp/ray/ray_current_cluster must not be joined instead.
        ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
        yield cluster.head_node.node_id, worker.node_id
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.mark.ray
@pytest.mark.slow
def test_probe_cluster_reports_each_declared_node(two_nodes) -> None:
    head_id, worker_id = two_nodes
    topo = probe_cluster()
    assert sorted(n.node_id for n in topo.nodes) == sorted([head_id, worker_id])

    head = topo.node(head_id)
    assert head.source == f"declared:{PCIE4}"
    assert head.num_devices == 4 and len(head.links) == 6
    assert [head.link(0, 1).kind, head.link(2, 3).kind, head.link(1, 2).kind] == ["pxb", "pix", "sys"]

    worker = topo.node(worker_id)
    assert worker.source == f"declared:{A6000}"
    assert worker.num_devices == 8 and len(worker.links) == 28
    assert (worker.link(6, 7).kind, worker.link(6, 7).nvlinks) == ("nvlink", 4)
    assert worker.link(0, 4).kind == "sys"
    assert [n.name for n in worker.nics] == ["mlx5_0", "mlx5_1"]
    # Declared captures give no NIC speed: the network figure stays the default.
    assert topo.network.source == "default"


@pytest.mark.ray
@pytest.mark.slow
def test_a_node_is_probed_in_the_jobs_worker_there_or_by_task_when_it_cannot_answer(two_nodes) -> None:
    # The driver's workers start before the probe; a node with one is probed in it (no process
    # of the probe's own to start), and one whose worker died is probed by the task as before.
    import os

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    head_id, worker_id = two_nodes

    @ray.remote(num_cpus=0)
    class Prober:
        def probe(self, slots: int) -> dict:
            return {**probe_local(slots).to_dict(), "hostname": f"probed in {os.getpid()}"}

        def pid(self) -> int:
            return os.getpid()

    def on(node: str):
        return Prober.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()

    live, dead = on(worker_id), on(head_id)
    live_pid = ray.get(live.pid.remote())
    ray.get(dead.pid.remote())
    ray.kill(dead)
    topo = probe_cluster(on={worker_id: live, head_id: dead})
    assert topo.node(worker_id).hostname == f"probed in {live_pid}"
    assert topo.node(worker_id).num_devices == 8 and topo.node(worker_id).source == f"declared:{A6000}"
    assert not topo.node(head_id).hostname.startswith("probed in")
    assert topo.node(head_id).num_devices == 4 and topo.node(head_id).source == f"declared:{PCIE4}"


def test_declared_file_wins_and_bad_file_is_a_topology_error(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv(TOPOLOGY_FILE_ENV, str(A6000))
    node = probe_local()
    assert node.source == f"declared:{A6000}" and node.hostname
    bad = tmp_path / "bad.txt"
    bad.write_text("")
    monkeypatch.setenv(TOPOLOGY_FILE_ENV, str(bad))
    with pytest.raises(TopologyError, match="bad.txt"):
        probe_local()


def test_no_gpu_gives_cpu_slots(monkeypatch, tmp_path: Path) -> None:
    import fake_pynvml as fake

    monkeypatch.delenv(TOPOLOGY_FILE_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi either
    nv = fake.pcie_pxb_pix()
    nv.failing["nvmlInit"] = fake.NVMLError_DriverNotLoaded
    node = probe_local(3, sysfs_root=tmp_path, pynvml_module=nv)
    assert node.source == "cpu" and node.num_devices == 3
    assert {l.kind for l in node.links} == {"shm"}


def test_a_cpu_slots_speed_is_measured_once_per_kind_of_host(monkeypatch, tmp_path: Path) -> None:
    # Measuring means importing torch in the probe, a second on the path to the first step:
    # the figure is kept per CPU model, core count and torch build.
    import json

    from orchestrator.topology import local

    measured = []
    monkeypatch.setattr(local, "cpu_slot_tflops", lambda: measured.append(1) or 0.25)
    monkeypatch.setenv(local.CACHE_DIR_ENV, str(tmp_path / "cache"))
    assert local.known_cpu_slot_tflops() == 0.25 and len(measured) == 1
    assert local.known_cpu_slot_tflops() == 0.25 and len(measured) == 1  # taken from the cache
    path = tmp_path / "cache" / "cpu_slot_tflops.json"
    assert list(json.loads(path.read_text())) == [local._cpu_key()]
    monkeypatch.setattr(local, "_cpu_key", lambda: "another CPU | 2 CPUs | torch 9")
    assert local.known_cpu_slot_tflops() == 0.25 and len(measured) == 2  # another host: measured, both kept
    assert len(json.loads(path.read_text())) == 2
    path.write_text("{not json")
    assert local.known_cpu_slot_tflops() == 0.25 and len(measured) == 3  # a damaged cache is measured over
    monkeypatch.setenv(local.CACHE_DIR_ENV, str(path / "under-a-file"))  # nothing can be written there
    assert local.known_cpu_slot_tflops() == 0.25 and len(measured) == 4
    monkeypatch.setattr(local, "_cpu_key", lambda: None)  # no torch: nothing to measure with
    assert local.known_cpu_slot_tflops() is None and len(measured) == 4


def test_a_busy_moment_at_the_cpu_measurement_is_timed_again_and_a_run_corrects_the_kept_rate(
        monkeypatch, tmp_path: Path) -> None:
    import json

    from orchestrator.topology import local

    # Five passes, one slowed by another process to half: spread 0.5 > 0.15, so timed again.
    passes = iter([1.0, 1.0, 0.5, 1.0, 1.0] + [1.0, 0.98, 1.0, 1.01, 1.0])
    assert local.steadiest_median(lambda: next(passes), 5, 3, local.CPU_RATE_SPREAD) == 1.0
    assert next(passes, None) is None  # the second try was steady: no third
    # Always busy: the steadiest of three tries is kept, not the last.
    passes = iter([1.0, 0.2, 1.0, 1.0, 1.0] + [1.0, 0.5, 0.5, 0.9, 1.0] + [0.3, 1.0, 1.0, 1.0, 0.2])
    assert local.steadiest_median(lambda: next(passes), 5, 3, local.CPU_RATE_SPREAD) == 0.9
    # A first measurement taken while the machine was busy is corrected by what a run measured.
    monkeypatch.setenv(local.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(local, "cpu_slot_tflops", lambda: 0.0585)
    assert local.known_cpu_slot_tflops() == 0.0585
    assert local.correct_cpu_slot_tflops(0.062) == 0.0585  # within 15%: agrees, kept
    assert local.correct_cpu_slot_tflops(0.118) == 0.118  # twice as fast: replaced
    assert local.known_cpu_slot_tflops() == 0.118
    assert json.loads((tmp_path / "cache" / "cpu_slot_tflops.json").read_text()) == {local._cpu_key(): 0.118}
    assert local.correct_cpu_slot_tflops(0.0) is None and local.known_cpu_slot_tflops() == 0.118


@pytest.mark.slow  # spins the cores for a few seconds
def test_the_cpu_rate_is_the_core_s_own_while_other_processes_share_the_cores() -> None:
    import os
    import subprocess
    import sys
    import time

    from orchestrator.topology import local

    idle = local.cpu_slot_tflops()
    # Twice as many spinning processes as cores: as when a small host starts its workers beside
    # the probe. A wall clock would give this thread's turns only (measured: half the rate or less).
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * (os.cpu_count() or 1))]
    try:
        time.sleep(0.3)
        busy = local.cpu_slot_tflops()
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert idle and busy and busy / idle >= 0.75, (idle, busy)


def test_nvml_probe_gains_sysfs_nics(monkeypatch, tmp_path: Path) -> None:
    import fake_pynvml as fake

    monkeypatch.delenv(TOPOLOGY_FILE_ENV, raising=False)
    nv = fake.a100_nvswitch()
    dev = tmp_path / "sys/devices/pci0000:0f/0000:0f:00.0/0000:10:00.0/0000:11:01.0/0000:1b:00.0"
    dev.mkdir(parents=True)
    (dev / "numa_node").write_text("0\n")
    gpu = tmp_path / "sys/devices/pci0000:0f/0000:0f:00.0/0000:10:00.0/0000:11:00.0/0000:18:00.0"
    gpu.mkdir(parents=True)
    (tmp_path / "sys/bus/pci/devices").mkdir(parents=True)
    (tmp_path / "sys/bus/pci/devices/0000:1b:00.0").symlink_to(dev)
    (tmp_path / "sys/bus/pci/devices/0000:18:00.0").symlink_to(gpu)
    ib = tmp_path / "sys/class/infiniband/mlx5_0"
    (ib / "ports/1").mkdir(parents=True)
    (ib / "device").symlink_to(dev)
    (ib / "ports/1/state").write_text("4: ACTIVE\n")
    (ib / "ports/1/rate").write_text("200 Gb/sec (4X HDR)\n")
    (ib / "ports/1/link_layer").write_text("InfiniBand\n")
    node = probe_local(sysfs_root=tmp_path, pynvml_module=nv)
    assert node.source == "nvml"
    [nic] = node.nics
    assert (nic.name, nic.speed_gbps, nic.kind) == ("mlx5_0", 200.0, "infiniband")
    assert nic.gpu_paths == {0: "pix"}  # GPU0 sits at 18:00.0 under the same switch


def test_network_from_gpu_side_nics_only() -> None:
    def node(*nics: Nic) -> NodeTopology:
        return NodeTopology(nics=list(nics))

    gpu_nic = lambda name: Nic(name=name, speed_gbps=400.0, kind="infiniband", gpu_paths={0: "pix", 1: "sys"})  # noqa: E731
    storage = Nic(name="eth0", speed_gbps=100.0, kind="ethernet", gpu_paths={0: "sys", 1: "sys"})
    net = network_from_nodes([node(gpu_nic("a"), gpu_nic("b"), storage), node(gpu_nic("c"), storage)])
    # 400 Gbit/s = 50 GB/s; the slower node (one GPU NIC) sets the figure; storage ports do not count.
    assert (net.bandwidth_gbps, net.source) == (50.0, "nics")
    assert network_from_nodes([node(Nic(name="x"))]).source == "default"
