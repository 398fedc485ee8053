"""Training metrics exported through Ray's metrics pipeline (Prometheus, the dashboard, Grafana).

Each rank records into `ray.util.metrics`; Ray's per-node agent serves them on the node's
`--metrics-export-port` with Ray's `ray_` prefix, so `orchestrator_loss` is scraped as
`ray_orchestrator_loss{job_name="llm",rank="3",node="..."}`. Every series carries the job name, the
rank and the node, so one Grafana query can split a run by rank or find the slow node.

The job's tag is `job_name`, not `job`: Prometheus gives every scraped target a `job` label of
its own (Ray's scrape configuration names it `ray`) and renames a metric's `job` to
`exported_job`, so a `job` tag would be queried under a name nobody expects. `job_name` is also
the key the Ray dashboard's Jobs page shows as a job's name.
"""

from __future__ import annotations

import functools
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    import torch

JOB_TAG = "job_name"
TAG_KEYS = (JOB_TAG, "rank", "node")
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
PLANNED_MEMORY = MetricSpec("orchestrator_memory_planned_bytes", "gauge",
                            "The plan's predicted memory per rank (model states, activations, buffers).")
BASELINE_MEMORY = MetricSpec("orchestrator_memory_baseline_bytes", "gauge",
                             "What the rank held before its model was built (interpreter and libraries on CPU).")
# A gauge, not a counter: it must read 0 before the first restart (a Ray counter cannot be
# incremented by 0), or a dashboard's restarts panel would be empty for every healthy run.
EXPERT_IMBALANCE = MetricSpec("orchestrator_expert_imbalance", "gauge",
                              "An MoE layer's busiest expert's tokens over the layer's mean, last step.",
                              "expert_imbalance")
"""Tagged with the layer too: one series per MoE layer and rank. Tokens per expert stay in
metrics.jsonl and the report's heat map: layers x experts series per rank (14,848 for
DeepSeek-V3) would outgrow what a Prometheus keeps per job."""
EXPERT_TAG_KEYS = TAG_KEYS + ("layer",)
RESTARTS = MetricSpec("orchestrator_restarts", "gauge", "Restarts of the job after a failure so far.")

GAUGE_REFRESH_S = 5.0
"""How often a gauge's last value is set again. Ray's metrics agent forgets a gauge that was not
set within two export intervals (2 x `metrics_report_interval_ms`, 20 s by default), so a value
set once (the plan's memory, the restarts so far) or by a step slower than that would vanish
from Prometheus between steps."""

EXPORT_INTERVAL_S = 1.0
"""How often the steps recorded since the last export reach Ray's metrics. The training loop only
hands a step's values over (a list append); a background thread sets the metrics, so none of
that work (tag checks, a lock per metric, a memory reading) sits between two steps. Ray's agent
reads them every report interval (10 s by default), so a second's delay shows nowhere."""

_registry: dict[str, Any] = {}
_gauges: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
_gauges_lock = threading.Lock()
_exporter: threading.Thread | None = None
# Every TrainMetrics of this process, for the exporter: held, so a step recorded by one its
# creator dropped still reaches Ray (a few per process: one per setup).
_live: list["TrainMetrics"] = []


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


def _set_gauge(spec: MetricSpec, tag_keys: tuple[str, ...], value: float, tags: dict[str, str]) -> None:
    """Set a gauge and keep setting it to this value every GAUGE_REFRESH_S until it changes."""
    _metric(spec, tag_keys).set(value, tags=tags)
    with _gauges_lock:
        _gauges[(spec.name, tuple(tags.items()))] = value
    _start_exporter()


def _start_exporter() -> None:
    global _exporter
    with _gauges_lock:
        if _exporter is None:
            _exporter = threading.Thread(target=_export_loop, name="orchestrator-metrics", daemon=True)
            _exporter.start()


def _export_loop() -> None:
    import time

    refreshed = time.monotonic()
    while True:
        time.sleep(EXPORT_INTERVAL_S)
        for m in list(_live):
            m.flush()
        if time.monotonic() - refreshed >= GAUGE_REFRESH_S:
            refreshed = time.monotonic()
            with _gauges_lock:
                last = list(_gauges.items())
            for (name, tags), value in last:
                _registry[name].set(value, tags=dict(tags))


