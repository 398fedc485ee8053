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
"""

from __future__ import annotations

from dataclasses import dataclass

from .model_math import RECOMPUTE_MODES, ModelShape

# Per GPT block, in values of s*h (the fused-attention count of `gpt_block_values`).
GPT_REPLICATED_VALUES = 4
"""The block input, ln_1's output, the residual after attention and ln_2's output: whole on
every tensor-parallel rank (the runtime shards the matmuls only, no sequence parallelism)."""
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

    @property
    def peak(self) -> float:
        return self.kept + self.transient


def _check(recompute: str, tp: int, micro_batch: int) -> None:
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {recompute!r}")
    if tp < 1:
        raise ValueError(f"tensor-parallel degree must be >= 1, got {tp}")
    if micro_batch < 1:
        raise ValueError(f"micro-batch must be >= 1, got {micro_batch}")


def gpt_block_bytes(shape: ModelShape, tp: int, recompute: str, bytes_per_value: int) -> float:
    """Bytes one block of the built-in GPT keeps for backward per sequence.

    none: 4 whole values of s*h (block input, ln_1 output, post-attention residual, ln_2
    output), 12/t sharded ones (q, k, v, attention output; c_fc and GELU outputs of width 4h),
    the fp32 log-sum-exp per head and token, two LayerNorms' fp32 statistics. selective:
    checkpointing the attention drops q, k, v, its output and the log-sum-exp (its input, ln_1's
    output, is kept anyway by the checkpoint). full: the block input only.
    """
    s, h, a = shape.seq, shape.hidden, shape.heads
    if recompute == "full":
        return s * h * bytes_per_value
    values = GPT_REPLICATED_VALUES + GPT_MLP_VALUES / tp
    lse = 0.0
    if recompute == "none":
        values += GPT_ATTENTION_VALUES / tp
        lse = FP32 * a * s / tp
    return values * s * h * bytes_per_value + lse + 2 * LAYERNORM_STATS_BYTES * s


def gpt_root_bytes(shape: ModelShape, bytes_per_value: int) -> float:
    """Bytes kept per sequence outside the GPT's blocks: the last block's output and ln_f's
    statistics (kept by ln_f), ln_f's output (kept by lm_head), the fp32 log-probabilities the
    loss keeps (lm_head is replicated under tensor parallelism, so the logits are whole)."""
    s, h = shape.seq, shape.hidden
    return 2 * s * h * bytes_per_value + LAYERNORM_STATS_BYTES * s + FP32 * s * shape.vocab


def _largest_weight_gradient(shape: ModelShape, tp: int) -> float:
    """fp32 bytes of the largest weight gradient of a block, a temporary while it is added to
    the gradient the rank keeps (c_fc's 4h x h)."""
    return FP32 * 4 * shape.hidden * shape.hidden / tp


def activation_profile(
    shape: ModelShape, micro_batch: int, tp: int = 1, recompute: str = "none", bytes_per_value: int = 2,
    *, blocks: int | None = None, last: bool = True, in_flight: float = 1.0,
) -> ActivationBytes:
    """Kept and transient activation bytes of one rank for a micro-batch of `micro_batch`
    sequences. `bytes_per_value` is the layout's activation bytes (2 under 16-bit autocast,
    4 in fp32); log-sum-exps, LayerNorm statistics and the loss stay fp32 whatever it is.

    A pipeline rank holds `blocks` of the model's blocks (all of them by default), the head and
    the loss only when it is the `last` stage, and keeps what its blocks save for `in_flight`
    micro-batches at once (up to p on 1F1B's first stage); what backward adds on top is one
    micro-batch's. A stage that is not the last keeps its output until the next stage sends
    its gradient back (torch's PipelineStage runs backward from it)."""
    _check(recompute, tp, micro_batch)
    b = micro_batch
    nblocks = shape.layers if blocks is None else blocks
    if shape.spec is not None:
        one = _measured(shape, b, tp, recompute, bytes_per_value, nblocks, last)
        return ActivationBytes(kept=in_flight * one.kept, transient=one.transient)
    block = gpt_block_bytes(shape, tp, recompute, bytes_per_value)
    tail = gpt_root_bytes(shape, bytes_per_value) if last else shape.seq * shape.hidden * bytes_per_value
    kept = in_flight * b * (nblocks * block + tail)
    loss = b * LOSS_GRAD_BYTES * shape.seq * shape.vocab if last else 0.0
    in_block = b * BLOCK_GRAD_VALUES * shape.seq * shape.hidden * bytes_per_value
    if recompute == "full":
        # Backward of a block re-runs its forward: its activations (but the input, kept) live again.
        in_block += b * (gpt_block_bytes(shape, tp, "none", bytes_per_value) - block)
    return ActivationBytes(kept=kept, transient=max(loss, in_block) + _largest_weight_gradient(shape, tp))


def _measured(shape: ModelShape, b: int, tp: int, recompute: str, bytes_per_value: int, blocks: int,
              last: bool) -> ActivationBytes:
    """A measured model: its fp32 bytes per sequence scaled to the micro-batch and the
    activation dtype; tensor parallelism divides the part of a block the measurement found
    split (the GPT's 12 of 16 values where it could not tell). The part kept outside the
    blocks (mostly the head's logits) sits on the last stage; the backward transient was
    measured with the loss in it, so the other stages get a block's backward instead. The
    loss's own bytes stay fp32 under autocast (`Trainer._loss` upcasts the logits)."""
    spec = shape.spec
    assert spec is not None
    scale = b * bytes_per_value / FP32
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
    # A block's own backward was not measured apart from the loss's: the GPT's count of it, with
    # the measured block re-run under full recomputation (what a stage without the loss holds).
    in_block = b * BLOCK_GRAD_VALUES * shape.seq * shape.hidden * bytes_per_value
    if recompute == "full":
        in_block += scale * (spec.block_activation_bytes["none"] - spec.block_activation_bytes["full"])
    if not last:
        # No loss on this stage: the measured transient (the loss's, mostly) does not arise here.
        return ActivationBytes(kept=kept, transient=in_block + _largest_weight_gradient(shape, tp))
    return ActivationBytes(kept=kept, transient=scale * (transient - loss_grad) + b * loss_grad)
