"""Checkpoint cost: how long training stops for a checkpoint, written synchronously
(`dcp.save`, every rank waits for the write) and asynchronously (`dcp.async_save`: the state is
copied to CPU memory, written in a background thread, committed after the next step).

One process (a gloo group of 1), an MLP with Adam, checkpoints to a local directory; the step
time of ordinary steps beside that of a checkpoint step (its save, or its staging plus the next
step's commit) for each mode.

    python benchmarks/checkpoint_cost.py [--quick] [--params-m N] [--steps N]
"""

from __future__ import annotations

import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parse_args, print_table, run, write_result  # noqa: E402


def _model(params_m: float):
    import torch

    width = 1024
    layers = max(1, round(params_m * 1e6 / (width * width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    return model, torch.optim.Adam(model.parameters(), lr=1e-4), width


def _step(model, opt, width: int) -> None:
    import torch

    x = torch.randn(32, width)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _state(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def measure(params_m: float, steps: int, every: int, root: Path) -> dict:
    """Mean plain step, and the mean stall per checkpoint, for sync and async checkpoints."""
    import torch

    from orchestrator.runtime import checkpoint

    torch.manual_seed(0)
    model, opt, width = _model(params_m)
    group = checkpoint.writer_group()
    out = {"params": sum(p.numel() for p in model.parameters())}
    for mode in ("sync", "async"):
        plain, stall = [], []
        pending = None
        base = root / mode
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            _step(model, opt, width)
            extra = 0.0
            if pending is not None:
                c0 = time.perf_counter()
                pending.commit()
                extra = time.perf_counter() - c0
                pending = None
            if step % every == 0:
                meta = {"world_size": 1}
                if mode == "sync":
                    checkpoint.save(str(base), step, _state(model, opt), meta, keep_last=1)
                else:
                    pending = checkpoint.save_async(str(base), step, _state(model, opt), meta, 1, group)
            took = time.perf_counter() - t0
            if step % every == 0:
                stall.append(took)  # the step that saves (sync) or stages (async)
            elif extra:
                stall[-1] += extra  # the commit the next step waits for, counted against the checkpoint
                plain.append(took - extra)
            elif step > 2:
                plain.append(took)
        if pending is not None:
            pending.commit()
        p = statistics.mean(plain)
        out[mode] = {"plain_step_s": p, "checkpoint_step_s": statistics.mean(stall),
                     "stall_per_checkpoint_s": statistics.mean(stall) - p, "checkpoints": len(stall)}
    return out


def options(ap) -> None:
    ap.add_argument("--params-m", type=float, default=50.0, help="parameters of the MLP, millions (quick: 10)")
    ap.add_argument("--steps", type=int, default=40, help="training steps (quick: 20)")


def main(argv=None) -> None:
    args = parse_args(__doc__, argv, options)
    import torch.distributed as dist

    params_m, steps = (10.0, 20) if args.quick else (args.params_m, args.steps)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            res = measure(params_m, steps, 5, Path(tmp))
    finally:
        dist.destroy_process_group()
    rows = [(mode, f"{res[mode]['plain_step_s'] * 1000:.0f} ms", f"{res[mode]['checkpoint_step_s'] * 1000:.0f} ms",
             f"{res[mode]['stall_per_checkpoint_s'] * 1000:.0f} ms") for mode in ("sync", "async")]
    print_table(f"checkpoint cost, {res['params'] / 1e6:.0f}M parameters + Adam, 1 rank",
                ["mode", "plain step", "checkpoint step", "training stopped per checkpoint"], rows)
    write_result("checkpoint_cost", {"params_m": params_m, "steps": steps, **res}, args)


if __name__ == "__main__":
    run(main)
