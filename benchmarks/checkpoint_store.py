"""Checkpoint store: save and load time, and the step stall under async save, to a local S3 server against local disk.

    python benchmarks/checkpoint_store.py [--quick] [--ranks N] [--steps N]
                                          [--dim N] [--layers N] [--heads N] [--ffn N] [--vocab N]

A Llama-shaped model (`orchestrator.workloads.llama`; by default the 0.6B shape of
jobs/llama-0.6b-cpu.yaml: dim 1536, 20 layers, 16 heads and 8 key/value heads, SwiGLU width
4096, a 32k vocabulary) sharded
with FSDP2 (ZeRO-3) over plain CPU ranks on one gloo group, AdamW, a batch of one 128-token
sequence. The same checkpoints (`orchestrator.runtime.checkpoint`, as a run writes them: every
rank its DCP shards and their hashes, meta.json last) go to a local directory and to a local
S3 server (moto's standalone server on 127.0.0.1, reached through s3fs as
`checkpoint.path=s3://...` reaches a store). Per store: a synchronous save (`checkpoint.save`,
every rank waits), a load of it back into the model and optimizer (`checkpoint.load`), and
`--steps` training steps with an async save (`checkpoint.save_async`) every 4th, whose stall
is what training waits for it: the staging to CPU memory on the saving step, and the next
step's wait for the commit (the rest of the upload, the hashes, meta.json).
Times are the slowest rank's (every rank waits for it). moto keeps objects in its own Python
process's memory: its throughput is a local server's on this machine, not a cloud store's.
`--quick` is a small Llama (dim 256, 4 layers) on the same ranks. Writes
benchmarks/results/checkpoint_store.json.
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parse_args, print_table, run, write_result  # noqa: E402

from orchestrator.errors import ConfigError  # noqa: E402

BLOCK = 128
EVERY = 4
"""Steps between the async saves: a commit has the next step to overlap with, as in a run."""
QUICK = {"dim": 256, "layers": 4, "heads": 4, "ffn": 704, "vocab": 8000}
BUCKET = "checkpoint-store-bench"


def options(ap) -> None:
    ap.add_argument("--ranks", type=int, default=4, help="CPU ranks the model is sharded over")
    ap.add_argument("--dim", type=int, default=1536, help="model width (quick: 256)")
    ap.add_argument("--layers", type=int, default=20, help="decoder layers (quick: 4)")
    ap.add_argument("--heads", type=int, default=16, help="attention heads, half as many key/value heads (quick: 4)")
    ap.add_argument("--ffn", type=int, default=4096, help="SwiGLU width (quick: 704)")
    ap.add_argument("--vocab", type=int, default=32000, help="vocabulary (quick: 8000)")
    ap.add_argument("--steps", type=int, default=12, help="training steps per store under async save")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, shape: dict, steps: int, roots: dict[str, str], out: dict) -> None:
    """One rank: build and shard the model, then save, load and train with async saves to each store."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    from orchestrator.runtime import checkpoint
    from orchestrator.workloads.llama import build

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = build(dim=shape["dim"], n_layers=shape["layers"], n_heads=shape["heads"], n_kv_heads=shape["heads"] // 2,
                  ffn_dim=shape["ffn"], vocab_size=shape["vocab"])
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    group = checkpoint.writer_group()

    def step() -> float:
        t0 = time.perf_counter()
        x = torch.randint(0, shape["vocab"], (1, BLOCK + 1))
        loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    def state() -> dict:
        msd, osd = get_state_dict(model, opt)
        return {"model": msd, "optim": osd}

    def started() -> float:
        dist.barrier()
        return time.perf_counter()

    def since(t0: float) -> float:
        dist.barrier()  # the slowest rank's time: every rank waits for it
        return time.perf_counter() - t0

    step()
    step()  # Adam's moments exist: the checkpoint holds the whole optimizer state
    mine: dict = {}
    for store, root in roots.items():
        t0 = started()
        saved = checkpoint.save(f"{root}/sync", 1, state(), {"world_size": world}, 1)
        save_s = since(t0)
        t0 = started()
        checkpoint.load(saved, state())
        load_s = since(t0)
        plain, stalls, pending = [], [], None
        for i in range(1, steps + 1):
            took = step()
            if pending is not None:
                c0 = time.perf_counter()
                pending.commit()
                stalls[-1] += time.perf_counter() - c0
                pending = None
                plain.append(took)
            elif i % EVERY == 0:
                s0 = time.perf_counter()
                pending = checkpoint.save_async(f"{root}/async", i, state(), {"world_size": world}, 1, group)
                stalls.append(time.perf_counter() - s0)
            elif i > 1:
                plain.append(took)
        if pending is not None:
            pending.commit()
        mine[store] = {"save_s": save_s, "load_s": load_s, "plain_step_s": statistics.mean(plain),
                       "async_stall_s": statistics.mean(stalls), "async_saves": len(stalls)}
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        out.update({store: {k: max(g[store][k] for g in gathered) for k in mine[store]} for store in roots})
        out["params"] = sum(p.numel() for p in model.parameters())
        out["checkpoint_bytes"] = sum(f["bytes"] for f in _files(saved))
    dist.destroy_process_group()


