"""Activation bytes of one rank as the runtime produces them: kept for backward, and at the peak.

Korthikanti et al. 2022 (`model_math.activation_bytes_per_layer`) price attention as the math
path computes it, keeping the s x s scores, their softmax and its dropout mask. The built-in
models call `scaled_dot_product_attention`, which on every device the runtime uses runs a
fused kernel (flash, memory-efficient, CPU flash): it keeps q, k, v, the output and a
log-sum-exp of one fp32 value per head and token, and no s x s tensor. The models have no
dropout by default, so no masks either.

The built-in GPT is priced by counting what its layers save (below); any other model by what
`workloads.inspect` measured with torch's MemTracker on the meta device, recompute mode by
recompute mode, with the runtime's own checkpointing applied. What is kept at the end of
forward is the `kept` figure; on top of it backward briefly holds gradient temporaries (the
fp32 gradients of the logits, the working set of a block) and, under full recomputation, one
recomputed block: the `transient` figure. A rank's peak is the sum.

Autocast computes matmuls and attention in 16 bits but leaves every other value in the dtype
it arrives in (`ValueBytes`): the residual stream is fp32 where the weights are (ddp, zero1),
CUDA runs normalisations in fp32, and each matmul that reads an fp32 value keeps a 16-bit copy
of its own, as it keeps one of each fp32 weight.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..sequence_split import ulysses_kv_heads
from .model_math import RECOMPUTE_MODES, ModelShape
from .pipeline import Moment, StageShare, whole_model_moment

# Per GPT block, in values of s*h (the fused-attention count of `gpt_block_values`).
GPT_REPLICATED_VALUES = 4
"""The block input, ln_1's output, the residual after attention and ln_2's output: whole on
every tensor-parallel rank (the runtime shards the matmuls only, no sequence parallelism)."""
GPT_LN1_READERS = 3
"""Matmuls reading ln_1's output (q, k and v, split so tensor parallelism shards each by
heads): where that output is fp32 under autocast, each keeps a 16-bit copy of it."""
GPT_BLOCK_WEIGHTS = 12
"""Matmul weights of a block in units of h*h (q, k, v and the output projection; the MLP's
4h x h twice): what autocast keeps a 16-bit copy of when they are fp32."""
GPT_MLP_WEIGHTS = 8
"""The MLP's share of `GPT_BLOCK_WEIGHTS`, which selective recomputation keeps."""
STREAM_VALUES = 2
"""Values of the residual stream a pre-norm block keeps: its input and the sum after
attention (each kept by the normalisation that reads it)."""
NORMS_PER_BLOCK = 2
"""A pre-norm block's normalisations, before attention and before the MLP."""
GPT_ATTENTION_VALUES = 4
"""q, k, v and the attention output (which c_proj reads as its input, a view of it)."""
GPT_MLP_VALUES = 8
"""c_fc's output (4h, kept by GELU) and GELU's output (4h, kept by the MLP's c_proj)."""
FP32 = 4
LAYERNORM_STATS_BYTES = 2 * FP32
"""LayerNorm keeps its mean and reciprocal deviation per token, in fp32."""
BLOCK_GRAD_VALUES = 2
"""Backward of a block holds the gradient of its output and of its residual branch (s x h
each) beside what it kept."""
LOSS_GRAD_BYTES = 2 * FP32
"""Backward of the loss holds the fp32 gradients of the log-probabilities and of the logits at
once, each one value per token and vocabulary entry, while the log-probabilities are still
kept: the peak at the start of backward."""


@dataclass(frozen=True)
class ActivationBytes:
    """Activation bytes of one rank for one micro-batch."""

    kept: float
    """Alive at the end of forward: what backward needs (MemTracker's activations then)."""
    transient: float
    """The most backward holds at once on top of `kept` (gradient temporaries, a recomputed
    block)."""
    in_blocks: float
    """The most activations amount to while the blocks run backward, after the loss's backward
    has freed its log-probabilities and their gradients: what sits beside the gradients FSDP2
    makes there (`kept + transient` on a rank without the loss). That is as the blocks' backward
    starts, before any block has made its gradients."""
    blocks_done: float = 0.0
    """What activations amount to as the blocks' backward ends, every block's gradients made:
    the first block's values and its backward (every other block has freed its own)."""
    after_backward: float = 0.0
    """What is left once the micro-batch's backward is done: the other micro-batches in flight
    on a pipeline stage, nothing otherwise."""

    @property
    def peak(self) -> float:
        return self.kept + self.transient


