"""Predicted step time and memory of one candidate plan on one laid-out cluster."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..choices import AccumSync, Compression, PipelineSchedule, Precision, Recompute, Strategy, SyncAlgorithm
from .calibration import UNCALIBRATED, Calibration
from .comm import (
    GLOO_LAUNCH_US,
    LAUNCH_S,
    GroupLinks,
    all_reduce,
    gloo_all_reduce,
    group_all_gather,
    group_all_reduce,
    group_reduce_scatter,
)
from .compute import DeviceSpeed, efficiency, elementwise_seconds, matmul_seconds, optimizer_seconds
from .layout import ClusterLayout
from .memory import ByteLayout, MemoryBreakdown, params_per_tp_rank, rank_memory, runtime_states
from .mesh import Mesh
from .model_math import ModelShape, block_params, flops_per_step, root_params
from .pipeline import bubble_fraction, resolve_pipeline, slowest_stage, stage_cost, stage_share
from .resolve import Execution, Unsupported, resolve
from .sync import MB, SyncPlan, auto_bucket_mb, wire_bytes_per_grad


@dataclass(frozen=True)
class JobContext:
    """What stays the same across the candidates of one job."""

    shape: ModelShape
    """The model's figures."""
    params: int
    """Distinct parameters."""
    global_batch: int
    """Sequences per optimizer step."""
    layout: ByteLayout
    """Bytes per parameter and activation the runtime keeps."""
    speed: DeviceSpeed
    """Each rank's device (the slowest, on a mixed cluster)."""
    on_gpu: bool
    """False for CPU slots (gloo, fp32, no overlap)."""
    usable_bytes: int
    """Memory a rank may plan to use."""
    net_gbps: float
    """Bandwidth out of one node, GB/s per direction."""
    net_lat_us: float
    """One-way latency between nodes."""
    gpus_per_node: int
    """Ranks on each node."""
    powersgd_ratio: float
    """Bytes PowerSGD sends per gradient byte."""
    precision: Precision = Precision.auto
    """`train.precision`, as `resolve` turns it into what runs on this kind of device."""
    max_steps: int = 0
    """Optimizer steps of the run (PowerSGD's plain-all-reduce warm-up is a share of them)."""
    calibration: Calibration = UNCALIBRATED
    """Measured / predicted factors from a trial on this cluster (`--calibration`); 1.0 each
    prices from the tables and the probe alone."""

    @property
    def device(self) -> str:
        return "gpu" if self.on_gpu else "cpu"


@dataclass(frozen=True)
class Choice:
    """One point of the search space."""

    strategy: Strategy
    mesh: Mesh
    micro_batch: int
    recompute: Recompute
    compression: Compression = Compression.none
    algorithm: SyncAlgorithm = SyncAlgorithm.auto
    """Requested all-reduce schedule: auto, flat or hierarchical."""
    bucket_mb: float | None = None
    """Forced DDP bucket size; None sizes it."""
    pp_schedule: PipelineSchedule = PipelineSchedule.one_f_one_b
    """The pipeline schedule (with mesh.pp > 1)."""
    virtual: int = 1
    """Chunks per pipeline rank (interleaved schedules)."""
    accum_sync: AccumSync = AccumSync.last_micro_step
    """When gradients are reduced under accumulation (a choice only where FSDP2 reduces them
    without a pipeline; see `resolve`)."""


@dataclass
class Estimate:
    """A candidate's predicted cost."""

    choice: Choice
    execution: Execution
    """What runs for the choice (`resolve`), as it was priced."""
    memory: MemoryBreakdown
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    sync: SyncPlan
    comm_parts: dict[str, float] = field(default_factory=dict)
    """Seconds of communication per step by what it is for (tp, gradients, gathers)."""
    schedule: str = ""
    """The collective schedule the gradient reduction uses, in words."""
    bubble_s: float = 0.0
    """Seconds the pipeline's slowest stage idles per step (its schedule's bubble)."""

    @property
    def total_s(self) -> float:
        return self.compute_s + self.bubble_s + self.exposed_comm_s

    def fits(self, usable: int) -> bool:
        return self.memory.total <= usable


