"""Parity harness: the same tiny GPT trained by one process and by 4 gloo ranks per strategy.

Kept out of the test module so spawned ranks import it without importing pytest.
Every case starts from the same seed and the same global batches; a rank trains on its
data-parallel slice of each micro-batch, exactly as the training loop does. Each case is what
`resolve` says runs on CPU ranks; a case whose execution autocasts (and so gathers 16-bit
weights) runs its forward under that autocast, as the Trainer does, and is compared with a
single process under the same autocast.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import FSDPModule

from orchestrator.planning.mesh import Mesh
from orchestrator.planning.resolve import Execution, resolve
from orchestrator.runtime.comm_hooks import PARAM_DTYPES, hierarchical_all_reduce
from orchestrator.runtime.parallelize import build_mesh, data_parallel_rank, parallelize
from orchestrator.workloads.gpt import GPT, GPTConfig, param_groups

CFG = GPTConfig(n_layer=2, n_head=4, n_embd=32, vocab_size=64, block_size=16)
WORLD = 4
STEPS = 6
GLOBAL_MICRO_BATCH = 8
MAX_NORM = 0.5  # below the first steps' gradient norm, so clipping really scales the update
LR = 1e-2


def cpu_execution(strategy: str, mesh: Mesh, precision: str = "fp32", max_steps: int = STEPS, **kwargs) -> Execution:
    """What runs for `strategy` on `mesh` on gloo CPU ranks (the Trainer's device kind here)."""
    return resolve(strategy, mesh, precision=precision, device="cpu", max_steps=max_steps, **kwargs)


@dataclass(frozen=True)
class Case:
    name: str
    ex: Execution
    accum: int
    tolerance: float = 1e-5
    checkpoint: bool = True
    """Also save with DCP after the first steps and resume a freshly initialised replica."""
    resume_from: str | None = None
    """Also resume from this earlier case's checkpoint (same accum, other layout): DCP resharding."""
    static_graph: bool = False
    """DDP's static_graph (the same parameters are used every step)."""
    node_of_rank: tuple[str, ...] | None = None
    """The node of every rank, for a hierarchical all-reduce."""

    @property
    def autocast(self) -> torch.dtype | None:
        """The forward's autocast dtype (the one FSDP2 gathers weights in); None for fp32."""
        return None if self.ex.autocast is None else PARAM_DTYPES[str(self.ex.autocast)]


CASES = [
    Case("ddp", cpu_execution("ddp", Mesh(dp_replicate=4), bucket_mb=0.05, recompute="full"), accum=2,
         checkpoint=False, static_graph=True),
    # A run of 10 x STEPS steps: PowerSGD's warm-up (10% of them) is plain all-reduce through
    # all STEPS steps here, so zero1 with powersgd must match one process exactly.
    Case("zero1", cpu_execution("zero1", Mesh(dp_replicate=4), compression="powersgd", max_steps=10 * STEPS),
         accum=2),
    # R=2 x S=2 for zero2: all four data-parallel ranks still form one shard group.
    Case("zero2", cpu_execution("zero2", Mesh(dp_replicate=2, dp_shard=2), compression="bf16"), accum=2),
    Case("zero3", cpu_execution("zero3", Mesh(dp_shard=4), recompute="selective"), accum=1),
    Case("hsdp", cpu_execution("hsdp", Mesh(dp_replicate=2, dp_shard=2)), accum=2, resume_from="zero1"),
    Case("tp_fsdp", cpu_execution("zero3", Mesh(dp_shard=2, tp=2)), accum=2, resume_from="zero2"),
    # Two ranks per node on two nodes: reduce-scatter in the pair, all-reduce across, all-gather.
    Case("ddp_hier", cpu_execution("ddp", Mesh(dp_replicate=4), bucket_mb=0.05, algorithm="hierarchical"), accum=2,
         node_of_rank=("n0", "n0", "n1", "n1")),
    Case("tp_ddp", cpu_execution("ddp", Mesh(dp_replicate=2, tp=2)), accum=1, checkpoint=False),
    # fp16 rounding of the gradient all-reduce: parity only to fp16 precision. Gradients keep 11
    # bits; a few Adam steps later the loss (about 4) moves by some 1e-3 (measured: up to 1.5e-3
    # at step 3, the size depending on the initial draw), a wrong reduction by far more.
    Case("ddp_fp16", cpu_execution("ddp", Mesh(dp_replicate=4), compression="fp16"), accum=1, tolerance=3e-3,
         checkpoint=False),
    # A run of STEPS steps: PowerSGD all-reduces plainly for its warm-up, then compresses.
    Case("ddp_powersgd", cpu_execution("ddp", Mesh(dp_replicate=4), compression="powersgd"), accum=1,
         tolerance=float("inf"), checkpoint=False),
    # torchtitan's mixed precision: bf16 all-gathers under bf16 autocast, fp32 reduce-scatter
    # and fp32 master weights. Compared with a bf16-autocast single process, so the gap is
    # the rounding of weights autocast leaves in fp32 (LayerNorm, embedding), not the sharding.
    Case("zero3_bf16", cpu_execution("zero3", Mesh(dp_shard=4), precision="bf16"), accum=2, tolerance=1e-2),
]


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups(model, weight_decay=0.1), lr=LR, betas=(0.9, 0.95))


