"""A run's final weights out of the DCP shards, as a directory `transformers` loads with
`AutoModelForCausalLM.from_pretrained`: the built-in GPT gathered here, in GPT-2's layout; the
built-in Llama and any `model.hf_config` model shard file by shard file (`hf_export.py`).

The built-in GPT is GPT-2's architecture exactly: learned positions, pre-LayerNorm with eps
1e-5, biases, tied input/output embeddings, 4x MLP, attention scaled by 1/sqrt(head_dim), and
exact (erf) GELU, which GPT-2's config names `activation_function: gelu` (its own default,
`gelu_new`, is the tanh approximation). So the export is GPT-2's layout: q, k and v concatenated
into `c_attn`, every Linear transposed into GPT-2's Conv1D (in, out) order, a model without
biases given zero ones. The directory holds

    config.json         GPT2Config: `GPT2LMHeadModel.from_pretrained(DIR)` loads it
    model.safetensors   the weights (fp32, as trained; lm_head is tied to wte, so not stored)
    gpt_config.json     our GPTConfig, which `load_exported` reads back into the built-in GPT
    tokenizer.json      the data's tokenizer, when `prepare` recorded one

Every export is written under a temporary name, renamed into place when complete; an
existing directory that is not empty is replaced only when asked to (`force`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..config import GPT_FACTORY, ModelConfig
from ..errors import UserError
from ..workloads.gpt import GPT, GPTConfig

FORMAT = "orchestrator-gpt/1"
LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, which the built-in GPT uses
MAX_SHARD_BYTES = 5 * 10**9
"""The largest safetensors file of a sharded export (Hugging Face's own default, 5 GB)."""


def require_safetensors():
    try:
        import safetensors.torch as st
    except ImportError:
        raise UserError("export needs the `safetensors` package: pip install -e '.[hf]'") from None
    return st


def to_gpt2(sd: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """Our state dict in GPT-2's names and shapes."""
    E = cfg.n_embd
    out: dict[str, torch.Tensor] = {}

    def bias(prefix: str, n: int) -> torch.Tensor:
        return sd.get(f"{prefix}.bias", torch.zeros(n, dtype=sd[f"{prefix}.weight"].dtype))

    def conv1d(dst: str, src: str) -> None:
        out[f"{dst}.weight"] = sd[f"{src}.weight"].t().contiguous()
        out[f"{dst}.bias"] = bias(src, sd[f"{src}.weight"].shape[0]).contiguous()

    def norm(dst: str, src: str) -> None:
        out[f"{dst}.weight"] = sd[f"{src}.weight"].contiguous()
        out[f"{dst}.bias"] = bias(src, E).contiguous()

    out["transformer.wte.weight"] = sd["wte.weight"].contiguous()
    out["transformer.wpe.weight"] = sd["wpe.weight"].contiguous()
    for i in range(cfg.n_layer):
        h, d = f"h.{i}", f"transformer.h.{i}"
        norm(f"{d}.ln_1", f"{h}.ln_1")
        norm(f"{d}.ln_2", f"{h}.ln_2")
        qkv = [f"{h}.attn.{n}_proj" for n in "qkv"]
        out[f"{d}.attn.c_attn.weight"] = torch.cat([sd[f"{n}.weight"] for n in qkv], 0).t().contiguous()
        out[f"{d}.attn.c_attn.bias"] = torch.cat([bias(n, E) for n in qkv]).contiguous()
        conv1d(f"{d}.attn.c_proj", f"{h}.attn.c_proj")
        conv1d(f"{d}.mlp.c_fc", f"{h}.mlp.c_fc")
        conv1d(f"{d}.mlp.c_proj", f"{h}.mlp.c_proj")
    norm("transformer.ln_f", "ln_f")
    return out


def from_gpt2(tensors: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """GPT-2's names and shapes back into our state dict (biases dropped when cfg has none)."""
    E = cfg.n_embd
    sd: dict[str, torch.Tensor] = {"wte.weight": tensors["transformer.wte.weight"],
                                   "wpe.weight": tensors["transformer.wpe.weight"]}

    def put(dst: str, src: str, transpose: bool) -> None:
        w = tensors[f"{src}.weight"]
        sd[f"{dst}.weight"] = w.t().contiguous() if transpose else w
        if cfg.bias:
            sd[f"{dst}.bias"] = tensors[f"{src}.bias"]

    for i in range(cfg.n_layer):
        h, d = f"h.{i}", f"transformer.h.{i}"
        put(f"{h}.ln_1", f"{d}.ln_1", False)
        put(f"{h}.ln_2", f"{d}.ln_2", False)
        w = tensors[f"{d}.attn.c_attn.weight"].t()
        b = tensors[f"{d}.attn.c_attn.bias"]
        for j, n in enumerate("qkv"):
            sd[f"{h}.attn.{n}_proj.weight"] = w[j * E:(j + 1) * E].contiguous()
            if cfg.bias:
                sd[f"{h}.attn.{n}_proj.bias"] = b[j * E:(j + 1) * E].contiguous()
        put(f"{h}.attn.c_proj", f"{d}.attn.c_proj", True)
        put(f"{h}.mlp.c_fc", f"{d}.mlp.c_fc", True)
        put(f"{h}.mlp.c_proj", f"{d}.mlp.c_proj", True)
    put("ln_f", "transformer.ln_f", False)
    sd["lm_head.weight"] = sd["wte.weight"]
    return sd


def gpt2_config(cfg: GPTConfig, eos_id: int | None = None) -> dict[str, Any]:
    """The GPT2Config (as config.json) of the same architecture."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.block_size,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": None,
        "activation_function": "gelu",
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "layer_norm_epsilon": LAYER_NORM_EPS,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }


def check_out(out: Path, force: bool = False) -> None:
    """UserError, before anything is read or written, unless `out` can be written: a new
    directory in an existing one, an empty directory, or (`force`) a directory to replace."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a directory; choose another")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UserError(f"--out {out}: exists and is not an empty directory; choose another, "
                        f"or pass --force to replace what it holds")
    if not out.parent.is_dir():
        raise UserError(f"--out {out}: no such directory {out.parent}")


@contextlib.contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A new directory beside `out` to write into; it takes `out`'s place when the block
    completes, and is removed when it fails, so `out` holds a whole export or what it held."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        yield tmp
        if out.is_dir() and any(out.iterdir()):
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".replaced", dir=out.parent))
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old)
        else:
            if out.is_dir():
                out.rmdir()
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def export_model(model: GPT, out: Path, tokenizer: str | None = None, eos_id: int | None = None,
                 force: bool = False) -> Path:
    """Write `model` to the directory `out`, which must not exist yet, or be empty (or, with
    `force`, is replaced)."""
    st = require_safetensors()
    out = Path(out)
    check_out(out, force)
    cfg = model.cfg
    with staged(out) as tmp:
        sd = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
        st.save_file(to_gpt2(sd, cfg), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(gpt2_config(cfg, eos_id), indent=2) + "\n")
        (tmp / "gpt_config.json").write_text(
            json.dumps({"format": FORMAT, "layout": "gpt2", **dataclasses.asdict(cfg)}, indent=2) + "\n")
        copy_tokenizer(tokenizer, tmp)
    return out


