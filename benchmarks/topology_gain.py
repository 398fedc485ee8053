"""Topology gain, measured: the aware plan against the equal-links plan on a shaped cluster.

    sudo python benchmarks/topology_gain.py --nodes 2 --per-node 2 --inter-gbit 1 --inter-ms 1 [--steps 30]

Builds a local cluster of N Ray nodes, each in its own network namespace, whose links to each
other are shaped to G Gbit/s and M ms one way (`orchestrator.testbed`); loopback inside a node
stays unshaped. Inside the head's namespace it runs `probe --measure` (the inter-node link as
the probe measures it), then trains one job twice with `submit`:

* aware: the plan made from the measured topology;
* blind: the plan the same search makes when it sees every link alike: the inter-node link
  given the intra-node link's measured bandwidth and latency (the equal-links baseline of
  `placement_gain.py`), its choice then run on the real, shaped cluster.

Ray Train's default rank order (rank i on node i // K) is the order both runs use on CPU
slots, so it is not run separately. The job: a GPT with a large vocabulary and a small body
(n_embd 256, 2 layers, vocab 50304, 64-token blocks): its 16M parameters make 64 MB of fp32
gradients per step against little compute, so the step is decided by how gradients cross the
slow link, which is the wiring question (on a GPU cluster the same ratio holds for a large model
over a slow network). The median steady step time of each run (the first steps dropped) and the
planner's predicted step time for the aware plan are reported; the last line printed is one
JSON object. Writes benchmarks/results/topology_gain.json (or --out). Needs root (namespaces).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import ROOT, parse_args, print_table, rel_error, write_result

MODEL = ["model.n_layer=2", "model.n_head=4", "model.n_embd=256", "model.vocab_size=50304", "model.block_size=32"]
WARMUP_STEPS = 5  # lazily built buffers, first gloo connections, the allocator


def _extra(ap) -> None:
    ap.add_argument("--nodes", type=int, default=2, help="Ray nodes, one network namespace each")
    ap.add_argument("--per-node", type=int, default=2, help="CPU-slot workers per node")
    ap.add_argument("--inter-gbit", type=float, default=1.0, help="inter-node link, Gbit/s per direction")
    ap.add_argument("--inter-ms", type=float, default=1.0, help="inter-node one-way delay, ms")
    ap.add_argument("--steps", type=int, default=25, help="training steps per run")
    ap.add_argument("--batch", type=int, default=4, help="global batch size (sequences)")


def _in_head(cluster, args: list[str], env: dict[str, str]) -> str:
    res = cluster.run_in_head([sys.executable, "-m", "orchestrator", *args], env=env, capture=True)
    return res.stdout


def _submit(cluster, env: dict[str, str], runs: Path, overrides: list[str]) -> dict[str, Any]:
    _in_head(cluster, ["submit", str(ROOT / "jobs" / "llm.yaml"), *overrides, f"monitor.runs_dir={runs}"], env)
    run = sorted(runs.glob("*/"), key=lambda p: p.stat().st_mtime)[-1]
    plan = json.loads((run / "plan.json").read_text())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r["step_s"] for r in rows if r.get("step_s") is not None][WARMUP_STEPS:]
    return {"run_dir": str(run), "strategy": plan["strategy"], "mesh": plan["mesh"],
            "sync": plan.get("sync", {}).get("algorithm"),
            "predicted_step_s": plan["step_time"]["total_s"],
            "measured_step_s": statistics.median(steps) if steps else None, "steps_timed": len(steps)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__, argv, _extra)
    from orchestrator.testbed.cluster import ClusterSpec, ShapedCluster
    from orchestrator.testbed.network import Shaping

    t0 = time.perf_counter()
    spec = ClusterSpec(nodes=args.nodes, slots_per_node=args.per_node, shaping=Shaping(args.inter_gbit, args.inter_ms))
    with tempfile.TemporaryDirectory(prefix="topology-gain-") as tmp, ShapedCluster(spec) as cluster:
        env = {"ORCHESTRATOR_MEASURE_CACHE": f"{tmp}/measure"}
        print(f"shaped cluster up: {args.nodes} nodes x {args.per_node} slots, {args.inter_gbit} Gbit/s, "
              f"{args.inter_ms} ms one way (delay {'applied' if cluster.delay_applied else 'NOT applied: no netem'})",
              flush=True)
        probe = json.loads(_in_head(cluster, ["probe", "--measure", "--json", "--address", "auto"], env))
        net = probe["network"]
        intra = [l for n in probe["nodes"] for l in n.get("links", []) if l.get("measured")]
        intra_gbps = statistics.median(l["bandwidth_gbps"] for l in intra) if intra else None
        intra_lat = statistics.median(l["latency_us"] for l in intra) if intra else None
        measured_gbit = net["bandwidth_gbps"] * 8
        print(f"probe: inter-node {measured_gbit:.3g} Gbit/s, {net['latency_us']:.0f} us; "
              f"intra-node {intra_gbps} GB/s, {intra_lat} us", flush=True)
        common = [*MODEL, f"train.global_batch_size={args.batch}", f"train.max_steps={args.steps}",
                  f"train.eval_interval={args.steps}", "train.eval_iters=1", "checkpoint.enabled=false",
                  "monitor.progress=false", "monitor.dashboard=false", "cluster.address=auto",
                  f"cluster.num_workers={args.per_node}", "cluster.measure=true"]
        runs = Path(tmp) / "runs"
        aware = _submit(cluster, env, runs / "aware", common)
        print(f"aware: {aware}", flush=True)
        blind = _submit(cluster, env, runs / "blind", [*common, f"cluster.inter_node_gbps={intra_gbps}",
                                                        f"cluster.inter_node_latency_us={intra_lat}"])
        print(f"blind: {blind}", flush=True)
    rows = [[name, r["strategy"], r["sync"], r["predicted_step_s"], r["measured_step_s"]]
            for name, r in (("aware (measured links)", aware), ("blind (equal links)", blind))]
    print_table(f"{args.nodes}x{args.per_node} CPU slots, inter-node {args.inter_gbit} Gbit/s {args.inter_ms} ms",
                ["plan", "strategy", "sync", "predicted step s", "measured step s"], rows,
                caption="Ray's default rank order equals both runs' order on CPU slots")
    a, b, p = aware["measured_step_s"], blind["measured_step_s"], aware["predicted_step_s"]
    summary = {"nodes": args.nodes, "per_node": args.per_node, "inter_gbit": args.inter_gbit, "inter_ms": args.inter_ms,
               "delay_applied": cluster.delay_applied, "measured_inter_gbit": measured_gbit,
               "measured_inter_latency_us": net["latency_us"], "aware_step_s": a, "blind_step_s": b,
               "predicted_aware_step_s": p, "speedup": b / a if a and b else None,
               # the runs are sequential: a host busy with other work skews one against the other
               "load_average_at_end": __import__("os").getloadavg()[0],
               "predicted_error": rel_error(p, a) if a else None}
    out = write_result("topology_gain", {**summary, "aware": aware, "blind": blind, "model": MODEL,
                                         "seconds": time.perf_counter() - t0}, args)
    print(f"wrote {out}")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
