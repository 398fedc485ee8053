"""What the planner knows of a model it did not design: a typed summary, measured elsewhere.

`orchestrator.workloads.inspect` builds the model on the meta device and measures these
figures (exact parameters, the repeated block, FLOPs with FlopCounterMode, the bytes autograd
saves per block); the planner only reads them, so it stays pure and never imports torch.
The built-in GPT needs no measurement: its `ModelShape` formulas give the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..serialize import to_plain


@dataclass(frozen=True)
class ExpertSpec:
    """A Mixture-of-Experts model's experts, as the cost, memory and placement models see them.

    The routed experts of one MoE layer are `experts x 3 x hidden x expert_hidden` parameters
    (SwiGLU: gate, up, down); each token runs `top_k` of them plus every shared expert.
    """

    experts: int
    """Routed experts per MoE layer."""
    top_k: int
    """Routed experts each token is sent to."""
    expert_hidden: int
    """Width of one routed expert's SwiGLU (`moe_intermediate_size`)."""
    moe_blocks: int
    """Blocks whose feed-forward is an MoE layer; the model's first `blocks - moe_blocks` are dense."""
    shared_experts: int = 0
    """Shared experts every token runs, beside the routed ones (0: none)."""
    shared_hidden: int = 0
    """Width of one shared expert's SwiGLU (0 without shared experts)."""
    dense_block_params: int = 0
    """Parameters of one dense (non-MoE) block; 0 when every block is an MoE block."""
    router_groups: int = 1
    """Groups the experts are split into for group-limited (node-limited) routing; 1: none."""
    router_top_groups: int = 1
    """Groups each token's experts may come from under group-limited routing."""

    def __post_init__(self) -> None:
        for name in ("experts", "top_k", "expert_hidden", "moe_blocks", "router_groups", "router_top_groups"):
            if getattr(self, name) < 1:
                raise ValueError(f"expert spec {name} must be >= 1, got {getattr(self, name)}")
        if self.top_k > self.experts:
            raise ValueError(f"expert spec top_k={self.top_k} must be at most the {self.experts} experts")
        if self.experts % self.router_groups or self.router_top_groups > self.router_groups:
            raise ValueError(f"expert spec: {self.router_groups} router groups must divide the {self.experts} "
                             f"experts and hold the {self.router_top_groups} a token may use")
        if (self.shared_experts > 0) != (self.shared_hidden > 0):
            raise ValueError("expert spec: shared_experts and shared_hidden are both set or both 0")

    def routed_params_per_block(self, hidden: int) -> int:
        """Routed expert parameters of one MoE layer (what expert parallelism divides)."""
        return self.experts * 3 * hidden * self.expert_hidden

    def inactive_params_per_block(self, hidden: int) -> int:
        """Routed parameters of one MoE layer a token does not run (the experts it is not sent to)."""
        return (self.experts - self.top_k) * 3 * hidden * self.expert_hidden


@dataclass(frozen=True)
class ModelSpec:
    """A model as the cost and memory models see it."""

    PLAIN_OMIT_AT_DEFAULT: ClassVar[tuple[str, ...]] = ("experts",)
    """A dense model's record reads as before."""

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
    experts: ExpertSpec | None = None
    """The model's experts where it is a Mixture of Experts (`block_params` is then one MoE
    block's, and `experts.dense_block_params` a dense block's); None for a dense model."""

    def __post_init__(self) -> None:
        for name in ("params", "blocks", "hidden", "heads", "kv_heads", "vocab", "seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"model spec {name} must be >= 1, got {getattr(self, name)}")
        moe_blocks = self.experts.moe_blocks if self.experts else self.blocks
        if moe_blocks > self.blocks:
            raise ValueError(f"model spec: {moe_blocks} MoE blocks in a model of {self.blocks} blocks")
        dense_params = (self.blocks - moe_blocks) * (self.experts.dense_block_params if self.experts else 0)
        if moe_blocks * self.block_params + dense_params + self.root_params != self.params:
            raise ValueError(f"model spec: {moe_blocks} blocks x {self.block_params} + {dense_params} in dense blocks "
                             f"+ {self.root_params} root parameters != {self.params} parameters")
        for name in ("block_activation_bytes", "backward_transient_bytes"):
            if set(getattr(self, name)) != {"none", "selective", "full"}:
                raise ValueError(f"model spec {name} must give none, selective and full, got "
                                 f"{sorted(getattr(self, name))}")
        if self.tp_sharded_params > self.params:
            raise ValueError("model spec: tensor parallelism cannot shard more parameters than the model has")

    @property
    def active_params(self) -> int:
        """Parameters one token runs: all of a dense model's; a Mixture of Experts leaves out the
        routed experts each token is not sent to."""
        if self.experts is None:
            return self.params
        return self.params - self.experts.moe_blocks * self.experts.inactive_params_per_block(self.hidden)

    def to_dict(self) -> dict[str, Any]:
        return to_plain(self)