def group_links(ctx: JobContext, cl: ClusterLayout, axis: str) -> GroupLinks:
    """The links a group of `axis` runs over: its in-node ring, and its share of the network
    (every group of the axis on a node communicates at once, so they split the node's ports)."""
    size = cl.mesh.size(axis)
    per_node = cl.per_node[axis]
    ring = cl.rings[axis]
    spans = size > per_node
    inter = ctx.net_gbps * per_node / ctx.gpus_per_node if spans else math.inf
    return GroupLinks(size=size, per_node=per_node, intra_gbps=ring.gbps,
                      intra_lat_us=ring.lat_us if per_node > 1 else 0.0,
                      inter_gbps=inter, inter_lat_us=ctx.net_lat_us if spans else 0.0,
                      gloo_mem_gbps=None if ctx.on_gpu else ctx.speed.mem_gbps)


def execution(ctx: JobContext, c: Choice) -> Execution:
    """What runs for choice `c` (Unsupported when it cannot run at all)."""
    pipeline = None
    if c.mesh.pp > 1:
        m = ctx.global_batch // (c.mesh.dp * c.micro_batch)
        try:
            pipeline = resolve_pipeline(ctx.shape, c.mesh.pp, c.pp_schedule, m, c.virtual)
        except ValueError as e:
            raise Unsupported(str(e)) from e
    return resolve(c.strategy, c.mesh, precision=ctx.precision, device=ctx.device, recompute=c.recompute,
                   compression=c.compression, algorithm=c.algorithm, bucket_mb=c.bucket_mb or 25.0,
                   max_steps=ctx.max_steps, pipeline=pipeline, accum_sync=c.accum_sync)


def accum_steps(ctx: JobContext, c: Choice) -> int:
    """Micro-steps per optimizer step of choice `c` (a pipeline's micro-batches)."""
    return ctx.global_batch // (c.mesh.dp * c.micro_batch)


def held_grad_bytes(ex: Execution, layout: ByteLayout, accum: int) -> int | None:
    """Bytes per parameter of the unsharded gradient FSDP2 keeps between micro-steps when it
    reduces on the last one only: its reduce dtype (fp32, or the 16-bit compression dtype;
    `comm_hooks.fsdp_policy`). None where nothing is kept that way: DDP-style reducers keep
    their whole gradients in the `grads` layout anyway, and one micro-step keeps nothing."""
    if ex.ddp_reduces or ex.reduce_every_micro_step or accum <= 1:
        return None
    return min(2, layout.grads) if ex.compression in (Compression.fp16, Compression.bf16) else layout.grads


def tp_all_reduces_per_micro_batch(shape: ModelShape, recompute: Recompute | str) -> int:
    """Activation all-reduces of one tensor-parallel block and micro-batch: forward's and
    backward's (`tp_all_reduces_per_block`), and under full recomputation forward's again but the
    last: torch's checkpoint stops re-running the block once backward has every tensor it saved,
    and the block's final row-parallel Linear (the MLP's output) saved nothing backward reads."""
    fwd, bwd = tp_all_reduces_per_block(shape)
    return fwd + bwd + (max(0, fwd - 1) if str(recompute) == "full" else 0)


def tp_all_reduces_per_block(shape: ModelShape) -> tuple[int, int]:
    """(forward, backward) activation all-reduces of one tensor-parallel block: one per
    row-parallel Linear's output forward, one per column-parallel Linear's input gradient
    backward (DTensor reduces each on its own). The built-in GPT, and a measured model whose
    plan was not counted, have Megatron's two and two (fused qkv and MLP input; attention and
    MLP output)."""
    spec = shape.spec
    if spec is None or not (spec.tp_colwise_per_block and spec.tp_rowwise_per_block):
        return 2, 2
    return spec.tp_rowwise_per_block, spec.tp_colwise_per_block


