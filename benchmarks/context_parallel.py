"""CPU step time under context parallelism: one long sequence shared by cp = 1, 2 and 4 ranks.

    python benchmarks/context_parallel.py [--quick] [--seq N] [--steps N]

The built-in Llama (dim 128, 2 layers, 4 heads, 2 key/value heads) trains on one sequence of
`--seq` tokens (4096; 2048 with --quick, which also leaves out cp=4) as zero3 over a cp group of
gloo ranks, one thread each, through the runtime's own `parallelize` and sequence hook
(`runtime/context_parallel.py`): each rank holds 2 of the 2 x cp head-tail chunks and attends
them to the whole sequence's keys and values, all-gathered. Figures per cp: the steady step
time (`_common.steady_mean`: warm-up steps left out), tokens/s, the keys and values each rank receives per layer in
forward, `(cp - 1)/cp x 2 x S x n_kv x head_dim x 4` bytes, and the loss of the first step
(the same under every cp: the same sequence and weights). On a host with fewer cores than
ranks the ranks share them: the step time then says what the split costs, not what it gains.
Writes benchmarks/results/context_parallel.json.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from _common import parse_args, print_table, run, steady_mean, write_result

DIM, LAYERS, HEADS, KV_HEADS, VOCAB = 128, 2, 4, 2, 256


def options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--seq", type=int, default=None, help="sequence length (4096; 2048 with --quick)")
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps per cp")


def _rank(rank: int, world: int, seq: int, steps: int, init: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from orchestrator.planning.mesh import Mesh
    from orchestrator.planning.resolve import resolve
    from orchestrator.runtime.context_parallel import ZigzagShard
    from orchestrator.runtime.parallelize import build_mesh, parallelize
    from orchestrator.workloads.llama import build

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        ex = resolve("zero3", Mesh(cp=world), precision="fp32", device="cpu", max_steps=steps)
        mesh = build_mesh(ex.mesh, "cpu")
        torch.manual_seed(0)
        model = build(dim=DIM, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=KV_HEADS, vocab_size=VOCAB,
                      ffn_dim=4 * DIM)
        par = parallelize(model, ex, mesh, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
                          torch.device("cpu"))
        tokens = torch.randint(0, VOCAB, (1, seq + 1), generator=torch.Generator().manual_seed(1))
        x, y = tokens[:, :-1], tokens[:, 1:]
        if world > 1:
            shard = ZigzagShard(mesh["cp"])
            x, y = shard.take(x), shard.take(y)
        times, losses = [], []
        for _ in range(steps):
            dist.barrier()
            t0 = time.perf_counter()
            logits = par.model(x)
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
            loss.backward()
            par.optimizer.step()
            par.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            times.append(time.perf_counter() - t0)
            losses.append(float(mean) / world)
        if rank == 0:
            with open(out, "w") as f:
                json.dump({"times": times, "losses": losses}, f)
    finally:
        dist.destroy_process_group()


def measure(cp: int, seq: int, steps: int) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(_rank, args=(cp, seq, steps, os.path.join(tmp, "init"), out), nprocs=cp, join=True)
        with open(out) as f:
            got = json.load(f)
    step_s = steady_mean(got["times"])
    head_dim = DIM // HEADS
    return {"cp": cp, "step_s": step_s, "tokens_per_s": seq / step_s, "first_loss": got["losses"][0],
            "kv_received_bytes_per_layer": int((cp - 1) / cp * 2 * seq * KV_HEADS * head_dim * 4),
            "step_times": got["times"]}


def main() -> None:
    args = parse_args(__doc__, None, options)
    seq = args.seq or (2048 if args.quick else 4096)
    cps = (1, 2) if args.quick else (1, 2, 4)
    rows = [measure(cp, seq, args.steps) for cp in cps]
    base = rows[0]["step_s"]
    for row in rows:
        row["speedup"] = base / row["step_s"]
    print_table(f"Llama at {seq} tokens, zero3 over a cp group of gloo ranks (one thread each)",
                ["cp", "step s", "tokens/s", "speedup", "K/V in per layer (KB)", "first loss"],
                [[r["cp"], r["step_s"], r["tokens_per_s"], r["speedup"], r["kv_received_bytes_per_layer"] / 1e3,
                  r["first_loss"]] for r in rows])
    path = write_result("context_parallel", {"seq": seq, "model": {"dim": DIM, "layers": LAYERS, "heads": HEADS,
                                                                   "kv_heads": KV_HEADS, "vocab": VOCAB},
                                             "rows": rows}, args)
    print(f"wrote {path}")


if __name__ == "__main__":
    run(main)
