"""What a CPU rank's own measured compute says of its host's per-slot matmul rate.

The planner prices a CPU slot from a rate measured once per kind of host and kept
(`topology.local.known_cpu_slot_tflops`). A first measurement taken while the host was busy
would price every later plan wrong; each start's compute-only pass (`StepTimer.calibrate`)
measures the same thing again under the plan's own shapes, so the first rank of each node keeps
the rate that pass implies where it disagrees (`topology.local.correct_cpu_slot_tflops`)."""

from __future__ import annotations

from ..planning import Plan


def implied_cpu_slot_tflops(plan: Plan, compute_micro_s: float | None) -> float | None:
    """The per-slot TFLOP/s under which the plan's compute would have taken what the rank
    measured: the planner's compute time scales as one over the rate. None without a measured
    pass or a compute prediction."""
    st = plan.step_time
    peak = plan.model.peak_tflops_per_rank
    if not compute_micro_s or not st.compute_s or not peak:
        return None
    measured = plan.sync.grad_accum_steps * compute_micro_s
    return peak * st.compute_s / measured


def keep_measured_cpu_rate(plan: Plan, compute_micro_s: float | None) -> float | None:
    """Keep the rate `compute_micro_s` implies as this host's, where it disagrees with the kept
    one; the figure now kept (None where nothing was measured)."""
    from ..topology.local import correct_cpu_slot_tflops

    implied = implied_cpu_slot_tflops(plan, compute_micro_s)
    return correct_cpu_slot_tflops(implied) if implied else None
