"""NCCL's environment for each worker, from the probed topology.

NCCL picks NICs and paths by its own topology search; the lever it offers is the topology
file (`NCCL_TOPO_FILE`), not forced HCA lists. So, per node:

- a node whose wiring was declared (`ORCHESTRATOR_TOPOLOGY_FILE`: a container without NVML,
  a VM whose hypervisor flattens the PCI tree, a simulated node) gets `NCCL_TOPO_FILE`: the
  declared file itself when it is NCCL XML, else the XML written from our model of it, which
  needs the GPUs' PCI bus ids;
- a probed node gets none: NCCL reads the same PCI tree we read;
- a job on several nodes gets `NCCL_SOCKET_IFNAME=<name>` (NCCL's `=`: an exact match; a bare
  name is a prefix), the interface holding the node's Ray address, the one that reaches the
  other nodes (NCCL's bootstrap otherwise takes the first
  non-loopback interface, a docker bridge as often as not).

A `NCCL_*` variable already set in a worker's environment (the node's, or the job's
runtime_env) is never changed. `apply` runs in the worker before the process group starts,
and returns every `NCCL_*` variable the worker then has (placement.json records them).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..topology.model import NodeTopology
from ..topology.nccl_write import bus_id, missing_bus_ids, nccl_topology_xml

TOPO_FILE = "NCCL_TOPO_FILE"
SOCKET_IFNAME = "NCCL_SOCKET_IFNAME"
_DECLARED = "declared:"


@dataclass(frozen=True)
class NcclSetup:
    """What one node's workers should give NCCL; decided on the driver from the topology."""

    topo_xml: str | None = None
    """NCCL topology XML to write on the node and point NCCL_TOPO_FILE at."""
    topo_file: str | None = None
    """A file on the node to point NCCL_TOPO_FILE at as it is (a declared NCCL XML)."""
    socket_ifname: bool = False
    """Whether to set NCCL_SOCKET_IFNAME (the job spans several nodes)."""
    note: str = ""
    """Why no topology file is given, when none is."""


def nccl_setup(node: NodeTopology, multi_node: bool) -> NcclSetup:
    """The NCCL settings for the workers of `node`."""
    if not node.source.startswith(_DECLARED) or not any(d.kind == "gpu" for d in node.devices):
        return NcclSetup(socket_ifname=multi_node)
    path = node.source[len(_DECLARED):]
    if path.lower().endswith(".xml"):
        return NcclSetup(topo_file=path, socket_ifname=multi_node)
    missing = missing_bus_ids(node)
    if missing:
        return NcclSetup(socket_ifname=multi_node,
                         note=f"{TOPO_FILE} not set for {node.hostname or node.node_id}: its declared topology "
                              f"{path} gives no PCI bus id for GPU(s) {', '.join(map(str, missing))}, and NCCL "
                              "matches GPUs by it")
    return NcclSetup(topo_xml=nccl_topology_xml(node), socket_ifname=multi_node)


def interface_addresses() -> dict[str, list[str]]:
    """Each network interface's addresses (IPv4 by SIOCGIFADDR, IPv6 from /proc/net/if_inet6)."""
    import fcntl
    import ipaddress
    import socket
    import struct

    out: dict[str, list[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                out.setdefault(name, []).append(socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24]))
            except OSError:  # an interface without an IPv4 address
                out.setdefault(name, [])
    try:
        for line in Path("/proc/net/if_inet6").read_text().splitlines():
            hexaddr, *_, name = line.split()
            out.setdefault(name, []).append(str(ipaddress.IPv6Address(bytes.fromhex(hexaddr))))
    except (OSError, ValueError):
        pass
    return out


def interface_of(ip: str) -> str | None:
    """The network interface holding the address `ip`; None when none does."""
    import ipaddress

    want = ipaddress.ip_address(ip.split("%")[0])
    for name, addrs in interface_addresses().items():
        if any(ipaddress.ip_address(a) == want for a in addrs):
            return name
    return None


def _write_once(xml: str) -> str:
    """The XML in a file named by its content, written atomically (ranks of a node share it)."""
    folder = Path(tempfile.gettempdir()) / "orchestrator-nccl"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"topo-{hashlib.sha256(xml.encode()).hexdigest()[:16]}.xml"
    if not path.exists():
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(xml)
        tmp.replace(path)
    return str(path)


def apply(setup: NcclSetup | None, node_ip: str, gpu_bus_id: str | None = None) -> tuple[dict[str, str], list[str]]:
    """Set NCCL's variables in this process where the user has not; return every NCCL_*
    variable the process now has, and notes for the user. `gpu_bus_id` is this rank's GPU as
    NVML reports it, where it can: a written file that does not name it describes another
    machine, and NCCL is better off without it."""
    notes = [setup.note] if setup is not None and setup.note else []
    if setup is not None:
        if TOPO_FILE not in os.environ:
            if setup.topo_file:
                os.environ[TOPO_FILE] = setup.topo_file
            elif setup.topo_xml and gpu_bus_id and f'"{bus_id(gpu_bus_id)}"' not in setup.topo_xml:
                notes.append(f"{TOPO_FILE} not set: the declared topology does not name this GPU's PCI bus id "
                             f"{bus_id(gpu_bus_id)}; it describes another machine")
            elif setup.topo_xml:
                os.environ[TOPO_FILE] = _write_once(setup.topo_xml)
        if setup.socket_ifname and SOCKET_IFNAME not in os.environ:
            name = interface_of(node_ip)
            if name:
                # `=`: exactly this interface; a bare name is a prefix (eth0 would also match eth0.100).
                os.environ[SOCKET_IFNAME] = f"={name}"
            else:
                notes.append(f"{SOCKET_IFNAME} not set: no interface holds this node's address {node_ip}")
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")}, notes
