"""The Grafana dashboard of the orchestrator's metrics, and its installation beside Ray's own.

The panels are declared once here (`PANELS`); `dashboard()` turns them into Grafana's JSON
model, which the project also ships as `deploy/grafana/orchestrator-dashboard.json` for a
Grafana that Ray did not provision (a test keeps the two the same). Every query filters on
the `job_name` and `node` variables; a query whose legend names `{{rank}}` or `{{node}}`
returns one series per rank or per node, which the Prometheus test checks.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

UID = "orchestrator"
FILE_NAME = "orchestrator_grafana_dashboard.json"
"""The file in Ray's provisioned dashboards folder (Ray's own are `*_grafana_dashboard.json`)."""
DASHBOARDS_DIR_ENV = "RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR"
"""Where Ray's dashboard writes the Grafana dashboards it provisions, when set (Ray's own variable)."""
SELECT = 'job_name=~"$job_name", node=~"$node"'
"""The label filter of every query: the job and the nodes picked in the dashboard's variables."""


@dataclass(frozen=True)
class Target:
    """One PromQL query of a panel."""

    expr: str
    """The query; `$job_name`, `$node` and `$__rate_interval` are Grafana's to fill in."""
    legend: str
    """The series' name in the legend; `{{rank}}` or `{{node}}` splits the panel by that label."""


@dataclass(frozen=True)
class Panel:
    """One panel of the dashboard."""

    title: str
    unit: str
    """Grafana's unit id: `short`, `s`, `bytes`, `percentunit`."""
    targets: tuple[Target, ...]
    description: str
    kind: str = "timeseries"
    """`timeseries` or `stat`."""
    moe_only: bool = False
    """Its series exist only for a Mixture-of-Experts model: empty on a dense run."""


def _step_quantile(q: float, by: str) -> str:
    return (f"histogram_quantile({q}, sum by (le, {by}) "
            f"(rate(ray_orchestrator_step_time_seconds_bucket{{{SELECT}}}[$__rate_interval])))")


PANELS: tuple[Panel, ...] = (
    Panel("Loss", "short", (
        Target(f"avg by (job_name) (ray_orchestrator_loss{{{SELECT}}})", "train"),
        Target(f"avg by (job_name) (ray_orchestrator_val_loss{{{SELECT}}})", "validation"),
    ), "Training loss of the last step and validation loss of the last evaluation (every rank reports the "
       "same reduced value)."),
    Panel("Tokens per second", "short", (
        Target(f"max by (job_name) (ray_orchestrator_tokens_per_second{{{SELECT}}})", "tokens/s"),
    ), "Training throughput of the whole job."),
    Panel("Step time per rank", "s", (
        Target(_step_quantile(0.5, "rank"), "p50 rank {{rank}}"),
        Target(_step_quantile(0.9, "rank"), "p90 rank {{rank}}"),
    ), "Quantiles of each rank's optimizer-step wall time. Ranks of one synchronous step take about the "
       "same time; see exposed communication for who waits."),
    Panel("Step time per node (p90)", "s", (
        Target(_step_quantile(0.9, "node"), "p90 {{node}}"),
    ), "The 90th percentile of step time over each node's ranks: a slow node stands out."),
    Panel("Exposed communication per rank", "s", (
        Target(f"max by (rank) (ray_orchestrator_exposed_comm_seconds{{{SELECT}}})", "rank {{rank}}"),
    ), "Communication per step not hidden behind compute. The ranks that wait for a straggler show the most."),
    Panel("MFU per rank", "percentunit", (
        Target(f"max by (rank) (ray_orchestrator_mfu{{{SELECT}}})", "rank {{rank}}"),
    ), "Model FLOPs utilisation against the peak the planner assumed for the device."),
    Panel("Memory per rank against the plan", "bytes", (
        Target(f"max by (rank) (ray_orchestrator_memory_bytes{{{SELECT}}}) - "
               f"max by (rank) (ray_orchestrator_memory_baseline_bytes{{{SELECT}}})", "measured rank {{rank}}"),
        Target(f"max by (rank) (ray_orchestrator_memory_planned_bytes{{{SELECT}}})", "planned rank {{rank}}"),
    ), "Each rank's memory above what it held before its model was built (CUDA's peak allocation on a GPU, "
       "the resident set on CPU), beside the plan's prediction per rank."),
    Panel("Gradient norm and learning rate", "short", (
        Target(f"max by (job_name) (ray_orchestrator_grad_norm{{{SELECT}}})", "grad norm"),
        Target(f"max by (job_name) (ray_orchestrator_learning_rate{{{SELECT}}})", "learning rate"),
    ), "The global gradient norm before clipping, and the learning rate of the last step."),
    Panel("Expert load imbalance per MoE layer", "short", (
        Target(f"max by (layer) (ray_orchestrator_expert_imbalance{{{SELECT}}})", "layer {{layer}}"),
    ), "Per MoE layer, the busiest expert's tokens over the layer's mean in the last step (1 is even; top-k "
       "routing over E experts reaches E/k when every token picks the same experts). The run's report.html "
       "draws tokens per expert as a layer x expert heat map.", moe_only=True),
    Panel("Restarts", "short", (
        Target('max by (job_name) (ray_orchestrator_restarts{job_name=~"$job_name"})', "restarts"),
    ), "Restarts of the job after a failure (the driver's count; the run directory's summary.json says why).",
        kind="stat"),
)