@dataclass(frozen=True)
class ValueBytes:
    """Bytes of each kind of value a rank keeps for backward, as autocast leaves them."""

    act: int
    """A matmul's or attention's output, and a 16-bit copy a matmul makes of its input: the
    dtype autocast computes in (4 without autocast)."""
    stream: int
    """The residual stream (block inputs and the sums they are added into): the dtype of the
    weights forward computes with, fp32 under ddp and zero1 (replicated fp32 weights, cast per
    use), FSDP2's param_dtype under zero2, zero3 and hsdp."""
    norm_out: int
    """A LayerNorm's output: fp32 where autocast runs normalisations in fp32 (CUDA always; on
    CPU only an fp32 input gives an fp32 output). Where it is not `act`, each matmul reading it
    keeps its own 16-bit copy."""
    weight_copies: bool
    """Whether autocast keeps a 16-bit copy of each fp32 matmul weight from forward to backward
    (fp32 weights computed with in 16 bits: ddp and zero1 under autocast)."""

    @classmethod
    def uniform(cls, nbytes: int) -> "ValueBytes":
        """Every value in one dtype, nothing copied: fp32 training (4), or a 16-bit model (2)."""
        return cls(nbytes, nbytes, nbytes, False)


def value_bytes(act: int, weights: int, on_gpu: bool) -> ValueBytes:
    """What autocast leaves where it computes in `act` bytes a value and forward's weights have
    `weights` bytes (4: fp32, cast per use; `act`: FSDP2 gathers them in autocast's dtype).
    No autocast (`act` 4) keeps everything fp32."""
    if act >= 4:
        return ValueBytes.uniform(4)
    return ValueBytes(act=act, stream=weights, norm_out=4 if on_gpu else weights, weight_copies=weights > act)


def _check(recompute: str, tp: int, micro_batch: int) -> None:
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {recompute!r}")
    if tp < 1:
        raise ValueError(f"tensor-parallel degree must be >= 1, got {tp}")
    if micro_batch < 1:
        raise ValueError(f"micro-batch must be >= 1, got {micro_batch}")


def gpt_block_bytes(shape: ModelShape, tp: int, recompute: str, values: ValueBytes) -> float:
    """Bytes one block of the built-in GPT keeps for backward per sequence.

    none: the block input and the post-attention residual (as the LayerNorms keep them: in
    fp32 where autocast runs them so, else in the residual stream's dtype), ln_1's output as
    q, k and v read it (one value, or a 16-bit copy each where it is fp32) and ln_2's as c_fc
    reads it, whole on every tensor-parallel rank; 12/t sharded values (q, k, v, attention
    output; c_fc and GELU outputs of width 4h); the fp32 log-sum-exp per head and token; two
    LayerNorms' fp32 statistics. selective: checkpointing the attention drops q, k, v, its output,
    the log-sum-exp and ln_1's copies, and keeps ln_1's output itself (the checkpoint's input).
    full: the block input only. Autocast's weight copies are per forward, not per sequence
    (`gpt_weight_copy_bytes`).
    """
    s, h, a = shape.seq, shape.hidden, shape.heads
    v = values
    if recompute == "full":
        return s * h * v.stream
    ln2 = v.act  # c_fc reads it: the value itself, or the one copy it makes
    # The block input and the post-attention residual, as the LayerNorms reading them keep
    # them: an fp32 copy where autocast runs the norm in fp32.
    stream = 2 * v.norm_out * s * h + 2 * LAYERNORM_STATS_BYTES * s
    mlp = GPT_MLP_VALUES / tp * s * h * v.act
    if recompute == "selective":
        return stream + (v.norm_out + ln2) * s * h + mlp
    ln1 = v.act * (GPT_LN1_READERS if v.norm_out != v.act else 1)
    attention = GPT_ATTENTION_VALUES / tp * s * h * v.act + FP32 * a * s / tp
    return stream + (ln1 + ln2) * s * h + attention + mlp


