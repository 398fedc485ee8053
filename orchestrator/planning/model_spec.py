"""What the planner knows of a model it did not design: a typed summary, measured elsewhere.

`orchestrator.workloads.inspect` builds the model on the meta device and measures these
figures (exact parameters, the repeated block, FLOPs with FlopCounterMode, the bytes autograd
saves per block); the planner only reads them, so it stays pure and never imports torch.
The built-in GPT needs no measurement: its `ModelShape` formulas give the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..serialize import to_plain


@dataclass(frozen=True)
class ModelSpec:
    """A model as the cost and memory models see it."""

    name: str
    """The factory (`module:callable`) or the Hugging Face architecture it was built from."""
    params: int
    """Distinct parameters (a tensor shared by two modules counted once)."""
    blocks: int
    """Repeated blocks: the unit of FSDP wrapping, activation checkpointing and pipeline stages."""
    block_class: str
    """Class name of the repeated block."""
    block_params: int
    """Parameters of one block."""
    root_params: int
    """Parameters outside the blocks (embeddings, final norm, output head)."""
    hidden: int
    """Width of the residual stream (the block's input and output features)."""
    heads: int
    """Attention heads per block (1 where the model has none)."""
    kv_heads: int
    """Key/value heads per block (grouped-query attention keeps fewer than `heads`)."""
    vocab: int
    """Logit width of the output."""
    seq: int
    """Sequence length every sample is cut to (`model.block_size`)."""
    forward_flops_per_token: float
    """Forward FLOPs per token of the whole model at `seq` (FlopCounterMode: 2 per multiply-add)."""
    block_forward_flops_per_token: float
    """Forward FLOPs per token of one block at `seq`."""
    # The by-mode tables stay out of the hash (a dict has none) so a spec can key the planner's
    # caches; equality still compares them.
    block_activation_bytes: dict[str, float] = field(hash=False)
    """Bytes one block keeps for backward per sequence of `seq` tokens, by recompute mode (none,
    selective, full), in the fp32 the model was measured in, with the fused attention kernel a
    real run uses and the runtime's own activation checkpointing."""
    root_activation_bytes: float
    """Bytes kept per sequence outside the blocks: embedding output, final norm, output head
    input and the loss's fp32 log-probabilities (fp32 as measured)."""
    backward_transient_bytes: dict[str, float] = field(hash=False)
    """The most backward holds at once per sequence on top of what forward kept, by recompute
    mode (gradient temporaries of the logits and of a block, a recomputed block), weight
    gradients left out (fp32 as measured)."""
    tp_sharded_activation_fraction: float | None
    """Fraction of `block_activation_bytes['none']` that tensor parallelism splits (measured as
    one rank of tp=2 holds the block); None without a plan or where it could not be measured."""
    tp_sharded_params: int
    """Parameters the model's tensor-parallel plan shards (0 without a plan)."""
    tp_plan: bool
    """Whether the model declares a tensor-parallel plan; without one the planner keeps tp=1."""
    tied_embeddings: bool
    """Whether the input embedding and the output head share one tensor."""
    pipeline_ends: bool = False
    """Whether the model names its ends (`embed`, `head`), so a pipeline can split it at block
    boundaries; without them the planner keeps pp=1."""
    tp_colwise_per_block: int = 0
    """Column-parallel Linears the plan names in one block. Each takes its input whole and
    DTensor all-reduces that input's gradient on its own in backward: separate q, k and v
    projections cost three all-reduces where a fused qkv costs one. 0: unknown, priced as the
    GPT's two (fused qkv, MLP input)."""
    fp32_norms_per_block: int | None = None
    """Normalisations in one block that CUDA autocast runs in fp32 (`F.layer_norm`,
    `F.rms_norm`), counted in its forward: their outputs are fp32 on a GPU whatever their input,
    so each matmul reading one keeps a 16-bit copy of it. A block that normalises by hand (a
    Hugging Face RMSNorm: fp32 inside, its input's dtype out) has 0. None: not counted, taken
    as a pre-norm block's two."""
    tp_rowwise_per_block: int = 0
    """Row-parallel Linears the plan names in one block: one all-reduce of the output each in
    forward (again under full recomputation). 0: unknown, priced as the GPT's two."""
    graph_break: str | None = None
    """Where the block's forward first breaks `torch.compile`'s graph (the reason and the source
    line); None where it compiles as one graph or was not checked."""
    compile_checked: bool = False
    """Whether the block was traced for `graph_break` (`workloads/compile_check.py`): done
    before planning under train.compile=true, else only once a plan would compile."""

    def __post_init__(self) -> None:
        for name in ("params", "blocks", "hidden", "heads", "kv_heads", "vocab", "seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"model spec {name} must be >= 1, got {getattr(self, name)}")
        if self.blocks * self.block_params + self.root_params != self.params:
            raise ValueError(f"model spec: {self.blocks} blocks x {self.block_params} + {self.root_params} root "
                             f"parameters != {self.params} parameters")
        for name in ("block_activation_bytes", "backward_transient_bytes"):
            if set(getattr(self, name)) != {"none", "selective", "full"}:
                raise ValueError(f"model spec {name} must give none, selective and full, got "
                                 f"{sorted(getattr(self, name))}")
        if self.tp_sharded_params > self.params:
            raise ValueError("model spec: tensor parallelism cannot shard more parameters than the model has")

    def to_dict(self) -> dict[str, Any]:
        return to_plain(self)
