"""The planner: sharding strategy, mesh layout and gradient sync from memory and cost models
of the probed topology. Pure Python: no Ray, no torch."""

from __future__ import annotations

from .plan import Plan, StepTime, job_context, plan_job

__all__ = ["Plan", "StepTime", "job_context", "plan_job"]
