"""NICs, NUMA nodes and PCIe paths read from a sysfs tree built the way Linux lays it out."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from orchestrator.topology.sysfs import numa_nodes, pci_numa_node, pcie_path_kind, read_nics

# Two sockets. Socket 0: root port 17:00.0 -> switch (18 up, 19:00/19:01 down) with the GPU
# at 1a and mlx5_0 at 1b (PIX); a second switch under the same root port holds an NVMe-like
# device at 1e (PXB from the GPU); 30:00.0 hangs off its own root port of the same host
# bridge (PHB). Socket 1: mlx5_1 (port down), an EFA device and an Ethernet port.
PCI = {
    "0000:1a:00.0": ("pci0000:17", ["0000:17:00.0", "0000:18:00.0", "0000:19:00.0"], 0),
    "0000:1b:00.0": ("pci0000:17", ["0000:17:00.0", "0000:18:00.0", "0000:19:01.0"], 0),
    "0000:1e:00.0": ("pci0000:17", ["0000:17:00.0", "0000:1c:00.0", "0000:1d:00.0"], 0),
    "0000:30:00.0": ("pci0000:17", ["0000:17:02.0"], 0),
    "0000:52:00.0": ("pci0000:50", ["0000:50:00.0"], 0),
    "0000:98:00.0": ("pci0000:97", ["0000:97:00.0"], 1),
    "0000:a1:00.0": ("pci0000:a0", ["0000:a0:00.0"], 1),
    "0000:b1:00.0": ("pci0000:b0", ["0000:b0:00.0"], -1),
}


def _device(root: Path, bdf: str) -> Path:
    host, bridges, numa = PCI[bdf]
    path = root / "sys/devices" / host
    for b in bridges + [bdf]:
        path = path / b
    path.mkdir(parents=True, exist_ok=True)
    (path / "numa_node").write_text(f"{numa}\n")
    link = root / "sys/bus/pci/devices" / bdf
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.exists():
        link.symlink_to(os.path.relpath(path, link.parent))
    return path


def _ib(root: Path, name: str, bdf: str, state: str, rate: str, layer: str, driver: str = "mlx5_core") -> None:
    dev = _device(root, bdf)
    drv = root / "sys/bus/pci/drivers" / driver
    drv.mkdir(parents=True, exist_ok=True)
    if not (dev / "driver").is_symlink():
        (dev / "driver").symlink_to(os.path.relpath(drv, dev))
    cls = root / "sys/class/infiniband" / name
    (cls / "ports/1").mkdir(parents=True)
    (cls / "device").symlink_to(dev)
    (cls / "ports/1/state").write_text(state + "\n")
    (cls / "ports/1/rate").write_text(rate + "\n")
    (cls / "ports/1/link_layer").write_text(layer + "\n")


def _net(root: Path, name: str, bdf: str | None, state: str, speed: str | None, dtype: int = 1) -> None:
    cls = root / "sys/class/net" / name
    cls.mkdir(parents=True)
    if bdf is not None:
        (cls / "device").symlink_to(_device(root, bdf))
    (cls / "operstate").write_text(state + "\n")
    (cls / "type").write_text(f"{dtype}\n")
    if speed is not None:
        (cls / "speed").write_text(speed + "\n")


@pytest.fixture()
def root(tmp_path: Path) -> Path:
    for bdf in ("0000:1a:00.0", "0000:1e:00.0", "0000:30:00.0", "0000:52:00.0"):
        _device(tmp_path, bdf)
    _ib(tmp_path, "mlx5_0", "0000:1b:00.0", "4: ACTIVE", "400 Gb/sec (4X NDR)", "InfiniBand")
    _ib(tmp_path, "mlx5_1", "0000:98:00.0", "1: DOWN", "400 Gb/sec (4X NDR)", "InfiniBand")
    _ib(tmp_path, "mlx5_2", "0000:b1:00.0", "4: ACTIVE", "200 Gb/sec (4X HDR)", "Ethernet")
    _ib(tmp_path, "rdmap161s0", "0000:a1:00.0", "4: ACTIVE", "100 Gb/sec", "Unspecified", driver="efa")
    _net(tmp_path, "ib0", "0000:1b:00.0", "up", "400000", dtype=32)  # netdev of mlx5_0
    _net(tmp_path, "ens5", "0000:52:00.0", "up", "25000")
    _net(tmp_path, "ens6", "0000:30:00.0", "down", None)
    _net(tmp_path, "lo", None, "unknown", None, dtype=772)
    _net(tmp_path, "docker0", None, "up", None)
    for n in (0, 1):
        (tmp_path / f"sys/devices/system/node/node{n}").mkdir(parents=True)
    (tmp_path / "sys/devices/system/node/possible").write_text("0-1\n")
    return tmp_path


def test_nics_up_with_kind_speed_numa_and_pci(root: Path) -> None:
    nics = {n.name: n for n in read_nics(root)}
    assert sorted(nics) == ["ens5", "mlx5_0", "mlx5_2", "rdmap161s0"]
    ib = nics["mlx5_0"]
    assert (ib.kind, ib.speed_gbps, ib.numa_node, ib.pci_bus_id) == ("infiniband", 400.0, 0, "0000:1b:00.0")
    assert (nics["mlx5_2"].kind, nics["mlx5_2"].speed_gbps, nics["mlx5_2"].numa_node) == ("roce", 200.0, None)
    assert (nics["rdmap161s0"].kind, nics["rdmap161s0"].numa_node) == ("efa", 1)
    assert (nics["ens5"].kind, nics["ens5"].speed_gbps) == ("ethernet", 25.0)


def test_numa_nodes_and_pci_numa(root: Path) -> None:
    assert numa_nodes(root) == [0, 1]
    assert pci_numa_node("0000:98:00.0", root) == 1
    assert pci_numa_node("0000:b1:00.0", root) is None  # the kernel's -1
    assert pci_numa_node("0000:ff:00.0", root) is None


def test_pcie_path_kinds(root: Path) -> None:
    gpu = "0000:1a:00.0"
    assert pcie_path_kind(gpu, "0000:1b:00.0", root) == "pix"
    assert pcie_path_kind(gpu, "0000:1e:00.0", root) == "pxb"
    assert pcie_path_kind(gpu, "0000:30:00.0", root) == "phb"
    assert pcie_path_kind(gpu, "0000:52:00.0", root) == "node"
    assert pcie_path_kind(gpu, "0000:98:00.0", root) == "sys"
    assert pcie_path_kind(gpu, "0000:ee:00.0", root) is None


def test_empty_root_has_nothing(tmp_path: Path) -> None:
    assert read_nics(tmp_path) == [] and numa_nodes(tmp_path) == []
