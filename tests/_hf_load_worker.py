"""Sharded loading harness: tiny Hugging Face Llamas saved with save_pretrained, loaded by 4
gloo ranks into a meta-built model sharded by FSDP2 (and tensor parallelism), each rank
reading only its slices.

Kept out of the test module so spawned ranks import it without importing pytest.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

WORLD = 4


@dataclass(frozen=True)
class Case:
    name: str
    tied: bool
    sharded_file: bool
    """Saved as several files with an index (save_pretrained's max_shard_size), else one file."""
    tp: int = 1
    big: bool = False
    """Tens of MB, for the host memory measurement."""

    @property
    def weights(self) -> str:
        """What model.hf_weights names: the file itself, or the sharded checkpoint's directory."""
        return self.name if self.sharded_file else f"{self.name}/model.safetensors"


CASES = [
    Case("fsdp_tied_file", tied=True, sharded_file=False),
    Case("fsdp_untied_index", tied=False, sharded_file=True),
    Case("tp_fsdp_tied_index", tied=True, sharded_file=True, tp=2),
    Case("tp_fsdp_untied_file", tied=False, sharded_file=False, tp=2),
    Case("memory", tied=False, sharded_file=False, big=True),
]


def llama_config(tied: bool, big: bool = False):
    import transformers

    if big:  # 17.8M parameters, 71 MB in fp32
        return transformers.LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                                        num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=tied)
    # Odd vocabulary: FSDP2's Shard(0) of the embedding is uneven over 4 ranks.
    return transformers.LlamaConfig(vocab_size=301, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)


def save(case: Case, root: Path, seed: int = 0) -> None:
    """The case's model, randomly initialised from `seed`, as save_pretrained writes it."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(llama_config(case.tied, case.big))
    # Small shards: the index case spreads even the tiny model over several files.
    shard = "20KB" if case.sharded_file else "10GB"
    model.save_pretrained(root / case.name, safe_serialization=True, max_shard_size=shard)


def _build_sharded(case: Case, root: Path):
    """The case's model built on meta by the job's factory, tensor-parallel if asked, FSDP2 per
    decoder layer and root, then given (uninitialised) storage: what the runtime loads into."""
    from orchestrator.runtime.state_names import tied_aliases
    from orchestrator.runtime.tensor_parallel import apply_tensor_parallel
    from orchestrator.workloads.hf import build

    with torch.device("meta"):
        # The weights are named but not read: a meta model has nowhere to put them.
        model = build(str(root / case.name / "config.json"), str(root / case.weights))
    aliases = tied_aliases(model)
    if case.tp > 1:
        mesh = init_device_mesh("cpu", (WORLD // case.tp, case.tp), mesh_dim_names=("dp_shard", "tp"))
        apply_tensor_parallel(model, mesh["tp"])
        dp = mesh["dp_shard"]
    else:
        dp = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp_shard",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            # NaN everywhere: a slice the load misses cannot pass for a loaded one.
            (p.to_local() if isinstance(p, DTensor) else p).fill_(float("nan"))
    return model, aliases


def _local_bytes(model: torch.nn.Module) -> int:
    return sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in model.parameters())


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(f"{field}:"))
    return int(line.split()[1]) * 1024  # kB


class PeakGrowth:
    """The most this process's resident memory (anonymous and mapped file pages) rose above
    its level at entry, at any moment inside: the kernel's high-water mark, reset at entry."""

    def __enter__(self) -> PeakGrowth:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS to the current RSS (Linux >= 4.0)
        self.start = _status_bytes("VmRSS")
        return self

    def __exit__(self, *exc) -> None:
        self.bytes = _status_bytes("VmHWM") - self.start


def _run_case(case: Case, root: Path) -> dict:
    from safetensors.torch import load_file

    from orchestrator.runtime.hf_weights import load_weights, weight_files

    model, aliases = _build_sharded(case, root)
    path = str(root / case.weights)
    files = weight_files(path)
    start = time.perf_counter()
    with PeakGrowth() as sliced:
        load_weights([model], path, aliases)
    load_s = time.perf_counter() - start
    with PeakGrowth() as whole:  # the old way, for scale: every tensor of the file in this rank's memory
        saved: dict[str, torch.Tensor] = {}
        for f in files:
            saved.update(load_file(str(f)))
        sum(float(t.float().sum()) for t in saved.values())  # every page touched
    out: dict = {"shard_bytes": _local_bytes(model), "file_bytes": sum(f.stat().st_size for f in files),
                 "files": len(files), "sliced_peak_growth": sliced.bytes, "whole_peak_growth": whole.bytes,
                 "load_s": load_s}

    wrong, placements, names = [], set(), []
    for name, p in model.named_parameters(remove_duplicate=False):
        full = p.full_tensor() if isinstance(p, DTensor) else p.detach()  # collective: same order on every rank
        if isinstance(p, DTensor):
            placements.add(f"{name.rsplit('.', 1)[0].split('.')[-1]}:{p.placements}")
        names.append(name)
        if not torch.equal(full, saved[aliases.get(name, name)]):
            wrong.append(name)
    out.update(wrong=wrong, placements=sorted(placements), names=names, saved_keys=sorted(saved),
               compared=sorted({aliases.get(n, n) for n in names}))
    return out


def _one_rank_lacks_a_tensor(root: Path) -> str:
    """What load_weights raises on each rank when only rank 0 holds a parameter the file lacks
    (as one pipeline stage may): every rank must refuse, none wait for the others."""
    from orchestrator.errors import ConfigError
    from orchestrator.runtime.hf_weights import load_weights

    case = CASES[0]
    stage = torch.nn.Module()
    stage.lm_head = torch.nn.Linear(32, 301, bias=False)
    if dist.get_rank() == 0:
        stage.extra_head = torch.nn.Linear(32, 3, bias=False)
    try:
        load_weights([stage], str(root / case.weights), {"lm_head.weight": "model.embed_tokens.weight"})
    except ConfigError as e:
        return str(e)
    return "loaded"


def run_rank(rank: int, init_file: str, root: str, names: list[str]) -> None:
    torch.set_num_threads(1)
    # A collective some rank never joins fails after the timeout instead of hanging the test.
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    try:
        results = {}
        for case in CASES:
            if case.name in names:
                results[case.name] = _run_case(case, Path(root))
            dist.barrier()
        results["one_rank_lacks_a_tensor"] = _one_rank_lacks_a_tensor(Path(root))
        dist.barrier()
        # Whole or absent (renamed into place): the test reads it even if the teardown aborts.
        tmp = Path(root) / f"rank{rank}.json.tmp"
        tmp.write_text(json.dumps(results))
        tmp.replace(Path(root) / f"rank{rank}.json")
    finally:
        dist.destroy_process_group()
