"""The run in the experiment trackers `monitor.trackers` names: TensorBoard, MLflow, W&B.

One process logs, the driver, from the rows rank 0 sends it (the ones metrics.jsonl is
written from), so each step appears once. A world that restarts recomputes the steps after its
checkpoint, and the driver rewinds its own record to it; a tracker keeps what it had and is
handed only steps above the last it logged (a resume is exact, so the recomputed rows are the
same). Everything a tracker does, network calls included, runs on one background thread:
the driver's loop only hands rows over, and a tracker that cannot be reached or fails is
dropped with one note while the run goes on. Each tracker's run id and the last step logged
are kept in the run directory (`trackers.json`), so a driver started again on the same run
directory continues the same tracker runs.
"""

from __future__ import annotations

import json
import math
import os
import queue
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from ..config import JobConfig, to_dict
from .run_state import RunState
from .rundir import RunDir

STATE = "trackers.json"
"""The run directory's record of each tracker's run id and the last step logged."""
TENSORBOARD_DIR = "tensorboard"
"""The run directory's folder of TensorBoard event files."""
ARTIFACTS = ("plan.json", "summary.json", "report.html", "loss.svg")
"""The run's record files a tracker that stores files is given at the end."""
STEP_METRICS = ("loss", "lr", "tokens_per_s", "step_s", "grad_norm", "mfu", "exposed_comm_s", "memory_bytes")
"""The fields of a metrics row each step logs (with `val_loss`, `restarts` and, for a
Mixture-of-Experts model, its expert load: `expert_imbalance/max` and `expert_imbalance/layer_N`)."""
CLOSE_TIMEOUT_S = 180.0
"""How long the end of the run waits for the trackers to finish their uploads (and, in a run
shorter than that, their imports: MLflow and TensorBoard take tens of seconds on a busy host)."""
MLFLOW_SHORT_RETRIES = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
"""MLflow's retry settings where the user set none: its defaults retry an unreachable server
for minutes, which would keep the run's end waiting that long before its note."""
_SECRET_KEY = re.compile(r"secret|token|password|credential", re.IGNORECASE)
_URL_USER = re.compile(r"(?<=://)[^/@\s]+@")


def expert_metrics(row: dict[str, Any]) -> dict[str, float]:
    """A Mixture-of-Experts row's load as tracker metrics: each MoE layer's busiest expert over
    its mean, and the most of them (tokens per expert stay in metrics.jsonl and report.html)."""
    imbalance = row.get("expert_imbalance")
    if not isinstance(imbalance, list) or not imbalance:
        return {}
    values = _finite({f"expert_imbalance/layer_{i}": v for i, v in enumerate(imbalance)})
    if values:
        values["expert_imbalance/max"] = max(values.values())
    return values


class Tracker(Protocol):
    """One tracker's run. Every method runs on the background thread and may raise: the
    tracker is then dropped with one note."""

    name: str

    def start(self, run_id: str | None) -> str:
        """Open the tracker's run (`run_id`: the one to continue); returns its id."""
        ...

    def params(self, params: dict[str, str]) -> None: ...

    def metrics(self, step: int, values: dict[str, float]) -> None: ...

    def finish(self, artifacts: list[Path]) -> None:
        """Store the run's record files and close the run."""
        ...


def flatten(tree: Any, prefix: str = "") -> dict[str, str]:
    """A nested config as dotted keys and string values; no value whose key names a secret,
    and no user or password inside a URL."""
    out: dict[str, str] = {}
    if isinstance(tree, dict):
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    key = prefix.rstrip(".")
    if _SECRET_KEY.search(key):
        return out
    out[key] = _URL_USER.sub("", str(tree))
    return out


def plan_params(summary: dict[str, Any]) -> dict[str, str]:
    """The plan's strategy, mesh and predicted figures, as summary.json states them."""
    return flatten({"plan": {"strategy": summary.get("strategy"), "world_size": summary.get("world_size"),
                             "mesh": summary.get("mesh"), "predicted": summary.get("predicted")}})


