"""Per-rank memory: model states by strategy (ZeRO's accounting), activations, buffers.

Model states follow Rajbhandari et al. 2020 (ZeRO) Sec. 5: with Psi parameters, weights of
w bytes, gradients of g bytes and K bytes of optimizer state per parameter, a rank keeps
DDP (w+g+K)Psi; ZeRO-1 (w+g)Psi + K Psi/N; ZeRO-2 w Psi + (g+K)Psi/N; ZeRO-3 (w+g+K)Psi/N,
where N is the number of ranks a state is sharded over (HSDP: the shard group).

`model_states` is that accounting. What a rank of the runtime keeps (`runtime_states`) differs
in one place: the runtime's zero2 is FSDP2 with reshard_after_forward=False, which keeps a
weight *shard* at rest (w Psi/N) and holds the gathered weights only from each unit's forward
until its backward, as transient buffers. DeepSpeed's ZeRO-2, which the paper measures, keeps
the full 16-bit weights at rest.

The runtime's mixed precision is torchtitan's, not the paper's: fp32 weights, gradients and
Adam moments (4 + 4 + 8 bytes) under 16-bit autocast, with FSDP2 all-gathering weights in the
autocast dtype (2 bytes) and reduce-scattering gradients in fp32. `ZERO_MIXED_PRECISION` is the
paper's layout (2 + 2 + 12), kept for its tables.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..choices import Precision, Strategy
from ..serialize import to_plain
from .activations import (
    ActivationBytes,
    ValueBytes,
    activation_profile,
    context_shard,
    gathered_kv_bytes,
    routed_activation_bytes,
    ulysses_kept_bytes,
    value_bytes,
)
from .model_math import ModelShape, root_params, routed_params, routed_params_per_block, tp_param_split
from .pipeline import Moment, StageShare, whole_model_moment
from .resolve import resolve_precision, wrapping_of

STRATEGIES = Strategy.concrete()
# Under ZeRO-3 a rank holds the gathered block being computed and the one being prefetched.
FSDP_PREFETCH_BLOCKS = 2
# NCCL communicators' staging buffers and cuBLAS workspaces: a few hundred MB on a GPU.
GPU_WORKSPACE_BYTES = 512 * 2**20
# The CUDA context and allocator fragmentation are not addressable by the model: keep them out.
CUDA_CONTEXT_BYTES = 1 * 2**30
MEMORY_MARGIN = 0.10
"""Fraction of device memory kept free for fragmentation and what the model does not see."""


@dataclass(frozen=True)
class ByteLayout:
    """Bytes per parameter of each model state, and per stored activation value."""

    name: str
    """What this layout is, for the explanation (`fp32 master + bf16 autocast`, ...)."""
    weights: int
    """Bytes of the weights each rank computes with (what ZeRO-3 shards as `params`)."""
    grads: int
    """Bytes of each gradient."""
    optimizer: int
    """Optimizer bytes: Adam's two moments plus any fp32 master copy (ZeRO's K)."""
    activation: int
    """Bytes of one stored activation value (2 under 16-bit autocast, 4 in fp32)."""
    compute: int
    """Bytes of a weight as FSDP2 all-gathers it for compute (its param_dtype), and of the
    gradient autograd computes for that gathered weight."""
    half: str | None = None
    """The 16-bit dtype autocast computes in (bf16 | fp16); None for fp32 runs."""


ZERO_MIXED_PRECISION = ByteLayout("fp16 weights and gradients, fp32 master weights and Adam moments (ZeRO)",
                                  2, 2, 12, 2, 2, "fp16")
"""Rajbhandari et al. 2020's mixed precision (their K=12), as DeepSpeed keeps it."""


def byte_layout(precision: str, device_kind: str = "gpu") -> ByteLayout:
    """The byte layout the runtime keeps for `train.precision` on this kind of device.

    `bf16`/`fp16`, and `auto` on GPU: fp32 weights, gradients and Adam moments (4 + 4 + 8)
    under 16-bit autocast, with 16-bit activations and 16-bit FSDP2 gathers. `fp32`, and `auto`
    on CPU: 4 + 4 + 8 with fp32 activations and gathers. This is the runtime's
    `resolve_precision`: only `auto` means fp32 on CPU.
    """
    if precision not in Precision.__members__:
        raise ValueError(f"precision must be one of {Precision.names()}, got {precision!r}")
    autocast = resolve_precision(precision, device_kind)
    if autocast is None:
        return ByteLayout("fp32 weights, gradients and Adam moments", 4, 4, 8, 4, 4)
    half = str(autocast)
    # The runtime gives FSDP2 the autocast dtype as param_dtype (torchtitan's policy), so the
    # gathered weights and the all-gather are 16-bit; the fp32 shards are the master weights.
    return ByteLayout(f"fp32 master weights, gradients and Adam moments; {half} autocast and FSDP2 gathers",
                      4, 4, 8, 2, 2, half)


