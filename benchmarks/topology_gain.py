"""Topology gain, measured: the aware plan against the equal-links plan on a shaped cluster.

    sudo python benchmarks/topology_gain.py --nodes 2 --per-node 2 --inter-gbit G [G ...] --inter-ms M [--quick]

Builds a local cluster of N Ray nodes, each in its own network namespace, whose links to each
other are shaped to G Gbit/s (`orchestrator.testbed`); loopback inside a node stays unshaped.
M ms of one-way delay is added only where the kernel has `sch_netem`; where it has not (the
run says so, and the JSON records `delay_applied: false`), the link has its rate and the
latency of the namespaces' own path, nothing else. Inside the head's namespace it runs
`probe --measure` (the inter-node link as the probe measures it), then trains one job with
`submit` under two plans:

* aware: the plan made from the measured topology;
* blind: the plan the same search makes when it sees every link alike: the inter-node link
  given the intra-node link's measured bandwidth and latency (the equal-links baseline of
  `placement_gain.py`), its choice then run on the real, shaped cluster;
* trial: the aware job with `parallel.trial=3`: the planner's choice, the equal-links plan and
  the fastest runner-up inside the cost model's error band each run a few steps on the
  cluster before the run, and the fastest measured one trains (what a user gets).

The three alternate (aware, blind, trial, then in reverse order, ...) for `--rounds` rounds,
so that a host whose load drifts slows all alike; each plan's figure is the median of its
steady steps (the first of every run dropped) over all its rounds. Several `--inter-gbit`
rates sweep in one invocation, a fresh shaped cluster each; every rate writes its own JSON and
the sweep one table (results/topology_gain_sweep.json).

The job is one whose plan the wiring decides: a GPT with a large vocabulary and a small body
(n_embd 256, 2 layers, vocab 50304, 32-token blocks, 2 sequences per rank). Its 14.5M
parameters make 58 MB of fp32 gradients per step against about a second of CPU work on a
2-core host (compute, optimizer, DDP's copies), so up to a few hundred Mbit/s the step is
decided by how gradients cross the slow link; above that the CPU's own per-parameter costs
outweigh the bytes the hierarchical schedule saves (benchmarks/README.md has the regime). Over equal links a flat
ring all-reduce is the cheapest (one collective, no extra in-node steps); over a slow network
the aware plan reduce-scatters inside each node first, so only 1/K of the gradient crosses the
network from each rank (per node, n bytes out instead of a flat ring's 2(p-1)/p n). Tensor
parallelism is pinned off (`parallel.tp=1`): splitting a 256-wide layer over CPU slots buys
nothing, and it is the data-parallel sync this measures. The planner's predicted step time of
each plan on the measured cluster is reported beside the measured one, and the predicted
speedup is the planner's on the view that chose the aware plan: the blind plan priced on the
aware run's own probe over the aware plan's own figure. The last line printed is one JSON
object. Writes benchmarks/results/topology_gain_<G>gbit.json (or --out, for one rate). Needs
root (namespaces).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import ROOT, parse_args, print_table, rel_error, run, write_result

JOB = ROOT / "jobs" / "llm.yaml"
MODEL = ["model.n_layer=2", "model.n_head=4", "model.n_embd=256", "model.vocab_size=50304", "model.block_size=32",
         "parallel.tp=1"]
SEQUENCES_PER_RANK = 2
# Dropped from every run: lazily built buffers, the first gloo connections, the allocator.
WARMUP_STEPS = 2


def options(ap) -> None:
    ap.add_argument("--nodes", type=int, default=2, help="Ray nodes, one network namespace each")
    ap.add_argument("--per-node", type=int, default=2, help="CPU-slot workers per node")
    ap.add_argument("--inter-gbit", type=float, nargs="+", default=[0.2],
                    help="inter-node link, Gbit/s per direction; several sweep, a fresh cluster each")
    ap.add_argument("--inter-ms", type=float, default=0.0,
                    help="inter-node one-way delay, ms (applied only where the kernel has netem)")
    ap.add_argument("--steps", type=int, default=None, help="training steps per run (default 10, --quick 6)")
    ap.add_argument("--rounds", type=int, default=None, help="aware/blind pairs of runs (default 3, --quick 1)")
    ap.add_argument("--prefix", default="orch-", help="name prefix of the shaped network's namespaces; "
                    "a second run beside a live one needs its own, and its own --subnet")
    ap.add_argument("--subnet", default="198.18.0.0/24", help="the nodes' addresses, inside 198.18.0.0/15")


def _in_head(cluster, args: list[str], env: dict[str, str]) -> str:
    res = cluster.run_in_head([sys.executable, "-m", "orchestrator", *args], env=env, capture=True)
    return res.stdout


def _submit(cluster, env: dict[str, str], runs: Path, overrides: list[str]) -> dict[str, Any]:
    runs.mkdir(parents=True, exist_ok=True)
    before = set(runs.iterdir())
    _in_head(cluster, ["submit", str(JOB), *overrides, f"monitor.runs_dir={runs}"], env)
    (run,) = set(runs.iterdir()) - before
    plan = json.loads((run / "plan.json").read_text())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r["step_s"] for r in rows if r.get("step_s") is not None][WARMUP_STEPS:]
    # Read now: the run directory goes with the benchmark's temporary folder.
    return {"run_dir": str(run), **plan_summary(plan), "steps": steps, "trial_choice": _trial_choice(plan),
            "topology": json.loads((run / "topology.json").read_text())}


def plan_summary(plan: dict[str, Any]) -> dict[str, Any]:
    """What a run's plan.json says it ran and predicted: enough for `price_on` to price it again."""
    return {"strategy": plan["strategy"], "mesh": plan["mesh"], "sync": plan.get("sync", {}).get("algorithm"),
            "micro_batch_size": plan.get("micro_batch_size"), "recompute": plan.get("recompute"),
            "pipeline": plan.get("pipeline"), "accum_sync": plan.get("sync", {}).get("accum_sync"),
            "predicted_step_s": plan["step_time"]["total_s"]}


