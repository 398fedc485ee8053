"""The run directory: one per `submit`, never reused, written as the run goes.

    runs/<name>-<YYYYmmdd-HHMMSS>/
        config.yaml      the merged config
        topology.json    the probed cluster
        plan.json        the plan (strategy, mesh, rank -> node/GPU, predictions)
        placement.json   what each worker actor reported: rank, node, GPU or CPU slot, pid, NCCL env
        metrics.jsonl    one JSON line per optimizer step
        summary.json     the outcome, with the plan's predictions beside the measurements
        loss.svg         the loss curve
        logs/            rank-N.log (what rank N printed), ray.log (Ray's own processes)
        checkpoints/     committed DCP checkpoints (step_NNNNNNNN/)
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from ..connect.remote import REMOTE_RUN_ENV


def anchored(path: str | None) -> str | None:
    """`path` for a driver the Jobs API started: a relative path is taken from the home
    directory of the node the driver runs on, because the job's working directory there is
    Ray's temporary copy of the project, removed when the cluster cleans up (and may be
    unpacked again under a running job). Absolute paths and URIs (`s3://...`) are kept."""
    if path is None or "://" in path:
        return path
    path = os.path.expanduser(path)
    if os.path.isabs(path) or not os.environ.get(REMOTE_RUN_ENV):
        return path
    return str(Path.home() / path)


class RunDir:
    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def create(cls, runs_dir: str | os.PathLike, name: str, exact: str | None = None) -> "RunDir":
        """A new directory named `<name>-<time>`, or `exact` (a Jobs API submission id, so the
        job's record can name its run directory before the run starts); an existing one of
        the same name is never touched (a suffix is added)."""
        parent = Path(runs_dir)
        parent.mkdir(parents=True, exist_ok=True)
        base = exact or f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
        for i in range(1000):
            path = parent / (base + (f"-{i}" if i else ""))
            try:
                path.mkdir()  # atomic: fails if another submit took the name first
                return cls(path)
            except FileExistsError:
                continue
        raise FileExistsError(f"could not find a free run directory name under {parent}")

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def write_text(self, name: str, text: str) -> Path:
        p = self.path / name
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(p)  # readers never see half a file
        return p

    def write_json(self, name: str, data: Any) -> Path:
        return self.write_text(name, json.dumps(data, indent=2, default=str) + "\n")

    def append_jsonl(self, name: str, rows: list[dict[str, Any]]) -> None:
        if rows:
            with open(self.path / name, "a") as f:
                for r in rows:
                    f.write(json.dumps(r) + "\n")