@dataclass
class MemoryBreakdown:
    """Bytes one rank needs at its peak."""

    params: int
    """Weights the rank keeps (its shard, or all of them)."""
    grads: int
    """Gradients the rank holds at its peak (FSDP2 makes them in backward: none at the loss's
    backward without accumulation)."""
    optimizer: int
    """Optimizer state (Adam moments, master weights) the rank keeps."""
    activations: int
    """Activation bytes of one micro-batch at their peak: what forward keeps for backward plus
    the most backward holds at once on top (`activations.activation_profile`)."""
    buffers: int
    """Transient: DDP's buckets, FSDP's gathered weights and unsharded gradients, the
    tensor-parallel gather, NCCL and cuBLAS workspaces."""
    total: int
    """The sum of the above."""

    def to_dict(self) -> dict[str, int]:
        return to_plain(self)


def params_per_tp_rank(shape: ModelShape, tp: int) -> float:
    """Parameters one tensor-parallel rank holds before data-parallel sharding."""
    sharded, replicated = tp_param_split(shape)
    return sharded / tp + replicated


def model_states(strategy: str, params: float, shard: int, layout: ByteLayout) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per rank at rest under ZeRO's accounting (the
    paper's stages, as DeepSpeed keeps them) for `params` parameters sharded over `shard` ranks."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if shard < 1:
        raise ValueError(f"shard group size must be >= 1, got {shard}")
    w, g, k = params * layout.weights, params * layout.grads, params * layout.optimizer
    if strategy == "ddp":
        return w, g, k
    if strategy == "zero1":
        return w, g, k / shard
    if strategy == "zero2":
        return w, g / shard, k / shard
    return w / shard, g / shard, k / shard  # zero3, and hsdp inside its shard group


@dataclass(frozen=True)
class StateBytes:
    """What one rank of the runtime keeps of the model, in bytes."""

    params: float
    """Weights at rest: the rank's shard under FSDP2, all of them under DDP and ZeRO-1."""
    grads: float
    """Gradients as the optimizer step sees them (sharded under FSDP2); or, where FSDP2 reduces
    on the last micro-step only, the unsharded gradients it accumulates until then, which are
    what the peak holds."""
    optimizer: float
    """Adam moments (and master weights) of the parameters this rank steps."""
    gathered: float
    """Weights FSDP2 holds unsharded (in its param_dtype) at the peak, on top of `params` (transient)."""
    unsharded_grads: float
    """Gradients FSDP2 holds unsharded (in its param_dtype) at the peak before reduce-scattering
    them (transient)."""
    late_grads: float = 0.0
    """Of `unsharded_grads`, what backward makes only once the blocks are done: a first pipeline
    stage's root unit holds the embeddings alone, whose gradient comes last."""
    root_grads: float = 0.0
    """Of `grads`, the parameters' outside the blocks (embeddings, head, final norm)."""