def price_on(topology: dict[str, Any], overrides: list[str], run: dict[str, Any]) -> dict[str, Any]:
    """The planner's step time of a run's plan on the measured cluster: the plan's own strategy,
    mesh, micro-batch, recomputation and all-reduce schedule, priced by `cost.estimate` on the
    topology the probe measured (how `placement_gain.py` prices its equal-links plan)."""
    from orchestrator.choices import AccumSync, PipelineSchedule, Recompute, Strategy, SyncAlgorithm
    from orchestrator.config import load_config
    from orchestrator.planning import job_context
    from orchestrator.planning.cost import Choice, estimate
    from orchestrator.planning.layout import Wirings, cluster_layout
    from orchestrator.planning.mesh import Mesh
    from orchestrator.topology.model import ClusterTopology

    topo = ClusterTopology.from_dict(topology)
    ctx = job_context(load_config(str(JOB), overrides), topo)
    # The whole mesh, pp included: a pipeline's mesh without its pp axis covers a fraction of
    # the cluster, which cluster_layout refuses.
    mesh = Mesh.from_dict(run["mesh"])
    pl = run.get("pipeline") or {}
    choice = Choice(Strategy(run["strategy"]), mesh, int(run["micro_batch_size"]), Recompute(run["recompute"]),
                    algorithm=SyncAlgorithm(run["sync"]),
                    pp_schedule=PipelineSchedule(pl.get("schedule", PipelineSchedule.one_f_one_b)),
                    virtual=int(pl.get("virtual", 1)),
                    accum_sync=AccumSync(run.get("accum_sync") or AccumSync.last_micro_step))
    e = estimate(ctx, cluster_layout(Wirings.of(topo), mesh), choice)
    return {"step_s": e.total_s, "compute_s": e.compute_s, "comm_s": e.comm_s, "comm_parts": e.comm_parts,
            "schedule": e.schedule}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__, argv, options)
    if len(args.inter_gbit) > 1 and args.out:
        raise SystemExit("error: --out names one file; a sweep writes one per rate")
    rates = [measure_rate(args, gbit, argv) for gbit in args.inter_gbit]
    if len(rates) > 1:
        sweep(args, rates)
    return 0