def _files(path: str) -> list[dict]:
    from orchestrator.runtime import checkpoint_files

    return list(checkpoint_files.read_meta(path)["files"].values())


def _worker(rank: int, world: int, port: int, shape: dict, steps: int, roots: dict, queue) -> None:
    out: dict = {}
    _rank(rank, world, port, shape, steps, roots, out)
    if rank == 0:
        queue.put(out)


def measure(ranks: int, shape: dict, steps: int, local_root: str) -> dict:
    """Start the S3 server, run the ranks, return the slowest rank's figures per store."""
    try:
        import boto3
        from moto.server import ThreadedMotoServer
    except ImportError:
        raise ConfigError("the S3 server needs moto and boto3: pip install -e \".[test]\"") from None
    import logging

    import torch.multiprocessing as mp

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    # The ranks read the endpoint and credentials as a run's workers do: from the environment.
    os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="bench",
                      AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    try:
        boto3.client("s3").create_bucket(Bucket=BUCKET)
        ctx = mp.get_context("spawn")
        queue = ctx.SimpleQueue()
        roots = {"local disk": local_root, "S3 (moto, local)": f"s3://{BUCKET}/bench"}
        mp.start_processes(_worker, args=(ranks, _free_port(), shape, steps, roots, queue), nprocs=ranks,
                           start_method="spawn")
        return queue.get()
    finally:
        server.stop()


def main(argv=None) -> None:
    args = parse_args(__doc__, argv, options)
    if args.quick:
        for key, value in QUICK.items():
            if f"--{key}" not in args.argv and not any(a.startswith(f"--{key}=") for a in args.argv):
                setattr(args, key, value)
    if args.steps < EVERY + 1:
        raise ConfigError(f"--steps {args.steps}: at least {EVERY + 1}, so an async save has a next step to commit in")
    if args.heads < 2 or args.heads % 2 or args.dim % args.heads:
        raise ConfigError(f"--heads {args.heads}: an even number of heads that divides --dim {args.dim}")
    shape = {"dim": args.dim, "layers": args.layers, "heads": args.heads, "ffn": args.ffn, "vocab": args.vocab}
    with tempfile.TemporaryDirectory(prefix="checkpoint-store-") as tmp:
        res = measure(args.ranks, shape, args.steps, tmp)
    stores = [k for k in res if isinstance(res[k], dict)]
    rows = [(store, f"{res[store]['save_s']:.2f} s", f"{res[store]['load_s']:.2f} s",
             f"{res[store]['plain_step_s'] * 1000:.0f} ms", f"{res[store]['async_stall_s'] * 1000:.0f} ms")
            for store in stores]
    print_table(f"checkpoint store, Llama {res['params'] / 1e6:.0f}M parameters + AdamW "
                f"({res['checkpoint_bytes'] / 2**20:.0f} MiB a checkpoint), {args.ranks} CPU ranks, ZeRO-3",
                ["store", "save (sync)", "load", "plain step", "step stall per async save"], rows)
    write_result("checkpoint_store", {"ranks": args.ranks, **shape, "steps": args.steps,
                                      "stores": {s: res[s] for s in stores}, "params": res["params"],
                                      "checkpoint_bytes": res["checkpoint_bytes"]}, args)


if __name__ == "__main__":
    run(main)
