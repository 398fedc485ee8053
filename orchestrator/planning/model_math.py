"""Model arithmetic of the GPT workload: parameters, FLOPs and activation memory.

Pure arithmetic on the architecture (`model.*` of the job), so the planner never builds the
model. Parameters are counted exactly as `orchestrator.workloads.gpt.GPT` holds them; FLOPs
follow Narayanan et al. 2021 (Megatron-LM at scale, Eq. 3 and its derivation) and activation
bytes follow Korthikanti et al. 2022 (Reducing Activation Recomputation, Sec. 4).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig
from .model_spec import ModelSpec

RECOMPUTE_MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class ModelShape:
    """The figures of a GPT decoder the cost models need (Narayanan's and Korthikanti's letters)."""

    layers: int
    """l: transformer blocks."""
    hidden: int
    """h: hidden size."""
    heads: int
    """a: attention heads."""
    vocab: int
    """V: vocabulary size."""
    seq: int
    """s: sequence length (the context length every sample is cut to)."""
    bias: bool = True
    """Whether Linear and LayerNorm layers carry biases (GPT-2 style)."""
    spec: ModelSpec | None = None
    """The measured figures of a model that is not the built-in GPT; None: the GPT's formulas."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "vocab", "seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"model {name} must be >= 1, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden size {self.hidden} must be divisible by the head count {self.heads}")

    @classmethod
    def from_config(cls, m: ModelConfig) -> "ModelShape":
        return cls(layers=m.n_layer, hidden=m.n_embd, heads=m.n_head, vocab=m.vocab_size, seq=m.block_size, bias=m.bias)

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> "ModelShape":
        """A measured model: its letters for the formulas that need them (TP activations, the
        per-block all-reduce), its measured figures for everything the spec states."""
        heads = spec.heads if spec.hidden % spec.heads == 0 else 1
        return cls(layers=spec.blocks, hidden=spec.hidden, heads=heads, vocab=spec.vocab, seq=spec.seq, bias=False,
                   spec=spec)

    @property
    def tp_capable(self) -> bool:
        """Whether the runtime can shard this model with tensor parallelism."""
        return self.spec is None or self.spec.tp_plan


def routed_params_per_block(shape: ModelShape) -> int:
    """Routed expert parameters of one MoE block (0 for a dense model): what the expert mesh
    holds, apart from the dense mesh's parameters."""
    experts = shape.spec.experts if shape.spec is not None else None
    return experts.routed_params_per_block(shape.hidden) if experts else 0


def routed_params(shape: ModelShape) -> int:
    """Routed expert parameters of the whole model (0 for a dense model)."""
    experts = shape.spec.experts if shape.spec is not None else None
    return experts.moe_blocks * routed_params_per_block(shape) if experts else 0


def block_params(shape: ModelShape) -> int:
    """Parameters of one transformer block on the dense mesh: q, k, v, o (4h^2), MLP (8h^2),
    two LayerNorms; a measured model's block less its routed experts (the expert mesh's)."""
    if shape.spec is not None:
        return shape.spec.block_params - routed_params_per_block(shape)
    h = shape.hidden
    weights = 12 * h * h
    if not shape.bias:
        return weights + 2 * h  # LayerNorm weights only
    # q/k/v/o biases 4h, c_fc bias 4h, MLP c_proj bias h, two LayerNorms (weight + bias) 4h.
    return weights + 13 * h


def param_count(shape: ModelShape) -> int:
    """Distinct parameters of the GPT workload (the tied wte/lm_head counted once)."""
    if shape.spec is not None:
        return shape.spec.params
    h = shape.hidden
    final_norm = 2 * h if shape.bias else h
    return shape.layers * block_params(shape) + (shape.vocab + shape.seq) * h + final_norm


def narayanan_params(shape: ModelShape) -> float:
    """Narayanan et al. 2021 Eq. 2: 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h)).

    It counts the blocks with biases and the two embeddings; it leaves out the final
    LayerNorm (2h), which is why `param_count` of a biased model is larger by exactly 2h.
    """
    l, h, v, s = shape.layers, shape.hidden, shape.vocab, shape.seq
    return 12 * l * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * l * h))


def root_params(shape: ModelShape) -> int:
    """Parameters outside the blocks: the tied wte/lm_head, the position embedding and the
    final LayerNorm (what the runtime's root FSDP unit holds)."""
    if shape.spec is not None:
        return shape.spec.root_params
    final_norm = 2 * shape.hidden if shape.bias else shape.hidden
    return (shape.vocab + shape.seq) * shape.hidden + final_norm