def _current_node() -> str:
    import ray

    if ray.is_initialized():
        return ray.get_runtime_context().get_node_id()
    import socket

    return socket.gethostname()


def process_memory_bytes(device: torch.device | None = None) -> int:
    """Peak memory this rank holds: CUDA's peak allocation on `device` when it is a GPU, else
    resident memory. The device is named, never taken as the current one: the current device is
    per thread, and the exporter's thread would read device 0 for every rank."""
    if device is not None and device.type == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated(device))
    return int(_this_process().memory_info().rss)


@functools.lru_cache(maxsize=4)
def _process(pid: int):
    import psutil

    return psutil.Process(pid)


def _this_process():
    # Keyed by pid: a forked child must not read its parent's figures.
    return _process(os.getpid())


class TrainMetrics:
    """One rank's exported metrics, tagged with its job, rank and node."""

    def __init__(self, job: str, rank: int, node: str | None = None, *, planned_bytes: int | None = None,
                 baseline_bytes: int | None = None, device: torch.device | None = None) -> None:
        if not job:
            raise ValueError("TrainMetrics needs a job name (the `name` of the job config)")
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        self.tags = {JOB_TAG: job, "rank": str(rank), "node": node or _current_node()}
        self.device = device  # whose memory a step without `memory_bytes` reports
        self._metrics = {spec.name: (spec, _metric(spec, TAG_KEYS)) for spec in METRICS}
        self._pending: list[Mapping[str, Any]] = []
        self._lock = threading.Lock()
        _live.append(self)
        _start_exporter()
        # What the rank's measured memory is read against on a dashboard.
        for spec, value in ((PLANNED_MEMORY, planned_bytes), (BASELINE_MEMORY, baseline_bytes)):
            if value is not None:
                _set_gauge(spec, TAG_KEYS, float(value), self.tags)

    def record_step(self, result: Mapping[str, Any]) -> None:
        """Hand one step's result dict (the Trainer's StepResult as a dict) to the exporter,
        which sets the metrics within EXPORT_INTERVAL_S (`flush` does it at once).

        Keys it reads: loss, val_loss, tokens_per_s, step_s, exposed_comm_s, mfu, grad_norm,
        lr, memory_bytes, step, expert_imbalance (one gauge per MoE layer). Absent or None keys
        are skipped (a step without evaluation has no val_loss); memory_bytes, when absent, is
        measured from this process at export.
        """
        with self._lock:
            self._pending.append(result)

    def flush(self) -> None:
        """Export every step recorded since the last export: each step time into the histogram,
        the steps into the counter, every gauge to the last value the steps gave it."""
        with self._lock:
            rows, self._pending = self._pending, []
        if not rows:
            return
        last: dict[str, Any] = {}
        for row in rows:
            last.update((k, v) for k, v in row.items() if v is not None)
        if last.get("memory_bytes") is None:
            last["memory_bytes"] = process_memory_bytes(self.device)
        for spec, metric in self._metrics.values():
            if spec.step_key is None:
                continue
            if spec.kind == "histogram":
                for row in rows:
                    if row.get(spec.step_key) is not None:
                        metric.observe(float(row[spec.step_key]), tags=self.tags)
            elif last.get(spec.step_key) is not None:
                _set_gauge(spec, TAG_KEYS, float(last[spec.step_key]), self.tags)
        self._metrics["orchestrator_steps_total"][1].inc(float(len(rows)), tags=self.tags)
        for layer, value in enumerate(last.get("expert_imbalance") or ()):
            _set_gauge(EXPERT_IMBALANCE, EXPERT_TAG_KEYS, float(value), self.tags | {"layer": str(layer)})


def record_restarts(job: str, restarts: int) -> None:
    """Set how many times `job` has restarted (called by the driver at the start of a run and
    after each restart, so it is tagged with the job only)."""
    if not job:
        raise ValueError("record_restarts needs the job name")
    if restarts < 0:
        raise ValueError(f"restarts must be >= 0, got {restarts}")
    _set_gauge(RESTARTS, (JOB_TAG,), float(restarts), {JOB_TAG: job})
