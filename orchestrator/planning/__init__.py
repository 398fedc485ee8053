"""The planner: sharding strategy, mesh layout and gradient sync from memory and cost models
of the probed topology. Pure Python: no Ray, no torch."""

from __future__ import annotations

from .flow import job_context, plan_job
from .plan import Plan, StepTime

__all__ = ["Plan", "StepTime", "job_context", "plan_job"]