def gpt_root_bytes(shape: ModelShape, values: ValueBytes) -> float:
    """Bytes kept per sequence outside the GPT's blocks: the last block's output and ln_f's
    statistics (kept by ln_f, as a block's norms keep theirs), ln_f's output as lm_head reads
    it, the fp32 log-probabilities the loss keeps (lm_head is replicated under tensor
    parallelism, so the logits are whole)."""
    s, h = shape.seq, shape.hidden
    return s * h * (values.norm_out + values.act) + LAYERNORM_STATS_BYTES * s + FP32 * s * shape.vocab


def gpt_weight_copy_bytes(shape: ModelShape, tp: int, recompute: str, values: ValueBytes, blocks: int,
                          last: bool) -> tuple[float, float]:
    """(kept, cached) bytes of autocast's 16-bit copies of fp32 weights: those backward reads
    (every block matmul's without recomputation, the MLP's under selective; lm_head's on the
    last stage) live until backward; autocast's cache holds the others until forward ends.
    One copy per forward whatever the micro-batch."""
    if not values.weight_copies:
        return 0.0, 0.0
    h2 = shape.hidden * shape.hidden * values.act / tp
    kept_units = {"none": GPT_BLOCK_WEIGHTS, "selective": GPT_MLP_WEIGHTS, "full": 0}[recompute]
    head = shape.vocab * shape.hidden * values.act if last else 0.0
    return blocks * kept_units * h2 + head, blocks * (GPT_BLOCK_WEIGHTS - kept_units) * h2


def _largest_weight_gradient(shape: ModelShape, tp: int) -> float:
    """fp32 bytes of the largest weight gradient of a block, a temporary while it is added to
    the gradient the rank keeps (c_fc's 4h x h)."""
    return FP32 * 4 * shape.hidden * shape.hidden / tp


def activation_profile(
    shape: ModelShape, micro_batch: int, tp: int = 1, recompute: str = "none", values: ValueBytes | int = 2,
    *, stage: StageShare | None = None, moment: Moment | None = None,
) -> ActivationBytes:
    """Kept and transient activation bytes of one rank for a micro-batch of `micro_batch`
    sequences, at the start of one of its backwards (`moment`; the whole model's one by
    default). `values`: what autocast leaves each kind of value (`value_bytes`), or one size
    for all (2 for a 16-bit model, 4 in fp32); log-sum-exps, LayerNorm statistics and the loss
    stay fp32 whatever it is.

    A pipeline rank (`stage`) holds its share of the blocks, the head and the loss only when it
    is the last stage. At `moment` it keeps what its blocks save for `moment.in_flight`
    micro-batches, what its last chunk keeps outside its blocks (the loss's log-probabilities)
    for `moment.tail_in_flight`, and its chunks' outputs (`moment.outputs_in_flight`: the
    logits, on the last chunk); what the backward adds on top is one micro-batch's: the
    loss's gradients where it starts with the loss, a block's otherwise."""
    _check(recompute, tp, micro_batch)
    v = values if isinstance(values, ValueBytes) else ValueBytes.uniform(values)
    b = micro_batch
    nblocks, last = (shape.layers, True) if stage is None else (stage.blocks, stage.last)
    mo = moment or whole_model_moment(nblocks, 1)
    if shape.spec is not None:
        one = _measured(shape, b, tp, recompute, v, nblocks, last)
        copies, cached = _measured_weight_copy_bytes(shape, tp, recompute, v, nblocks, last)
    else:
        one = _gpt(shape, b, tp, recompute, v, nblocks, last)
        copies, cached = gpt_weight_copy_bytes(shape, tp, recompute, v, nblocks, last)
    blocks_kept = nblocks * one.block_kept
    tail = one.kept - blocks_kept
    kept = mo.in_flight * blocks_kept + mo.tail_in_flight * tail + b * stage_output_bytes(shape, v, mo, last) + copies
    # The backward frees one micro-batch of its chunk: that chunk's blocks' values, its output,
    # and (the last chunk) what it keeps outside them.
    alone = replace(mo, tail_in_flight=1, outputs_in_flight=min(1, mo.outputs_in_flight))
    freed = mo.blocks * one.block_kept + b * stage_output_bytes(shape, v, alone, last and mo.loss) + (
        tail if mo.loss else 0.0)
    loss_kept, transient = (one.loss_kept, one.transient) if mo.loss else (0.0, one.block_transient)
    in_blocks = kept - loss_kept + one.block_transient
    # The copies autocast caches but backward does not read die when forward ends, before
    # backward's temporaries exist: whichever is larger sits on top of what is kept.
    return ActivationBytes(kept=kept, transient=max(transient, cached), in_blocks=in_blocks,
                           blocks_done=in_blocks - max(0, mo.blocks - 1) * one.block_kept,
                           after_backward=max(0.0, kept - copies - freed))


