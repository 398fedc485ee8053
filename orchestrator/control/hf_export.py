"""A run's weights as a Hugging Face checkpoint, written one shard file at a time: the built-in
Llama as `LlamaForCausalLM`, the built-in MoE as `Glm4MoeForCausalLM` or `MixtralForCausalLM`
(whichever its router is exactly, `moe_architecture`), a `model.hf_config` model in its own
layout.

The model is built on the meta device, which gives every tensor's name, shape and dtype and
allocates nothing. Its tensors are dealt, in state-dict order, into files of at most
`max_shard_bytes`; for each file `dcp.load` reads just those tensors out of the checkpoint
(resharding whatever plan wrote it) and torch's `HuggingFaceStorageWriter` writes them under
their Hugging Face names. So a host holds one file's tensors at a time, never the model.

Names: a `model.hf_config` model trains under its own Hugging Face names (`runtime/hf_weights.py`
loads `model.hf_weights` by them), so its checkpoint's canonical names are the file's names;
a tied output head is held once, under the embedding's name, which is where Hugging Face saves
it too. The built-in Llama's modules are Hugging Face Llama's under other names, and
`LLAMA_TO_HF` renames them; its rotary form is already the half-split one Hugging Face uses,
so no weight is permuted. The built-in MoE is Llama's attention with routed SwiGLU experts held
as `[E, F, D]` weights, as Hugging Face's MoE models hold theirs, except that Hugging Face joins
each layer's gate and up projections into one `gate_up_proj` `[E, 2F, D]` (gate first).
"""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader, HuggingFaceStorageWriter

from ..config import ModelConfig
from ..errors import CheckpointError, ConfigError
from ..runtime.checkpoint_files import filesystem, is_local
from ..runtime.materialize import build_on_meta
from ..runtime.state_names import tied_aliases

LLAMA_FACTORY = "orchestrator.workloads.llama:build"
MOE_FACTORY = "orchestrator.workloads.moe:build"
INDEX = "model.safetensors.index.json"
MODEL_SECTION = "model"
"""The checkpoint's section holding the model's state (beside `optimizer`)."""

LLAMA_TO_HF: tuple[tuple[str, str], ...] = (
    (r"tok_embeddings\.", "model.embed_tokens."),
    (r"layers\.(\d+)\.attention_norm\.", r"model.layers.\1.input_layernorm."),
    (r"layers\.(\d+)\.attention\.", r"model.layers.\1.self_attn."),
    (r"layers\.(\d+)\.ffn_norm\.", r"model.layers.\1.post_attention_layernorm."),
    (r"layers\.(\d+)\.feed_forward\.", r"model.layers.\1.mlp."),
    (r"norm\.", "model.norm."),
    (r"output\.", "lm_head."),
)
"""The built-in Llama's parameter-name prefixes and Hugging Face Llama's for the same modules."""


@dataclass(frozen=True)
class ExportedTensor:
    """One tensor of the exported model."""

    checkpoint_name: str
    """Its canonical name in the checkpoint's model section (the first part, where joined)."""
    hf_name: str
    """Its name in the Hugging Face checkpoint."""
    shape: tuple[int, ...]
    """Its shape in the checkpoint (each part's, where joined)."""
    dtype: torch.dtype
    """Its dtype as trained (the checkpoint's master weights)."""
    joined: tuple[str, ...] = ()
    """Further checkpoint tensors of the same shape joined after it along dim 1: an MoE
    layer's gate and up projections, which Hugging Face holds as one `gate_up_proj`."""

    @property
    def parts(self) -> tuple[str, ...]:
        """The checkpoint tensors it is made of, in order."""
        return (self.checkpoint_name, *self.joined)

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * int(torch.Size(self.shape).numel()) * len(self.parts)


@dataclass(frozen=True)
class HFLayout:
    """What a Hugging Face directory of the run's model holds."""

    config: Any
    """The `transformers` PretrainedConfig written as config.json."""
    tensors: tuple[ExportedTensor, ...]
    """Every tensor, in the model's state-dict order, each once."""


def llama_hf_name(name: str) -> str:
    """Hugging Face Llama's name of the built-in Llama's parameter `name`."""
    for pattern, replacement in LLAMA_TO_HF:
        renamed, count = re.subn(f"^{pattern}", replacement, name)
        if count:
            return renamed
    raise ValueError(f"{name}: not a parameter of the built-in Llama")


def tensors_of(model: nn.Module, rename: Callable[[str], str] = str) -> tuple[ExportedTensor, ...]:
    """The model's state under canonical names, each tensor once (a tied alias is dropped),
    with `rename` of each name as its Hugging Face name."""
    aliases = tied_aliases(model)
    return tuple(ExportedTensor(name, rename(name), tuple(value.shape), value.dtype)
                 for name, value in model.state_dict().items() if name not in aliases)


