"""Predicted step time and memory of one candidate plan on one laid-out cluster."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..choices import (
    AccumSync,
    Compression,
    CpAttention,
    PipelineSchedule,
    Precision,
    Recompute,
    Strategy,
    SyncAlgorithm,
)
from .activations import ROUTED_IMBALANCE, kv_heads_and_width, routed_rows, ulysses_tensor_bytes
from .calibration import UNCALIBRATED, Calibration
from .comm import (
    GLOO_LAUNCH_US,
    LAUNCH_S,
    GroupLinks,
    all_reduce,
    gloo_all_reduce,
    group_all_gather,
    group_all_reduce,
    group_all_to_all,
    group_reduce_scatter,
)
from .compute import (
    DeviceSpeed,
    efficiency,
    elementwise_seconds,
    expert_efficiency,
    matmul_seconds,
    optimizer_seconds,
)
from .layout import ClusterLayout
from .memory import (
    ByteLayout,
    MemoryBreakdown,
    expert_states,
    moe_blocks_of,
    params_per_tp_rank,
    rank_memory,
    runtime_states,
)
from .mesh import Mesh
from .model_math import ModelShape, block_params, flops_per_step, root_params, routed_params_per_block
from .pipeline import StageShare, bubble_fraction, resolve_pipeline, slowest_stage, stage_cost, stage_share
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
    cp_attention: CpAttention = CpAttention.allgather_kv
    """How attention sees the whole sequence under mesh.cp > 1 (`context_parallel_term`)."""


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


def axis_size(mesh: Mesh, axis: str) -> int:
    """Ranks in one group of `axis`: a mesh axis, or `dp_shard_cp`, the FSDP group context
    parallelism joins (dp_shard x cp)."""
    return mesh.dp_shard * mesh.cp if axis == "dp_shard_cp" else mesh.size(axis)


def fsdp_axis(mesh: Mesh) -> str:
    """The axis FSDP shards the dense model over: dp_shard, joined by cp where it has ranks."""
    return "dp_shard_cp" if mesh.cp > 1 else "dp_shard"


def group_links(ctx: JobContext, layout: ClusterLayout, axis: str) -> GroupLinks:
    """The links a group of `axis` runs over: its in-node ring, and its share of the network
    (every group of the axis on a node communicates at once, so they split the node's ports)."""
    size = axis_size(layout.mesh, axis)
    per_node = layout.per_node[axis]
    ring = layout.rings[axis]
    spans = size > per_node
    inter = ctx.net_gbps * per_node / ctx.gpus_per_node if spans else math.inf
    return GroupLinks(size=size, per_node=per_node, intra_gbps=ring.gbps,
                      intra_lat_us=ring.lat_us if per_node > 1 else 0.0,
                      inter_gbps=inter, inter_lat_us=ctx.net_lat_us if spans else 0.0,
                      gloo_mem_gbps=None if ctx.on_gpu else ctx.speed.mem_gbps)


def execution(ctx: JobContext, choice: Choice) -> Execution:
    """What runs for `choice` (Unsupported when it cannot run at all)."""
    pipeline = None
    if choice.mesh.pp > 1:
        microbatches = ctx.global_batch // (choice.mesh.dp * choice.micro_batch)
        try:
            pipeline = resolve_pipeline(ctx.shape, choice.mesh.pp, choice.pp_schedule, microbatches, choice.virtual)
        except ValueError as error:
            raise Unsupported(str(error)) from error
    return resolve(choice.strategy, choice.mesh, precision=ctx.precision, device=ctx.device, recompute=choice.recompute,
                   compression=choice.compression, algorithm=choice.algorithm, bucket_mb=choice.bucket_mb or 25.0,
                   max_steps=ctx.max_steps, pipeline=pipeline, accum_sync=choice.accum_sync,
                   cp_attention=choice.cp_attention)


def accum_steps(ctx: JobContext, choice: Choice) -> int:
    """Micro-steps per optimizer step of `choice` (a pipeline's micro-batches)."""
    return ctx.global_batch // (choice.mesh.dp * choice.micro_batch)


def held_grad_bytes(runs: Execution, layout: ByteLayout, accum: int) -> int | None:
    """Bytes per parameter of the unsharded gradient FSDP2 keeps between micro-steps when it
    reduces on the last one only: its reduce dtype (fp32, or the 16-bit compression dtype;
    `comm_hooks.fsdp_policy`). None where nothing is kept that way: DDP-style reducers keep
    their whole gradients in the `grads` layout anyway, and one micro-step keeps nothing."""
    if runs.ddp_reduces or runs.reduce_every_micro_step or accum <= 1:
        return None
    return min(2, layout.grads) if runs.compression in (Compression.fp16, Compression.bf16) else layout.grads


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


# The records one estimate builds (Candidate, ComputeTerm, CommTerm) are slotted and not frozen:
# the search builds thousands of them per plan, and a frozen dataclass's __init__ costs several
# times a plain one's. Nothing keeps them past the estimate that made them.
@dataclass(slots=True)
class Candidate:
    """What every cost term reads of one choice as it runs: its execution, its accumulation,
    and the slowest pipeline stage's share of the model (the whole model without a pipeline)."""

    choice: Choice
    execution: Execution
    """What runs for the choice (`resolve`)."""
    accum: int
    """Micro-steps per optimizer step (a pipeline's micro-batches)."""
    syncs: int
    """Gradient reductions per step: every micro-step, or only the last one's (`no_sync()`
    before it; a pipeline's stages always sync so)."""
    held: int | None
    """FSDP2's unsharded gradient bytes per parameter kept between micro-steps (`held_grad_bytes`)."""
    share: StageShare | None
    """The slowest stage's blocks and root parameters; None without a pipeline."""
    work: float
    """The slowest stage's share of the model's compute (1 without a pipeline)."""
    params_per_rank: float
    """Parameters one rank of the slowest stage holds before data-parallel sharding."""
    blocks: int
    """Blocks the slowest stage runs."""
    block_params: float
    """Parameters of one block on one tensor-parallel rank."""


def candidate(ctx: JobContext, choice: Choice) -> Candidate:
    """The figures of `choice` every term reads; Unsupported when it cannot run at all."""
    shape = ctx.shape
    runs = execution(ctx, choice)
    pipeline = runs.pipeline
    accum = accum_steps(ctx, choice)
    # With a pipeline the accumulation steps are its micro-batches, and a rank holds and runs
    # its stage; the slowest stage sets the pace of the whole pipeline.
    slowest = slowest_stage(shape, pipeline)
    share = stage_share(shape, pipeline, slowest) if pipeline else None
    work = stage_cost(shape, pipeline, slowest) / stage_cost(shape, None, 0) if pipeline else 1.0
    whole = params_per_tp_rank(shape, choice.mesh.tp)
    per_block_rank = (whole - root_params(shape)) / shape.layers
    return Candidate(choice=choice, execution=runs, accum=accum, syncs=accum if runs.reduce_every_micro_step else 1,
                     held=held_grad_bytes(runs, ctx.layout, accum), share=share, work=work,
                     params_per_rank=share.blocks * per_block_rank + share.root if share else whole,
                     blocks=share.blocks if share else shape.layers,
                     block_params=block_params(shape) / choice.mesh.tp)


@dataclass(slots=True)
class ComputeTerm:
    """The matmuls and the optimizer of one step on the slowest rank."""

    matmul_s: float
    """Forward, backward and recomputation matmuls (and, on a GPU, the element-wise passes)."""
    compute_s: float
    """matmul_s plus the optimizer step."""
    forward_s: float
    """One micro-step's forward share of matmul_s: what an all-gather before it can hide behind."""
    backward_s: float
    """One micro-step's backward share of matmul_s: what a gradient reduction can hide behind."""
    bubble_s: float
    """Seconds the pipeline's slowest stage idles per step (its schedule's bubble)."""


def compute_term(ctx: JobContext, cand: Candidate) -> ComputeTerm:
    """The job's hardware FLOPs split evenly over the data- and tensor-parallel ranks, the
    slowest pipeline stage's share of them on each, at the GEMM efficiency of one micro-batch;
    the optimizer steps the states the rank keeps."""
    shape, choice, pipeline = ctx.shape, cand.choice, cand.execution.pipeline
    tp, dp, cp = choice.mesh.tp, choice.mesh.dp, choice.mesh.cp
    flops = flops_per_step(shape, ctx.global_batch, choice.recompute) / (dp * tp * cp) * cand.work
    routed = min(flops, routed_expert_flops(ctx, cand))
    gemm_efficiency = efficiency(choice.micro_batch * shape.seq // cp, shape.hidden, tp, ctx.speed, ctx.on_gpu)
    matmul_s = matmul_seconds(flops - routed, ctx.speed, gemm_efficiency) + expert_seconds(ctx, cand, routed)
    if ctx.on_gpu:
        matmul_s += elementwise_seconds(ctx.global_batch * shape.seq / (dp * cp), shape.hidden, tp, cand.blocks,
                                        str(choice.recompute), ctx.layout.activation, ctx.speed)
    step_flops = flops_per_step(shape, ctx.global_batch, choice.recompute)
    forward_share = flops_per_step(shape, ctx.global_batch, "none") / 3 / step_flops
    # Under a pipeline ddp and zero1 run as FSDP2 (see resolve): their memory is FSDP2's.
    wrapping = cand.execution.wrapping if pipeline else choice.strategy
    states = runtime_states(wrapping, shape, tp, cand.execution.shard_group, ctx.layout, cand.share)
    experts = expert_states(wrapping, shape, tp, choice.mesh.ep, choice.mesh.efsdp, ctx.layout, cand.share)
    stepped = states.params + states.grads + states.optimizer + experts.params + experts.grads + experts.optimizer
    return ComputeTerm(matmul_s=matmul_s,
                       compute_s=matmul_s + optimizer_seconds(stepped, ctx.speed),
                       forward_s=matmul_s / cand.accum * forward_share,
                       backward_s=matmul_s / cand.accum * (1 - forward_share),
                       bubble_s=matmul_s * pipeline.bubble if pipeline else 0.0)


def routed_expert_flops(ctx: JobContext, cand: Candidate) -> float:
    """FLOPs of the routed experts on one rank and step at balance: each routed row runs one
    expert's SwiGLU, 2 x 3 d F FLOPs forward (top_k of the active parameters per token), twice
    that backward and once more under full recomputation. 0 for a dense model."""
    shape, choice = ctx.shape, cand.choice
    experts = shape.spec.experts if shape.spec is not None else None
    if experts is None:
        return 0.0
    passes = 3 + (1 if str(choice.recompute) == "full" else 0)
    rows = routed_rows(shape, choice.micro_batch, choice.mesh.cp, choice.mesh.tp) * cand.accum
    per_row = 2 * 3 * shape.hidden * experts.expert_hidden
    return rows * moe_blocks_of(shape, cand.share) * per_row * passes


def expert_seconds(ctx: JobContext, cand: Candidate, routed_flops: float) -> float:
    """Seconds of the routed experts' grouped matmuls: at the efficiency of the rows each local
    expert takes (`expert_efficiency`: ep ranks' rows for each of `experts / ep`), and on the
    busiest expert-parallel rank `ROUTED_IMBALANCE` of its share; at ep=1 every rank runs its
    own rows through every expert, balanced."""
    if routed_flops <= 0:
        return 0.0
    shape, choice = ctx.shape, cand.choice
    assert shape.spec is not None and shape.spec.experts is not None, "routed FLOPs need experts"
    experts, ep = shape.spec.experts, choice.mesh.ep
    rows_per_expert = routed_rows(shape, choice.micro_batch, choice.mesh.cp, choice.mesh.tp) * ep / experts.experts
    eff = expert_efficiency(rows_per_expert, shape.hidden, experts.expert_hidden, ctx.speed, ctx.on_gpu)
    return matmul_seconds(routed_flops * (ROUTED_IMBALANCE if ep > 1 else 1.0), ctx.speed, eff)


@dataclass(slots=True)
class CommTerm:
    """Communication of one kind in a step: its parts by what they carry, and what of them
    compute does not hide."""

    parts: dict[str, float] = field(default_factory=dict)
    """Seconds per step by what it is for, in the order the explanation lists them."""
    exposed_s: tuple[float, ...] = ()
    """The exposed seconds, in the order they add up (the step's total sums them so)."""
    compute_s: tuple[float, ...] = ()
    """Seconds of device-memory copies the communication makes compute wait for."""
    bucket_mb: float = 0.0
    """The gradient bucket the reduction runs in (DDP's bucket; FSDP2's unit)."""
    schedule: str = ""
    """The collective schedule of the gradient reduction, in words."""


def tensor_parallel_term(ctx: JobContext, layout: ClusterLayout, cand: Candidate) -> CommTerm:
    """All-reduces of a block's activations, forward and backward, and forward's again but the
    last under full recomputation (`tp_all_reduces_per_micro_batch`; reduce-scatter +
    all-gather pairs under sequence parallelism move the same bytes), on every micro-batch of
    every block. Nothing hides them; a pipeline's bubble stretches them as it does compute."""
    choice, pipeline, tp = cand.choice, cand.execution.pipeline, cand.choice.mesh.tp
    if tp <= 1:
        return CommTerm()
    links = group_links(ctx, layout, "tp")
    activation = choice.micro_batch * ctx.shape.seq // choice.mesh.cp * ctx.shape.hidden * ctx.layout.activation
    if ctx.on_gpu:
        per_all_reduce, _ = all_reduce(activation, tp, links.flat_gbps, links.flat_lat_us)
    else:
        per_all_reduce = gloo_all_reduce(activation, tp, links.flat_gbps, links.flat_lat_us, ctx.speed.mem_gbps)
    count = tp_all_reduces_per_micro_batch(ctx.shape, choice.recompute)
    seconds = cand.accum * cand.blocks * count * per_all_reduce * (1 + (pipeline.bubble if pipeline else 0.0))
    return CommTerm(parts={"tp": seconds}, exposed_s=(seconds,))


def pipeline_term(ctx: JobContext, layout: ClusterLayout, cand: Candidate) -> CommTerm:
    """Each micro-batch's activation crosses every chunk boundary forward and its gradient
    backward, on the link between adjacent stages; in the steady state a send overlaps the next
    micro-batch's compute, the first micro-batch's trip through all p*v chunks forward and back
    is on the critical path. A tied head's gradient sum follows the schedule, unhidden."""
    pipeline = cand.execution.pipeline
    if pipeline is None:
        return CommTerm()
    shape = ctx.shape
    links = group_links(ctx, layout, "pp")
    activation = cand.choice.micro_batch * shape.seq // cand.choice.mesh.cp * shape.hidden * ctx.layout.activation
    send = p2p_seconds(activation, links.flat_gbps, links.flat_lat_us, ctx.on_gpu)
    parts = {"pipeline p2p": 2 * pipeline.virtual * pipeline.microbatches * send}
    exposed = 2 * (pipeline.stages * pipeline.virtual - 1) * send
    if ties_head(shape):
        # The first stage holds the embedding, the last its tied copy as the head; after the
        # schedule their gradients are summed (Megatron's embedding all-reduce, the runtime's
        # `Pipelined._sync_tied`): each rank sends and receives its share of the vocabulary
        # x hidden gradient over the pp link, before the optimizer can step. Nothing hides it.
        tied = shape.vocab * shape.hidden * ctx.layout.grads / cand.execution.shard_group
        parts["tied embedding sync"] = p2p_seconds(tied, links.flat_gbps, links.flat_lat_us, ctx.on_gpu)
        exposed += parts["tied embedding sync"]
    return CommTerm(parts=parts, exposed_s=(exposed,))


def context_parallel_term(ctx: JobContext, layout: ClusterLayout, cand: Candidate) -> CommTerm:
    """Context parallelism's attention traffic per attention layer and micro-batch, on the link
    the cp group spans; attention waits for it, so nothing hides it, and a pipeline's bubble
    stretches it as it does compute.

    - allgather_kv: the sequence's K and V all-gathered in forward (`(cp-1)/cp x 2 x S x n_kv
      x head_dim x bytes` per rank), their gradients reduce-scattered in backward; recomputing
      attention (selective or full) gathers them again.
    - ulysses: four all-to-alls in forward (q, k, v to heads, the output back) and four in
      backward, each sending (cp-1)/cp of the rank's tensor (`ulysses_tensor_bytes`), the
      forward four again under recomputation."""
    choice, pipeline, cp = cand.choice, cand.execution.pipeline, cand.choice.mesh.cp
    if cp <= 1:
        return CommTerm()
    links = group_links(ctx, layout, "cp")
    if cand.execution.cp_attention == CpAttention.ulysses:
        cp_in = layout.per_node["cp"]
        # Each rank keeps 1/cp of every tensor and sends the rest, to its island's members and beyond.
        one_pass = sum(2 * group_all_to_all(held * (cp_in - 1) / cp, held * (cp - cp_in) / cp, links)
                       for held in ulysses_tensor_bytes(ctx.shape, choice.micro_batch, choice.mesh.tp, cp,
                                                        ctx.layout.activation))
        per_block = (2 if str(choice.recompute) == "none" else 3) * one_pass
        name = "cp head all-to-all"
    else:
        kv, width = kv_heads_and_width(ctx.shape)
        gathered = 2 * choice.micro_batch * ctx.shape.seq * kv * width * ctx.layout.activation
        gathers = 2 if str(choice.recompute) != "none" else 1
        per_block = gathers * group_all_gather(gathered, links) + group_reduce_scatter(gathered, links)
        name = "cp K/V all-gather"
    seconds = cand.accum * cand.blocks * per_block * (1 + (pipeline.bubble if pipeline else 0.0))
    return CommTerm(parts={name: seconds}, exposed_s=(seconds,))


NODE_LIMIT = 4
"""Islands a token's experts may sit on when an expert group spans several (DeepSeek-V3's
node-limited routing, M=4), unless the model's own group-limited routing says fewer."""


@dataclass(frozen=True)
class ExpertRouting:
    """How tokens reach an expert group that spans NVLink islands: node-limited routing."""

    groups: int
    """Router groups: one per island the expert group spans (its experts split by island)."""
    top_groups: int
    """Groups (islands) each token's experts may come from."""


def expert_routing(ctx: JobContext, layout: ClusterLayout) -> ExpertRouting | None:
    """Node-limited routing for an expert group that spans islands (None inside one): the
    group count is the islands it spans, each token limited to the model's own top groups
    where it routes by groups, else to `NODE_LIMIT`, and never more than its top_k."""
    experts = ctx.shape.spec.experts if ctx.shape.spec is not None else None
    mesh = layout.mesh
    if experts is None or mesh.ep <= 1 or mesh.ep <= layout.per_node["ep"]:
        return None
    islands = mesh.ep // layout.per_node["ep"]
    limit = experts.router_top_groups if experts.router_groups > 1 else NODE_LIMIT
    return ExpertRouting(groups=islands, top_groups=min(islands, limit, experts.top_k))


def expert_parallel_term(ctx: JobContext, layout: ClusterLayout, cand: Candidate) -> CommTerm:
    """The expert all-to-alls: per MoE layer and micro-batch, dispatch and combine each send
    `top_k x hidden x bytes x (ep-1)/ep` per token (the rank's rows, `routed_rows`), in
    forward, again in backward, and once more under full recomputation; the busiest rank
    receives `ROUTED_IMBALANCE` of its share, which sets the pace. In-node members take
    theirs over the island's links; across islands, node-limited routing (`expert_routing`)
    sends each token once per destination island (DeepEP's dedup), `top_groups` copies at
    most. Nothing hides it (the experts wait for their rows)."""
    choice, mesh, pipeline = cand.choice, cand.choice.mesh, cand.execution.pipeline
    if mesh.ep <= 1:
        return CommTerm()
    links = group_links(ctx, layout, "ep")
    rows = routed_rows(ctx.shape, choice.micro_batch, mesh.cp, mesh.tp)
    row_bytes = ctx.shape.hidden * ctx.layout.activation
    ep_in = layout.per_node["ep"]
    intra = rows * row_bytes * (ep_in - 1) / mesh.ep
    routing = expert_routing(ctx, layout)
    inter = 0.0
    if routing is not None:
        assert ctx.shape.spec is not None and ctx.shape.spec.experts is not None, "routing needs experts"
        tokens = rows / ctx.shape.spec.experts.top_k
        inter = tokens * routing.top_groups * row_bytes * (routing.groups - 1) / routing.groups
    one = ROUTED_IMBALANCE * group_all_to_all(intra, inter, links)
    passes = 4 + (2 if str(choice.recompute) == "full" else 0)
    seconds = cand.accum * moe_blocks_of(ctx.shape, cand.share) * passes * one * (
        1 + (pipeline.bubble if pipeline else 0.0))
    return CommTerm(parts={"ep all-to-all": seconds}, exposed_s=(seconds,))


def expert_sync_term(ctx: JobContext, layout: ClusterLayout, cand: Candidate, compute: ComputeTerm,
                     dense_s: float) -> CommTerm:
    """FSDP2 over the experts' own group (efsdp, what ep leaves of dp_shard x cp x tp): per MoE
    layer the rank's `experts / ep` all-gathered forward, again for backward where the
    strategy reshards (zero3, hsdp), their gradients reduce-scattered on each sync, and under
    hsdp all-reduced across the replicas. At ep=1 this is the FSDP-only alternative: the whole
    expert set gathered per layer. It hides behind what compute the dense gradient sync
    (`dense_s`) leaves."""
    shape, runs, mesh = ctx.shape, cand.execution, cand.choice.mesh
    blocks = moe_blocks_of(shape, cand.share)
    if not blocks or runs.ddp_reduces:
        return CommTerm()
    local_layer = routed_params_per_block(shape) / mesh.ep
    parts = {}
    if mesh.efsdp > 1:
        links = group_links(ctx, layout, "efsdp")
        gather = group_all_gather(local_layer * ctx.layout.compute, links)
        reduce = group_reduce_scatter(local_layer * wire_bytes_per_gradient(ctx, cand), links)
        gathers = 2 * cand.accum if runs.reshard_after_forward else 1
        parts["expert all-gather"] = blocks * gathers * gather
        parts["expert reduce-scatter"] = blocks * cand.syncs * reduce
    if runs.fsdp_replicates and mesh.dp_replicate > 1:
        replicas = group_links(ctx, layout, "dp_replicate")
        shard_bytes = blocks * local_layer / mesh.efsdp * wire_bytes_per_gradient(ctx, cand)
        parts["expert replica all-reduce"] = cand.syncs * group_all_reduce(shard_bytes, replicas, "flat")[0]
    total = sum(parts.values())
    exposed = overlapped(total, max(0.0, compute.matmul_s - dense_s)) if ctx.on_gpu else total
    return CommTerm(parts=parts, exposed_s=(exposed,))


def wire_bytes_per_gradient(ctx: JobContext, cand: Candidate) -> float:
    """Bytes one gradient puts on the wire per reduction (compressed where the execution
    compresses, PowerSGD's warm-up priced as its share of the run)."""
    runs = cand.execution
    return wire_bytes_per_grad(runs.compression, ctx.layout.grads, ctx.powersgd_ratio,
                               runs.compression_warmup_steps / ctx.max_steps if ctx.max_steps else 0.0)


def held_gradient_seconds(ctx: JobContext, cand: Candidate) -> float:
    """Each micro-step after the first adds its gradient into FSDP2's kept unsharded one (a
    read of both and a write, in device memory); reducing every micro-step would copy it into
    the reduce-scatter's input instead (`sharded_sync_term`'s copy-in)."""
    if cand.held is None or not ctx.on_gpu:
        return 0.0
    return (cand.accum - 1) * cand.params_per_rank * (ctx.layout.compute + 2 * cand.held) / (ctx.speed.mem_gbps * 1e9)


def ddp_sync_term(ctx: JobContext, layout: ClusterLayout, cand: Candidate, compute: ComputeTerm) -> CommTerm:
    """DDP's bucketed all-reduce of the gradients while backward runs (also FSDP2 over a shard
    group of one, which all-reduces per unit as DDP's buckets do): all but the last bucket
    hides behind backward; ZeRO-1 then broadcasts each rank's stepped partition, unhidden."""
    choice, runs = cand.choice, cand.execution
    links = group_links(ctx, layout, "dp_replicate" if choice.strategy == Strategy.ddp else "dp_shard")
    grad_bytes = cand.params_per_rank * wire_bytes_per_gradient(ctx, cand)
    bucket_mb = choice.bucket_mb or auto_bucket_mb(grad_bytes, links.size, links.flat_gbps, links.flat_lat_us)
    algorithm = str(runs.sync_algorithm)
    reduction, schedule = group_all_reduce(grad_bytes, links, algorithm)
    tail, _ = group_all_reduce(min(bucket_mb * MB, grad_bytes), links, algorithm)
    parts = {"grad all-reduce": cand.syncs * reduction}
    schedule += _flat_note(cand)
    exposed = []
    if runs.wrapping == Strategy.zero1 and links.size > 1:
        # ZeroRedundancyOptimizer runs under DDP's all-reduce: each rank steps its partition
        # and broadcasts it, one bucket per rank, after the step, where nothing hides it.
        broadcast = group_all_gather(cand.params_per_rank * ctx.layout.weights, links, links.size)
        parts["param broadcast"] = broadcast
        schedule += f"; parameters: {links.size} broadcasts, one per rank's partition"
        exposed.append(broadcast)
    hides = ctx.on_gpu and links.size > 1
    exposed.append(cand.syncs * ((overlapped(reduction, compute.backward_s) + tail) if hides else reduction))
    return CommTerm(parts=parts, exposed_s=tuple(exposed), bucket_mb=bucket_mb, schedule=schedule)


def sharded_sync_term(ctx: JobContext, layout: ClusterLayout, cand: Candidate, compute: ComputeTerm) -> CommTerm:
    """ZeRO-2/3 and FSDP2: a reduce-scatter of the gradients and all-gathers of the weights,
    one collective per unit (each block, and the root's own parameters), so each pays the
    ring's latency: at hundreds of ranks that, not bandwidth, is what small units cost. All but
    the last unit's hide behind the pass they serve."""
    runs, syncs, accum = cand.execution, cand.syncs, cand.accum
    links = group_links(ctx, layout, fsdp_axis(cand.choice.mesh))
    per_gradient = wire_bytes_per_gradient(ctx, cand)
    grad_bytes = cand.params_per_rank * per_gradient
    block_wire = cand.block_params * per_gradient
    units = cand.blocks + 1
    reduce_scatter = group_reduce_scatter(grad_bytes, links, units)
    reduce_scatter_block = group_reduce_scatter(block_wire, links)
    gathered = cand.params_per_rank * ctx.layout.compute
    all_gather = group_all_gather(gathered, links, units)
    all_gather_block = group_all_gather(cand.block_params * ctx.layout.compute, links)
    copy_out, copy_in = _fsdp_copies(ctx, links.size, gathered, grad_bytes)
    forward_s, backward_s, hides = compute.forward_s, compute.backward_s, ctx.on_gpu
    if not runs.reshard_after_forward:
        # Weights gathered once, kept to the end; gradients reduce-scattered `syncs` times.
        parts = {"grad reduce-scatter": syncs * reduce_scatter, "param all-gather": all_gather}
        copies = copy_out + syncs * copy_in
        exposed = (syncs * (overlapped(reduce_scatter, backward_s) + reduce_scatter_block)
                   + overlapped(all_gather, forward_s) + all_gather_block) if hides \
            else syncs * reduce_scatter + all_gather
    else:
        # ZeRO-3 / FSDP: gather forward and again for backward every micro-step; reduce-scatter
        # on `syncs` of them, beside that micro-step's backward gathers.
        parts = {"param all-gather": 2 * accum * all_gather, "grad reduce-scatter": syncs * reduce_scatter}
        copies = accum * 2 * copy_out + syncs * copy_in
        exposed = (accum * (overlapped(all_gather, forward_s) + all_gather_block)
                   + (accum - syncs) * overlapped(all_gather, backward_s)
                   + syncs * (overlapped(all_gather + reduce_scatter, backward_s) + reduce_scatter_block)) if hides \
            else accum * 2 * all_gather + syncs * reduce_scatter
    schedule = "flat ring reduce-scatter / all-gather" if links.size > 1 else NO_SCHEDULE
    return CommTerm(parts=parts, exposed_s=(exposed,), compute_s=(copies,), bucket_mb=block_wire / MB,
                    schedule=schedule)


def _fsdp_copies(ctx: JobContext, group: int, gathered: float, grad_bytes: float) -> tuple[float, float]:
    """FSDP2 copies each gathered unit out of the flat buffer into its parameters
    (`foreach_all_gather_copy_out`), and each unit's gradients into the reduce-scatter's input
    (`foreach_reduce`): a read and a write of the bytes in device memory each, which compute
    waits for or shares the memory with. (copy out, copy in) seconds; none on CPU or alone."""
    if not (ctx.on_gpu and group > 1):
        return 0.0, 0.0
    return 2 * gathered / (ctx.speed.mem_gbps * 1e9), 2 * grad_bytes / (ctx.speed.mem_gbps * 1e9)


def replica_sync_term(ctx: JobContext, layout: ClusterLayout, cand: Candidate) -> CommTerm:
    """HSDP: FSDP2 all-reduces each shard's gradients across the replicas in one flat group
    (hsdp's mesh is the hierarchy), after the reduce-scatter, unhidden."""
    links = group_links(ctx, layout, "dp_replicate")
    grad_bytes = cand.params_per_rank * wire_bytes_per_gradient(ctx, cand)
    seconds, schedule = group_all_reduce(grad_bytes / cand.execution.shard_group, links, "flat")
    return CommTerm(parts={"replica all-reduce": cand.syncs * seconds}, exposed_s=(cand.syncs * seconds,),
                    schedule=schedule)


NO_SCHEDULE = "none (one data-parallel rank)"
"""The gradient schedule's words where no data-parallel group reduces anything."""


def data_parallel_terms(ctx: JobContext, layout: ClusterLayout, cand: Candidate,
                        compute: ComputeTerm) -> tuple[CommTerm, ...]:
    """The gradient sync of the strategy as it runs: DDP's all-reduce (ddp, zero1, FSDP2 over
    a shard group of one), else FSDP2's reduce-scatter and all-gathers, and HSDP's replica
    all-reduce after them."""
    if _ddp_priced(cand):
        return (ddp_sync_term(ctx, layout, cand, compute),)
    sharded = sharded_sync_term(ctx, layout, cand, compute)
    return (sharded, replica_sync_term(ctx, layout, cand)) if cand.execution.fsdp_replicates else (sharded,)


def _ddp_priced(cand: Candidate) -> bool:
    # FSDP2 over a shard group of one (ddp with tensor parallelism) all-reduces per unit while
    # backward runs, as DDP's buckets do: both are priced as DDP's bucketed all-reduce.
    return cand.execution.ddp_reduces or cand.choice.strategy == Strategy.ddp


def _flat_note(cand: Candidate) -> str:
    """Why a requested hierarchical all-reduce runs flat, in words ('' where it does not)."""
    runs = cand.execution
    if cand.choice.algorithm == SyncAlgorithm.hierarchical and runs.flat_reason:
        return f" (parallel.sync=hierarchical runs flat: {runs.flat_reason})"
    return ""


def sync_schedule(cand: Candidate, terms: tuple[CommTerm, ...]) -> str:
    """The gradient reduction's schedule in words: DDP's as its term says it, else the
    shards', the replicas' after it, and why a requested hierarchical all-reduce runs flat."""
    if _ddp_priced(cand):
        return terms[0].schedule
    schedule = terms[0].schedule
    if len(terms) > 1:
        schedule = f"{schedule}; replicas: {terms[1].schedule}"
    return schedule + _flat_note(cand)


def estimate(ctx: JobContext, layout: ClusterLayout, choice: Choice) -> Estimate:
    """Memory and step time of `choice` on `layout`, as `resolve` says it runs, term by term;
    Unsupported when it cannot run at all."""
    cand = candidate(ctx, choice)
    compute = compute_term(ctx, cand)
    model_parallel: tuple[CommTerm, ...] = (tensor_parallel_term(ctx, layout, cand), pipeline_term(ctx, layout, cand),
                      context_parallel_term(ctx, layout, cand), expert_parallel_term(ctx, layout, cand))
    gradient_sync = data_parallel_terms(ctx, layout, cand, compute)
    if ctx.shape.spec is not None and ctx.shape.spec.experts is not None:
        dense_s = sum(s for term in gradient_sync for s in term.parts.values())
        model_parallel += (expert_sync_term(ctx, layout, cand, compute, dense_s),)
    parts: dict[str, float] = {}
    for term in model_parallel + gradient_sync:
        parts.update(term.parts)
    exposed = sum(x for term in model_parallel for x in term.exposed_s)
    for term in gradient_sync:
        for seconds in term.exposed_s:
            exposed += seconds
    compute_s = compute.compute_s + held_gradient_seconds(ctx, cand)
    for seconds in gradient_sync[0].compute_s:
        compute_s += seconds
    schedule = sync_schedule(cand, gradient_sync)
    runs = cand.execution
    sync = SyncPlan(bucket_mb=round(gradient_sync[0].bucket_mb, 3),
                    algorithm=SyncAlgorithm("hierarchical" if schedule.startswith("hierarchical") else "flat"),
                    compression=runs.compression, grad_accum_steps=cand.accum, overlap=ctx.on_gpu,
                    accum_sync=AccumSync.per_micro_step if runs.reduce_every_micro_step else AccumSync.last_micro_step)
    memory = _peak_memory(ctx, choice, runs, gradient_sync[0].bucket_mb * MB if runs.ddp_reduces else 0.0, cand.held)
    comm_s = sum(parts.values())
    # What compute hides of communication is bounded by the communication itself.
    return calibrated(ctx.calibration, Estimate(
        choice=choice, execution=runs, memory=memory, compute_s=compute_s, comm_s=comm_s,
        exposed_comm_s=min(exposed, comm_s), sync=sync, comm_parts=parts, schedule=schedule,
        bubble_s=compute.bubble_s))


def calibrated(calibration: Calibration, raw: Estimate) -> Estimate:
    """`raw` with a trial's measured factors applied: they scale whole term kinds (compute and
    the bubble by one, communication by the other); the terms' shapes stay the model's."""
    if not calibration.applied:
        return raw  # factors of 1.0 change nothing
    compute, communication = calibration.compute, calibration.communication
    return Estimate(choice=raw.choice, execution=raw.execution, memory=raw.memory, compute_s=raw.compute_s * compute,
                    comm_s=raw.comm_s * communication,
                    exposed_comm_s=raw.exposed_comm_s * communication, sync=raw.sync,
                    comm_parts={k: v * communication for k, v in raw.comm_parts.items()}, schedule=raw.schedule,
                    bubble_s=raw.bubble_s * compute)


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


def _peak_memory(ctx: JobContext, choice: Choice, runs: Execution, bucket_bytes: float,
                 held: int | None = None) -> MemoryBreakdown:
    """Peak bytes of the fullest rank: every pipeline stage differs (the first holds the
    embeddings and the most micro-batches in flight, the last the head and the logits).
    `held`: FSDP2's unsharded gradient bytes per parameter kept between micro-steps."""
    # Under a pipeline ddp and zero1 run as FSDP2 (see resolve): their memory is FSDP2's.
    wrapping = runs.wrapping if runs.pipeline else choice.strategy
    args = (wrapping, ctx.shape, choice.mesh.tp, runs.shard_group, choice.micro_batch, choice.recompute, ctx.layout,
            bucket_bytes,
            ctx.on_gpu)
    mesh = choice.mesh
    pipeline = runs.pipeline
    if pipeline is None:
        return rank_memory(*args, held_grad_bytes=held, micro_steps=accum_steps(ctx, choice),
                           cp=mesh.cp, ep=mesh.ep, efsdp=mesh.efsdp, cp_attention=choice.cp_attention)
    # Activations in flight fall with the stage index and blocks differ by at most one between
    # middle stages, so the fullest rank is the first, the second, the last, or the first middle
    # stage with the most blocks.
    middle = range(1, pipeline.stages - 1)
    most = max(middle, key=lambda stage: stage_share(ctx.shape, pipeline, stage).blocks, default=0)
    return max((rank_memory(*args, share=stage_share(ctx.shape, pipeline, stage),
                            held_grad_bytes=held, micro_steps=pipeline.microbatches, cp=mesh.cp, ep=mesh.ep,
                            efsdp=mesh.efsdp, cp_attention=choice.cp_attention)
                for stage in sorted({0, min(1, pipeline.stages - 1), most, pipeline.stages - 1})),
               key=lambda memory: memory.total)


def compute_floor(ctx: JobContext, mesh: Mesh, micro_batch: int, recompute: Recompute | str = Recompute.none) -> float:
    """A lower bound on the step time of any plan on `mesh` with micro-batches of
    `micro_batch` sequences (efficiency is not monotone in it: waves of GEMM tiles): its
    matmuls split perfectly over every rank, and the smallest bubble a pipeline of that many
    micro-batches can have (interleaved with two chunks, zero-bubble's third of it), nothing
    else."""
    gemm_efficiency = efficiency(micro_batch * ctx.shape.seq // mesh.cp, ctx.shape.hidden, mesh.tp, ctx.speed,
                                 ctx.on_gpu)
    busy = matmul_seconds(flops_per_step(ctx.shape, ctx.global_batch, str(recompute)) / mesh.world_size, ctx.speed,
                          gemm_efficiency)
    microbatches = max(1, ctx.global_batch // (mesh.dp * micro_batch))
    return busy * ctx.calibration.compute * (1 + bubble_fraction(PipelineSchedule.zero_bubble, mesh.pp, microbatches,
                                                                 2 if mesh.pp > 1 else 1))