def runtime_states(strategy: str, shape: ModelShape, tp: int, shard: int, layout: ByteLayout,
                   share: StageShare | None = None, held_grad_bytes: int | None = None) -> StateBytes:
    """Model-state bytes one rank keeps under the runtime's wrapping of the GPT.

    ddp and zero1 keep what ZeRO counts. FSDP2 (zero2, zero3, hsdp) shards every weight over
    the `shard` group at rest. Its root unit (embeddings, tied lm_head, final LayerNorm) follows
    the blocks' rule (zero3 and hsdp reshard it after forward and gather it again for the head's
    backward), and its unsharded gradient lives through the whole backward (lm_head's part
    comes first, the embedding's last); each block's unsharded
    gradient lives until its reduce-scatter. zero2 (reshard_after_forward=False) keeps every
    block's gathered weights from its forward until its backward, so at the start of backward
    all of them exist at once; zero3 and hsdp re-gather per block and hold the block being
    computed plus the one being prefetched, except in a pipeline stage, which keeps them all
    gathered through the step as zero2 does. Gathered weights and their unsharded gradients are
    in the layout's `compute` dtype (FSDP2's param_dtype); the shards are fp32. With a pipeline,
    `share` is what the rank's stage holds (its blocks; the embeddings or the head).

    `held_grad_bytes` is for FSDP2 accumulating over micro-steps with gradient sync off until
    the last one (`no_sync()`, or a pipeline's stages): it keeps each parameter's whole
    unsharded gradient, upcast to its reduce dtype (`to_accumulated_grad_if_needed`), at this
    many bytes per parameter from the first micro-step's backward to the last one's reduce-scatter,
    while the sharded gradients do not exist yet (the optimizer zeroes them to None). None: it
    reduce-scatters every micro-step (or there is one) and keeps sharded gradients.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if shard < 1:
        raise ValueError(f"shard group size must be >= 1, got {shard}")
    if tp < 1:
        raise ValueError(f"tensor-parallel degree must be >= 1, got {tp}")
    strategy = wrapping_of(strategy, tp)
    p = params_per_tp_rank(shape, tp)
    root = root_params(shape)
    per_block = (p - root) / shape.layers
    if share is not None:
        root = share.root
        p = share.blocks * per_block + root
    if strategy in ("ddp", "zero1"):
        w, g, k = model_states(strategy, p, shard, layout)
        return StateBytes(w, g, k, 0.0, 0.0)
    w, g, k = (p * b / shard for b in (layout.weights, layout.grads, layout.optimizer))
    if held_grad_bytes is not None:
        g = p * held_grad_bytes
    blocks = shape.layers if share is None else share.blocks
    if strategy == "zero2" or share is not None:
        # A pipeline stage wraps without resharding after forward whatever the strategy
        # (`resolve`: m micro-batches would gather m times), as zero2 does.
        gathered = p * layout.compute
    else:
        gathered = (root + min(FSDP_PREFETCH_BLOCKS, blocks) * per_block) * layout.compute
    late = root * layout.compute if share is not None and share.first and not share.last else 0.0
    return StateBytes(w, g, k, gathered, (root + per_block) * layout.compute, late, g * root / p if p else 0.0)


def moe_blocks_of(shape: ModelShape, share: StageShare | None) -> float:
    """MoE blocks a rank holds: all of them, or its stage's share of the blocks (spread evenly:
    the dense-first blocks are few)."""
    experts = shape.spec.experts if shape.spec is not None else None
    if experts is None:
        return 0.0
    return experts.moe_blocks if share is None else experts.moe_blocks * share.blocks / shape.layers


def expert_states(strategy: str, shape: ModelShape, tp: int, ep: int, efsdp: int, layout: ByteLayout,
                  share: StageShare | None = None) -> StateBytes:
    """Routed-expert bytes one rank keeps, on the expert mesh: each MoE layer's experts split
    over `ep`, and under FSDP2 (zero2, zero3, hsdp) each expert's states sharded over `efsdp`,
    what ep leaves of dp_shard x cp x tp; ddp and zero1 keep the rank's experts whole (zero1
    shards their optimizer state). FSDP2 gathers one MoE layer's `experts / ep` at a time (and
    the one prefetched) under zero3 and hsdp, every layer's under zero2 and in a pipeline stage,
    in its param_dtype, and holds one layer's unsharded gradients before reduce-scattering them."""
    blocks = moe_blocks_of(shape, share)
    if blocks == 0:
        return StateBytes(0.0, 0.0, 0.0, 0.0, 0.0)
    local_layer = routed_params_per_block(shape) / ep
    local = blocks * local_layer
    strategy = wrapping_of(strategy, tp)
    if strategy in ("ddp", "zero1"):
        w, g, k = model_states(strategy, local, efsdp, layout)
        return StateBytes(w, g, k, 0.0, 0.0)
    w, g, k = (local * b / efsdp for b in (layout.weights, layout.grads, layout.optimizer))
    if efsdp == 1:
        return StateBytes(w, g, k, 0.0, 0.0)  # nothing sharded: nothing gathered
    gathered_layers = blocks if strategy == "zero2" or share is not None else min(FSDP_PREFETCH_BLOCKS, blocks)
    return StateBytes(w, g, k, gathered_layers * local_layer * layout.compute, local_layer * layout.compute)


def _with_experts(dense: StateBytes, experts: StateBytes) -> StateBytes:
    """The dense mesh's states and the expert mesh's on one rank."""
    return StateBytes(dense.params + experts.params, dense.grads + experts.grads, dense.optimizer + experts.optimizer,
                      dense.gathered + experts.gathered, dense.unsharded_grads + experts.unsharded_grads,
                      dense.late_grads, dense.root_grads)