def stage_output_bytes(shape: ModelShape, v: ValueBytes, moment: Moment, last: bool) -> float:
    """Bytes per sequence of the chunk outputs a pipeline rank holds for their backward: a
    residual stream value per chunk and micro-batch in flight, and on the `last` stage the
    logits autocast computed (whole: the head is replicated under tensor parallelism) for each
    of its last chunk's. None without a pipeline (`outputs_in_flight` 0)."""
    if not moment.outputs_in_flight:
        return 0.0
    logits = moment.tail_in_flight if last else 0
    sh = shape.seq * shape.hidden
    return (moment.outputs_in_flight - logits) * sh * v.stream + logits * shape.seq * shape.vocab * v.act


@dataclass(frozen=True)
class _OneMicroBatch:
    kept: float
    transient: float
    loss_kept: float
    """Of `kept`, the loss's log-probabilities, freed by the loss's backward."""
    block_transient: float
    """What a block's backward holds on top of what is kept."""
    block_kept: float = 0.0
    """What one block keeps (of `kept`)."""


def _gpt(shape: ModelShape, b: int, tp: int, recompute: str, v: ValueBytes, blocks: int,
         last: bool) -> _OneMicroBatch:
    block = gpt_block_bytes(shape, tp, recompute, v)
    tail = gpt_root_bytes(shape, v) if last else 0.0
    kept = b * (blocks * block + tail)
    loss = b * LOSS_GRAD_BYTES * shape.seq * shape.vocab if last else 0.0
    # The gradients flowing down the residual stream are in its dtype.
    in_block: float = b * BLOCK_GRAD_VALUES * shape.seq * shape.hidden * v.stream
    if recompute == "full":
        # Backward of a block re-runs its forward: its activations (but the input, kept) live again.
        in_block += b * (gpt_block_bytes(shape, tp, "none", v) - block)
    in_block += _largest_weight_gradient(shape, tp)
    loss_kept = b * FP32 * shape.seq * shape.vocab if last else 0.0
    return _OneMicroBatch(kept, max(loss + _largest_weight_gradient(shape, tp), in_block), loss_kept, in_block,
                          b * block)


def _measured_weight_copy_bytes(shape: ModelShape, tp: int, recompute: str, v: ValueBytes, blocks: int,
                                last: bool) -> tuple[float, float]:
    """`gpt_weight_copy_bytes` for a measured model: its block parameters (matmul weights,
    nearly all, sharded by tensor parallelism), the MLP's share kept under selective
    recomputation taken as the GPT's, and the output head's vocab x hidden."""
    spec = shape.spec
    assert spec is not None
    if not v.weight_copies:
        return 0.0, 0.0
    block = spec.block_params / tp * v.act
    share = {"none": 1.0, "selective": GPT_MLP_WEIGHTS / GPT_BLOCK_WEIGHTS, "full": 0.0}[recompute]
    head = shape.vocab * shape.hidden * v.act if last else 0.0
    return blocks * share * block + head, blocks * (1 - share) * block


