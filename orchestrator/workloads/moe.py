"""A Mixture-of-Experts decoder: Llama's attention, RMSNorm and rotary positions (imported from
`llama.py`), with a routed feed-forward (Shazeer et al. 2017; DeepSeek-V3, Qwen3-MoE and
Mixtral's shapes as presets).

Imports torch only. A block's feed-forward is Llama's dense SwiGLU for the first
`dense_layers` blocks and an :class:`MoE` after them: a top-k token-choice :class:`Router`,
routed SwiGLU experts held as `[E, F, D]` weights (:class:`GroupedExperts`, one grouped
matmul over the tokens sorted by expert) and optional shared experts every token runs.

Load balancing is DeepSeek-V3's auxiliary-loss-free one: a per-expert bias, added to the scores
only to choose experts, moved after every optimizer step towards the experts that got fewer
tokens (`MoE.balance`; the runtime runs it as a step pre-hook with the counts summed over
the ranks that share a loss). An optional sequence-wise auxiliary loss (DeepSeek-V3's eq. 17)
joins the backward without changing the loss the model returns (:class:`_AuxLoss`).

Expert parallelism is the runtime's (`runtime/expert_parallel.py`): it wraps
`GroupedExperts` so its input is dispatched to the ranks holding each expert and its output
combined back, and holds `1/ep` of the experts on each rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor

from ..planning.model_spec import ExpertSpec
from .llama import Attention, FeedForward, RMSNorm

SCORE_FUNCTIONS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEConfig:
    """The model's shape; every field is a `model.args` key."""

    dim: int = 64
    """Width of the residual stream."""
    n_layers: int = 3
    """Decoder blocks."""
    n_heads: int = 4
    """Query heads per block."""
    n_kv_heads: int = 2
    """Key/value heads per block (grouped-query attention)."""
    head_dim: int = 0
    """Width of one attention head; 0: dim / n_heads (Qwen3 uses 128 over a narrower stream)."""
    vocab_size: int = 256
    """Logit width."""
    ffn_dim: int = 128
    """SwiGLU width of the dense blocks."""
    norm_eps: float = 1e-5
    """RMSNorm's epsilon."""
    rope_theta: float = 500000.0
    """Rotary positions' base."""
    num_experts: int = 8
    """Routed experts per MoE block."""
    top_k: int = 2
    """Routed experts each token runs."""
    moe_dim: int = 32
    """SwiGLU width of one routed expert."""
    shared_experts: int = 0
    """Shared experts every token runs beside the routed ones (run as one SwiGLU of
    `shared_experts x moe_dim`, as DeepSeek-V3 does)."""
    dense_layers: int = 1
    """The first blocks whose feed-forward is dense (DeepSeek-V3's `first_k_dense_replace`)."""
    score_function: str = "softmax"
    """Router scores: softmax over the experts (Mixtral, Qwen3) or a sigmoid each (DeepSeek-V3)."""
    route_norm: bool = True
    """Normalise a token's top-k scores to sum to one before `route_scale`."""
    route_scale: float = 1.0
    """Factor on the routed experts' gate values (DeepSeek-V3's `routed_scaling_factor`)."""
    router_groups: int = 1
    """Groups the experts are split into for group-limited routing (DeepSeek-V3's `n_group`;
    with experts laid out by group, a group is a node's experts: node-limited routing)."""
    router_top_groups: int = 1
    """Groups a token's experts may come from (`topk_group`)."""
    load_balance_coeff: float = 1e-3
    """Step of the auxiliary-loss-free bias update (DeepSeek-V3's gamma); 0 leaves the bias at 0."""
    aux_loss_coeff: float = 0.0
    """Weight of the sequence-wise balance loss (DeepSeek-V3's alpha) added to every
    micro-batch's backward; 0: none."""

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim", "num_experts", "top_k",
                     "moe_dim", "router_groups", "router_top_groups"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.args.{name} must be >= 1, got {getattr(self, name)}")
        if self.top_k > self.num_experts:
            raise ValueError(f"model.args.top_k={self.top_k} must be at most model.args.num_experts="
                             f"{self.num_experts}: a token runs that many distinct experts")
        if self.score_function not in SCORE_FUNCTIONS:
            raise ValueError(f"model.args.score_function must be one of {', '.join(SCORE_FUNCTIONS)}, "
                             f"got {self.score_function!r}")
        if not 0 <= self.dense_layers <= self.n_layers:
            raise ValueError(f"model.args.dense_layers={self.dense_layers} must be between 0 and n_layers="
                             f"{self.n_layers}")
        if self.num_experts % self.router_groups or self.router_top_groups > self.router_groups:
            raise ValueError(f"model.args.router_groups={self.router_groups} must divide num_experts="
                             f"{self.num_experts} and be at least router_top_groups={self.router_top_groups}")
        if self.router_groups > 1 and self.top_k > self.router_top_groups * (self.num_experts // self.router_groups):
            raise ValueError(f"model.args.top_k={self.top_k} exceeds the experts of router_top_groups="
                             f"{self.router_top_groups} groups")
        if self.shared_experts < 0 or self.head_dim < 0:
            raise ValueError("model.args.shared_experts and model.args.head_dim must be >= 0")

    @property
    def head_width(self) -> int:
        return self.head_dim or self.dim // self.n_heads


# Published shapes. Attention is Llama's grouped-query attention throughout; DeepSeek-V3's
# multi-head latent attention (187M parameters a block) stands as 56 full heads of 128
# (206M), which keeps the whole within 0.2% of its 671B. Qwen3's per-head q/k norms (256
# parameters a block) are left out.
PRESETS: dict[str, MoEConfig] = {
    # DeepSeek-AI, "DeepSeek-V3 Technical Report" (2024), and its config.json.
    "deepseek-v3": MoEConfig(dim=7168, n_layers=61, n_heads=56, n_kv_heads=56, vocab_size=129280, ffn_dim=18432,
                             rope_theta=10000.0, norm_eps=1e-6, num_experts=256, top_k=8, moe_dim=2048,
                             shared_experts=1, dense_layers=3, score_function="sigmoid", route_scale=2.5,
                             router_groups=8, router_top_groups=4),
    # Qwen team, "Qwen3 Technical Report" (2025), and the models' config.json.
    "qwen3-30b-a3b": MoEConfig(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128, vocab_size=151936,
                               ffn_dim=6144, rope_theta=1000000.0, norm_eps=1e-6, num_experts=128, top_k=8,
                               moe_dim=768, dense_layers=0),
    "qwen3-235b-a22b": MoEConfig(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, head_dim=128, vocab_size=151936,
                                 ffn_dim=12288, rope_theta=1000000.0, norm_eps=1e-6, num_experts=128, top_k=8,
                                 moe_dim=1536, dense_layers=0),
    # Mistral AI, "Mixtral of Experts" (Jiang et al. 2024), and the models' config.json.
    "mixtral-8x7b": MoEConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000, ffn_dim=14336,
                              rope_theta=1000000.0, num_experts=8, top_k=2, moe_dim=14336, dense_layers=0),
    "mixtral-8x22b": MoEConfig(dim=6144, n_layers=56, n_heads=48, n_kv_heads=8, vocab_size=32768, ffn_dim=16384,
                               rope_theta=1000000.0, num_experts=8, top_k=2, moe_dim=16384, dense_layers=0),
    "tiny": MoEConfig(),
}