def buffer_bytes(
    strategy: str, shape: ModelShape, tp: int, shard: int, layout: ByteLayout, bucket_bytes: float, micro_batch: int,
    on_gpu: bool, share: StageShare | None = None, cp: int = 1, experts: StateBytes | None = None,
) -> float:
    """Transient buffers: two gradient buckets in flight for DDP-style reduction, or FSDP2's
    gathered weights and unsharded gradients (`runtime_states`); a pipeline stage's receive
    buffers, one per micro-batch and boundary (`StageShare.recv_buffers`); the tensor-parallel
    gather of one block input; the GPU libraries' workspaces. A context-parallel rank's
    activations are `seq / cp` tokens; `experts`: the rank's routed-expert states, whose
    gathered weights and unsharded gradients FSDP2 holds beside the dense ones."""
    if wrapping_of(strategy, tp) in (Strategy.ddp, Strategy.zero1):
        comm = 2 * bucket_bytes
    else:
        states = runtime_states(strategy, shape, tp, shard, layout, share)
        comm = states.gathered + states.unsharded_grads
    if experts is not None:
        comm += experts.gathered + experts.unsharded_grads
    tokens = shape.seq // cp
    if share is not None:
        comm += share.recv_buffers * micro_batch * tokens * shape.hidden * layout.activation
    if tp > 1:
        comm += micro_batch * tokens * shape.hidden * layout.activation
    return comm + (GPU_WORKSPACE_BYTES if on_gpu else 0)


def forward_values(strategy: str, tp: int, layout: ByteLayout, on_gpu: bool) -> ValueBytes:
    """What autocast leaves each kind of value under the runtime's wrapping: ddp and zero1
    compute with the fp32 weights they replicate (autocast casts them per use), FSDP2 gathers
    them in autocast's dtype."""
    replicated = wrapping_of(strategy, tp) in (Strategy.ddp, Strategy.zero1)
    return value_bytes(layout.activation, layout.weights if replicated else layout.compute, on_gpu)


def rank_memory(
    strategy: str,
    shape: ModelShape,
    tp: int,
    shard: int,
    micro_batch: int,
    recompute: str,
    layout: ByteLayout,
    bucket_bytes: float,
    on_gpu: bool = True,
    share: StageShare | None = None,
    held_grad_bytes: int | None = None,
    micro_steps: int = 1,
    cp: int = 1, ep: int = 1, efsdp: int = 1, cp_attention: str = "allgather_kv",
) -> MemoryBreakdown:
    """Peak bytes of one rank: model states as the runtime keeps them (`runtime_states`), one
    micro-batch's activations, transient buffers.

    Activations are what the runtime's fused attention and checkpointing keep, at their peak in
    backward (`activations.activation_profile`); with tensor parallelism only the part between
    the split matmuls is divided (no sequence parallelism), and the replicated output head keeps
    whole logits.

    A pipeline rank (`share`) is priced at the start of each of its backwards as its schedule
    runs them (`share.moments`): its blocks' activations of the micro-batches in flight then
    (up to p on the first stage under 1F1B), its chunks' outputs, the head's logits and the
    loss on the last stage, beside the gradients its earlier backwards made; the fullest
    moment is the peak. `held_grad_bytes`: FSDP2's unsharded gradients kept between
    micro-steps (`runtime_states`). `micro_steps`: without a pipeline, the accumulation steps:
    past the first, the gradients of the earlier ones are held while the loss's backward runs.
    `cp`, `ep`, `efsdp`, `cp_attention`: `seq / cp` tokens' activations and what their attention adds;
    the expert mesh's states (`expert_states`)."""
    states, experts = _rank_states(strategy, shape, tp, shard, layout, share, held_grad_bytes, ep, efsdp)
    values = forward_values(strategy, tp, layout, on_gpu)
    buffers = buffer_bytes(strategy, shape, tp, shard, layout, bucket_bytes, micro_batch, on_gpu, share, cp, experts)
    extra = _context_and_expert_bytes(shape, micro_batch, cp, tp, ep, recompute, layout, share, cp_attention)
    tokens = context_shard(shape, cp)
    fsdp = wrapping_of(strategy, tp) not in (Strategy.ddp, Strategy.zero1)
    # zero3 and hsdp reshard every unit after its forward, the root too, and gather none again
    # before its own backward: none is gathered while the loss runs backward (in a pipeline
    # they keep every unit gathered, as zero2 does).
    resharded = wrapping_of(strategy, tp) != Strategy.zero2 and share is None
    idle = states.unsharded_grads + (states.gathered if resharded else 0.0)
    phases = []
    moments = share.moments if share is not None and share.moments else (
        whole_model_moment(shape.layers if share is None else share.blocks, micro_steps),)
    for moment in moments:
        profile = _with_context_and_experts(
            activation_profile(tokens, micro_batch, tp, recompute, values, stage=share, moment=moment), *extra)
        if not fsdp:
            # DDP and ZeRO-1 hold every gradient (their bucket views) and their buckets all step
            # long: one peak, the largest activations beside them all.
            phases.append((states.grads, profile.peak, buffers))
            continue
        phases += _fsdp_phases(states, moment, profile, buffers, idle)
    grads, activations, held_buffers = max(phases, key=sum)
    params, grads_bytes, optimizer, activation_bytes, held_buffer_bytes = (
        int(round(x)) for x in (states.params, grads, states.optimizer, activations, held_buffers))
    return MemoryBreakdown(params, grads_bytes, optimizer, activation_bytes, held_buffer_bytes,
                           total=params + grads_bytes + optimizer + activation_bytes + held_buffer_bytes)


