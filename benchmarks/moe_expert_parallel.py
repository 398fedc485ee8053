"""CPU throughput of the tiny MoE at ep=2 against ep=1, side by side on 2 gloo ranks.

    python benchmarks/moe_expert_parallel.py [--quick] [--steps N] [--rounds N]

Both run zero3 over the 2 ranks (dp_shard=2) with the runtime's own `parallelize`: at ep=1
every rank runs all 8 experts of each MoE block on its own tokens (FSDP2 gathering them per
block); at ep=2 each rank holds 4 experts and the tokens travel to them and back by
all-to-all. The two alternate round by round in one process world, so a busy host falls on
both. Figure: steady-state tokens/s (the mean step after the first few) per ep, and their
ratio. Writes benchmarks/results/moe_expert_parallel.json.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import parse_args, print_table, run, steady_mean, write_result  # noqa: E402

WORLD = 2
BATCH = 8
SEQ = 64


def options(ap) -> None:
    ap.add_argument("--steps", type=int, default=30, help="steps per ep per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of (ep=1, ep=2)")


def _rank(rank: int, init: str, out: str, steps: int, rounds: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from orchestrator.planning.mesh import Mesh
    from orchestrator.planning.resolve import resolve
    from orchestrator.runtime.parallelize import build_mesh, data_parallel_rank, parallelize
    from orchestrator.workloads import moe
    from orchestrator.workloads.gpt import param_groups

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=WORLD)
    step_s: dict[int, list[float]] = {1: [], 2: []}
    try:
        for _ in range(rounds):
            for ep in (1, 2):
                ex = resolve("zero3", Mesh(dp_shard=WORLD, ep=ep), precision="fp32", device="cpu", max_steps=steps)
                mesh = build_mesh(ex.mesh, "cpu")
                dp_rank, dp_world = data_parallel_rank(mesh)
                torch.manual_seed(0)
                par = parallelize(moe.build("tiny"), ex, mesh,
                                  lambda m: torch.optim.AdamW(param_groups(m, 0.1), lr=1e-3), torch.device("cpu"))
                g = torch.Generator().manual_seed(rank)
                times = []
                for _step in range(steps):
                    ids = torch.randint(0, 256, (BATCH // dp_world, SEQ + 1), generator=g)
                    dist.barrier()
                    start = time.perf_counter()
                    logits = par.model(ids[:, :-1])
                    F.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1)).backward()
                    par.optimizer.step()
                    par.zero_grad()
                    dist.barrier()
                    times.append(time.perf_counter() - start)
                step_s[ep].append(steady_mean(times))
        if rank == 0:
            Path(out).write_text(json.dumps(step_s))
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    import torch.multiprocessing as mp

    args = parse_args(__doc__, argv, options)
    steps, rounds = (10, 1) if args.quick else (args.steps, args.rounds)
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "steps.json")
        mp.spawn(_rank, args=(os.path.join(scratch, "init"), out, steps, rounds), nprocs=WORLD, join=True)
        step_s = {int(k): v for k, v in json.loads(Path(out).read_text()).items()}
    tokens = BATCH * SEQ
    figures = {ep: {"step_s": min(times), "tokens_per_s": tokens / min(times), "rounds_step_s": times}
               for ep, times in step_s.items()}
    ratio = figures[2]["tokens_per_s"] / figures[1]["tokens_per_s"]
    print_table("tiny MoE, zero3 on 2 CPU ranks", ["ep", "step (ms)", "tokens/s"],
                [(ep, f"{f['step_s'] * 1e3:.1f}", f"{f['tokens_per_s']:.0f}") for ep, f in figures.items()],
                caption=f"ep=2 / ep=1 throughput: {ratio:.2f}x (best round of {rounds}, {steps} steps each)")
    write_result("moe_expert_parallel", {"world": WORLD, "batch": BATCH, "seq": SEQ, "steps": steps,
                                         "rounds": rounds, "by_ep": figures, "ep2_over_ep1": ratio}, args)
    return 0


if __name__ == "__main__":
    run(main)