class MoEAttention(Attention):
    """Llama's attention with a head width of its own (`MoEConfig.head_dim`); its forward is Llama's."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__(cfg)  # type: ignore[arg-type]  # reads the fields both configs share
        if cfg.head_width != self.head_dim:
            self.head_dim = cfg.head_width
            self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
            self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
            self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
            self.o_proj = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)


@dataclass(frozen=True)
class _FeedForwardShape:
    """What Llama's FeedForward reads of its config."""

    dim: int
    """Input and output width."""
    ffn_dim: int
    """SwiGLU width."""


def _swiglu_ffn(dim: int, width: int) -> FeedForward:
    return FeedForward(_FeedForwardShape(dim=dim, ffn_dim=width))  # type: ignore[arg-type]


@dataclass(frozen=True)
class Routing:
    """One forward's routing of N tokens."""

    experts: torch.Tensor
    """[N, K] int64: the experts each token was sent to."""
    gates: torch.Tensor
    """[N, K] fp32: each chosen expert's weight in the token's output (from the unbiased scores)."""
    counts: torch.Tensor
    """[E] int64: tokens sent to each expert."""
    probabilities: torch.Tensor
    """[N, E] fp32: every expert's score normalised over the experts (the auxiliary loss's P)."""


class Router(nn.Module):
    """Top-k token choice: fp32 scores of a bias-free gate, softmax or sigmoid; the expert bias
    added to choose, never to weigh; group-limited choice where configured."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(cfg.dim, cfg.num_experts, bias=False)

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor) -> Routing:
        cfg = self.cfg
        logits = self.gate(x).float()
        scores = logits.softmax(-1) if cfg.score_function == "softmax" else logits.sigmoid()
        choice = scores.detach() + expert_bias
        if cfg.router_groups > 1:
            choice = self._limit_groups(choice)
        experts = choice.topk(cfg.top_k, dim=-1).indices
        gates = scores.gather(-1, experts)
        if cfg.route_norm and cfg.top_k > 1:
            gates = gates / (gates.sum(-1, keepdim=True) + 1e-20)
        # scatter_add rather than bincount: it also runs on the meta device.
        flat = experts.reshape(-1)
        counts = flat.new_zeros(cfg.num_experts).scatter_add_(0, flat, torch.ones_like(flat))
        probabilities = scores / scores.sum(-1, keepdim=True)
        return Routing(experts=experts, gates=gates * cfg.route_scale, counts=counts, probabilities=probabilities)

    def _limit_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """Scores outside each token's best `router_top_groups` groups masked out; a group's
        score is the sum of its best two experts' (DeepSeek-V3's node-limited routing)."""
        cfg = self.cfg
        grouped = choice.view(choice.shape[0], cfg.router_groups, -1)
        best = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        keep = torch.zeros_like(best, dtype=torch.bool).scatter_(-1, best.topk(cfg.router_top_groups, -1).indices,
                                                                 True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)


def _grouped_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` takes x [R, in] against weight [E, in, out]: a kernel for
    the device and dtype (CPU: any float; CUDA: bf16) and every row a multiple of 16 bytes."""
    if x.device.type not in ("cpu", "cuda") or (x.device.type == "cuda" and x.dtype != torch.bfloat16):
        return False
    size = x.element_size()
    return all(n * size % 16 == 0 for n in (*x.shape[1:], *weight.shape[1:]))


