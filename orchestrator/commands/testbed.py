"""`testbed`: a local multi-node Ray cluster on a shaped network, to rehearse a plan on.

    python -m orchestrator testbed --nodes 2 --per-node 2 --inter-gbit 1 --inter-ms 1 -- \\
        python -m orchestrator submit jobs/llm.yaml cluster.address=auto cluster.measure=true

Starts N Ray nodes, each in its own network namespace, joined through a bridge whose links
are limited to G Gbit/s and delayed M ms one way (see `orchestrator.testbed`), runs COMMAND
inside the head's namespace with RAY_ADDRESS pointing at the cluster (an interactive shell
when no command is given), and removes every namespace and process when it ends, on Ctrl-C
too. Needs root. Addresses come from 198.18.0.0/15 and the host's own network is not touched.
"""

from __future__ import annotations

import argparse
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=2, help="Ray nodes, one network namespace each (default 2)")
    parser.add_argument("--per-node", type=int, default=2, help="CPU slots per node (default 2)")
    parser.add_argument("--gpus-per-node", type=int, default=0, help="fake GPUs each node declares (default 0)")
    parser.add_argument("--topology", metavar="FILE", default=None,
                        help="a capture each node declares as its wiring (with --gpus-per-node)")
    parser.add_argument("--inter-gbit", type=float, default=1.0, help="inter-node link, Gbit/s per direction")
    parser.add_argument("--inter-ms", type=float, default=1.0, help="inter-node one-way delay, ms")
    parser.add_argument("--prefix", default="orch-", help="name prefix of the namespaces (default orch-)")
    parser.add_argument("--subnet", default="198.18.0.0/24", help="the nodes' subnet inside 198.18.0.0/15")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="what to run in the head's namespace")


def run(args: argparse.Namespace) -> int:
    from ..testbed.cluster import ClusterSpec, ShapedCluster
    from ..testbed.network import NetworkSpec, Shaping

    spec = ClusterSpec(nodes=args.nodes, slots_per_node=args.per_node, gpus_per_node=args.gpus_per_node,
                       topology_file=args.topology, shaping=Shaping(args.inter_gbit, args.inter_ms),
                       network=NetworkSpec(prefix=args.prefix, subnet=args.subnet))
    command = [c for c in args.command if c != "--"] or [os.environ.get("SHELL", "/bin/sh")]
    with ShapedCluster(spec) as cluster:
        delay = "" if cluster.delay_applied or args.inter_ms == 0 else " (delay not applied: the kernel has no netem)"
        print(f"shaped cluster at {cluster.address}: {args.nodes} nodes, {args.inter_gbit} Gbit/s, "
              f"{args.inter_ms} ms{delay}", flush=True)
        return cluster.run_in_head(command, check=False).returncode