def measure_rate(args, gbit: float, argv: list[str] | None) -> dict[str, Any]:
    """Aware, blind and trial runs on a cluster shaped to `gbit`; writes and returns its result."""
    from orchestrator.testbed.cluster import ClusterSpec, ShapedCluster
    from orchestrator.testbed.network import NetworkSpec, Shaping

    steps = args.steps or (6 if args.quick else 10)
    rounds = args.rounds or (1 if args.quick else 3)
    t0 = time.perf_counter()
    spec = ClusterSpec(nodes=args.nodes, slots_per_node=args.per_node, shaping=Shaping(gbit, args.inter_ms),
                       network=NetworkSpec(args.prefix, args.subnet))
    loads = []
    with tempfile.TemporaryDirectory(prefix="topology-gain-") as tmp, ShapedCluster(spec) as cluster:
        env = {"ORCHESTRATOR_MEASURE_CACHE": f"{tmp}/measure"}
        delay = ("applied" if cluster.delay_applied else
                 "NOT applied: this kernel has no netem, so the link has its rate and no added delay")
        print(f"shaped cluster up: {args.nodes} nodes x {args.per_node} slots, {gbit} Gbit/s, "
              f"{args.inter_ms} ms one way (delay {delay})", flush=True)
        probe = json.loads(_in_head(cluster, ["probe", "--measure", "--json", "--address", "auto"], env))
        net = probe["network"]
        intra = [l for n in probe["nodes"] for l in n.get("links", []) if l.get("measured")]
        intra_gbps = statistics.median(l["bandwidth_gbps"] for l in intra) if intra else None
        intra_lat = statistics.median(l["latency_us"] for l in intra) if intra else None
        measured_gbit = net["bandwidth_gbps"] * 8
        print(f"probe: inter-node {measured_gbit:.3g} Gbit/s, {net['latency_us']:.0f} us; "
              f"intra-node {intra_gbps} GB/s, {intra_lat} us", flush=True)
        common = [*MODEL, f"train.global_batch_size={SEQUENCES_PER_RANK * args.nodes * args.per_node}",
                  f"train.max_steps={steps}", f"train.eval_interval={steps}", "train.eval_iters=1",
                  "checkpoint.enabled=false", "monitor.progress=false", "monitor.dashboard=false",
                  "cluster.address=auto", f"cluster.num_workers={args.per_node}", "cluster.measure=true"]
        plans = {"aware": [*common, "parallel.trial=off"],
                 "blind": [*common, "parallel.trial=off", f"cluster.inter_node_gbps={intra_gbps}",
                           f"cluster.inter_node_latency_us={intra_lat}"],
                 "trial": [*common, "parallel.trial=3"]}
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in plans}
        for r in range(rounds):
            # Alternate the order, so a drift in the host's load favours none.
            for name in (tuple(plans) if r % 2 == 0 else tuple(reversed(plans))):
                run = _submit(cluster, env, Path(tmp) / "runs" / name, plans[name])
                loads.append(os.getloadavg()[0])
                runs[name].append(run)
                print(f"round {r + 1}/{rounds} {name}: {run['strategy']} {run['mesh']} sync {run['sync']}, "
                      f"median {statistics.median(run['steps']):.3f} s over {len(run['steps'])} steps, "
                      f"load {loads[-1]:.1f}", flush=True)
    result: dict[str, Any] = {}
    for name in plans:
        first = runs[name][0]
        all_steps = [s for run in runs[name] for s in run["steps"]]
        result[name] = {k: first[k] for k in ("strategy", "mesh", "sync", "micro_batch_size", "recompute")}
        result[name].update(measured_step_s=statistics.median(all_steps), steps_timed=len(all_steps),
                            run_medians=[statistics.median(run["steps"]) for run in runs[name]],
                            planned_step_s=first["predicted_step_s"],
                            priced_on_measured=price_on(probe, common, first))
    result["trial"]["choices"] = [run["trial_choice"] for run in runs["trial"]]
    a, b, t = (result[k]["measured_step_s"] for k in ("aware", "blind", "trial"))
    # The predicted speedup is the planner's on one view of the cluster: the aware run's own
    # probe, which chose its plan. (Each run probes afresh, and link and compute readings move
    # by several percent between runs: dividing predictions made on two views mixes that in.)
    pa = result["aware"]["planned_step_s"]
    result["blind"]["priced_on_aware_view"] = price_on(runs["aware"][0]["topology"], common, runs["blind"][0])
    pb = result["blind"]["priced_on_aware_view"]["step_s"]
    rows = [[name, r["strategy"], "x".join(str(v) for v in r["mesh"].values()), r["sync"], pred,
             r["measured_step_s"], r["steps_timed"]]
            for name, r, pred in (("aware (measured links)", result["aware"], pa),
                                  ("blind (equal links)", result["blind"], pb),
                                  ("trial (parallel.trial=3)", result["trial"], result["trial"]["planned_step_s"]))]
    delay = "applied" if cluster.delay_applied else "none (no netem)"
    print_table(f"{args.nodes}x{args.per_node} CPU slots, inter-node {gbit} Gbit/s "
                f"(probe: {measured_gbit:.3g} Gbit/s), delay {delay}",
                ["plan", "strategy", "mesh", "sync", "predicted step s", "measured step s", "steps timed"], rows,
                caption="mesh: pp x dp_replicate x dp_shard x tp; predicted: the aware plan's own figure, the blind "
                        "plan priced on the aware run's probe, the trial's kept plan's own figure; "
                        f"measured: median over {rounds} interleaved runs each")
    summary = {"nodes": args.nodes, "per_node": args.per_node, "inter_gbit": gbit,
               "inter_ms": args.inter_ms, "delay_applied": cluster.delay_applied,
               "measured_inter_gbit": measured_gbit, "probe_error": rel_error(measured_gbit, gbit)
               if gbit else None, "measured_inter_latency_us": net["latency_us"],
               "aware_step_s": a, "blind_step_s": b, "speedup": b / a, "trial_step_s": t, "trial_speedup": b / t,
               "trial_vs_blind_ok": t <= b / 0.98,
               "predicted_aware_step_s": pa, "predicted_error": rel_error(pa, a),
               "predicted_blind_step_s": pb, "predicted_blind_error": rel_error(pb, b),
               "predicted_speedup": pb / pa, "speedup_prediction_error": rel_error(pb / pa, b / a),
               "load_average": [min(loads), max(loads)]}
    one = len(args.inter_gbit) == 1
    out = (args.out if one else None) or ROOT / "benchmarks" / "results" / f"topology_gain_{gbit:g}gbit.json"
    args.out = out
    arguments = list(argv if argv is not None else sys.argv[1:])
    out = write_result("topology_gain", {**summary, **result, "arguments": arguments, "probe_topology": probe,
                                         "model": MODEL, "rounds": rounds,
                                         "steps_per_run": steps, "intra_node_gbps": intra_gbps,
                                         "intra_node_latency_us": intra_lat,
                                         "seconds": time.perf_counter() - t0}, args)
    args.out = None
    print(f"wrote {out}")
    print(json.dumps(summary), flush=True)
    return {**summary, "aware": result["aware"], "blind": result["blind"], "trial": result["trial"]}


