"""Placement gain: the topology-aware plan's predicted step time against a topology-blind one.

    python benchmarks/placement_gain.py [--quick]

For every real capture in tests/fixtures/topology that describes a node's wiring, and for
every ready cluster shape in conf/cluster (as shipped, and at 4 nodes), per model size:

* blind: DDP over every GPU, no pipeline (`parallel.pp=1`), with ranks in Ray's default order
  (rank i on GPU i of node i // g), the best DDP micro-batch and recomputation the planner finds;
* placed: the planner's choice of strategy and mesh, but with ranks in Ray's default order
  (the gain of the strategy alone);
* equal links: what a tool that treats every link alike decides: the planner run on a copy of
  each node whose links all carry the node's mean bandwidth and latency, its choice then priced
  on the real wiring with ranks in Ray's default order;
* aware: the planner's plan, its strategy, mesh and rank layout.

All three are priced by the planner's own cost functions (`planning.cost.estimate` on a
`ClusterLayout`), so the figures differ only in what is chosen, never in how it is priced.
Writes benchmarks/results/placement_gain.json.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from _common import ROOT, parse_args, print_table, run, write_result

FIXTURES = ROOT / "tests" / "fixtures" / "topology"
SHAPES = ROOT / "conf" / "cluster"
# GPU model of each capture (the captures that do not name one), from tests/fixtures/README.md.
CAPTURE_GPUS = {
    "nccl_xml_aws_p4d-24xl-topo.xml": "A100-40GB",
    "nccl_xml_aws_p5.48xl-topo.xml": "H100",
    "nccl_xml_aws_g5.48xl-topo.xml": "A10G",
    "topo_4gpu_pcie_pxb_pix_nccl667.txt": "A100-40GB",
    "topo_4x_a100_nv4_nccltests331.txt": "A100",
    "topo_8x4090_pcie_gpuallocator17.txt": "RTX-4090",
    "topo_8x_rtxa6000_nvlink_pairs_unige3741.txt": "RTX-A6000",
    "topo_a100_8gpu_mlengineering.txt": "A100",
    "topo_dgx_a100_40gb_nics_nccl1505_PARTIAL.txt": "A100-40GB",
    "topo_h100_8gpu_mlengineering.txt": "H100",
    "topo_hgx_h100_nics_nccl1264.txt": "H100",
}
# GPT-3 paper shapes (Brown et al. 2020, Table 2.1) and a Llama-2-7B-sized decoder.
MODELS = {
    "125M": ["model.n_layer=12", "model.n_head=12", "model.n_embd=768", "model.vocab_size=50304",
             "model.block_size=2048"],
    "1.3B": ["model.n_layer=24", "model.n_head=16", "model.n_embd=2048", "model.vocab_size=50304",
             "model.block_size=2048"],
    "7B": ["model.n_layer=32", "model.n_head=32", "model.n_embd=4096", "model.vocab_size=32000",
           "model.block_size=4096", "model.bias=false"],
}
GLOBAL_BATCH = "train.global_batch_size=256"
SCALED_NODES = 4
# Below this the difference is within the cost model's own error: topology does not matter.
MATTERS = 0.02


def clusters(quick: bool) -> list[dict[str, Any]]:
    """(name, gpu, topology) of every capture that describes a node's wiring, and of each ready
    shape; captures that are not a node's wiring (per-GPU link lists, bandwidth tests, a node
    without GPUs) are listed with the reason they are left out."""
    from omegaconf import OmegaConf

    from orchestrator.errors import UserError
    from orchestrator.planning.describe import describe_cluster
    from orchestrator.topology.files import load_topology_file
    from orchestrator.topology.model import Network
    from orchestrator.topology.network import network_from_nodes

    out = []
    for path in sorted(FIXTURES.iterdir()):
        gpu = CAPTURE_GPUS.get(path.name)
        try:
            node = load_topology_file(path, gpu)
        except UserError as e:
            out.append({"name": path.name, "skipped": str(e).split(";")[0].replace(str(path) + ": ", "")})
            continue
        if node.num_devices < 2:
            out.append({"name": path.name, "skipped": f"describes {node.num_devices} GPUs: nothing to place"})
            continue
        topo = describe_cluster(node, 1, network_from_nodes([node]), gpu)
        out.append({"name": path.name, "gpu": gpu, "nodes": 1, "topology": topo})
    for shape in sorted(SHAPES.glob("*.yaml")):
        c = OmegaConf.load(shape).cluster
        node = load_topology_file(ROOT / "conf" / c.topology_file, c.gpu)
        net = Network(float(c.inter_node_gbps), float(c.inter_node_latency_us), "config")
        for nodes in sorted({int(c.get("nodes", 1)), SCALED_NODES}):
            if quick and nodes == 1:
                continue  # the 1-node shapes repeat the captures they are made of
            out.append({"name": f"conf/cluster/{shape.stem}", "gpu": c.gpu, "nodes": nodes,
                        "topology": describe_cluster(node, nodes, net, c.gpu)})
    return out


def identity_layout(wirings, mesh):
    """The layout Ray's default order gives: local rank j on GPU j of every node, with the
    in-node rings each axis then crosses, measured as the planner measures its own."""
    from orchestrator.planning.layout import cluster_layout

    return cluster_layout(wirings, mesh, topology_aware=False)


def equal_links(topo):
    """A copy of `topo` in which every link of a node carries that node's mean bandwidth and
    latency: the cluster as a topology-blind tool sees it."""
    import copy

    flat = copy.deepcopy(topo)
    for node in flat.nodes:
        if node.links:
            bw = sum(l.bandwidth_gbps for l in node.links) / len(node.links)
            lat = sum(l.latency_us for l in node.links) / len(node.links)
            for l in node.links:
                l.bandwidth_gbps, l.latency_us = bw, lat
    return flat


def _choice(plan):
    """The planner's choice in a Plan, as `cost.estimate` takes it (the all-reduce schedule left
    to the cost model, so it suits the layout it is priced on)."""
    from orchestrator.planning.cost import Choice

    return Choice(strategy=plan.strategy, mesh=plan.mesh, micro_batch=plan.micro_batch_size, recompute=plan.recompute,
                  compression=plan.sync.compression, accum_sync=plan.sync.accum_sync)


def compare(topo, gpu: str, model: list[str]) -> dict[str, Any]:
    """Predicted step seconds of the blind, placed and aware plans of one model on one cluster."""
    from orchestrator.config import load_config
    from orchestrator.errors import PlanError
    from orchestrator.planning import job_context, plan_job
    from orchestrator.planning.cost import estimate
    from orchestrator.planning.layout import Wirings

    overrides = [*model, GLOBAL_BATCH, f"cluster.gpu={gpu}"]
    cfg = load_config(None, overrides)
    ctx = job_context(cfg, topo)
    wirings = Wirings.of(topo)
    aware = plan_job(cfg, topo)
    out: dict[str, Any] = {
        "aware": {"strategy": str(aware.strategy), "mesh": aware.mesh.to_dict(), "fits": aware.fits,
                  "step_s": aware.step_time.total_s, "exposed_comm_s": aware.step_time.exposed_comm_s,
                  "gpu_order": [r.gpu for r in aware.ranks[:topo.nodes[0].num_devices]]},
    }
    chosen = _choice(aware)
    placed = estimate(ctx, identity_layout(wirings, chosen.mesh), chosen)
    out["placed"] = {"step_s": placed.total_s, "exposed_comm_s": placed.exposed_comm_s,
                     "fits": placed.fits(ctx.usable_bytes)}
    equal = plan_job(cfg, equal_links(topo))
    c = _choice(equal)
    priced = estimate(ctx, identity_layout(wirings, c.mesh), c)
    out["equal_links"] = {"strategy": str(equal.strategy), "mesh": equal.mesh.to_dict(), "step_s": priced.total_s,
                          "fits": priced.fits(ctx.usable_bytes)}
    try:
        ddp = plan_job(load_config(None, [*overrides, "parallel.strategy=ddp", "parallel.tp=1", "parallel.pp=1"]),
                       topo)
    except PlanError as e:
        out["blind"] = {"step_s": None, "fits": False, "reason": str(e)}
    else:
        c = _choice(ddp)
        blind = estimate(ctx, identity_layout(wirings, c.mesh), c)
        out["blind"] = {"mesh": ddp.mesh.to_dict(), "step_s": blind.total_s, "exposed_comm_s": blind.exposed_comm_s,
                        "fits": blind.fits(ctx.usable_bytes), "micro_batch_size": c.micro_batch,
                        "recompute": str(c.recompute)}
    a, b, p = out["aware"]["step_s"], out["blind"]["step_s"], out["placed"]["step_s"]
    out["speedup_vs_blind"] = b / a if b and out["blind"]["fits"] and out["aware"]["fits"] else None
    out["placement_speedup"] = p / a if out["aware"]["fits"] else None
    e = out["equal_links"]
    out["speedup_vs_equal_links"] = e["step_s"] / a if e["fits"] and out["aware"]["fits"] else None
    return out


def verdict(row: dict[str, Any]) -> str:
    """Where topology awareness matters, in words."""
    blind, placement = row["speedup_vs_blind"], row["placement_speedup"]
    if not row["aware"]["fits"]:
        return "nothing fits"
    parts = [] if row["blind"]["fits"] else ["blind DDP does not fit"]
    if placement is not None and placement - 1 >= MATTERS:
        parts.append(f"rank layout {placement:.2f}x")
    if row["blind"]["fits"] and blind is not None and blind / (placement or 1) - 1 >= MATTERS:
        parts.append(f"strategy {blind / (placement or 1):.2f}x")
    equal = row["speedup_vs_equal_links"]
    if not row["equal_links"]["fits"]:
        parts.append("the equal-links plan does not fit")
    elif equal is not None and equal - 1 >= MATTERS:
        parts.append(f"vs equal links {equal:.2f}x")
    return "; ".join(parts) if parts else "does not matter"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__, argv)
    t0 = time.perf_counter()
    models = {k: MODELS[k] for k in (("125M", "7B") if args.quick else MODELS)}
    rows, skipped = [], []
    for c in clusters(args.quick):
        if "skipped" in c:
            skipped.append({"name": c["name"], "reason": c["skipped"]})
            continue
        for size, model in models.items():
            r = compare(c["topology"], c["gpu"], model)
            rows.append({"cluster": c["name"], "gpu": c["gpu"], "nodes": c["nodes"], "model": size, **r})
            rows[-1]["verdict"] = verdict(rows[-1])
    ms = lambda v: v * 1e3 if v is not None else None  # noqa: E731
    print_table(
        "predicted step time (ms): topology-blind DDP vs the topology-aware plan",
        ["cluster", "GPU", "nodes", "model", "blind DDP", "equal-links plan", "plan, Ray order", "aware plan",
         "aware mesh", "speedup", "where it matters"],
        [[Path(r["cluster"]).stem[:32], r["gpu"], r["nodes"], r["model"],
          ms(r["blind"]["step_s"]) if r["blind"]["fits"] else "no fit",
          ms(r["equal_links"]["step_s"]) if r["equal_links"]["fits"] else "no fit",
          ms(r["placed"]["step_s"]), ms(r["aware"]["step_s"]),
          f"{r['aware']['strategy']} " + "x".join(str(v) for v in r["aware"]["mesh"].values()),
          r["speedup_vs_blind"], r["verdict"]] for r in rows],
        caption="mesh: pp x dp_replicate x dp_shard x tp; speedup = blind / aware",
    )
    for s in skipped:
        print(f"left out {s['name']}: {s['reason']}")
    out = write_result("placement_gain", {"global_batch": GLOBAL_BATCH, "models": models, "rows": rows,
                                          "skipped": skipped, "seconds": time.perf_counter() - t0}, args)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    run(main)