def _finite(values: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class TensorBoardTracker:
    """Event files in the run directory's tensorboard/ (`tensorboard --logdir RUN_DIR`)."""

    name = "tensorboard"

    def __init__(self, run: RunDir) -> None:
        self._dir = run.path / TENSORBOARD_DIR
        self._writer: Any = None

    def start(self, run_id: str | None) -> str:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(self._dir))
        return str(self._dir)

    def params(self, params: dict[str, str]) -> None:
        table = "\n".join(f"| {k} | {v} |" for k, v in sorted(params.items()))
        self._writer.add_text("params", "| key | value |\n|---|---|\n" + table)

    def metrics(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self._writer.add_scalar(key, value, step)

    def finish(self, artifacts: list[Path]) -> None:
        self._writer.close()  # the event files are in the run directory already, beside the artifacts


class MLflowTracker:
    """A run on the MLflow server MLFLOW_TRACKING_URI names (MLflow's own convention), in the
    experiment MLFLOW_EXPERIMENT_NAME names, else the job's name."""

    name = "mlflow"

    def __init__(self, job_name: str, run_name: str) -> None:
        self._experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or job_name
        self._run_name = run_name
        self._client: Any = None
        self._run_id = ""

    def start(self, run_id: str | None) -> str:
        for key, value in MLFLOW_SHORT_RETRIES.items():
            os.environ.setdefault(key, value)
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient()
        if run_id:
            self._client.update_run(run_id, status="RUNNING")
            self._run_id = run_id
            return run_id
        experiment = self._client.get_experiment_by_name(self._experiment)
        experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(self._experiment)
        self._run_id = self._client.create_run(experiment_id, run_name=self._run_name).info.run_id
        return self._run_id

    def params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        logged = self._client.get_run(self._run_id).data.params
        fresh = [Param(k, v[:6000]) for k, v in params.items() if k not in logged]  # a param is set once
        for i in range(0, len(fresh), 100):  # MLflow takes at most 100 params a batch
            self._client.log_batch(self._run_id, params=fresh[i:i + 100])

    def metrics(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(self._run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def finish(self, artifacts: list[Path]) -> None:
        for path in artifacts:
            self._client.log_artifact(self._run_id, str(path))
        self._client.set_terminated(self._run_id)


class WandbTracker:
    """A Weights & Biases run in the project WANDB_PROJECT names, else the job's name; its local
    files go under the run directory (offline, with WANDB_MODE=offline, they are all there is)."""

    name = "wandb"

    def __init__(self, job_name: str, run: RunDir) -> None:
        self._project = os.environ.get("WANDB_PROJECT") or job_name
        self._run_dir = run.path
        self._run: Any = None

    def start(self, run_id: str | None) -> str:
        import wandb

        self._run = wandb.init(project=self._project, name=self._run_dir.name, dir=str(self._run_dir),
                               id=run_id, resume="allow" if run_id else None, reinit="create_new")
        return str(self._run.id)

    def params(self, params: dict[str, str]) -> None:
        self._run.config.update(params, allow_val_change=True)

    def metrics(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)

    def finish(self, artifacts: list[Path]) -> None:
        for path in artifacts:
            self._run.save(str(path), base_path=str(path.parent), policy="now")
        self._run.finish()


def make_tracker(name: str, cfg: JobConfig, run: RunDir) -> Tracker:
    if name == "tensorboard":
        return TensorBoardTracker(run)
    if name == "mlflow":
        return MLflowTracker(cfg.name, run.path.name)
    if name == "wandb":
        return WandbTracker(cfg.name, run)
    raise ValueError(f"no tracker {name!r}")  # config.py refuses it first


class Trackers:
    """The run's trackers, fed from the driver's record and run on one background thread."""

    def __init__(self, cfg: JobConfig, run: RunDir, note: Callable[[str], None],
                 make: Callable[[str, JobConfig, RunDir], Tracker] = make_tracker) -> None:
        """`note`: how a tracker that fails is reported (once per tracker)."""
        self._run = run
        self._note = note
        saved = self._saved()
        self._ids: dict[str, str] = dict(saved.get("runs", {}))
        self._logged = int(saved.get("last_step", -1))
        """The last step handed to the trackers (-1: none); the background thread persists it."""
        self._val_logged = int(saved.get("last_val_step", -1))
        self._live: list[Tracker] = [make(name, cfg, run) for name in cfg.monitor.trackers]
        self._work: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        if self._live:
            self._thread = threading.Thread(target=self._serve, name="trackers", daemon=True)
            self._thread.start()
            self._work.put(self._start)
            self._work.put(lambda: self._each(lambda t: t.params(flatten(to_dict(cfg)))))

    @property
    def enabled(self) -> bool:
        return self._thread is not None

    def log(self, state: RunState) -> None:
        """Hand over the steps of `state` above the last one handed over (cheap: the driver's
        loop calls it after every drain)."""
        if not self.enabled:
            return
        restarts = len(state.restarts)
        for step, val_loss in state.val:
            if step > self._val_logged and step <= max(self._logged, 0):
                self._val_logged = step
                self._queue_metrics(step, {"val_loss": val_loss}, self._logged, step)
        rows = [r for r in state.rows if r["step"] > self._logged]
        for row in rows:
            values = _finite({k: row.get(k) for k in STEP_METRICS})
            values["restarts"] = float(restarts)
            values.update(expert_metrics(row))
            if row.get("val_loss") is not None and row["step"] > self._val_logged:
                values["val_loss"] = float(row["val_loss"])
                self._val_logged = row["step"]
            self._logged = row["step"]
            self._queue_metrics(row["step"], values, self._logged, self._val_logged)

    def finish(self, summary: dict[str, Any]) -> None:
        """Log the plan's figures and the measured peak memory, store the run's record files and
        close every tracker's run; waits at most CLOSE_TIMEOUT_S for them."""
        if not self.enabled:
            return
        peaks = (summary.get("measured") or {}).get("peak_memory_bytes_per_rank") or []
        if peaks:
            self._queue_metrics(max(self._logged, 0), {"peak_memory_bytes": float(max(peaks))},
                                self._logged, self._val_logged)
        artifacts = [self._run.path / name for name in ARTIFACTS if (self._run.path / name).is_file()]
        self._work.put(lambda: self._each(lambda t: t.params(plan_params(summary))))
        self.close(artifacts)

    def close(self, artifacts: list[Path] | None = None) -> None:
        """Close every tracker's run (storing `artifacts`) and stop the background thread once
        it has done what it was handed; a second call, or one without trackers, does nothing."""
        if self._thread is None:
            return
        self._work.put(lambda: self._each(lambda t: t.finish(artifacts or [])))
        self._work.put(None)
        self._thread.join(CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            self._note(f"monitor.trackers: {', '.join(t.name for t in self._live)} did not finish within "
                       f"{CLOSE_TIMEOUT_S:.0f}s; the run's record is complete without them")
        self._thread = None

    # --- the background thread ----------------------------------------------------------------

    def _queue_metrics(self, step: int, values: dict[str, float], last: int, last_val: int) -> None:
        def work() -> None:
            self._each(lambda t: t.metrics(step, values))
            self._save(last, last_val)

        self._work.put(work)

    def _serve(self) -> None:
        while (work := self._work.get()) is not None:
            work()

    def _start(self) -> None:
        def start(tracker: Tracker) -> None:
            self._ids[tracker.name] = tracker.start(self._ids.get(tracker.name))

        self._each(start)
        self._save(self._logged, self._val_logged)

    def _each(self, call: Callable[[Tracker], None]) -> None:
        for tracker in list(self._live):
            try:
                call(tracker)
            except Exception as e:  # noqa: BLE001 - any tracker failure is one note; the run goes on
                self._live.remove(tracker)
                first = (str(e).splitlines() or [type(e).__name__])[0]
                self._note(f"monitor.trackers: {tracker.name} failed ({type(e).__name__}: {first[:300]}); "
                           f"the run goes on without it")

    def _saved(self) -> dict[str, Any]:
        """What trackers.json holds; nothing (fresh tracker runs, with a note) when it is unreadable."""
        path = self._run.path / STATE
        if not path.is_file():
            return {}
        try:
            saved = json.loads(path.read_text())
            if isinstance(saved, dict):
                return saved
        except (OSError, ValueError):
            pass
        self._note(f"monitor.trackers: {path} is unreadable; the trackers start new runs")
        return {}

    def _save(self, last: int, last_val: int) -> None:
        state = {"runs": self._ids, "last_step": last, "last_val_step": last_val}
        (self._run.path / STATE).write_text(json.dumps(state, indent=2) + "\n")