def _grid(panels: tuple[Panel, ...]) -> list[dict]:
    """Each panel's place: time series two to a row, a stat across a row of its own."""
    out, x, y = [], 0, 0
    for p in panels:
        w, h = (24, 4) if p.kind == "stat" else (12, 8)
        if x + w > 24:
            x, y = 0, y + 8
        out.append({"h": h, "w": w, "x": x, "y": y})
        x += w
    return out


def _panel_json(p: Panel, pid: int, grid: dict) -> dict:
    return {
        "id": pid,
        "type": p.kind,
        "title": p.title,
        "description": p.description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": grid,
        "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
        "options": {"legend": {"displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull"]}},
        "targets": [{"refId": chr(ord("A") + i), "expr": t.expr, "legendFormat": t.legend,
                     "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                    for i, t in enumerate(p.targets)],
    }


def _variable(name: str, label: str, query: str) -> dict:
    return {
        "name": name, "label": label, "type": "query", "query": {"query": query, "refId": name},
        "definition": query, "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "includeAll": True, "multi": True, "allValue": ".*", "refresh": 2, "sort": 1,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
    }


def dashboard() -> dict:
    """Grafana's JSON model of the orchestrator's dashboard."""
    return {
        "uid": UID,
        "title": "Orchestrator: training runs",
        "description": "Loss, throughput, step time, exposed communication, MFU, memory against the plan and "
                       "restarts of the orchestrator's jobs (metrics `ray_orchestrator_*`).",
        "tags": ["ray", "orchestrator"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0},
            _variable("job_name", "Job", "label_values(ray_orchestrator_step, job_name)"),
            _variable("node", "Node", 'label_values(ray_orchestrator_step{job_name=~"$job_name"}, node)'),
        ]},
        "panels": [_panel_json(p, i + 1, g) for i, (p, g) in enumerate(zip(PANELS, _grid(PANELS)))],
    }


def dashboard_json() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def provisioned_dir(session_dir: str | os.PathLike) -> Path:
    """The folder Ray's Grafana provisioning reads dashboards from for the session `session_dir`."""
    override = os.environ.get(DASHBOARDS_DIR_ENV)
    return Path(override) if override else Path(session_dir) / "metrics" / "grafana" / "dashboards"


def install(session_dir: str | os.PathLike) -> Path | None:
    """Write the dashboard where Ray provisions its own, so a Grafana started with Ray's
    configuration lists it in Ray's folder. None when that folder is not on this machine (a
    driver that is not on the head) or Ray's dashboard has not made it."""
    folder = provisioned_dir(session_dir)
    if not folder.is_dir():
        return None
    path = folder / FILE_NAME
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(dashboard_json())
    tmp.replace(path)
    return path


if __name__ == "__main__":  # python -m orchestrator.record.grafana > deploy/grafana/orchestrator-dashboard.json
    print(dashboard_json(), end="")