def _trial_choice(plan: dict[str, Any]) -> dict[str, Any]:
    """What a run's plan.json says its trial measured and kept."""
    trial = plan.get("trial") or {}
    if "skipped" in trial or not trial:
        return {"skipped": trial.get("skipped", "no trial")}
    kept = trial["candidates"][trial["winner"]]
    return {"kept": kept["label"], "overruled": trial["overruled"], "cost_s": trial["cost_s"],
            "candidates": [{k: c.get(k) for k in ("label", "strategy", "mesh", "sync", "predicted_step_s",
                                                  "measured_step_s", "measured_steps_s", "visits", "failed")}
                           for c in trial["candidates"]]}


def sweep(args, rates: list[dict[str, Any]]) -> None:
    """One row per rate: what the probe read, each plan, measured and predicted speedups."""
    def plan_of(r: dict[str, Any]) -> str:
        return f"{r['strategy']} {'x'.join(str(v) for v in r['mesh'].values())} {r['sync']}"

    rows = [[r["inter_gbit"], round(r["measured_inter_gbit"], 3), plan_of(r["aware"]), plan_of(r["blind"]),
             ", ".join(c.get("kept", "skipped") for c in r["trial"]["choices"]), r["aware_step_s"], r["blind_step_s"],
             r["trial_step_s"], r["speedup"], r["predicted_speedup"], r["trial_speedup"]] for r in rates]
    print_table("topology gain by link rate",
                ["Gbit/s", "probe", "aware plan", "blind plan", "trial kept", "aware s", "blind s", "trial s",
                 "speedup", "predicted", "trial speedup"], rows,
                caption="speedup: blind / aware measured step time; trial speedup: blind / the trial's kept plan")
    args.out = ROOT / "benchmarks" / "results" / "topology_gain_sweep.json"
    keys = ("inter_gbit", "measured_inter_gbit", "aware_step_s", "blind_step_s", "trial_step_s", "speedup",
            "predicted_speedup", "speedup_prediction_error", "trial_speedup", "trial_vs_blind_ok")
    out = write_result("topology_gain_sweep", {"rates": [{**{k: r[k] for k in keys},
                                                          "aware": plan_of(r["aware"]), "blind": plan_of(r["blind"]),
                                                          "trial": r["trial"]["choices"]} for r in rates],
                                               "arguments": list(args.argv)}, args)
    print(f"wrote {out}")


if __name__ == "__main__":
    run(main)