def estimate(ctx: JobContext, cl: ClusterLayout, c: Choice) -> Estimate:
    """Memory and step time of choice `c` on layout `cl`, as `resolve` says it runs;
    Unsupported when it cannot run at all."""
    shape, lay = ctx.shape, ctx.layout
    ex = execution(ctx, c)
    pl = ex.pipeline
    tp, dp = c.mesh.tp, c.mesh.dp
    accum = accum_steps(ctx, c)
    # Gradient reductions per step: every micro-step, or only the last one's (`no_sync()` before
    # it; a pipeline's stages always sync so).
    syncs = accum if ex.reduce_every_micro_step else 1
    held = held_grad_bytes(ex, lay, accum)
    # With a pipeline the accumulation steps are its micro-batches, and a rank holds and runs
    # its stage; the slowest stage sets the pace of the whole pipeline.
    slow = slowest_stage(shape, pl)
    share = stage_share(shape, pl, slow) if pl else None
    work = stage_cost(shape, pl, slow) / stage_cost(shape, None, 0) if pl else 1.0
    p_whole = params_per_tp_rank(shape, tp)
    per_block_rank = (p_whole - root_params(shape)) / shape.layers
    p_rank = share.blocks * per_block_rank + share.root if share else p_whole
    blocks = share.blocks if share else shape.layers
    block = block_params(shape) / tp
    wrapping = ex.wrapping
    # FSDP2 over a shard group of one (ddp with tensor parallelism) all-reduces per unit while
    # backward runs, as DDP's buckets do: both are priced as DDP's bucketed all-reduce.
    ddp_priced = ex.ddp_reduces or c.strategy == Strategy.ddp
    flat_note = (f" (parallel.sync=hierarchical runs flat: {ex.flat_reason})"
                 if c.algorithm == SyncAlgorithm.hierarchical and ex.flat_reason else "")

    # Compute: the job's hardware FLOPs split evenly over the data- and tensor-parallel ranks,
    # the slowest pipeline stage's share of them on each.
    flops = flops_per_step(shape, ctx.global_batch, c.recompute) / (dp * tp) * work
    eff = efficiency(c.micro_batch * shape.seq, shape.hidden, tp, ctx.speed, ctx.on_gpu)
    mm = matmul_seconds(flops, ctx.speed, eff)
    if ctx.on_gpu:
        mm += elementwise_seconds(ctx.global_batch * shape.seq / dp, shape.hidden, tp, blocks, str(c.recompute),
                                  lay.activation, ctx.speed)
    step_flops = flops_per_step(shape, ctx.global_batch, c.recompute)
    fwd_share = flops_per_step(shape, ctx.global_batch, "none") / 3 / step_flops
    fwd, bwd = mm / accum * fwd_share, mm / accum * (1 - fwd_share)
    # Under a pipeline ddp and zero1 run as FSDP2 (see resolve): their memory is FSDP2's.
    st = runtime_states(ex.wrapping if pl else c.strategy, shape, tp, ex.shard_group, lay, share)
    compute_s = mm + optimizer_seconds(st.params + st.grads + st.optimizer, ctx.speed)
    bubble_s = mm * pl.bubble if pl else 0.0

    # Tensor parallelism: all-reduces of a block's activations, forward and backward, and
    # forward's again but the last under full recomputation (`tp_all_reduces_per_micro_batch`;
    # reduce-scatter + all-gather pairs under sequence parallelism move the same bytes).
    # Nothing hides them.
    parts: dict[str, float] = {}
    if tp > 1:
        tpl = group_links(ctx, cl, "tp")
        act = c.micro_batch * shape.seq * shape.hidden * lay.activation
        if ctx.on_gpu:
            per_ar, _ = all_reduce(act, tp, tpl.flat_gbps, tpl.flat_lat_us)
        else:
            per_ar = gloo_all_reduce(act, tp, tpl.flat_gbps, tpl.flat_lat_us, ctx.speed.mem_gbps)
        n = tp_all_reduces_per_micro_batch(shape, c.recompute)
        parts["tp"] = accum * blocks * n * per_ar * (1 + (pl.bubble if pl else 0.0))
    if pl:
        # Each micro-batch's activation crosses every chunk boundary forward and its gradient
        # backward, on the link between adjacent stages (torch's schedules wait for them).
        ppl = group_links(ctx, cl, "pp")
        act = c.micro_batch * shape.seq * shape.hidden * lay.activation
        send = p2p_seconds(act, ppl.flat_gbps, ppl.flat_lat_us, ctx.on_gpu)
        parts["pipeline p2p"] = 2 * pl.virtual * pl.microbatches * send
        # In the steady state a send overlaps the next micro-batch's compute; the first
        # micro-batch's trip through all p*v chunks forward and back is on the critical path.
        p2p_exposed = 2 * (pl.stages * pl.virtual - 1) * send
        if ties_head(shape):
            # The first stage holds the embedding, the last its tied copy as the head; after the
            # schedule their gradients are summed (Megatron's embedding all-reduce, the runtime's
            # `Pipelined._sync_tied`): each rank sends and receives its share of the vocabulary
            # x hidden gradient over the pp link, before the optimizer can step. Nothing hides it.
            tied = shape.vocab * shape.hidden * lay.grads / ex.shard_group
            parts["tied embedding sync"] = p2p_seconds(tied, ppl.flat_gbps, ppl.flat_lat_us, ctx.on_gpu)
            p2p_exposed += parts["tied embedding sync"]
    else:
        p2p_exposed = 0.0
    tp_s = parts.get("tp", 0.0) + p2p_exposed

    grad_wire = wire_bytes_per_grad(ex.compression, lay.grads, ctx.powersgd_ratio,
                                    ex.compression_warmup_steps / ctx.max_steps if ctx.max_steps else 0.0)
    grad_bytes = p_rank * grad_wire
    if held is not None and ctx.on_gpu:
        # Each micro-step after the first adds its gradient into FSDP2's kept unsharded one (a
        # read of both and a write, in device memory); reducing every micro-step would copy it
        # into the reduce-scatter's input instead (`copy_in` below).
        compute_s += (accum - 1) * p_rank * (lay.compute + 2 * held) / (ctx.speed.mem_gbps * 1e9)
    overlap = ctx.on_gpu
    exposed = tp_s
    schedule = "none (one data-parallel rank)"
    if ddp_priced:
        axis = "dp_replicate" if c.strategy == Strategy.ddp else "dp_shard"
        gl = group_links(ctx, cl, axis)
        bucket_mb = c.bucket_mb or auto_bucket_mb(grad_bytes, gl.size, gl.flat_gbps, gl.flat_lat_us)
        algo = str(ex.sync_algorithm)
        red, schedule = group_all_reduce(grad_bytes, gl, algo)
        tail, _ = group_all_reduce(min(bucket_mb * MB, grad_bytes), gl, algo)
        parts["grad all-reduce"] = syncs * red
        schedule += flat_note
        if wrapping == Strategy.zero1 and gl.size > 1:
            # ZeroRedundancyOptimizer runs under DDP's all-reduce: each rank steps its partition
            # and broadcasts it, one bucket per rank, after the step, where nothing hides it.
            broadcast = group_all_gather(p_rank * lay.weights, gl, gl.size)
            parts["param broadcast"] = broadcast
            schedule += f"; parameters: {gl.size} broadcasts, one per rank's partition"
            exposed += broadcast
        exposed += syncs * ((overlapped(red, bwd) + tail) if overlap and gl.size > 1 else red)
    else:
        gl = group_links(ctx, cl, "dp_shard")
        bucket_mb = block * grad_wire / MB
        # FSDP2 issues one collective per unit (each block, and the root's own parameters), so
        # each pays the ring's latency: at hundreds of ranks that, not bandwidth, is what
        # small units cost.
        units = blocks + 1
        rs = group_reduce_scatter(grad_bytes, gl, units)
        rs_block = group_reduce_scatter(block * grad_wire, gl)
        gather_w = p_rank * lay.compute
        ag = group_all_gather(gather_w, gl, units)
        ag_block = group_all_gather(block * lay.compute, gl)
        if ctx.on_gpu and gl.size > 1:
            # FSDP2 copies each gathered unit out of the flat buffer into its parameters
            # (`foreach_all_gather_copy_out`), and each unit's gradients into the
            # reduce-scatter's input (`foreach_reduce`): a read and a write of the bytes in
            # device memory each, which compute waits for or shares the memory with.
            copy_out = 2 * gather_w / (ctx.speed.mem_gbps * 1e9)
            copy_in = 2 * grad_bytes / (ctx.speed.mem_gbps * 1e9)
        else:
            copy_out = copy_in = 0.0
        if not ex.reshard_after_forward:
            # Weights gathered once, kept to the end; gradients reduce-scattered `syncs` times.
            parts["grad reduce-scatter"], parts["param all-gather"] = syncs * rs, ag
            compute_s += copy_out + syncs * copy_in
            if overlap:
                exposed += syncs * (overlapped(rs, bwd) + rs_block) + overlapped(ag, fwd) + ag_block
            else:
                exposed += syncs * rs + ag
        else:
            # ZeRO-3 / FSDP: gather forward and again for backward every micro-step; reduce-scatter
            # on `syncs` of them, beside that micro-step's backward gathers.
            parts["param all-gather"], parts["grad reduce-scatter"] = 2 * accum * ag, syncs * rs
            compute_s += accum * 2 * copy_out + syncs * copy_in
            if overlap:
                exposed += (accum * (overlapped(ag, fwd) + ag_block) + (accum - syncs) * overlapped(ag, bwd)
                            + syncs * (overlapped(ag + rs, bwd) + rs_block))
            else:
                exposed += accum * 2 * ag + syncs * rs
        schedule = "flat ring reduce-scatter / all-gather" if gl.size > 1 else schedule
        if ex.fsdp_replicates:
            # FSDP2 all-reduces across replicas in one flat group: hsdp's mesh is the hierarchy.
            rl = group_links(ctx, cl, "dp_replicate")
            ar, sched = group_all_reduce(grad_bytes / ex.shard_group, rl, "flat")
            parts["replica all-reduce"] = syncs * ar
            exposed += syncs * ar
            schedule = f"{schedule}; replicas: {sched}"
        schedule += flat_note
    comm_s = sum(parts.values())
    algorithm = "hierarchical" if schedule.startswith("hierarchical") else "flat"
    sync = SyncPlan(bucket_mb=round(bucket_mb, 3), algorithm=SyncAlgorithm(algorithm), compression=ex.compression,
                    grad_accum_steps=accum, overlap=overlap,
                    accum_sync=AccumSync.per_micro_step if ex.reduce_every_micro_step else AccumSync.last_micro_step)
    mem = _peak_memory(ctx, c, ex, bucket_mb * MB if ex.ddp_reduces else 0.0, held)
    # A trial's measured factors scale whole term kinds; the terms' shapes stay the model's.
    k_c, k_m = ctx.calibration.compute, ctx.calibration.communication
    return Estimate(choice=c, execution=ex, memory=mem, compute_s=compute_s * k_c, comm_s=comm_s * k_m,
                    exposed_comm_s=min(exposed, comm_s) * k_m, sync=sync,
                    comm_parts={k: v * k_m for k, v in parts.items()}, schedule=schedule, bubble_s=bubble_s * k_c)


