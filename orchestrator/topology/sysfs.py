"""NICs, NUMA nodes and PCIe distances from Linux sysfs.

NVML knows GPUs only; the NICs that carry traffic between nodes and the NUMA layout come from
``/sys``. Every function takes the filesystem root so tests (and probes of a chroot) can point
it at a tree of their own. Only NICs with a link up are reported: a port that is down carries
nothing, and counting it would overstate the network.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .model import Nic

# `/sys/class/net/<if>/type` values (include/uapi/linux/if_arp.h).
_ARPHRD_ETHER = 1
_ARPHRD_INFINIBAND = 32
_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, ValueError):
        # Reading `speed` of a link that is down fails with EINVAL; absent files are common.
        return None


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _pci_device(dev_link: Path) -> tuple[str | None, int | None, str | None]:
    """(PCI bus id, NUMA node, driver) of the device a class entry points at."""
    try:
        real = dev_link.resolve(strict=True)
    except OSError:
        return None, None, None
    bus_id = real.name if _BDF.match(real.name) else None
    numa = _int(_read(real / "numa_node"))
    driver_link = real / "driver"
    driver = os.path.basename(os.readlink(driver_link)) if driver_link.is_symlink() else None
    # The kernel writes -1 when the platform does not say which node a device hangs off.
    return bus_id, (numa if numa is not None and numa >= 0 else None), driver


def _ib_rate_gbps(text: str | None) -> float | None:
    """`400 Gb/sec (4X NDR)` -> 400.0."""
    if not text:
        return None
    m = re.match(r"\s*([0-9.]+)\s*Gb/sec", text)
    return float(m.group(1)) if m else None


def infiniband_nics(root: str | Path = "/") -> list[Nic]:
    """RDMA devices (`/sys/class/infiniband`): InfiniBand, RoCE and EFA, with a port up."""
    base = Path(root) / "sys/class/infiniband"
    nics = []
    for dev in sorted(base.iterdir()) if base.is_dir() else []:
        best: float | None = None
        layer = ""
        active = False
        for port in sorted((dev / "ports").iterdir()) if (dev / "ports").is_dir() else []:
            state = _read(port / "state") or ""
            if "ACTIVE" not in state.upper():
                continue
            active = True
            rate = _ib_rate_gbps(_read(port / "rate"))
            if rate is not None and (best is None or rate > best):
                best = rate
            layer = layer or (_read(port / "link_layer") or "")
        if not active:
            continue
        bus_id, numa, driver = _pci_device(dev / "device")
        if driver == "efa" or dev.name.startswith("efa"):
            kind = "efa"
        elif layer.lower() == "ethernet":
            kind = "roce"
        elif layer.lower() == "infiniband":
            kind = "infiniband"
        else:
            kind = "unknown"
        nics.append(Nic(name=dev.name, speed_gbps=best, kind=kind, numa_node=numa, pci_bus_id=bus_id))
    return nics


def ethernet_nics(root: str | Path = "/", skip_pci: set[str] | None = None) -> list[Nic]:
    """Physical network interfaces (`/sys/class/net`) that are up.

    Virtual interfaces (loopback, bridges, veth, docker) have no `device` link and are left
    out, as are interfaces on a PCI device in `skip_pci` (the netdev of an RDMA NIC already
    reported by :func:`infiniband_nics`).
    """
    base = Path(root) / "sys/class/net"
    skip_pci = skip_pci or set()
    nics = []
    for dev in sorted(base.iterdir()) if base.is_dir() else []:
        if not (dev / "device").exists():
            continue
        if (_read(dev / "operstate") or "").lower() != "up":
            continue
        bus_id, numa, _ = _pci_device(dev / "device")
        if bus_id is not None and bus_id in skip_pci:
            continue
        mbps = _int(_read(dev / "speed"))
        dtype = _int(_read(dev / "type"))
        kind = "infiniband" if dtype == _ARPHRD_INFINIBAND else "ethernet" if dtype == _ARPHRD_ETHER else "unknown"
        nics.append(Nic(
            name=dev.name,
            speed_gbps=mbps / 1000 if mbps is not None and mbps > 0 else None,
            kind=kind, numa_node=numa, pci_bus_id=bus_id,
        ))
    return nics


def read_nics(root: str | Path = "/") -> list[Nic]:
    """All NICs with a link up: RDMA devices first, then plain Ethernet ports."""
    rdma = infiniband_nics(root)
    return rdma + ethernet_nics(root, skip_pci={n.pci_bus_id for n in rdma if n.pci_bus_id})


def numa_nodes(root: str | Path = "/") -> list[int]:
    """NUMA node ids present on the host (`/sys/devices/system/node/node<N>`)."""
    base = Path(root) / "sys/devices/system/node"
    ids = []
    for p in base.iterdir() if base.is_dir() else []:
        m = re.fullmatch(r"node(\d+)", p.name)
        if m:
            ids.append(int(m.group(1)))
    return sorted(ids)


def pci_numa_node(bus_id: str, root: str | Path = "/") -> int | None:
    """NUMA node of a PCI device, None where the platform does not say."""
    return _pci_device(Path(root) / "sys/bus/pci/devices" / bus_id)[1]


def _pci_chain(bus_id: str, root: Path) -> tuple[str, list[str]] | None:
    """(host bridge, [bridges from the root port down to the device, the device last])."""
    try:
        real = (root / "sys/bus/pci/devices" / bus_id).resolve(strict=True)
    except OSError:
        return None
    parts = real.parts
    for i, p in enumerate(parts):
        if p.startswith("pci") and ":" in p:
            chain = [x for x in parts[i + 1:] if _BDF.match(x)]
            return p, chain
    return None


def pcie_path_kind(bus_a: str, bus_b: str, root: str | Path = "/") -> str | None:
    """The `nvidia-smi topo -m` path name between two PCI devices, from where sysfs puts them.

    pix: below one PCIe switch (they share its upstream port); pxb: below one root port but
    through several switches; phb: only the host bridge in common; node/sys: different host
    bridges on the same / different NUMA nodes. None when either device is not in sysfs.
    """
    root = Path(root)
    ca, cb = _pci_chain(bus_a, root), _pci_chain(bus_b, root)
    if ca is None or cb is None:
        return None
    (host_a, chain_a), (host_b, chain_b) = ca, cb
    if host_a != host_b:
        na, nb = pci_numa_node(bus_a, root), pci_numa_node(bus_b, root)
        return "node" if na is not None and na == nb else "sys"
    common = 0
    for x, y in zip(chain_a[:-1], chain_b[:-1]):
        if x != y:
            break
        common += 1
    if common == 0:
        return "phb"
    # Below the deepest shared bridge each side passes one downstream port when that bridge
    # is a switch's upstream port; any more hops mean further switches.
    below_a, below_b = len(chain_a) - common, len(chain_b) - common
    return "pix" if below_a <= 2 and below_b <= 2 else "pxb"