def _grouped(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, sizes: list[int] | None) -> torch.Tensor:
    """Rows of x (sorted by expert, `counts` of each) times their expert's weight [E, in, out]."""
    if sizes is None and _grouped_mm_fits(x, weight):
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm
        return grouped_mm(x, weight, offs=offsets)
    sizes = sizes if sizes is not None else counts.tolist()
    return torch.cat([rows @ w for rows, w in zip(torch.split(x, sizes), weight.unbind(0))])


def _balanced_sizes(rows: int, experts: int) -> list[int]:
    """`rows` spread over `experts` as evenly as whole rows allow."""
    return [rows // experts + (e < rows % experts) for e in range(experts)]


class GroupedExperts(nn.Module):
    """E SwiGLU experts as three `[E, ., .]` weights, run over rows sorted by expert.

    Where the counts have no values (a model measured on the meta device, a rehearsal's fake
    tensors), the rows are spread evenly over the experts: the FLOPs and kept activations of a
    balanced router, which is what a plan prices."""

    def __init__(self, dim: int, width: int, experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, width, dim))
        """Gate projections [E, F, D]."""
        self.w2 = nn.Parameter(torch.empty(experts, dim, width))
        """Down projections [E, D, F]."""
        self.w3 = nn.Parameter(torch.empty(experts, width, dim))
        """Up projections [E, F, D]."""

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # Under expert parallelism the weights are DTensors on the ep axis: this rank's experts.
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
        device = x.device.type
        autocast = device in ("cpu", "cuda") and torch.is_autocast_enabled(device)
        dtype = torch.get_autocast_dtype(device) if autocast else x.dtype
        # grouped_mm is not on autocast's list: compute in autocast's dtype as a Linear would.
        x, w1, w2, w3 = (t.to(dtype) for t in (x, w1, w2, w3))
        sizes = _balanced_sizes(x.shape[0], w1.shape[0]) if x.is_meta or is_fake(counts) else None
        h = F.silu(_grouped(x, w1.transpose(-2, -1), counts, sizes)) * _grouped(x, w3.transpose(-2, -1), counts,
                                                                                 sizes)
        return _grouped(h, w2.transpose(-2, -1), counts, sizes)