def copy_tokenizer(tokenizer: str | None, directory: Path) -> None:
    """The data's tokenizer.json into `directory`, when `prepare` recorded one that is still there."""
    if tokenizer and Path(tokenizer).is_file():
        shutil.copyfile(tokenizer, directory / "tokenizer.json")


def load_exported(path: str | os.PathLike) -> GPT:
    """The built-in GPT from an exported directory (our config, GPT-2-layout weights)."""
    st = require_safetensors()
    p = Path(path)
    try:
        meta = json.loads((p / "gpt_config.json").read_text())
    except FileNotFoundError:
        raise UserError(f"{p}: no gpt_config.json; not a directory `export` wrote") from None
    if meta.pop("format", None) != FORMAT:
        raise UserError(f"{p / 'gpt_config.json'}: format is not {FORMAT}")
    meta.pop("layout", None)
    cfg = GPTConfig(**meta)
    model = GPT(cfg)
    model.load_state_dict(from_gpt2(st.load_file(str(p / "model.safetensors")), cfg))
    return model


def run_config(run_dir: Path) -> tuple[ModelConfig, dict[str, Any], str]:
    """What a run was trained with (its config.yaml): the model config (with the built-in GPT's
    fields), the data section, and where its checkpoints are."""
    from omegaconf import OmegaConf

    path = run_dir / "config.yaml"
    if not path.is_file():
        raise UserError(f"{run_dir}: no config.yaml; not a run directory")
    cfg: Any = OmegaConf.to_container(OmegaConf.load(path))
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    model = ModelConfig(**{k: v for k, v in cfg["model"].items() if k in fields})
    return model, cfg.get("data") or {}, (cfg.get("checkpoint") or {}).get("path") or str(run_dir / "checkpoints")


