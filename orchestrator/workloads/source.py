"""Where the user's model module lives, so the job can carry it to every worker.

A factory `package.module:callable` importable in the user's shell (the current directory or
PYTHONPATH) must import on every worker too; Ray's runtime_env `py_modules` uploads it with
the job, so nobody installs it on the nodes by hand. Installed packages (site-packages) and
this project are on the workers already and are not shipped. Imports neither torch nor Ray.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import sysconfig
from pathlib import Path

from ..config import GPT_FACTORY, ModelConfig

_INSTALLED = {Path(p).resolve() for p in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
                                          sysconfig.get_paths()["stdlib"])}
_PROJECT = Path(__file__).resolve().parents[1]  # the orchestrator package


def model_modules(m: ModelConfig, model_fn: object | None = None) -> list[str]:
    """Local paths (a package directory or a single .py file) of the model's top-level module,
    when it is neither installed nor part of this project; [] otherwise or when it cannot be found
    (the factory's own import error then names model.factory). For a callable passed in Python,
    its defining module (one defined in __main__ or a notebook travels by value, pickled)."""
    if model_fn is not None:
        return local_module_path(getattr(model_fn, "__module__", "") or "")
    if m.hf_config:
        return []
    return local_module_path(m.factory.partition(":")[0])


def local_module_path(module: str) -> list[str]:
    """[path] of the top-level module of `module` when it is local (not installed, not ours), else []."""
    top = module.split(".")[0]
    if top == "__main__":
        return []
    if not top or top in sys.builtin_module_names:
        return []
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.origin or spec.origin in ("built-in", "frozen"):
        return []
    path = Path(spec.submodule_search_locations[0] if spec.submodule_search_locations else spec.origin).resolve()
    if path == _PROJECT or _PROJECT in path.parents or any(d in path.parents for d in _INSTALLED):
        return []
    return [str(path)]


def inside_ray_job() -> bool:
    """Whether this process is a Ray Jobs API entrypoint (its runtime_env already carries the modules)."""
    return "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ


def is_builtin_gpt(m: ModelConfig, model_fn: object | None = None) -> bool:
    """The default model, which the planner prices by its formulas (no measurement, no torch)."""
    return model_fn is None and m.hf_config is None and m.factory == GPT_FACTORY
