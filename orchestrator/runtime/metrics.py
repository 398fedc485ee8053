"""Training metrics exported through Ray's metrics pipeline (Prometheus, the dashboard, Grafana).

Each rank records into `ray.util.metrics`; Ray's per-node agent serves them on the node's
`--metrics-export-port` with Ray's `ray_` prefix, so `orchestrator_loss` is scraped as
`ray_orchestrator_loss{job="llm",rank="3",node="..."}`. Every series carries the job name, the
rank and the node, so one Grafana query can split a run by rank or find the slow node.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

TAG_KEYS = ("job", "rank", "node")
# Step times from a tiny CPU run (tens of ms) to a large model on many nodes (tens of s).
STEP_TIME_BOUNDARIES_S = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0]


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric."""

    name: str
    """Metric name without Ray's `ray_` export prefix."""
    kind: str
    """`gauge`, `counter` or `histogram`."""
    description: str
    """Help text shown by Prometheus and the Ray dashboard."""
    step_key: str | None = None
    """The key of a step's result dict this metric reads; None for metrics set otherwise."""


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("orchestrator_loss", "gauge", "Training loss of the last optimizer step.", "loss"),
    MetricSpec("orchestrator_val_loss", "gauge", "Validation loss of the last evaluation.", "val_loss"),
    MetricSpec("orchestrator_tokens_per_second", "gauge", "Training tokens per second, whole job.", "tokens_per_s"),
    MetricSpec("orchestrator_step_time_seconds", "histogram", "Wall time of one optimizer step.", "step_s"),
    MetricSpec("orchestrator_exposed_comm_seconds", "gauge",
               "Communication time per step not hidden behind compute.", "exposed_comm_s"),
    MetricSpec("orchestrator_mfu", "gauge", "Model FLOPs utilisation of the last step, 0..1.", "mfu"),
    MetricSpec("orchestrator_grad_norm", "gauge", "Global gradient norm before clipping.", "grad_norm"),
    MetricSpec("orchestrator_learning_rate", "gauge", "Learning rate of the last step.", "lr"),
    MetricSpec("orchestrator_memory_bytes", "gauge",
               "Peak device memory allocated by this rank (resident memory on CPU ranks).", "memory_bytes"),
    MetricSpec("orchestrator_step", "gauge", "Optimizer steps completed.", "step"),
    MetricSpec("orchestrator_steps_total", "counter", "Optimizer steps run by this rank (restarts included)."),
)
RESTARTS = MetricSpec("orchestrator_restarts_total", "counter", "Times the job restarted after a failure.")

_registry: dict[str, Any] = {}


def _metric(spec: MetricSpec, tag_keys: tuple[str, ...]) -> Any:
    """The process-wide metric object of `spec` (Ray registers each name once per process)."""
    if spec.name not in _registry:
        from ray.util import metrics

        if spec.kind == "gauge":
            m = metrics.Gauge(spec.name, spec.description, tag_keys=tag_keys)
        elif spec.kind == "counter":
            m = metrics.Counter(spec.name, spec.description, tag_keys=tag_keys)
        else:
            m = metrics.Histogram(spec.name, spec.description, boundaries=STEP_TIME_BOUNDARIES_S, tag_keys=tag_keys)
        _registry[spec.name] = m
    return _registry[spec.name]


def _current_node() -> str:
    import ray

    if ray.is_initialized():
        return ray.get_runtime_context().get_node_id()
    import socket

    return socket.gethostname()


def process_memory_bytes() -> int:
    """Peak memory this rank holds: CUDA's peak allocation when it uses a GPU, else resident memory."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    import psutil

    return int(psutil.Process(os.getpid()).memory_info().rss)


class TrainMetrics:
    """One rank's exported metrics, tagged with its job, rank and node."""

    def __init__(self, job: str, rank: int, node: str | None = None) -> None:
        if not job:
            raise ValueError("TrainMetrics needs a job name (the `name` of the job config)")
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        self.tags = {"job": job, "rank": str(rank), "node": node or _current_node()}
        self._metrics = {spec.name: (spec, _metric(spec, TAG_KEYS)) for spec in METRICS}

    def record_step(self, result: Mapping[str, Any]) -> None:
        """Export one step's result dict (the Trainer's StepResult as a dict).

        Keys it reads: loss, val_loss, tokens_per_s, step_s, exposed_comm_s, mfu, grad_norm,
        lr, memory_bytes, step. Absent or None keys are skipped (a step without evaluation has
        no val_loss); memory_bytes, when absent, is measured from this process.
        """
        values = dict(result)
        if values.get("memory_bytes") is None:
            values["memory_bytes"] = process_memory_bytes()
        for spec, metric in self._metrics.values():
            if spec.step_key is None:
                continue
            value = values.get(spec.step_key)
            if value is None:
                continue
            if spec.kind == "histogram":
                metric.observe(float(value), tags=self.tags)
            else:
                metric.set(float(value), tags=self.tags)
        self._metrics["orchestrator_steps_total"][1].inc(1.0, tags=self.tags)


def record_restart(job: str) -> None:
    """Count one restart of `job` (called by the driver, so it is tagged with the job only)."""
    if not job:
        raise ValueError("record_restart needs the job name")
    _metric(RESTARTS, ("job",)).inc(1.0, tags={"job": job})
