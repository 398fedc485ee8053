"""`node-labels`: this machine's Ray node labels, from the local probe, for `ray start --labels`.

Cluster start-up scripts run `ray start ... --labels "$(python -m orchestrator node-labels)"`
so every node advertises what the planner and a label selector care about: the GPU model,
how many GPUs, which NVLink domain they form, and how many RDMA NIC rails leave the node.
The default output is Ray's `key=value,...` form (`--labels` in JSON is deprecated in Ray);
`--json` prints the same labels as a JSON object.
"""

from __future__ import annotations

import argparse
import json

from ..control.labels import format_labels, node_labels


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print a JSON object instead of key=value,...")


def run(args: argparse.Namespace) -> int:
    from ..topology.local import probe_local

    labels = node_labels(probe_local())
    print(json.dumps(labels, sort_keys=True) if args.json else format_labels(labels))
    return 0
