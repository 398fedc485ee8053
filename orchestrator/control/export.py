"""A run's final weights out of the DCP shards, as safetensors a `transformers` GPT-2 loads.

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

and is written under a temporary name, renamed into place when complete.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..errors import UserError
from ..workloads.gpt import GPT, GPTConfig

FORMAT = "orchestrator-gpt/1"
LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, which the built-in GPT uses


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


def export_model(model: GPT, out: Path, tokenizer: str | None = None, eos_id: int | None = None) -> Path:
    """Write `model` to the directory `out`, which must not exist yet (or be empty)."""
    st = require_safetensors()
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out}: exists and is not an empty directory; choose another")
    if not out.parent.is_dir():
        raise UserError(f"--out {out}: no such directory {out.parent}")
    cfg = model.cfg
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        sd = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
        st.save_file(to_gpt2(sd, cfg), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(gpt2_config(cfg, eos_id), indent=2) + "\n")
        (tmp / "gpt_config.json").write_text(
            json.dumps({"format": FORMAT, "layout": "gpt2", **dataclasses.asdict(cfg)}, indent=2) + "\n")
        if tokenizer and Path(tokenizer).is_file():
            shutil.copyfile(tokenizer, tmp / "tokenizer.json")
        if out.is_dir():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


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


def run_config(run_dir: Path) -> tuple[GPTConfig, dict[str, Any], str]:
    """What a run was trained with (its config.yaml): the model config, the data section, and
    where its checkpoints are."""
    from omegaconf import OmegaConf

    path = run_dir / "config.yaml"
    if not path.is_file():
        raise UserError(f"{run_dir}: no config.yaml; not a run directory")
    cfg: Any = OmegaConf.to_container(OmegaConf.load(path))
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    model = GPTConfig(**{k: v for k, v in cfg["model"].items() if k in fields})
    return model, cfg.get("data") or {}, (cfg.get("checkpoint") or {}).get("path") or str(run_dir / "checkpoints")


def latest_checkpoint(root: str) -> str:
    """The newest checkpoint under `root` that verifies (size and SHA-256 of every file)."""
    from ..errors import CheckpointError
    from ..runtime import checkpoint_files

    found = checkpoint_files.newest_whole(root)
    if found is None:
        raise CheckpointError(f"no whole checkpoint under {root}")
    return found[0]


def export_run(run_dir: str | os.PathLike, out: str | os.PathLike, checkpoint_path: str | None = None) -> Path:
    """Gather a run's final (or the given) checkpoint into one model and export it."""
    from ..data.tokenfiles import read_meta
    from ..runtime import checkpoint

    run_dir = Path(run_dir)
    require_safetensors()  # fail before any work when the package is missing
    cfg, data, root = run_config(run_dir)
    ckpt = checkpoint_path or latest_checkpoint(root)
    model = GPT(cfg)
    checkpoint.load_model_weights(ckpt, model)
    meta = read_meta(data["path"]) if data.get("path") and Path(data["path"]).is_file() else None
    tokenizer = meta.get("tokenizer") if meta else None
    return export_model(model, Path(out), tokenizer=tokenizer, eos_id=meta.get("eos_id") if meta else None)
