"""Errors a user can act on.

Anything raised as a :class:`UserError` is shown as one line and exits with code 2; the
traceback is shown only with ``--debug``. Everything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem with what the user gave us (config, file, cluster, plan), not with our code."""

    exit_code = 2


class ConfigError(UserError):
    """A config key has a wrong value or type, is unknown, or a config file is missing."""


class TopologyError(UserError):
    """A topology capture or declared topology file cannot be read."""


class PlanError(UserError):
    """No plan satisfies the constraints, or a forced plan cannot run."""


class ModelTooLarge(PlanError):
    """The model fits no plan on this cluster: not even its most memory-frugal one."""


class PlacementError(UserError):
    """The cluster cannot hold the plan (missing nodes, GPUs, or a layout mismatch)."""


class CheckpointError(UserError):
    """A checkpoint is partial, corrupted, or cannot be loaded into this run."""


class RunFailed(UserError):
    """Training failed more often than `train.max_failures` allows (exit code 1, not a usage error)."""

    exit_code = 1
