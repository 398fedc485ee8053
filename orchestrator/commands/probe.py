"""`probe`: show the interconnect topology of this cluster or of a capture file.

Without `--from` it runs one probe task on every alive Ray node (joining `--address`, or a
private local cluster when none is given); with `--from FILE` it reads a capture: this
project's JSON, NCCL topology XML or `nvidia-smi topo -m` text. `--json` prints the topology
as the planner reads it, `--svg OUT` draws it.
"""

from __future__ import annotations

import argparse
import os
import sys

from ..errors import TopologyError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--from", dest="from_file", metavar="FILE", action="append",
                        help="read a capture instead of probing: topology JSON, NCCL topology XML or "
                             "`nvidia-smi topo -m` text; give it twice to merge an NCCL XML (PCI tree, NICs) "
                             "with a `topo -m` (NVLink)")
    parser.add_argument("--gpu", "--gpu-name", dest="gpu_name", metavar="NAME",
                        help="GPU model for captures that do not name it, as NVML names it (sets NVLink rates; an SXM "
                             "part adds the NVSwitch fabric an NCCL XML cannot show), e.g. 'NVIDIA H100 80GB HBM3'")
    parser.add_argument("--nvlink-status", metavar="FILE",
                        help="`nvidia-smi nvlink -s` output for the --from capture: per-lane rates, inactive lanes")
    parser.add_argument("--address", default=None,
                        help="Ray cluster to probe: `auto` or host:port (default: a private local cluster)")
    parser.add_argument("--measure", action="store_true",
                        help="also run collective micro-benchmarks and report measured link bandwidths")
    parser.add_argument("--json", action="store_true", help="print the topology as JSON")
    parser.add_argument("--svg", metavar="OUT", help="write a drawing of the topology to OUT")


def run(args: argparse.Namespace) -> int:
    if args.from_file:
        if args.measure or args.address:
            raise TopologyError("--measure and --address probe a live cluster; they do not apply to --from FILE")
        cluster = _from_file(args)
    else:
        if args.nvlink_status or args.gpu_name:
            raise TopologyError("--nvlink-status and --gpu refine a --from capture; a live probe reads NVML")
        from ..connect.cluster import connect
        from ..topology.cluster_probe import probe_cluster

        with connect(args.address, name="--address"):
            cluster = probe_cluster(measure=args.measure)

    from ..topology.render import render_svg, render_text

    if args.svg:
        try:
            with open(args.svg, "w", encoding="utf-8") as f:
                f.write(render_svg(cluster))
        except OSError as e:
            raise TopologyError(f"{args.svg}: cannot write the picture: {e.strerror or e}") from None
    if args.json:
        sys.stdout.write(cluster.to_json() + "\n")
        # stdout stays pure JSON for scripts; the warnings (also in the JSON) go to stderr.
        for node in cluster.nodes:
            for w in node.warnings:
                print(f"warning: {w}", file=sys.stderr)
    else:
        sys.stdout.write(render_text(cluster))
        if args.svg:
            sys.stdout.write(f"picture written to {os.fspath(args.svg)}\n")
    return 0


def _from_file(args: argparse.Namespace):
    from ..topology.files import load_cluster_file

    if len(args.from_file) > 1:
        from ..topology.merge import load_merged
        from ..topology.model import ClusterTopology
        from ..topology.network import network_from_nodes

        node = load_merged(args.from_file, gpu_name=args.gpu_name)
        cluster = ClusterTopology(nodes=[node], network=network_from_nodes([node]))
    else:
        cluster = load_cluster_file(args.from_file[0], gpu_name=args.gpu_name)
    if args.nvlink_status:
        from ..topology.nvlink_status import parse_nvlink_status, refine_nvlink_bandwidth

        if len(cluster.nodes) != 1:
            raise TopologyError(f"{args.nvlink_status}: --nvlink-status refines a single-node capture; "
                                f"{args.from_file[0]} has {len(cluster.nodes)} nodes")
        try:
            with open(args.nvlink_status, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError as e:
            raise TopologyError(f"{args.nvlink_status}: cannot read: {e.strerror or e}") from None
        refine_nvlink_bandwidth(cluster.nodes[0], parse_nvlink_status(text, source=args.nvlink_status))
    return cluster