def _measured(shape: ModelShape, b: int, tp: int, recompute: str, v: ValueBytes, blocks: int,
              last: bool) -> _OneMicroBatch:
    """A measured model: its fp32 bytes per sequence scaled to the micro-batch and the
    activation dtype; tensor parallelism divides the part of a block the measurement found
    split (the GPT's 12 of 16 values where it could not tell). The part kept outside the
    blocks (mostly the head's logits) sits on the last stage; the backward transient was
    measured with the loss in it, so the other stages get a block's backward instead. The
    loss's own bytes stay fp32 under autocast (`Trainer._loss` upcasts the logits)."""
    spec = shape.spec
    assert spec is not None
    scale = b * v.act / FP32
    block = spec.block_activation_bytes[recompute]
    if tp > 1 and recompute != "full":  # without sequence parallelism the block input stays whole
        split = spec.tp_sharded_activation_fraction
        if split is None:
            split = (GPT_ATTENTION_VALUES + GPT_MLP_VALUES) / (
                GPT_REPLICATED_VALUES + GPT_ATTENTION_VALUES + GPT_MLP_VALUES)
        block *= 1 - split + split / tp
    transient = spec.backward_transient_bytes[recompute]
    root = spec.root_activation_bytes if last else 0.0
    # The loss runs in fp32 whatever autocast computes (`Trainer._loss`): its log-probabilities
    # (kept) and their and the logits' gradients (backward) do not shrink with the activations.
    loss_kept = min(root, FP32 * shape.seq * shape.vocab) if last else 0.0
    loss_grad = min(transient, LOSS_GRAD_BYTES * shape.seq * shape.vocab) if last else 0.0
    kept = scale * (blocks * block + root - loss_kept) + b * loss_kept
    # Measured in fp32 and scaled: the values autocast leaves in another dtype are set right.
    sh = shape.seq * shape.hidden
    if recompute == "full":
        fix = sh * (v.stream - v.act)  # the block input, all a checkpointed block keeps
    else:
        fix = STREAM_VALUES * sh * (v.norm_out - v.act)  # as the norms reading them keep them
        # A norm autocast runs in fp32 returns fp32; one written by hand returns its input's
        # dtype, the residual stream's.
        norm_out = v.stream if spec.fp32_norms_per_block == 0 else v.norm_out
        if recompute == "none" and norm_out != v.act and spec.tp_colwise_per_block:
            # Each matmul reading an fp32 norm output keeps its own 16-bit copy; the measurement
            # kept the output once. The column-parallel Linears are those readers (q, k, v and
            # the MLP's input projections), a plan that names none is taken to have one per norm.
            fix += (spec.tp_colwise_per_block - NORMS_PER_BLOCK) * sh * v.act
    kept += b * (blocks * fix + (sh * (v.norm_out - v.act) if last else 0.0))
    # A block's own backward was not measured apart from the loss's: the GPT's count of it, with
    # the measured block re-run under full recomputation (what a stage without the loss holds).
    in_block: float = b * BLOCK_GRAD_VALUES * shape.seq * shape.hidden * v.act
    if recompute == "full":
        in_block += scale * (spec.block_activation_bytes["none"] - spec.block_activation_bytes["full"])
    in_block += _largest_weight_gradient(shape, tp)
    per_block = scale * block + b * fix
    if not last:
        # No loss on this stage: the measured transient (the loss's, mostly) does not arise here.
        return _OneMicroBatch(kept, in_block, 0.0, in_block, per_block)
    return _OneMicroBatch(kept, scale * (transient - loss_grad) + b * loss_grad, b * loss_kept, in_block, per_block)