def gpt_config(model: ModelConfig) -> GPTConfig:
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    return GPTConfig(**{k: getattr(model, k) for k in fields if hasattr(model, k)})


def latest_checkpoint(root: str) -> str:
    """The newest checkpoint under `root` that verifies (size and SHA-256 of every file)."""
    from ..errors import CheckpointError
    from ..runtime import checkpoint_files

    found = checkpoint_files.newest_whole(root)
    if found is None:
        raise CheckpointError(f"no whole checkpoint under {root}: nothing to export")
    return found[0]


def check_exportable(model_config: ModelConfig) -> None:
    """ConfigError, before a run with `checkpoint.export` trains, where its model has no
    Hugging Face layout (the same check `export` makes at the end, on the model built on meta)."""
    require_safetensors()
    if model_config.hf_config is None and model_config.factory == GPT_FACTORY:
        return
    from . import hf_export

    hf_export.layout(model_config, model_config.block_size)


def export_run(run_dir: str | os.PathLike, out: str | os.PathLike, checkpoint_path: str | None = None,
               force: bool = False, max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Export a run's final (or the given) checkpoint into the directory `out`: the built-in
    GPT gathered into one model (GPT-2's layout), any other model shard file by shard file
    (`hf_export.py`). `out` must not exist yet, or be empty; `force` replaces it."""
    from ..data.tokenfiles import read_meta
    from ..runtime import checkpoint
    from ..runtime.checkpoint_files import verify
    from . import hf_export

    run_dir, out = Path(run_dir), Path(out)
    require_safetensors()  # fail before any work when the package is missing
    check_out(out, force)
    model_config, data, root = run_config(run_dir)
    ckpt = checkpoint_path or latest_checkpoint(root)
    meta = read_meta(data["path"]) if data.get("path") and Path(data["path"]).is_file() else None
    tokenizer, eos_id = (meta.get("tokenizer"), meta.get("eos_id")) if meta else (None, None)
    if model_config.hf_config is None and model_config.factory == GPT_FACTORY:
        model = GPT(gpt_config(model_config))
        hf_export.check_fits(ckpt, {t.checkpoint_name: t.shape for t in hf_export.tensors_of(model)}, "the GPT")
        checkpoint.load_model_weights(ckpt, model)
        return export_model(model, out, tokenizer=tokenizer, eos_id=eos_id, force=force)
    if checkpoint_path:
        verify(ckpt)  # the latest whole one is verified in finding it
    hf = hf_export.layout(model_config, model_config.block_size, eos_id)
    with staged(out) as tmp:
        hf_export.write(ckpt, hf, tmp, max_shard_bytes)
        copy_tokenizer(tokenizer, tmp)
    return out