# Compute slows while a collective runs beside it: NCCL's kernels take SMs and their traffic
# takes device-memory bandwidth (two to three bytes of it per byte on the wire). Lee et al. 2025
# ("Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed Deep
# Learning", arXiv 2507.03114) measured GPT and Llama training kernels on A100 and H100 (and
# MI250/MI210) 18.9% slower on average while overlapped than alone.
OVERLAP_COMPUTE_SLOWDOWN = 0.189


def overlapped(comm_s: float, compute_s: float) -> float:
    """Seconds a collective of `comm_s` adds to the `compute_s` it runs beside, from the same
    start: while both run, compute goes at 1/(1 + slowdown) of its speed; what the collective
    outlasts the slowed compute by is exposed."""
    if comm_s <= 0:
        return 0.0
    k = OVERLAP_COMPUTE_SLOWDOWN
    return max(comm_s - compute_s, comm_s * k / (1 + k))


def ties_head(shape: ModelShape) -> bool:
    """Whether the model's output head is its token embedding (the built-in GPT's is; a measured
    model says)."""
    return shape.spec is None or bool(shape.spec.tied_embeddings)


def p2p_seconds(nbytes: float, gbps: float, lat_us: float, on_gpu: bool) -> float:
    """One point-to-point send of n bytes between adjacent stages (gloo's thread hand-off on CPU)."""
    launch = LAUNCH_S if on_gpu else GLOO_LAUNCH_US * 1e-6
    return launch + lat_us * 1e-6 + nbytes / (gbps * 1e9)