def context_shard(shape: ModelShape, cp: int) -> ModelShape:
    """The shape one context-parallel rank computes activations for: `seq / cp` tokens of
    every sequence (head-tail chunks), a measured model's per-sequence figures divided
    alike. Everything a rank keeps per token shrinks by cp; what does not scale with tokens
    (weight gradients, autocast's weight copies) stays, as the profile prices it."""
    if cp < 1 or shape.seq % cp:
        raise ValueError(f"context-parallel degree {cp} must be >= 1 and divide the {shape.seq}-token sequence")
    if cp == 1:
        return shape
    spec = shape.spec
    if spec is not None:
        spec = replace(spec, seq=spec.seq // cp,
                       block_activation_bytes={k: v / cp for k, v in spec.block_activation_bytes.items()},
                       root_activation_bytes=spec.root_activation_bytes / cp,
                       backward_transient_bytes={k: v / cp for k, v in spec.backward_transient_bytes.items()})
    return replace(shape, seq=shape.seq // cp, spec=spec)


def kv_heads_and_width(shape: ModelShape) -> tuple[int, int]:
    """(key/value heads, width of one head): grouped-query attention keeps fewer K/V heads."""
    kv = shape.spec.kv_heads if shape.spec is not None else shape.heads
    return kv, shape.hidden // shape.heads


def gathered_kv_bytes(shape: ModelShape, micro_batch: int, cp: int, recompute: str, act_bytes: int,
                      blocks: int) -> tuple[float, float]:
    """(kept, transient) bytes the all-gather-KV context parallelism adds on one rank: every
    attention layer gathers the whole sequence's K and V (`2 x S x n_kv x head_dim`), and the
    fused kernel keeps them for backward where attention is not recomputed; the rank's own
    1/cp of them is in the profile already. Under recomputation one layer's gathered K/V
    live while it is recomputed and run backward: the transient."""
    if cp <= 1:
        return 0.0, 0.0
    kv, width = kv_heads_and_width(shape)
    whole = 2 * shape.seq * kv * width * act_bytes * micro_batch
    if recompute == "none":
        return blocks * whole * (cp - 1) / cp, whole
    return 0.0, whole


def ulysses_tensor_bytes(shape: ModelShape, micro_batch: int, tp: int, cp: int, act_bytes: int) -> tuple[float, float]:
    """(q or output, k or v) bytes one rank holds of one attention layer's tensors under
    context parallelism: its 1/cp of the sequence, its heads after tensor parallelism, the K/V
    heads repeated to the query heads' count where they do not divide by cp (what the Ulysses
    all-to-alls move: `runtime/context_parallel.UlyssesShard`)."""
    kv, width = kv_heads_and_width(shape)
    heads = shape.heads // tp
    tokens = micro_batch * shape.seq / cp
    kv_heads = ulysses_kv_heads(heads, max(1, kv // tp), cp)
    return tokens * heads * width * act_bytes, tokens * kv_heads * width * act_bytes


def ulysses_kept_bytes(shape: ModelShape, micro_batch: int, tp: int, cp: int, recompute: str, act_bytes: int,
                       blocks: int) -> tuple[float, float]:
    """(kept, transient) bytes the Ulysses attention adds on one rank. The kernel keeps the
    head-layout q, k, v and output for backward, the same sizes as the sequence-layout ones
    the profile holds at 1/cp, except K/V heads repeated to the query heads' count: those
    are kept by every attention layer where attention is not recomputed. One layer's send and
    receive copies of all four tensors are the transient."""
    if cp <= 1:
        return 0.0, 0.0
    q, kv = ulysses_tensor_bytes(shape, micro_batch, tp, cp, act_bytes)
    own_kv, width = kv_heads_and_width(shape)
    repeated = 2 * max(0.0, kv - micro_batch * shape.seq / cp * max(1, own_kv // tp) * width * act_bytes)
    transient = 2 * q + 2 * kv
    return (blocks * repeated if recompute == "none" else 0.0), transient


ROUTED_IMBALANCE = 1.25
"""The most routed rows an expert-parallel rank is planned to receive, over its balanced share
(`tokens x top_k`): DeepSeek-V3's aux-loss-free balancing holds the busiest rank near 1.1-1.3x
its share; the memory and the busiest rank's expert compute are priced at this allowance."""


def routed_rows(shape: ModelShape, micro_batch: int, cp: int, tp: int) -> float:
    """Routed rows one rank dispatches per MoE layer and micro-batch at balance: its tokens
    (the sequence split over cp, and over tp, as the sequence-parallel MoE input torchtitan
    dispatches) times top_k."""
    experts = shape.spec.experts if shape.spec is not None else None
    if experts is None:
        return 0.0
    return micro_batch * shape.seq / (cp * tp) * experts.top_k


def routed_activation_bytes(shape: ModelShape, micro_batch: int, cp: int, tp: int, ep: int, recompute: str,
                            act_bytes: int, moe_blocks: float) -> tuple[float, float]:
    """(kept, transient) bytes the routed experts' imbalance adds on the busiest expert-parallel
    rank: per MoE layer its rows (`routed_rows`) each keep the dispatched input and the expert
    output (2 d) and the SwiGLU's gate, up and product (3 F); the measured profile holds the
    balanced share, the allowance (`ROUTED_IMBALANCE`) adds the rest. Kept by every MoE layer
    without full recomputation; under it, one layer's recomputed while it runs backward. At
    ep=1 every rank runs its own tokens: no imbalance."""
    experts = shape.spec.experts if shape.spec is not None else None
    if experts is None or ep <= 1:
        return 0.0, 0.0
    layer = (ROUTED_IMBALANCE - 1) * routed_rows(shape, micro_batch, cp, tp) * (
        2 * shape.hidden + 3 * experts.expert_hidden) * act_bytes
    if recompute == "full":
        return 0.0, layer
    return moe_blocks * layer, 0.0