def tp_param_split(shape: ModelShape) -> tuple[int, int]:
    """(parameters sharded by tensor parallelism, parameters every TP rank replicates), of
    the dense mesh's parameters (a Mixture of Experts' routed experts are neither).

    As the runtime's plan (`runtime.tensor_parallel`) splits them: the four attention and two
    MLP matrices and the column-parallel biases (q, k, v, c_fc) are sharded; LayerNorms, the
    row-parallel biases (added after the reduction), both embeddings and the tied lm_head are
    replicated. Megatron's vocabulary-parallel embedding would shard V h more; the runtime keeps
    the tied weight whole so that wte and lm_head stay one parameter.
    """
    if shape.spec is not None:
        # Routed experts sit on the expert mesh (`routed_params`), outside both: tensor
        # parallelism does not split them (ep borrows the tp ranks instead, as torchtitan runs it).
        dense = shape.spec.params - routed_params(shape)
        sharded = min(shape.spec.tp_sharded_params, dense)
        return sharded, dense - sharded
    h, l = shape.hidden, shape.layers
    sharded = l * 12 * h * h
    if shape.bias:
        sharded += l * 7 * h
    return sharded, param_count(shape) - sharded


def forward_flops_per_token_layers(shape: ModelShape) -> float:
    """Forward matmul FLOPs per token in the blocks: 24h^2 per layer + 4sh for attention scores."""
    if shape.spec is not None:
        return shape.layers * shape.spec.block_forward_flops_per_token
    h, s = shape.hidden, shape.seq
    return shape.layers * (24 * h * h + 4 * s * h)


def flops_per_step(shape: ModelShape, batch: int, recompute: str = "none") -> float:
    """Hardware FLOPs of one optimizer step over `batch` sequences (forward + backward).

    Backward costs twice the forward. Full recomputation runs the blocks' forward again
    (Narayanan Eq. 3: 96 B s l h^2 (1 + s/6h + V/16lh)); selective recomputation runs only
    the attention core again (the 4 B s^2 h per layer of QK^T and attention x V). Attention is
    counted as dense, as in both papers (a causal kernel skips about half of it).
    """
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {recompute!r}")
    b, s, h = batch, shape.seq, shape.hidden
    layers_fwd = b * s * forward_flops_per_token_layers(shape)
    if shape.spec is not None:  # measured: the whole forward, blocks, head and all
        total = 3 * b * s * shape.spec.forward_flops_per_token
    else:
        total = 3 * (layers_fwd + 2 * b * s * h * shape.vocab)
    if recompute == "full":
        total += layers_fwd
    elif recompute == "selective":
        total += shape.layers * 4 * b * s * s * h
    return float(total)


def model_flops_per_step(shape: ModelShape, batch: int) -> float:
    """Model FLOPs (no recomputation): 72 B s l h^2 (1 + s/6h + V/12lh), the MFU numerator."""
    return flops_per_step(shape, batch, "none")


def activation_bytes_per_layer(
    shape: ModelShape, micro_batch: int, tp: int = 1, sequence_parallel: bool = False, recompute: str = "none"
) -> float:
    """Activation bytes one block keeps for backward, Korthikanti et al. 2022 Table 2: the
    papers' reference for a GPT whose attention runs on the math path and keeps its s x s
    scores. What the runtime keeps (fused attention) is `activations.activation_profile`.

    16-bit activations and 1-byte dropout masks, per micro-batch of `micro_batch` sequences:
    no parallelism sbh(34 + 5as/h); tensor parallelism sbh(10 + 24/t + 5as/(ht)); with
    sequence parallelism sbh(34/t + 5as/(ht)); selective recomputation drops the 5as/h
    attention term; full recomputation keeps only the block input, 2sbh (/t with SP).
    """
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {recompute!r}")
    if tp < 1:
        raise ValueError(f"tensor-parallel degree must be >= 1, got {tp}")
    s, b, h, a = shape.seq, micro_batch, shape.hidden, shape.heads
    sbh = s * b * h
    attention = 0.0 if recompute == "selective" else 5 * a * s / (h * tp)
    if recompute == "full":
        return 2 * sbh / (tp if sequence_parallel else 1)
    if tp == 1:
        return sbh * (34 + attention)
    if sequence_parallel:
        return sbh * (34 / tp + attention)
    return sbh * (10 + 24 / tp + attention)