def _peak_memory(ctx: JobContext, c: Choice, ex: Execution, bucket_bytes: float,
                 held: int | None = None) -> MemoryBreakdown:
    """Peak bytes of the fullest rank: every pipeline stage differs (the first holds the
    embeddings and the most micro-batches in flight, the last the head and the logits).
    `held`: FSDP2's unsharded gradient bytes per parameter kept between micro-steps."""
    # Under a pipeline ddp and zero1 run as FSDP2 (see resolve): their memory is FSDP2's.
    wrapping = ex.wrapping if ex.pipeline else c.strategy
    args = (wrapping, ctx.shape, c.mesh.tp, ex.shard_group, c.micro_batch, c.recompute, ctx.layout, bucket_bytes,
            ctx.on_gpu)
    pl = ex.pipeline
    if pl is None:
        return rank_memory(*args, held_grad_bytes=held, micro_steps=accum_steps(ctx, c))
    # Activations in flight fall with the stage index and blocks differ by at most one between
    # middle stages, so the fullest rank is the first, the second, the last, or the first middle
    # stage with the most blocks.
    middle = range(1, pl.stages - 1)
    most = max(middle, key=lambda s: stage_share(ctx.shape, pl, s).blocks, default=0)
    return max((rank_memory(*args, share=stage_share(ctx.shape, pl, s),
                            held_grad_bytes=held, micro_steps=pl.microbatches)
                for s in sorted({0, min(1, pl.stages - 1), most, pl.stages - 1})), key=lambda m: m.total)


def compute_floor(ctx: JobContext, mesh: Mesh, micro_batch: int, recompute: Recompute | str = Recompute.none) -> float:
    """A lower bound on the step time of any plan on `mesh` with micro-batches of
    `micro_batch` sequences (efficiency is not monotone in it: waves of GEMM tiles): its
    matmuls split perfectly over every rank, and the smallest bubble a pipeline of that many
    micro-batches can have (interleaved with two chunks, zero-bubble's third of it), nothing
    else."""
    eff = efficiency(micro_batch * ctx.shape.seq, ctx.shape.hidden, mesh.tp, ctx.speed, ctx.on_gpu)
    busy = matmul_seconds(flops_per_step(ctx.shape, ctx.global_batch, str(recompute)) / mesh.world_size, ctx.speed, eff)
    m = max(1, ctx.global_batch // (mesh.dp * micro_batch))
    return busy * ctx.calibration.compute * (1 + bubble_fraction(PipelineSchedule.zero_bubble, mesh.pp, m,
                                                                 2 if mesh.pp > 1 else 1))