def moe_hf_names(architecture: str) -> Callable[[str], str | None]:
    """Hugging Face's name of each built-in MoE tensor in `architecture`'s layout (None: a tensor
    that layout does not hold, Mixtral's all-zero expert bias); the attention, norms and dense
    blocks are named as Llama's."""
    moe_renames = (
        (r"layers\.(\d+)\.feed_forward\.router\.gate\.", r"model.layers.\1.mlp.gate."),
        (r"layers\.(\d+)\.feed_forward\.experts\.w1$", r"model.layers.\1.mlp.experts.gate_up_proj"),
        (r"layers\.(\d+)\.feed_forward\.experts\.w2$", r"model.layers.\1.mlp.experts.down_proj"),
        (r"layers\.(\d+)\.feed_forward\.shared_experts\.", r"model.layers.\1.mlp.shared_experts."),
        (r"layers\.(\d+)\.feed_forward\.expert_bias$", r"model.layers.\1.mlp.gate.e_score_correction_bias"),
    )

    def rename(name: str) -> str | None:
        if name.endswith("feed_forward.expert_bias") and architecture == "MixtralForCausalLM":
            return None
        for pattern, replacement in moe_renames:
            renamed, count = re.subn(f"^{pattern}", replacement, name)
            if count:
                return renamed
        return llama_hf_name(name)

    return rename


def moe_architecture(cfg: Any) -> str:
    """The Hugging Face model the built-in MoE of shape `cfg` is exactly: DeepSeek-V3's sigmoid
    router over Llama's attention is GLM-4.5's (`Glm4MoeForCausalLM`); a plain softmax router
    with no dense blocks, shared experts or bias is Mixtral's. ConfigError naming what else."""
    if cfg.score_function == "sigmoid":
        if cfg.router_groups > 1 and cfg.num_experts // cfg.router_groups < 2:
            raise ConfigError(f"key 'model.args.router_groups': {cfg.router_groups} groups of one expert have no "
                              f"Hugging Face layout (Glm4MoeForCausalLM scores a group by its best two experts)")
        return "Glm4MoeForCausalLM"
    mixtral = {"dense_layers": 0, "shared_experts": 0, "route_norm": True, "route_scale": 1.0, "router_groups": 1,
               "load_balance_coeff": 0.0}
    differ = [f"{k}={getattr(cfg, k)}" for k, v in mixtral.items() if getattr(cfg, k) != v]
    if cfg.top_k < 2:
        differ.append(f"top_k={cfg.top_k}")
    if differ:
        raise ConfigError(
            f"key 'model.args': a softmax-routed MoE exports as MixtralForCausalLM only with dense_layers=0, "
            f"shared_experts=0, route_norm=true, route_scale=1, router_groups=1, load_balance_coeff=0 and top_k>=2; "
            f"this one has {', '.join(differ)} (score_function=sigmoid exports as Glm4MoeForCausalLM)")
    return "MixtralForCausalLM"


def moe_layout(model: nn.Module, block_size: int, eos_id: int | None) -> HFLayout:
    """The built-in MoE's Hugging Face layout (`moe_architecture`): Llama's names for what is
    Llama's, each expert set's gate and up projections joined as `gate_up_proj`."""
    import transformers

    cfg = model.cfg
    architecture = moe_architecture(cfg)
    common: dict[str, Any] = {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_width,
        "rms_norm_eps": cfg.norm_eps, "max_position_embeddings": block_size, "hidden_act": "silu",
        "tie_word_embeddings": False, "num_experts_per_tok": cfg.top_k, "eos_token_id": eos_id,
        "architectures": [architecture], "dtype": torch.float32,
    }
    if architecture == "MixtralForCausalLM":
        config: Any = transformers.MixtralConfig(
            **common, intermediate_size=cfg.moe_dim, num_local_experts=cfg.num_experts,
            rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
            router_jitter_noise=0.0)
    else:
        config = transformers.Glm4MoeConfig(
            **common, intermediate_size=cfg.ffn_dim, moe_intermediate_size=cfg.moe_dim,
            n_routed_experts=cfg.num_experts, n_shared_experts=cfg.shared_experts,
            first_k_dense_replace=cfg.dense_layers, n_group=cfg.router_groups, topk_group=cfg.router_top_groups,
            # Ours normalises top-k gates only where there are several; Hugging Face's always.
            norm_topk_prob=cfg.route_norm and cfg.top_k > 1, routed_scaling_factor=cfg.route_scale,
            attention_bias=False, use_qk_norm=False, num_mtp_layers=0,
            rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta, "partial_rotary_factor": 1.0})
    rename = moe_hf_names(architecture)
    tensors = []
    for t in tensors_of(model):
        if t.checkpoint_name.endswith("experts.w3"):
            continue  # joined into its layer's gate_up_proj
        hf_name = rename(t.checkpoint_name)
        if hf_name is None:
            continue
        joined = (t.checkpoint_name[:-2] + "w3",) if t.checkpoint_name.endswith("experts.w1") else ()
        tensors.append(dataclasses.replace(t, hf_name=hf_name, joined=joined))
    return HFLayout(config, tuple(tensors))


