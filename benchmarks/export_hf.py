"""Export of the ~0.6B Llama-shaped model to Hugging Face's format: time and peak host memory.

    python benchmarks/export_hf.py [--quick] [--shard-gb GB]

Builds the model of jobs/llama-0.6b-cpu.yaml (601M parameters, fp32: 2.4 GB) in a child
process and writes it as a committed DCP checkpoint of a run directory, as a run's last
checkpoint is written; then runs `python -m orchestrator export RUN --out DIR --max-shard-gb GB`
as a user would, in a fresh process (the one rank an export runs on), and measures its wall time
and its peak resident memory (the kernel's high-water mark, `wait4`'s ru_maxrss). The export
reads one shard file's tensors out of the checkpoint at a time, so its peak is the
interpreter, torch and transformers plus about one file (`--shard-gb`), not the model.
`--quick` runs a small Llama of the same vocabulary. Writes benchmarks/results/export_hf.json.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, child_env, parse_args, print_table, python, run, write_result  # noqa: E402

JOB = ROOT / "jobs" / "llama-0.6b-cpu.yaml"
QUICK_MODEL = {"dim": 256, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 704}
"""The small Llama of `--quick`: the job's vocabulary kept."""

_CHECKPOINT = """
import json, sys
from pathlib import Path
import torch.distributed.checkpoint as dcp
from orchestrator.config import load_config, to_yaml
from orchestrator.runtime.checkpoint_files import META, filesystem, manifest, step_dir_name
from orchestrator.workloads.models import build_model
run, overrides = Path(sys.argv[1]), json.loads(sys.argv[2])
cfg = load_config(sys.argv[3], overrides)
(run / "config.yaml").write_text(to_yaml(cfg))
model = build_model(cfg.model)
path = run / "checkpoints" / step_dir_name(cfg.train.max_steps)
dcp.save({"model": model.state_dict()}, checkpoint_id=str(path), no_dist=True)
fs, base = filesystem(str(path))
(path / META).write_text(json.dumps({"step": cfg.train.max_steps, "files": manifest(fs, base, 0)}))
print(json.dumps({"params": sum(p.numel() for p in model.parameters())}))
"""


def options(ap) -> None:
    ap.add_argument("--shard-gb", type=float, default=0.5, help="the export's largest safetensors file, GB")


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> int:
    args = parse_args(__doc__, None, options)
    overrides = [f"model.args.{k}={v}" for k, v in QUICK_MODEL.items()] if args.quick else []
    work = Path(tempfile.mkdtemp(prefix="export_hf."))
    try:
        run_dir = work / "run"
        (run_dir / "checkpoints").mkdir(parents=True)
        made = subprocess.run([python(), "-c", _CHECKPOINT, str(run_dir), json.dumps(overrides), str(JOB)],
                              env=child_env(), check=True, capture_output=True, text=True)
        params = json.loads(made.stdout.strip().splitlines()[-1])["params"]
        out = work / "hf"
        log = work / "export.log"
        t0 = time.perf_counter()
        with open(log, "w") as f:
            export = subprocess.Popen([python(), "-m", "orchestrator", "export", str(run_dir), "--out", str(out),
                                       "--max-shard-gb", str(args.shard_gb)], env=child_env(), cwd=ROOT,
                                      stdout=f, stderr=subprocess.STDOUT)
            _, status, usage = os.wait4(export.pid, 0)
        export_s = time.perf_counter() - t0
        code = os.waitstatus_to_exitcode(status)
        if code:
            raise RuntimeError(f"export failed ({code}): {log.read_text()[-2000:]}")
        index = json.loads((out / "model.safetensors.index.json").read_text())
        figures: dict[str, Any] = {
            "params": params,
            "model_bytes": index["metadata"]["total_size"],
            "checkpoint_bytes": _dir_bytes(run_dir / "checkpoints"),
            "shard_gb": args.shard_gb,
            "files": len(set(index["weight_map"].values())),
            "export_s": round(export_s, 2),
            "ranks": 1,
            "peak_rss_bytes_per_rank": usage.ru_maxrss * 1024,  # Linux reports KiB
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_table("export to Hugging Face's format", ["params", "model GB", "files", "export s", "peak RSS GB"],
                [[f"{params / 1e6:.0f}M", f"{figures['model_bytes'] / 1e9:.2f}", figures["files"],
                  f"{figures['export_s']:.1f}", f"{figures['peak_rss_bytes_per_rank'] / 1e9:.2f}"]])
    print(f"wrote {write_result('export_hf', figures, args)}")
    return 0


if __name__ == "__main__":
    run(main)
