"""What the driver checks of the user's model before any worker starts: it is measured on the
meta device (no memory) into the ModelSpec the planner prices, and a model that breaks the
contract is refused in one line naming the key."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..config import JobConfig
from ..errors import ConfigError, PlanError
from ..planning.model_spec import ModelSpec


def measure_model(cfg: JobConfig, model_fn: Callable[..., Any] | None = None) -> ModelSpec | None:
    """The model's spec, measured on the meta device; None for the built-in GPT. ConfigError
    (one line naming the key) for a model that breaks the contract."""
    from ..workloads.source import is_builtin_gpt

    if is_builtin_gpt(cfg.model, model_fn):
        return None  # priced from its config: the driver need not import torch (most of a second)
    from ..workloads.inspect import model_spec

    spec: ModelSpec | None = model_spec(cfg.model, model_fn)
    if cfg.train.compile == "true":
        # Traced now, so a break is refused before anything starts; under `auto` only once a
        # plan would compile (`compile_checked`, called by the driver).
        spec = compile_checked(cfg, spec, model_fn)
    if isinstance(cfg.parallel.pp, int) and cfg.parallel.pp > 1:
        _check_pipeline_contract(cfg, model_fn)
    if cfg.model.hf_weights:
        _check_weights(cfg, cfg.model.hf_weights, model_fn)
    return spec


def start_measuring(cfg: JobConfig, model_fn: Callable[..., Any] | None = None) -> Future:
    """`measure_model` on a thread of its own: its import of torch and the model's build on the
    meta device (seconds on a small host) then overlap Ray's start instead of preceding it. The
    future's `result()` is the spec, or raises what measuring raised; the built-in GPT's (None,
    no torch) is ready at once."""
    from ..workloads.source import is_builtin_gpt

    if is_builtin_gpt(cfg.model, model_fn):
        done: Future = Future()
        done.set_result(None)
        return done
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="measure-model")
    try:
        return pool.submit(measure_model, cfg, model_fn)
    finally:
        pool.shutdown(wait=False)  # the thread ends with its one task


def _check_pipeline_contract(cfg: JobConfig, model_fn: Callable[..., Any] | None) -> None:
    """A forced pipeline needs a model that names its ends: refused here, in one line, before
    any worker starts."""
    import torch

    from ..runtime.pipeline import pipeline_parts
    from ..workloads.models import build_model

    with torch.device("meta"):
        model = build_model(cfg.model, model_fn)
    try:
        pipeline_parts(model)
    except PlanError as e:
        raise ConfigError(f"key 'parallel.pp': {e}") from None


def check_context_parallel(cfg: JobConfig, cp: int, model_fn: Callable[..., Any] | None = None) -> None:
    """A plan that shares sequences over `cp` ranks needs a sequence that halves into 2 x cp
    chunks and a model whose every block's attention declares the sequence hook: refused here,
    in one line naming the key, before any worker starts."""
    from ..sequence_split import sequence_split_problem

    problem = sequence_split_problem(cp, cfg.model.block_size)
    if problem is None and cp > 1:
        import torch

        from ..runtime.context_parallel import prepare_for_context_parallel
        from ..workloads.models import build_model

        with torch.device("meta"):
            model = build_model(cfg.model, model_fn)
        problem = prepare_for_context_parallel(model, cp)
    if problem:
        raise ConfigError(f"key 'parallel.cp': {problem}")


def _check_weights(cfg: JobConfig, weights: str, model_fn: Callable[..., Any] | None) -> None:
    """Weights that do not fit the model (missing or extra names, other shapes) are refused
    here from the file's headers, in one line, before any worker spends memory on them."""
    from ..runtime.hf_weights import check_weights
    from ..runtime.materialize import build_on_meta

    check_weights(build_on_meta(cfg.model, model_fn), weights)


def compile_checked(cfg: JobConfig, spec: ModelSpec | None,
                    model_fn: Callable[..., Any] | None = None) -> ModelSpec | None:
    """`spec` with its block traced for torch.compile where it was not yet: what a caller does
    once a plan would compile, then plans again (a block that breaks the graph then runs eager,
    or is refused under train.compile=true). The trace imports dynamo, seconds a plan that never
    compiles should not spend."""
    from dataclasses import replace

    from ..workloads.compile_check import graph_break

    if spec is None or spec.compile_checked:
        return spec
    return replace(spec, graph_break=graph_break(cfg.model, model_fn), compile_checked=True)
