"""deploy/: launcher configs pass Ray's own validation, manifests have KubeRay's shape, and
every node start-up gets valid Ray labels from `node-labels`."""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.commands import node_labels as cmd
from orchestrator.control.labels import PREFIX, format_labels, label_value, node_labels
from orchestrator.topology.files import load_topology_file
from orchestrator.topology.model import Device, NodeTopology, cpu_node

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
FIXTURES = ROOT / "tests/fixtures/topology"
LAUNCHER = {"aws-p4d.yaml": ("p4d.24xlarge", 4), "aws-p5.yaml": ("p5.48xlarge", 32),
            "gcp-a3-high.yaml": ("a3-highgpu-8g", 0)}
LABELS_CMD = '--labels "$(python3 -m orchestrator node-labels)"'


def _load(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


def test_every_deploy_file_is_checked_here():
    # grafana/: the dashboard, checked by test_monitoring.py against the one runs install.
    checked = set(LAUNCHER) | {"kuberay-raycluster.yaml", "kuberay-rayjob.yaml", "Dockerfile", "grafana"}
    assert {p.name for p in DEPLOY.iterdir()} == checked


@pytest.mark.parametrize("name", sorted(LAUNCHER))
def test_launcher_config_passes_ray_validation(name):
    from ray.autoscaler._private.util import prepare_config, validate_config

    # What `ray up` does before it calls the cloud: merge the provider defaults, then check the schema.
    prepared = prepare_config(copy.deepcopy(_load(name)))
    validate_config(prepared)
    instance, efa_cards = LAUNCHER[name]
    head = prepared["available_node_types"][prepared["head_node_type"]]
    workers = [t for n, t in prepared["available_node_types"].items() if n != prepared["head_node_type"]]
    assert head["resources"]["GPU"] == 0, "training ranks must not land on the head"
    assert len(workers) == 1 and workers[0]["resources"]["GPU"] == 8
    node_config = workers[0]["node_config"]
    assert instance in (node_config.get("InstanceType"), node_config.get("machineType"))
    # Project installed on every node from the synced checkout; token synced for authentication.
    assert prepared["file_mounts"]["~/orchestrator"] == "."
    assert "~/.ray/auth_token" in prepared["file_mounts"]
    assert any("pip install -e ~/orchestrator" in c for c in prepared["worker_setup_commands"])
    for commands in (prepared["head_start_ray_commands"], prepared["worker_start_ray_commands"]):
        start = next(c for c in commands if "ray start" in c)
        assert LABELS_CMD in start and "--metrics-export-port=8080" in start and "RAY_AUTH_MODE=token" in start
        # Workers at normal priority: Ray's default niceness 15 lets every daemon preempt a step.
        assert start.index("RAY_worker_niceness=0") < start.index("ray start")
    if efa_cards:
        nics = node_config["NetworkInterfaces"]
        assert sorted(n["NetworkCardIndex"] for n in nics) == list(range(efa_cards)), \
            "one EFA interface per network card"
        assert [n["DeviceIndex"] for n in nics].count(0) == 1
        assert all(n["InterfaceType"] in ("efa", "efa-only") and n["SubnetId"] and n["Groups"] for n in nics)
        # Ray's AWS bootstrap refuses subnets or groups outside the interfaces when they are set.
        assert not {"SubnetId", "SubnetIds", "SecurityGroupIds"} & set(node_config)
        assert node_config["Placement"]["GroupName"]
        # The EFA environment as AWS documents it reaches the workers (they inherit the raylet's).
        start = next(c for c in prepared["worker_start_ray_commands"] if "ray start" in c)
        efa_env = ("FI_PROVIDER=efa", "FI_EFA_USE_DEVICE_RDMA=1",
                   "LD_LIBRARY_PATH=/opt/amazon/ofi-nccl/lib:/opt/amazon/efa/lib")
        assert start.index("ray start") > max(start.index(v) for v in efa_env)


def test_ray_validation_rejects_a_broken_launcher_config():
    from jsonschema import ValidationError
    from ray.autoscaler._private.util import prepare_config, validate_config

    broken = _load("aws-p5.yaml")
    broken["setup_comands"] = broken.pop("setup_commands")
    with pytest.raises(ValidationError, match="setup_comands"):
        validate_config(prepare_config(broken))


@pytest.mark.parametrize("name", ["kuberay-raycluster.yaml", "kuberay-rayjob.yaml"])
def test_kuberay_manifest_fields(name):
    doc = _load(name)
    assert doc["apiVersion"] == "ray.io/v1"
    if doc["kind"] == "RayJob":
        assert "cluster.address=auto" in doc["spec"]["entrypoint"]
        assert doc["spec"]["entrypoint"].startswith("python -m orchestrator submit ")
        assert doc["spec"]["shutdownAfterJobFinishes"] is True
        spec = doc["spec"]["rayClusterSpec"]
    else:
        assert doc["kind"] == "RayCluster"
        spec = doc["spec"]
    assert spec["rayVersion"] == "2.60.0"
    head = spec["headGroupSpec"]
    assert head["rayStartParams"]["metrics-export-port"] == "8080"
    assert head["rayStartParams"]["num-gpus"] == "0"
    groups = spec["workerGroupSpecs"]
    assert groups
    assert all("rayStartParams" in g and g["minReplicas"] <= g["replicas"] <= g["maxReplicas"] for g in groups)
    for template in [head["template"]] + [g["template"] for g in groups]:
        assert template["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
        (container,) = template["spec"]["containers"]
        assert container["args"][0].startswith("ulimit -n 65536; $KUBERAY_GEN_RAY_START_CMD ")
        assert '--labels "$(python -m orchestrator node-labels)"' in container["args"][0]
        env = {e["name"]: e for e in container["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token"
        assert env["RAY_worker_niceness"]["value"] == "0"
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "orchestrator-ray-token"
    for g in groups:
        res = g["template"]["spec"]["containers"][0]["resources"]
        assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == "8"


def _ray_accepts(labels: dict[str, str]) -> dict[str, str]:
    """What `ray start --labels` makes of our output (Ray's own parser and validator)."""
    from ray._private.label_utils import parse_node_labels_string, validate_node_labels

    parsed = parse_node_labels_string(format_labels(labels))
    validate_node_labels(parsed)
    return parsed


@pytest.mark.parametrize("fixture, gpus, domain_size, rails", [
    ("topo_hgx_h100_nics_nccl1264.txt", 8, 8, 10),
    ("topo_8x_rtxa6000_nvlink_pairs_unige3741.txt", 8, 2, 2),
    ("topo_4gpu_pcie_pxb_pix_nccl667.txt", 4, 0, 0),
    ("nccl_xml_aws_p5.48xl-topo.xml", 8, 0, 32),
    # p4d's XML has no NVLink, but its PCI device id names the A100 SXM4, an NVSwitch part
    ("nccl_xml_aws_p4d-24xl-topo.xml", 8, 8, 4),
])
def test_labels_of_real_captures(fixture, gpus, domain_size, rails):
    node = load_topology_file(FIXTURES / fixture)
    node.hostname = "gpu-node-17.ec2.internal"
    labels = node_labels(node)
    assert _ray_accepts(labels) == labels
    assert labels[f"{PREFIX}gpus"] == str(gpus)
    assert labels[f"{PREFIX}nvlink-domain-size"] == str(domain_size)
    assert labels[f"{PREFIX}nic-rails"] == str(rails)
    assert labels[f"{PREFIX}nvlink-domain"] == ("gpu-node-17.ec2.internal-0" if domain_size else "none")


def test_labels_name_the_gpu_model_and_the_fabric_clique():
    clique = "8f0e2a6c-1d2b-4c1e-9a8e-0b4b1c1d2e3f/7"
    devices = [Device(index=i, name="NVIDIA GB200", fabric_clique=clique) for i in range(4)]
    node = NodeTopology(hostname="nvl72-tray-3", devices=devices, nvlink_domains=[[0, 1, 2, 3]], source="nvml")
    labels = node_labels(node)
    assert _ray_accepts(labels) == labels
    assert labels[f"{PREFIX}gpu"] == "GB200"  # the planner's model name, so labels and plans agree
    # Every tray of one NVL72 rack reports the same clique, so they share one domain label.
    assert labels[f"{PREFIX}nvlink-domain"] == "8f0e2a6c-1d2b-4c1e-9a8e-0b4b1c1d2e3f.7"
    h100 = NodeTopology(hostname="h", devices=[Device(index=i, name="NVIDIA H100 80GB HBM3") for i in range(2)])
    assert node_labels(h100)[f"{PREFIX}gpu"] == "H100"
    # A model the planner's table does not know: the product name, cleaned into a label value.
    new = NodeTopology(hostname="h", devices=[Device(index=0, name="NVIDIA RTX PRO 6000 Blackwell")])
    assert node_labels(new)[f"{PREFIX}gpu"] == "RTX-PRO-6000-Blackwell"


def test_cpu_only_machine_says_so():
    labels = node_labels(cpu_node(4, hostname="laptop"))
    assert labels == {f"{PREFIX}gpu": "none", f"{PREFIX}gpus": "0", f"{PREFIX}nvlink-domain": "none",
                      f"{PREFIX}nvlink-domain-size": "0", f"{PREFIX}nic-rails": "0", f"{PREFIX}topology-source": "cpu"}


def test_label_value_obeys_ray_syntax():
    from ray._private.label_utils import validate_label_value

    for raw in ["a" * 80, "-host.", "weird host/name:1", "", "ok_value-1.2"]:
        value = label_value(raw)
        validate_label_value(value)
        assert len(value) <= 63
    assert label_value("ok_value-1.2") == "ok_value-1.2"


def test_node_labels_command_reads_the_declared_topology(monkeypatch, capsys):
    monkeypatch.setenv("ORCHESTRATOR_TOPOLOGY_FILE", str(FIXTURES / "topo_hgx_h100_nics_nccl1264.txt"))
    parser = argparse.ArgumentParser()
    cmd.add_arguments(parser)
    assert cmd.run(parser.parse_args(["--json"])) == 0
    labels = json.loads(capsys.readouterr().out)
    assert labels[f"{PREFIX}topology-source"] == "declared" and labels[f"{PREFIX}gpus"] == "8"
    assert cmd.run(parser.parse_args([])) == 0
    assert _ray_accepts(labels) == labels == dict(kv.split("=") for kv in capsys.readouterr().out.strip().split(","))


def test_start_command_substitution_yields_ray_labels(monkeypatch):
    """The exact shell form the deploy files use, through the real CLI."""
    env = {"ORCHESTRATOR_TOPOLOGY_FILE": str(FIXTURES / "topo_4x_a100_nv4_nccltests331.txt"), 
           "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}
    out = subprocess.run(["bash", "-c", 'printf %s "$(python -m orchestrator node-labels)"'],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    from ray._private.label_utils import parse_node_labels_string

    labels = parse_node_labels_string(out.stdout)
    assert labels[f"{PREFIX}nvlink-domain-size"] == "4" and labels[f"{PREFIX}nic-rails"] == "4"


def test_gcp_recipe_says_plainly_that_nccl_runs_over_tcp():
    text = (DEPLOY / "gcp-a3-high.yaml").read_text()
    setup = "\n".join(_load("gcp-a3-high.yaml")["setup_commands"])
    # Neither the TCPX plugin nor the receive-datapath daemon is installed, and the file says so.
    assert "tcpx" not in setup.lower() and "rxdm" not in setup.lower()
    assert "NCCL between nodes runs over plain TCP sockets here, NOT GPUDirect-TCPX" in text