def batches(accum: int) -> torch.Tensor:
    """(STEPS, accum, 2, GLOBAL_MICRO_BATCH, block_size) token ids: inputs and next-token targets.

    Arithmetic sequences (random start and stride) are learnable within a few steps, so the
    loss trajectory moves and a strategy that mis-reduces gradients shows up in it.
    """
    g = torch.Generator().manual_seed(1234)
    shape = (STEPS, accum, GLOBAL_MICRO_BATCH, 1)
    start = torch.randint(0, CFG.vocab_size, shape, generator=g)
    stride = torch.randint(1, 4, shape, generator=g)
    seq = (start + stride * torch.arange(CFG.block_size + 1)) % CFG.vocab_size
    return torch.stack([seq[..., :-1], seq[..., 1:]], dim=2)


def fresh_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(CFG)


def _autocast(dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if dtype is None else torch.autocast("cpu", dtype=dtype)


def train_one_process(model: torch.nn.Module, opt: torch.optim.Optimizer, steps, accum: int, max_norm: float,
                      autocast: torch.dtype | None = None) -> dict[str, list[float]]:
    """Train one process on whole global batches, `accum` micro-batches a step, clipping at
    `max_norm`: the loss and gradient-norm trajectory a parallel run must match."""
    losses, norms = [], []
    for step in steps:
        total = 0.0
        for x, y in step:
            with _autocast(autocast):
                loss = model(x, y) / accum
            loss.backward()
            total += loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {"losses": losses, "norms": norms}


def reference(accum: int, autocast: torch.dtype | None = None) -> dict[str, list[float]]:
    """Single-process training on the whole global batch: the trajectory every strategy must match."""
    model = fresh_model()
    return train_one_process(model, make_optimizer(model), batches(accum), accum, MAX_NORM, autocast)


def _train_step(par, step: torch.Tensor, case: Case, dp_rank: int, dp_world: int) -> tuple[float, float]:
    share = GLOBAL_MICRO_BATCH // dp_world
    accum = case.accum
    local = torch.zeros(())
    for i, (x, y) in enumerate(step):
        x, y = x[dp_rank * share:(dp_rank + 1) * share], y[dp_rank * share:(dp_rank + 1) * share]
        # The training loop's micro-step: sync on the last, zero2's weights kept gathered until it.
        with par.micro_step(sync=i == accum - 1, last=i == accum - 1):
            with _autocast(case.autocast):
                loss = par.model(x, y) / accum
            loss.backward()
        local += loss.detach()
    norm = float(par.clip_grad_norm_(MAX_NORM))
    par.optimizer.step()
    # Every rank of a tp group holds the same loss, so the mean over all ranks is the dp mean.
    dist.all_reduce(local)
    return float(local) / dist.get_world_size(), norm


def _resume(case: Case, par, mesh, ckpt: str):
    """A differently initialised replica, restored from `par` through a DCP checkpoint."""
    dcp.save(par.state_dict(), checkpoint_id=ckpt)
    return _restore(case, mesh, ckpt)


def _restore(case: Case, mesh, ckpt: str):
    restored = _parallelize(fresh_model(seed=99), case, mesh)
    sd = restored.state_dict()
    dcp.load(sd, checkpoint_id=ckpt)
    restored.load_state_dict(sd)
    return restored


def _compute_dtypes(model: torch.nn.Module) -> set[str]:
    """Record the dtype of every weight as the layers compute with it (after FSDP2 gathered it)."""
    seen: set[str] = set()

    def note(module: torch.nn.Module, _args: object) -> None:
        seen.update(str(p.dtype) for p in module.parameters(recurse=False))

    for m in model.modules():
        if next(m.parameters(recurse=False), None) is not None:
            m.register_forward_pre_hook(note)
    return seen


def _hierarchy_report(par) -> dict | None:
    """The groups the hierarchical hook ran over, the buckets it reduced during training, and
    the error of averaging a 7-element tensor (not a multiple of the node size, so padded)
    through it in fp32 and in fp16 against the exact mean."""
    h = par.hierarchy
    if h is None:
        return None
    buckets = h.buckets_reduced
    rank = dist.get_rank()
    base = torch.linspace(0.1, 3.3, 7)  # not all representable in fp16, so fp16 rounding shows
    exact = base * (WORLD + 1) / 2  # the mean of (rank + 1) * base over the ranks
    errors = {}
    for name, dtype in (("fp32", None), ("fp16", torch.float16)):
        t = base * (rank + 1)
        out = hierarchical_all_reduce(t, replace(h, wire_dtype=dtype)).wait()
        errors[name] = float((out - exact).abs().max()) if out is t else float("inf")
    return {"intra": h.intra_ranks, "inter": h.inter_ranks, "buckets": buckets, "odd_errors": errors}


def _parallelize(model: torch.nn.Module, case: Case, mesh):
    return parallelize(model, case.ex, mesh, make_optimizer, torch.device("cpu"), node_of_rank=case.node_of_rank,
                       static_graph=case.static_graph)


def _run_case(case: Case, ckpt_root: str) -> dict:
    mesh = build_mesh(case.ex.mesh, "cpu")
    dp_rank, dp_world = data_parallel_rank(mesh)
    par = _parallelize(fresh_model(), case, mesh)
    compute_dtypes = _compute_dtypes(par.model)
    policies = sorted({(str(pol.param_dtype), str(pol.reduce_dtype))
                       for pol in (m._get_fsdp_state()._mp_policy for m in par.model.modules()
                                   if isinstance(m, FSDPModule))})
    data = batches(case.accum)
    losses, norms = [], []
    for step in data[:-1]:
        loss, norm = _train_step(par, step, case, dp_rank, dp_world)
        losses.append(loss)
        norms.append(norm)
        par.zero_grad()
        state = par.state_bytes()  # where the training loop reads it: after zero_grad

    # The replica must take the last step exactly as the trained model does.
    restored = _resume(case, par, mesh, os.path.join(ckpt_root, case.name)) if case.checkpoint else None
    other = _restore(case, mesh, os.path.join(ckpt_root, case.resume_from)) if case.resume_from else None
    loss, norm = _train_step(par, data[-1], case, dp_rank, dp_world)
    losses.append(loss)
    norms.append(norm)
    resumed_loss = _train_step(restored, data[-1], case, dp_rank, dp_world)[0] if restored else None
    resharded_loss = _train_step(other, data[-1], case, dp_rank, dp_world)[0] if other else None

    hierarchy = _hierarchy_report(par)
    all_states: list = [None] * dist.get_world_size()
    dist.all_gather_object(all_states, state)
    return {"losses": losses, "norms": norms, "resumed_loss": resumed_loss,
            "resharded_loss": resharded_loss,
            "state_bytes": all_states, "notes": par.notes, "hierarchy": hierarchy,
            "compute_dtypes": sorted(compute_dtypes), "mp_policies": policies,
            "sharded_dtypes": sorted({str(p.dtype) for p in par.model.parameters()})}


def run_rank(rank: int, init_file: str, out_file: str, names: list[str]) -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        results = {}
        with tempfile.TemporaryDirectory() as scratch:
            ckpt_root = [scratch]
            dist.broadcast_object_list(ckpt_root)  # one directory shared by all ranks
            for case in CASES:
                if case.name in names:
                    results[case.name] = _run_case(case, ckpt_root[0])
                dist.barrier()
        if rank == 0:
            with open(out_file, "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()
