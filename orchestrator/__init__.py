"""Topology-aware distributed training on Ray.

In Python (scripts, notebooks), `submit` runs a job exactly as the `submit` command does:

    import orchestrator
    summary = orchestrator.submit("jobs/llm.yaml", model=build_fn, overrides=["train.max_steps=100"])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__version__ = "0.1.0"


def submit(job: str | None = None, model: Callable[..., Any] | None = None,
           overrides: Sequence[str] = (), resume: str | None = None) -> dict[str, Any]:
    """Probe, plan, place and train `job` (a job file, or None for the defaults) with `overrides`;
    returns the run's summary (what summary.json holds).

    `model`, when given, builds the model instead of `model.factory`: called with `model.args`
    as keywords, it returns an `nn.Module` mapping token ids [B, T] to logits [B, T, V]. It
    reaches the workers pickled (a function defined in a notebook travels by value), so it needs
    no import path. Bad input raises `orchestrator.errors.UserError` with a one-line message.
    """
    from .commands.submit import submit_job
    from .config import load_config

    return submit_job(load_config(job, list(overrides)), resume, model_fn=model)
