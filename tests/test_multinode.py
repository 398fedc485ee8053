"""A GPU-less Ray head (as in every recipe of deploy/) and two nodes with 4 fake GPUs each,
wired as the real 4-GPU PCIe capture (GPUs 0-1 under one PCIe switch, 2-3 under another, SYS
between) plus three NICs and PCI bus ids: the head is left out of the plan, the planner's
layout and NICs reach the actors with NCCL settings from the probe. Losing a node mid-run is
tests/test_recovery.py's."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster
from rich.console import Console

from orchestrator.config import load_config
from orchestrator.control.driver import run_job
from orchestrator.record.rundir import RunDir
from orchestrator.runtime.nccl_env import interface_addresses
from orchestrator.topology.files import load_topology_file
from orchestrator.topology.model import Nic
from orchestrator.topology.nccl_xml import parse_nccl_xml

ROOT = Path(__file__).resolve().parent.parent
CAPTURE = ROOT / "tests" / "fixtures" / "topology" / "topo_4gpu_pcie_pxb_pix_nccl667.txt"
TINY = [
    "model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.block_size=32",
    "train.global_batch_size=8", "train.warmup_steps=1", "train.eval_iters=1",
    "cluster.gpu=A100", "cluster.cpus_per_worker=0.25",
    "monitor.progress=false", "monitor.dashboard=false",
]

pytestmark = [pytest.mark.ray, pytest.mark.slow]


# Node B's user set NCCL_SOCKET_IFNAME (NCCL's exact-match syntax): it must reach NCCL unchanged.
USER_NCCL = {"NCCL_SOCKET_IFNAME": "=lo", "NCCL_DEBUG": "WARN"}


def declared_node(folder: Path) -> Path:
    """The capture as a declared JSON node with PCI bus ids and NICs: two HCAs behind the
    GPU0/GPU1 switch (PXB), one beside GPU2/GPU3 (PIX)."""
    node = load_topology_file(CAPTURE, "A100")
    for d in node.devices:
        d.pci_bus_id = f"0000:{0x18 + 0x20 * d.index:02x}:00.0"
    near = {"mlx5_0": ("pxb", (0, 1)), "mlx5_1": ("pxb", (0, 1)), "mlx5_2": ("pix", (2, 3))}
    for i, (name, (kind, gpus)) in enumerate(near.items()):
        node.nics.append(Nic(name=name, kind="infiniband", speed_gbps=200.0, numa_node=0 if gpus[0] < 2 else 1,
                             pci_bus_id=f"0000:{0x1a + 0x40 * i:02x}:00.0",
                             gpu_paths={g: kind if g in gpus else "sys" for g in range(4)}))
    path = folder / "node.json"
    path.write_text(json.dumps(node.to_dict()))
    return path


def _cluster(declared: Path) -> Cluster:
    # Fast failure detection, so a removed node is declared dead in seconds, not half a minute.
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1, "num_gpus": 0,
            "_system_config": {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                               "health_check_failure_threshold": 3},
        },
    )
    env = {"ORCHESTRATOR_TOPOLOGY_FILE": str(declared)}
    cluster.node_a = cluster.add_node(num_cpus=2, num_gpus=4, env_vars=env)
    cluster.worker = cluster.add_node(num_cpus=2, num_gpus=4, env_vars={**env, **USER_NCCL})
    ray.init(address=cluster.address)
    cluster.wait_for_nodes()
    cluster.declared = declared
    return cluster


@pytest.fixture
def two_nodes():
    folder = Path(tempfile.mkdtemp(prefix="orx-mn-"))
    cluster = _cluster(declared_node(folder))
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(folder, ignore_errors=True)


def _run(tmp_path: Path, *overrides: str):
    cfg = load_config(ROOT / "jobs" / "llm.yaml", [*TINY, f"monitor.runs_dir={tmp_path}", *overrides])
    run = RunDir.create(cfg.monitor.runs_dir, cfg.name)
    return run.path, run_job(cfg, run, Console(file=open(os.devnull, "w")))


def test_tp_pairs_land_under_one_pcie_switch_and_hsdp_shards_stay_in_a_node(two_nodes, tmp_path):
    run_dir, summary = _run(tmp_path, "parallel.tp=2", "parallel.strategy=hsdp", "train.max_steps=2",
                            "train.eval_interval=2", "checkpoint.enabled=false")
    assert summary["steps"] == 2 and summary["world_size"] == 8
    plan = json.loads((run_dir / "plan.json").read_text())
    placement = json.loads((run_dir / "placement.json").read_text())
    where = {p["rank"]: (p["node_id"], p["gpu"]) for p in placement}
    assert len({node for node, _ in where.values()}) == 2
    for group in plan["groups"]["tp"]:
        nodes = {where[r][0] for r in group}
        gpus = {where[r][1] for r in group}
        assert len(nodes) == 1 and gpus in ({0, 1}, {2, 3}), (group, nodes, gpus)
    for group in plan["groups"]["dp_shard"]:
        assert len({where[r][0] for r in group}) == 1
    # the actors themselves reported these devices: Ray's choice of GPU matched the plan's
    assert all(p["gpu_ids"] == [p["gpu"]] for p in placement)
    # each worker exposes all of the job's GPUs on its node (NCCL needs its peers), in PCI order
    assert all(p["visible_gpus"] == "0,1,2,3" for p in placement)
    # the GPU-less head runs no rank and the plan says so
    head = ray.get_runtime_context().get_node_id()
    assert [x["node"] for x in plan["left_out"]] == [head]
    assert head not in {node for node, _ in where.values()}
    # each rank's NIC is its GPU's nearest, GPUs sharing two near NICs spread over them
    assert {r["gpu"]: r["nic"] for r in plan["ranks"]} == {0: "mlx5_0", 1: "mlx5_1", 2: "mlx5_2", 3: "mlx5_2"}
    # NCCL got the settings from the probe, and node B's own NCCL_* variables untouched
    user_node = two_nodes.worker.node_id
    declared = load_topology_file(two_nodes.declared)
    for p in placement:
        env = p["nccl_env"]
        if p["node_id"] == user_node:
            assert {k: env[k] for k in USER_NCCL} == USER_NCCL
        else:
            # the interface holding the node's address, the one the other nodes reach it by
            held = [f"={name}" for name, addrs in interface_addresses().items() if p["ip"] in addrs]
            assert [env["NCCL_SOCKET_IFNAME"]] == held and "NCCL_DEBUG" not in env
        written = parse_nccl_xml(Path(env["NCCL_TOPO_FILE"]).read_text())
        assert [d.pci_bus_id for d in written.devices] == [d.pci_bus_id for d in declared.devices]
        assert {(l.a, l.b): l.kind for l in written.links} == {(l.a, l.b): l.kind for l in declared.links}
        assert {n.pci_bus_id: n.gpu_paths for n in written.nics} == {n.pci_bus_id: n.gpu_paths for n in declared.nics}
    # the declared NICs this machine lacks are named, and the plan was still made
    topo = json.loads((run_dir / "topology.json").read_text())
    warned = [w for n in topo["nodes"] for w in n["warnings"] if "does not have" in w]
    assert len(warned) == 2 and all("mlx5_0, mlx5_1, mlx5_2" in w for w in warned)
