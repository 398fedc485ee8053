"""`plan`: show the plan for a job on this cluster, or on a described one.

`--topology FILE` (any probe format, one node) with `--nodes N` and `--gpu MODEL` describes a
cluster without probing; so does `cluster.topology_file` (and `cluster.nodes`) in the job, e.g.
through a ready shape in `conf/cluster/`. The network between nodes comes from
`cluster.inter_node_gbps` / `cluster.inter_node_latency_us`, else from the capture's NICs, as
for a probed cluster (`topology.network`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..config import JobConfig, conf_dir, load_config
from ..errors import ConfigError
from ..topology.model import ClusterTopology


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", nargs="?", help="job YAML file (omit for the defaults)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. parallel.tp=2")
    parser.add_argument("--topology", metavar="FILE", action="append",
                        help="plan for this node capture instead of probing; give it twice to merge an NCCL XML "
                             "(PCI tree, NICs) with a `nvidia-smi topo -m` (NVLink) of the same machine")
    parser.add_argument("--nodes", type=int, metavar="N", help="the described cluster has N such nodes")
    parser.add_argument("--gpu", metavar="MODEL",
                        help="GPU model of the described nodes, e.g. H100, or as NVML names it "
                             "('NVIDIA A100-SXM4-40GB'); an SXM part adds the NVSwitch fabric an NCCL XML cannot show")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--svg", metavar="OUT", help="write a drawing of the rank layout on the topology to OUT")
    parser.add_argument("--calibration", metavar="RUN",
                        help="price the plans with the measured / predicted ratios a run's trial wrote "
                             "(RUN/calibration.json, parallel.trial), so the plan starts from what this cluster did")
    parser.add_argument("--rehearse", action="store_true",
                        help="run one training step of the plan's first rank (and last stage's) in this process on "
                             "fake tensors and a fake process group, and compare its memory and collectives with "
                             "the plan's predictions")


def _resolve(path: str, job: str | None) -> Path:
    p = Path(path)
    if p.is_absolute() or p.exists():
        return p
    for base in ([Path(job).resolve().parent] if job else []) + [conf_dir()]:
        if (base / p).exists():
            return base / p
    return p


def described_topology(cfg: JobConfig, path: str | list[str], nodes: int, job: str | None) -> ClusterTopology:
    """The cluster of `nodes` copies of the capture at `path` (or of two captures of one machine,
    merged), with the job's network settings."""
    from ..planning.describe import describe_cluster
    from ..topology.merge import load_merged
    from ..topology.network import network_from_nodes

    paths = [path] if isinstance(path, str) else path
    node = load_merged([_resolve(p, job) for p in paths], cfg.cluster.gpu)
    # The job's cluster.inter_node_* settings take over from this figure when the plan is made.
    return describe_cluster(node, nodes, network_from_nodes([node]), cfg.cluster.gpu)


def live_topology(cfg: JobConfig) -> ClusterTopology:
    from ..connect.cluster import connect
    from ..topology.cluster_probe import probe_cluster

    with connect(cfg.cluster.address):
        return probe_cluster(num_cpu_slots=cfg.cluster.num_workers, cpus_per_worker=cfg.cluster.cpus_per_worker)


def _plan(cfg: JobConfig, topo: ClusterTopology, spec, calibration):
    """The plan `submit` would run on `topo`. Every node of a plan runs as many ranks, so where
    the nodes hold uneven numbers of workers (a small `ray start` cluster), the largest part of
    the cluster that holds them evenly is planned, as the driver does, and a note says so."""
    from ..control.elastic import plan_keeping_batch
    from ..planning import plan_job
    from ..planning.cluster_view import plannable

    view, left_out = plannable(topo)
    if len({n.num_devices for n in view.nodes}) <= 1:
        return plan_job(cfg, topo, spec=spec, calibration=calibration)
    plan, _, note = plan_keeping_batch(cfg, view, spec, left_out, calibration)
    if note:
        print(f"note: {note}", file=sys.stderr)
    return plan


def run(args: argparse.Namespace) -> int:
    from ..planning.calibration import UNCALIBRATED
    from ..planning.calibration import load as load_calibration
    from ..planning.render import render_svg, render_text
    from ..workloads.source import is_builtin_gpt

    overrides = list(args.overrides)
    if args.job and "=" in args.job and not Path(args.job).exists():
        overrides.insert(0, args.job)  # `plan key=value` with no job file
        args.job = None
    cfg = load_config(args.job, overrides)
    if args.calibration:
        cfg.parallel.calibration = args.calibration
    calibration = load_calibration(cfg.parallel.calibration) if cfg.parallel.calibration else UNCALIBRATED
    if args.gpu:
        cfg.cluster.gpu = args.gpu
    if args.nodes is not None and args.nodes < 1:
        raise ConfigError(f"--nodes: expected a positive number of nodes, got {args.nodes}")
    path = args.topology or cfg.cluster.topology_file
    if path:
        topo = described_topology(cfg, path, args.nodes or cfg.cluster.nodes, args.job)
    elif args.nodes or args.gpu:
        raise ConfigError("--nodes and --gpu describe a cluster: give its node with --topology FILE "
                          "(or cluster.topology_file)")
    else:
        topo = live_topology(cfg)
    spec = None
    if not is_builtin_gpt(cfg.model):
        # Deferred: measuring a model imports torch, which planning the built-in GPT never needs.
        from ..workloads.inspect import model_spec

        spec = model_spec(cfg.model)
    plan = _plan(cfg, topo, spec, calibration)
    if spec is not None and not spec.compile_checked and (plan.compile.enabled or cfg.train.compile == "true"):
        from ..control.preflight import compile_checked

        # Traced only once the plan would compile: planned again with what the trace found.
        spec = compile_checked(cfg, spec)
        plan = _plan(cfg, topo, spec, calibration)
    if args.svg:
        Path(args.svg).write_text(render_svg(plan, topo))
    if args.json:
        out = plan.to_dict()
        if args.rehearse:
            from .rehearsal_view import rehearsal_report

            try:
                out["rehearsal"] = rehearsal_report(cfg, plan, topo, spec)
            except Exception:
                json.dump(out, sys.stdout, indent=2)  # the plan stands even when its step cannot be rehearsed
                sys.stdout.write("\n")
                raise
        json.dump(out, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(render_text(plan, topo))
        if args.rehearse:
            from .rehearsal_view import rehearsal_report, render_rehearsal

            sys.stdout.flush()
            print(render_rehearsal(rehearsal_report(cfg, plan, topo, spec)))
    # What the capture could not say (NVLink missing from an XML, an assumed lane rate) is said
    # with every plan made from it; on stderr under --json, so stdout stays JSON.
    for w in dict.fromkeys(w for n in topo.nodes for w in n.warnings):
        print(f"topology warning: {w}", file=sys.stderr if args.json else sys.stdout)
    return 0
