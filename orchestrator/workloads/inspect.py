"""Measure a model for the planner without memory: build it on the meta device, count its
parameters exactly, find its repeated block, count FLOPs with FlopCounterMode and the bytes
autograd saves per block, and hand back a `ModelSpec` (pure data)."""

from __future__ import annotations

import contextlib
import copy
import fnmatch
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

from ..config import ModelConfig
from ..errors import ConfigError
from ..planning.model_math import RECOMPUTE_MODES
from ..planning.model_spec import ModelSpec
from .experts import expert_spec, is_moe_block
from .hf import unpacked_sequences
from .models import (
    apply_recompute,
    block_list,
    block_list_name,
    build_model,
    factory_name,
    heads_of,
    logits_of,
    pipeline_ends,
    tp_plan,
)


def distinct_params(module: nn.Module) -> int:
    """Parameters of `module`, a tensor shared by two modules counted once."""
    return sum(p.numel() for p in module.parameters())  # parameters() already skips duplicates


def _tp_styles_per_block(model: nn.Module, plan: dict[str, str] | None) -> tuple[int, int]:
    """(column-parallel, row-parallel) Linears the plan names in the model's first block."""
    if not plan:
        return 0, 0
    prefix = f"{block_list_name(model)}.0."
    styles = [next((s for pat, s in plan.items() if fnmatch.fnmatchcase(name, pat)), None)
              for name, _ in model.named_modules() if name.startswith(prefix)]
    return styles.count("colwise"), styles.count("rowwise")


def _tp_sharded(model: nn.Module, plan: dict[str, str] | None) -> int:
    """Parameters the plan shards: the weight and bias of column-parallel Linears, the weight of
    row-parallel ones (their bias is added after the reduction, whole on every rank)."""
    if not plan:
        return 0
    total = 0
    for name, mod in model.named_modules():
        style = next((s for pat, s in plan.items() if fnmatch.fnmatchcase(name, pat)), None)
        if style is None:
            continue
        total += mod.weight.numel() if getattr(mod, "weight", None) is not None else 0
        if style == "colwise" and getattr(mod, "bias", None) is not None:
            total += mod.bias.numel()
    return total


@contextlib.contextmanager
def _fused_attention() -> Iterator[None]:
    """Route unmasked scaled_dot_product_attention to the fused (flash) kernel, which has a meta
    implementation and keeps only q, k, v, the output and its log-sum-exp for backward, as the
    fused kernels of a real run (flash, memory-efficient, CPU flash) do."""
    original = F.scaled_dot_product_attention

    def fused(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        # The flash kernel takes values as wide as the queries; narrower ones (DeepSeek's
        # multi-head latent attention) run the unfused way here, as on a CPU.
        if attn_mask is not None or v.shape[-1] != q.shape[-1]:
            return original(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                            enable_gqa=enable_gqa)
        # The CPU kernel takes fewer key/value heads as they are (grouped-query attention), as a
        # real run does: repeating them here would count copies no real run keeps.
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal,
                                                                          scale=scale)[0]

    F.scaled_dot_product_attention = fused
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


@contextlib.contextmanager
def _grouped_mm_on_meta() -> Iterator[None]:
    """On the meta device, a grouped matmul of rows [M, K] against experts [E, K, N] as rows
    times one expert [K, N]: the same FLOPs, output and kept input, whatever the routing.
    torch's meta kernel for it accepts bf16 alone (a CUDA kernel's rule), so a Hugging Face
    MoE's experts, measured in fp32 here, would fail; real tensors keep the real kernel."""
    originals = {"torch": torch._grouped_mm, "functional": getattr(F, "grouped_mm", None)}

    def grouped(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def run(mat_a: torch.Tensor, mat_b: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if mat_a.is_meta and mat_a.dim() == 2 and mat_b.dim() == 3:
                return mat_a @ mat_b[0]
            return original(mat_a, mat_b, *args, **kwargs)
        return run

    torch._grouped_mm = grouped(originals["torch"])
    if originals["functional"] is not None:
        F.grouped_mm = grouped(originals["functional"])
    try:
        yield
    finally:
        torch._grouped_mm = originals["torch"]
        if originals["functional"] is not None:
            F.grouped_mm = originals["functional"]


@dataclass(frozen=True)
class _Activations:
    """fp32 bytes of one sequence, as MemTracker counts them on the meta device."""

    block: float
    """What one block keeps for backward at the end of forward."""
    root: float
    """What the rest keeps: embedding, final norm, output head, the loss's log-probabilities."""
    transient: float
    """The most that backward holds at once on top of what forward kept (gradient temporaries,
    the recomputed block), weight gradients left out."""


def _loss_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    # The runtime's loss (`Trainer._loss`): cross-entropy of the logits in fp32.
    logits = logits_of(model(ids))
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), ids.reshape(-1))