def layout(model_config: ModelConfig, block_size: int, eos_id: int | None = None) -> HFLayout:
    """The Hugging Face layout of the run's model: the built-in Llama's or a `model.hf_config`
    model's own; ConfigError for any other model. `block_size`: the trained context length,
    the built-in Llama's `max_position_embeddings`; `eos_id`: the data's end-of-document token,
    its `eos_token_id` (a `model.hf_config` model keeps its config's)."""
    if model_config.hf_config is not None and not Path(model_config.hf_config).is_file():
        raise ConfigError(f"key 'model.hf_config': the run was trained from {model_config.hf_config}, "
                          f"which no longer exists; export needs it")
    if model_config.hf_config is None and model_config.factory not in (LLAMA_FACTORY, MOE_FACTORY):
        raise ConfigError(f"key 'model.factory': {model_config.factory} has no Hugging Face layout; export writes "
                          f"the built-in GPT, Llama and MoE and any model.hf_config model")
    model = build_on_meta(model_config)  # the runtime's own build; the weights are the checkpoint's
    if model_config.factory == MOE_FACTORY and model_config.hf_config is None:
        return moe_layout(model, block_size, eos_id)
    if model_config.hf_config is not None:
        config = model.config
        with open(model_config.hf_config) as f:
            config.use_cache = json.load(f).get("use_cache", True)  # training turned it off
        config.architectures = [type(model).__name__]
        config.dtype = torch.float32
        return HFLayout(config, tensors_of(model))
    from transformers import LlamaConfig

    cfg = model.cfg
    fields: dict[str, Any] = {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.dim // cfg.n_heads, "rms_norm_eps": cfg.norm_eps, "max_position_embeddings": block_size,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        # transformers 4 reads rope_theta; 5 files it under rope_parameters itself.
        "rope_theta": cfg.rope_theta,
        "eos_token_id": eos_id, "architectures": ["LlamaForCausalLM"], "dtype": torch.float32,
    }
    config = LlamaConfig(**fields)
    return HFLayout(config, tensors_of(model, llama_hf_name))


def _stored_shapes(checkpoint: str) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor the checkpoint's model section holds, from DCP's metadata."""
    fs, path = filesystem(checkpoint)
    if is_local(fs):
        reader: Any = FileSystemReader(path)
    else:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        reader = FsspecReader(checkpoint)
    prefix = f"{MODEL_SECTION}."
    return {key[len(prefix):]: tuple(getattr(value, "size", ()))
            for key, value in reader.read_metadata().state_dict_metadata.items() if key.startswith(prefix)}


def check_fits(checkpoint: str, expected: dict[str, tuple[int, ...]], model: str) -> None:
    """CheckpointError, in one line, unless the checkpoint holds every tensor of `expected`
    ({canonical name: shape}) in that shape; `model` names the run's model for the message."""
    stored = _stored_shapes(checkpoint)
    missing = [name for name in expected if name not in stored]
    wrong = [f"{name}: {list(stored[name])} vs {list(shape)}" for name, shape in expected.items()
             if name in stored and stored[name] != shape]
    if missing or wrong:
        what = f"lacks {missing[0]}" if missing else f"holds {wrong[0]}"
        raise CheckpointError(f"checkpoint {checkpoint} does not hold {model} of the run's config.yaml: it {what} "
                              f"({len(missing)} missing, {len(wrong)} with another shape)")


def shard_files(tensors: tuple[ExportedTensor, ...], max_shard_bytes: int) -> list[list[ExportedTensor]]:
    """`tensors` dealt in order into files of at most `max_shard_bytes` (a larger tensor alone)."""
    files: list[list[ExportedTensor]] = [[]]
    size = 0
    for tensor in tensors:
        if files[-1] and size + tensor.nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(tensor)
        size += tensor.nbytes
    return files


def write(checkpoint: str, hf: HFLayout, out: Path, max_shard_bytes: int) -> None:
    """Write the weights of `checkpoint` into the directory `out` as `hf` lays them out:
    `model-0000N-of-0000M.safetensors`, `model.safetensors.index.json` and config.json."""
    check_fits(checkpoint, {name: t.shape for t in hf.tensors for name in t.parts}, type(hf.config).__name__)
    files = shard_files(hf.tensors, max_shard_bytes)
    file_of = {t.hf_name: index for index, tensors in enumerate(files, start=1) for t in tensors}
    weight_map: dict[str, str] = {}
    total = 0
    with warnings.catch_warnings():
        # One process without a group is the intended use here, not the mistake DCP warns of.
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        warnings.filterwarnings("ignore", message=".*load in a single process.*")
        warnings.filterwarnings("ignore", message=".*save in a single process.*")
        for tensors in files:
            held = {name: torch.empty(t.shape, dtype=t.dtype) for t in tensors for name in t.parts}
            dcp.load({MODEL_SECTION: held}, checkpoint_id=checkpoint, no_dist=True)
            dcp.save({t.hf_name: torch.cat([held[n] for n in t.parts], dim=1) if t.joined else held[t.checkpoint_name]
                      for t in tensors},
                     storage_writer=HuggingFaceStorageWriter(str(out), fqn_to_index_mapping=file_of), no_dist=True)
            # The writer's index lists the file it has just written; the whole index is their union.
            index = json.loads((out / INDEX).read_text())
            weight_map.update(index["weight_map"])
            total += index["metadata"]["total_size"]
            del held
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    hf.config.save_pretrained(str(out))