class _AuxLoss(torch.autograd.Function):
    """Returns its input unchanged and gives `aux` the gradient one, so the auxiliary loss's
    gradient joins the backward of whatever loss the output reaches (Megatron-Core's
    MoEAuxLossAutoScaler): the training loop's loss stays the language-model loss."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(aux)
        return output

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        (aux,) = ctx.saved_tensors
        return grad, torch.ones_like(aux)


class MoE(nn.Module):
    """A routed feed-forward: router, grouped experts, shared experts.

    `expert_bias` is a buffer (in checkpoints; only `balance` changes it)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = Router(cfg)
        self.experts = GroupedExperts(cfg.dim, cfg.moe_dim, cfg.num_experts)
        self.shared_experts = _swiglu_ffn(cfg.dim, cfg.shared_experts * cfg.moe_dim) if cfg.shared_experts else None
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))
        self.tokens_per_expert: torch.Tensor | None = None
        """Tokens each expert got in training forwards since the last `balance` (fp32, on the
        forward's device; None before the first). Not a buffer: DDP would broadcast rank 0's."""
        self.last_load: torch.Tensor | None = None
        """Tokens each expert got in the last step over the ranks sharing the loss (what the
        last `balance` read); None before it."""
        self.last_aux_loss: torch.Tensor | None = None
        """The sequence-wise balance loss of the last forward (None when `aux_loss_coeff` is 0)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        tokens = x.reshape(-1, D)
        routing = self.router(tokens, self.expert_bias)
        # A recomputed forward (activation checkpointing, run inside backward) routes the same
        # tokens again: counted once.
        if self.training and torch._C._current_graph_task_id() == -1:
            counts = routing.counts.detach().float()
            self.tokens_per_expert = counts if self.tokens_per_expert is None else self.tokens_per_expert + counts
        k = self.cfg.top_k
        order = routing.experts.reshape(-1).argsort(stable=True)
        routed = self.experts(tokens[order // k], routing.counts)
        # Back to token-major, each token's k outputs weighed by their gates and summed.
        unsorted = torch.empty_like(routed).index_copy_(0, order, routed)
        out = (unsorted.view(-1, k, D).float() * routing.gates.unsqueeze(-1)).sum(1).to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        out = out.view(B, T, D)
        self.last_aux_loss = None
        if self.cfg.aux_loss_coeff > 0 and self.training:
            self.last_aux_loss = self._sequence_balance_loss(routing, B, T)
            out = _AuxLoss.apply(out, self.last_aux_loss)
        return out

    def _sequence_balance_loss(self, routing: Routing, batch: int, seq: int) -> torch.Tensor:
        """DeepSeek-V3's sequence-wise balance loss: alpha * sum_i f_i * P_i per sequence, f_i
        the share of the sequence's choices expert i got (times E / K), P_i its mean normalised
        score; the mean over the sequences."""
        cfg = self.cfg
        chosen = torch.zeros(batch, seq * cfg.top_k, cfg.num_experts, device=routing.experts.device)
        chosen.scatter_(-1, routing.experts.view(batch, -1, 1), 1.0)
        share = chosen.sum(1) * cfg.num_experts / (cfg.top_k * seq)
        mean_score = routing.probabilities.view(batch, seq, -1).mean(1)
        return cfg.aux_loss_coeff * (share * mean_score).sum(-1).mean()

    @torch.no_grad()
    def balance(self, counts: torch.Tensor) -> None:
        """DeepSeek-V3's bias update from `counts` (tokens per expert over every rank that
        shares the loss): each bias moves by `load_balance_coeff` towards the mean load, the
        moves centred so the bias does not drift; the counts start again."""
        if self.cfg.load_balance_coeff > 0:
            delta = self.cfg.load_balance_coeff * torch.sign(counts.mean() - counts)
            self.expert_bias += delta - delta.mean()
        self.last_load = counts.detach().clone()
        self.tokens_per_expert = None

    def step_counts(self) -> torch.Tensor:
        """`tokens_per_expert`, zeros where no training forward ran since the last `balance`."""
        if self.tokens_per_expert is None:
            return torch.zeros(self.cfg.num_experts, device=self.expert_bias.device)
        return self.tokens_per_expert


def moe_layers(model: nn.Module) -> list[MoE]:
    """The routed feed-forwards `model` holds (none for a dense model, or for a pipeline stage
    or a wrapper holding no MoE block)."""
    return [m for m in model.modules() if isinstance(m, MoE)]


class DecoderLayer(nn.Module):
    """One block: Llama's attention, then a dense or routed feed-forward. One class for both,
    so the blocks are one repeated list (the unit of FSDP, recomputation and pipeline stages)."""

    def __init__(self, cfg: MoEConfig, index: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = MoEAttention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward: nn.Module = (_swiglu_ffn(cfg.dim, cfg.ffn_dim) if index < cfg.dense_layers else MoE(cfg))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class MoETransformer(nn.Module):
    tp_plan: dict[str, str] = {
        "layers.*.attention.q_proj": "colwise",
        "layers.*.attention.k_proj": "colwise",
        "layers.*.attention.v_proj": "colwise",
        "layers.*.attention.o_proj": "rowwise",
        "layers.*.feed_forward.gate_proj": "colwise",
        "layers.*.feed_forward.up_proj": "colwise",
        "layers.*.feed_forward.down_proj": "rowwise",
        "layers.*.feed_forward.shared_experts.gate_proj": "colwise",
        "layers.*.feed_forward.shared_experts.up_proj": "colwise",
        "layers.*.feed_forward.shared_experts.down_proj": "rowwise",
    }
    """Megatron's split of attention, the dense feed-forwards and the shared experts; the
    router and the routed experts stay whole on every tensor-parallel rank."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        if cfg.dim % cfg.n_heads and not cfg.head_dim or cfg.n_heads % cfg.n_kv_heads:
            raise ValueError(f"model.args: dim {cfg.dim} must divide by n_heads {cfg.n_heads} (or head_dim be set), "
                             f"and n_heads by n_kv_heads {cfg.n_kv_heads}")
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        for name, module in self.named_modules():
            self.init_module(module, name)

    def init_module(self, module: nn.Module, name: str) -> None:
        """One module's initialisation, after its own reset_parameters: normal(0, 0.02)
        matrices and experts, the residual projections (attention's output, every SwiGLU's
        down projection) scaled by 1 / sqrt(2 * n_layers), as the Llama's."""
        scale = math.sqrt(2 * self.cfg.n_layers)
        if isinstance(module, (nn.Linear, nn.Embedding)):
            std = 0.02 / scale if name.endswith(("o_proj", "down_proj")) else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, GroupedExperts):
            for weight, std in ((module.w1, 0.02), (module.w3, 0.02), (module.w2, 0.02 / scale)):
                nn.init.normal_(weight, mean=0.0, std=std)

    def expert_spec(self) -> ExpertSpec:
        """The experts as the planner sees them (`ModelSpec.experts`)."""
        cfg = self.cfg
        dense_params = 0
        if cfg.dense_layers:
            with torch.device("meta"):
                dense_params = sum(p.numel() for p in DecoderLayer(cfg, 0).parameters())
        return ExpertSpec(experts=cfg.num_experts, top_k=cfg.top_k, expert_hidden=cfg.moe_dim,
                          moe_blocks=cfg.n_layers - cfg.dense_layers, shared_experts=cfg.shared_experts,
                          shared_hidden=cfg.moe_dim if cfg.shared_experts else 0, dense_block_params=dense_params,
                          router_groups=cfg.router_groups, router_top_groups=cfg.router_top_groups)

    # The pipeline contract (runtime/pipeline.py): forward is head(blocks(embed(idx))).
    pipeline_embed = ("tok_embeddings",)
    pipeline_head = ("norm", "output")

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok_embeddings(idx)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(x))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build(preset: str | None = None, **overrides) -> MoETransformer:
    """The MoE factory: `preset` (deepseek-v3, qwen3-30b-a3b, qwen3-235b-a22b, mixtral-8x7b,
    mixtral-8x22b, tiny) with any MoEConfig field overridden."""
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; one of {', '.join(PRESETS)}")
    known = {f.name for f in fields(MoEConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"model.args {', '.join(unknown)} not MoE fields; the fields are {', '.join(sorted(known))}")
    return MoETransformer(replace(PRESETS[preset or "tiny"], **overrides))