@contextlib.contextmanager
def _quiet_module_tracker() -> Iterator[None]:
    """torch's module tracker warns when a module is entered inside itself, which a Hugging Face
    model's kernel wrappers (one `Func` module per wrapped function) do in every block; the
    totals MemTracker keeps are right either way. The warning also replaces the process's
    `warnings.formatwarning`, which is put back."""
    import warnings

    format_ = warnings.formatwarning
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The module hierarchy tracking maybe be messed up")
            yield
    finally:
        warnings.formatwarning = format_


def _tracked_run(model: nn.Module, ids: torch.Tensor) -> tuple[float, float]:
    """(activation bytes alive at the end of forward, peak activation and temporary bytes of
    the iteration) of one forward and backward on the meta device, by MemTracker."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    tracker = MemTracker()
    tracker.track_external(model)
    dev = ids.device
    with _fused_attention(), _grouped_mm_on_meta(), _quiet_module_tracker(), unpacked_sequences(), tracker:
        loss = _loss_of(model, ids)
        kept = tracker.get_tracker_snapshot("current").get(dev, {}).get(_MemRefType.ACT, 0)
        loss.backward()
    peak = tracker.get_tracker_snapshot("peak").get(dev, {})
    return float(kept), float(peak.get(_MemRefType.ACT, 0) + peak.get(_MemRefType.TEMP, 0))


def _cut(model: nn.Module, keep: int) -> nn.Module:
    """A copy of the meta-device `model` with its block list cut to its first `keep` blocks
    (a copy costs far less than building the model again)."""
    copy_ = copy.deepcopy(model)
    del block_list(copy_)[keep:]
    return copy_


def _activation_profile(model: nn.Module, seq: int, recompute: str) -> _Activations:
    """Activation bytes of one sequence under `recompute`, with the runtime's checkpointing and
    the fused attention kernel of a real run: the model cut to one block and to two, so that
    their difference is one block and the rest is everything outside the blocks."""
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    runs = []
    for keep in (1, 2):
        cut = _cut(model, keep)
        if len(block_list(cut)) < keep:
            break  # a one-block model: its block and its root cannot be told apart
        apply_recompute(cut, recompute)
        runs.append(_tracked_run(cut, ids))
    if len(runs) == 1:
        kept, peak = runs[0]
        return _Activations(block=kept, root=0.0, transient=max(0.0, peak - kept))
    (kept1, peak1), (kept2, peak2) = runs
    block = kept2 - kept1
    return _Activations(block=block, root=kept1 - block, transient=max(0.0, peak2 - kept2, peak1 - kept1))


def _narrowed(model: nn.Module, plan: dict[str, str], tp: int) -> None:
    """Cut the Linears the plan names as one tensor-parallel rank of `tp` holds them:
    column-parallel ones to 1/tp of their outputs, row-parallel ones to 1/tp of their inputs."""
    for name, mod in model.named_modules():
        style = next((s for pat, s in plan.items() if fnmatch.fnmatchcase(name, pat)), None)
        if style is None or not isinstance(mod, nn.Linear):
            continue
        out, inp = mod.weight.shape
        shape = (out // tp, inp) if style == "colwise" else (out, inp // tp)
        mod.weight = nn.Parameter(torch.empty(shape, device="meta"))
        if style == "colwise" and mod.bias is not None:
            mod.bias = nn.Parameter(torch.empty(out // tp, device="meta"))


def _tp_activation_fraction(model: nn.Module, seq: int, plan: dict[str, str] | None,
                            block: float) -> float | None:
    """Fraction of a block's kept activations that tensor parallelism splits: one block is
    measured whole and as one rank of tp=2 holds it (the planned Linears narrowed, heads and
    widths halved); what halves is the sharded part. None without a plan or where the halved
    block does not run (an odd head count)."""
    if not plan or block <= 0:
        return None
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    sizes = []
    for tp in (1, 2):
        cut = _cut(model, 1)
        if tp > 1:
            _narrowed(cut, plan, tp)
        try:
            sizes.append(_tracked_run(cut, ids)[0])
        except Exception:  # noqa: BLE001 - a block that cannot be halved keeps the default split
            return None
    whole, half = sizes
    # kept = outside + replicated + sharded / tp: halving tp removes half of the sharded part.
    return min(1.0, max(0.0, 2 * (whole - half) / block))


def model_spec(m: ModelConfig, model_fn: Callable[..., Any] | None = None, vocab_needed: int = 256) -> ModelSpec:
    """The measured spec of the model `m` names (or `model_fn` builds) at sequence length
    `m.block_size`; ConfigError, naming the key, when the model breaks the contract or its
    vocabulary is smaller than the data's `vocab_needed` tokens."""
    name = "python callable" if model_fn is not None else factory_name(m)
    with torch.device("meta"):
        model = build_model(m, model_fn)
    params = distinct_params(model)
    distinct = len(list(model.parameters()))
    blocks = block_list(model)
    n = len(blocks)
    experts = expert_spec(model, blocks)
    if experts is not None:
        # An MoE block is the one measured (and `block_params` its): the MoE blocks go first,
        # and a dense block's FLOPs follow from its parameters (below).
        ordered = sorted(blocks, key=lambda b: not is_moe_block(b))
        for i, b in enumerate(ordered):
            blocks[i] = b
        block_params = distinct_params(blocks[0])
    else:
        block_params = sum(distinct_params(b) for b in blocks) // n
    seen: dict[str, Any] = {"hidden": None}

    def pre(mod, args, kwargs):
        x = args[0] if args else kwargs.get("hidden_states")
        seen["hidden"] = x.shape[-1] if isinstance(x, torch.Tensor) else None

    plan = tp_plan(model)
    tp_sharded = _tp_sharded(model, plan)
    colwise, rowwise = _tp_styles_per_block(model, plan)
    named = sum(1 for _ in model.named_parameters(remove_duplicate=False))
    # The blocks repeat, so one or two are measured: the forward runs with the list cut to its
    # first blocks (an op on meta tensors costs milliseconds; a 70B model has 80 blocks).
    del blocks[2:]
    two = copy.deepcopy(model)
    del blocks[1:]
    h1 = blocks[0].register_forward_pre_hook(pre, with_kwargs=True)
    norms = _NormCounter(blocks[0])
    seq = m.block_size
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    counter = FlopCounterMode(display=False)
    try:
        with unpacked_sequences(), _grouped_mm_on_meta(), counter, norms:
            out = model(ids)
    except Exception as e:  # noqa: BLE001 - the user's forward, reported in one line
        raise ConfigError(f"key 'model.factory': the forward of {name} on token ids [1, {seq}] failed: "
                          f"{type(e).__name__}: {e}") from e
    finally:
        h1.remove()
        norms.remove()
    logits = logits_of(out) if isinstance(out, torch.Tensor) or hasattr(out, "logits") else None
    if logits is None or logits.dim() != 3 or tuple(logits.shape[:2]) != (1, seq):
        got = tuple(logits.shape) if logits is not None else type(out).__name__
        raise ConfigError(f"key 'model.factory': the forward of {name} must return logits [B, T, V] (or an object "
                          f"with .logits) for token ids [1, {seq}]; got {got}")
    vocab = logits.shape[-1]
    if vocab < vocab_needed:
        raise ConfigError(f"key 'model.args': the model's vocabulary ({vocab} logits) is smaller than the data's "
                          f"{vocab_needed} tokens (largest token id {vocab_needed - 1})")
    try:
        activations = {"none": _activation_profile(two, seq, "none")}
        for rc in RECOMPUTE_MODES[1:]:
            try:
                activations[rc] = _activation_profile(two, seq, rc)
            except Exception:  # noqa: BLE001 - priced as without recomputation, an upper bound
                # A forward that cannot be re-run as checkpointing does (one that changes state
                # it reads, as a KV cache grows) keeps at most what it keeps whole.
                activations[rc] = activations["none"]
        tp_activations = _tp_activation_fraction(two, seq, plan, activations["none"].block)
    except Exception as e:  # noqa: BLE001 - the user's forward or backward, reported in one line
        raise ConfigError(f"key 'model.factory': forward and backward of {name} on token ids [1, {seq}] under "
                          f"MemTracker failed: {type(e).__name__}: {e}") from e
    counts = counter.get_flop_counts()
    path = _block_path(model, blocks) + ".0"
    # FlopCounterMode names modules by their path under the root's class name ("Llama.layers.0").
    block_key = next((k for k in counts if k == path or k.endswith("." + path)), None)
    block_flops = sum(counts[block_key].values()) if block_key else 0.0
    hidden = seen["hidden"] or 1
    heads, kv_heads = heads_of(model)
    moe_blocks = experts.moe_blocks if experts is not None else n
    other_flops = 0.0
    root_params = params - n * block_params
    if experts is not None:
        # The blocks differ only in their feed-forward, all matmuls: 2 FLOPs per parameter a
        # token runs. (Priced from parameters because routing on meta cannot count tokens;
        # the MoE block itself was measured with its rows spread evenly over the experts.)
        active = block_params - experts.inactive_params_per_block(hidden)
        other_flops = (n - moe_blocks) * (block_flops + 2 * seq * (experts.dense_block_params - active))
        root_params = params - moe_blocks * block_params - (n - moe_blocks) * experts.dense_block_params
    return ModelSpec(
        name=name, params=params, blocks=n, block_class=type(blocks[0]).__name__, block_params=block_params,
        root_params=root_params, hidden=hidden, heads=heads or 1, kv_heads=kv_heads or 1, vocab=vocab, seq=seq,
        forward_flops_per_token=(counter.get_total_flops() + (moe_blocks - 1) * block_flops + other_flops) / seq,
        block_forward_flops_per_token=block_flops / seq,
        block_activation_bytes={rc: a.block for rc, a in activations.items()},
        root_activation_bytes=activations["none"].root,
        backward_transient_bytes={rc: a.transient for rc, a in activations.items()},
        tp_sharded_activation_fraction=tp_activations,
        tp_sharded_params=tp_sharded, tp_plan=plan is not None,
        tied_embeddings=named > distinct, pipeline_ends=pipeline_ends(model) is not None,
        tp_colwise_per_block=colwise, tp_rowwise_per_block=rowwise, fp32_norms_per_block=norms.count,
        experts=experts,
    )


class _NormCounter(TorchFunctionMode):
    """Counts the calls of `FP32_NORMS` inside `block`'s forward (its hooks open and close the
    count): the normalisations CUDA autocast runs in fp32, seen as the model calls them, before
    torch decomposes them into the ops a hand-written norm calls too."""

    FP32_NORMS = frozenset({"layer_norm", "rms_norm"})

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.count = 0
        self._inside = False
        self._hooks = [block.register_forward_pre_hook(lambda *_: self._enter(True)),
                       block.register_forward_hook(lambda *_: self._enter(False))]

    def _enter(self, inside: bool) -> None:
        self._inside = inside

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if self._inside and getattr(func, "__name__", "") in self.FP32_NORMS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _block_path(model: nn.Module, blocks: nn.ModuleList) -> str:
    return next(name for name, mod in model.named_modules() if mod is blocks)