def _rank_states(strategy: str, shape: ModelShape, tp: int, shard: int, layout: ByteLayout, share: StageShare | None,
                 held_grad_bytes: int | None, ep: int, efsdp: int) -> tuple[StateBytes, StateBytes | None]:
    """(every state the rank keeps, of them the expert mesh's: None for a dense model)."""
    states = runtime_states(strategy, shape, tp, shard, layout, share, held_grad_bytes)
    if not routed_params(shape):
        return states, None
    experts = expert_states(strategy, shape, tp, ep, efsdp, layout, share)
    return _with_experts(states, experts), experts


def _context_and_expert_bytes(shape: ModelShape, micro_batch: int, cp: int, tp: int, ep: int, recompute: str,
                              layout: ByteLayout, share: StageShare | None,
                              cp_attention: str = "allgather_kv") -> tuple[float, float]:
    """(kept, transient) activation bytes context parallelism's attention (the gathered K/V, or
    the Ulysses all-to-alls' copies) and the routed rows' imbalance add."""
    nblocks = shape.layers if share is None else share.blocks
    if cp_attention == "ulysses":
        kv_kept, kv_transient = ulysses_kept_bytes(shape, micro_batch, tp, cp, recompute, layout.activation, nblocks)
    else:
        kv_kept, kv_transient = gathered_kv_bytes(shape, micro_batch, cp, recompute, layout.activation, nblocks)
    routed_kept, routed_transient = routed_activation_bytes(shape, micro_batch, cp, tp, ep, recompute,
                                                            layout.activation, moe_blocks_of(shape, share))
    return kv_kept + routed_kept, kv_transient + routed_transient


def _with_context_and_experts(profile: ActivationBytes, kept: float, transient: float) -> ActivationBytes:
    """`profile` with what context and expert parallelism add: `kept` through the backward,
    `transient` on top of it at each moment of it."""
    if not (kept or transient):
        return profile
    return ActivationBytes(kept=profile.kept + kept, transient=profile.transient + transient,
                           in_blocks=profile.in_blocks + kept + transient,
                           blocks_done=profile.blocks_done + transient, after_backward=profile.after_backward)


def _fsdp_phases(states: StateBytes, moment: Moment, profile: ActivationBytes, buffers: float,
                 idle: float) -> list[tuple[float, float, float]]:
    """(gradients, activations, buffers) at the four moments of one FSDP2 backward.

    FSDP2 makes its gradients in backward: none of this backward's exist when the loss's
    backward holds the logits' gradients, and a block's unsharded gradients only once the
    blocks run backward, when those logits are gone. The blocks make their gradients one after
    another while each frees what it kept: their backward is fullest of activations as it
    starts and of gradients as it ends. Earlier backwards' gradients are there all along."""
    grads, root_grads = states.grads, states.root_grads
    before = (grads - root_grads) * moment.blocks_before + root_grads * moment.root_before
    after = (grads - root_grads) * moment.blocks_after + root_grads * moment.root_after
    # A first stage's embedding gradient comes once its micro-batch's activations are freed;
    # the embeddings' unsharded gradient is made at the end of each backward of their chunk.
    late = states.late_grads
    made_late = late if moment.makes_root else 0.0
    return [(before, profile.peak, buffers - idle), (before, profile.in_blocks, buffers - late),
            (after, profile.blocks_done, buffers - late), (after, profile.after_backward, buffers - late + made_late)]


def usable_bytes(capacity: int, on_gpu: bool) -> int:
    """What a rank may plan to use out of `capacity`: less the margin and the CUDA context."""
    reserve = CUDA_CONTEXT_BYTES if on_gpu else 0
    return int(capacity * (1 - MEMORY_MARGIN)) - reserve
