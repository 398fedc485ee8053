"""Jobs on a remote Ray cluster, through the Ray Jobs API of its dashboard (port 8265).

`submit --address` ships the working directory to the cluster in the job's `runtime_env` and
runs the same `python -m orchestrator submit` there with `cluster.address=auto`, so a remote
run is exactly a local run on the head node. `status`, `logs` and `stop` talk to the same API.

Token authentication: Ray's SDK adds the `Authorization` header only when this process runs
in token mode (`RAY_AUTH_MODE=token`), which a laptop talking to a cluster usually does not.
So the token is loaded here the way Ray loads it (`RAY_AUTH_TOKEN`, then the file named by
`RAY_AUTH_TOKEN_PATH`, then `~/.ray/auth_token`) regardless of the local mode, and passed
as an explicit header. A cluster without authentication ignores the header.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from ..errors import UserError

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
# Never shipped: run outputs, the virtual environment, git history, byte code.
EXCLUDES = ["runs/", ".venv/", ".git/", "__pycache__/", "*.pyc", ".pytest_cache/", ".hypothesis/"]
PROJECT_MARKERS = ("pyproject.toml", "orchestrator/__main__.py")
REMOTE_RUN_ENV = "ORCHESTRATOR_REMOTE_RUN"
"""Set in the environment of a driver that `submit --address` started through the Jobs API."""
RUN_NAME_ENV = "ORCHESTRATOR_RUN_NAME"
"""The name of the run directory a Jobs API driver creates: the job's submission id, so the job's
record (the dashboard's Jobs page, `status`) names its run directory before the run starts."""
RUN_DIR_LINE = "run directory: "
"""How the driver announces its run directory; `status` finds it in the job's log by this."""


class RemoteError(UserError):
    """The Ray cluster at an address cannot be reached, refuses us, or has no such job."""


@dataclass
class RemoteJob:
    """One Ray job as the cluster's Jobs API reports it."""

    job_id: str
    """The submission id (`submit` names it `<job name>-<time>-<suffix>`)."""
    status: str
    """PENDING, RUNNING, SUCCEEDED, FAILED or STOPPED."""
    entrypoint: str
    """The shell command the cluster runs."""
    start_time: float | None
    """Unix time (seconds) the job started; None before it does."""
    end_time: float | None
    """Unix time (seconds) the job ended; None while it runs."""
    message: str
    """Ray's last word on the job (why it failed, that it was stopped, ...)."""
    name: str
    """The orchestrator job name from the job file (`name:`), '' for jobs submitted otherwise."""


def default_address() -> str:
    """$RAY_ADDRESS when it names a dashboard (http/https), else the local dashboard."""
    env = os.environ.get("RAY_ADDRESS", "")
    return env if env.startswith(("http://", "https://")) else DEFAULT_ADDRESS


def _normalise(address: str) -> str:
    address = address.strip().rstrip("/")
    if not address:
        raise RemoteError("--address: empty; expected the dashboard URL, e.g. http://HEAD:8265")
    if "://" not in address:
        address = f"http://{address}"
    if not address.startswith(("http://", "https://")):
        raise RemoteError(
            f"--address {address}: expected the dashboard's http(s)://HOST:8265, not a Ray GCS or ray:// address")
    return address


def auth_headers() -> dict[str, str]:
    """`{"authorization": "Bearer <token>"}` when a Ray token is configured here, else {}."""
    try:
        from ray._raylet import AuthenticationTokenLoader
    except ImportError:  # a Ray build without the token loader cannot authenticate at all
        return {}
    loader = AuthenticationTokenLoader.instance()
    # The loader is process-wide and caches the first token it reads: read afresh, and leave
    # no cached token behind for a later ray.init in this process (its own cluster's token).
    loader.reset_cache()
    try:
        return dict(loader.get_token_for_http_header(ignore_auth_mode=True))
    except Exception as e:  # RAY_AUTH_TOKEN_PATH names an unreadable or empty file
        raise RemoteError(f"Ray authentication token: {str(e).splitlines()[0]}") from e
    finally:
        loader.reset_cache()


def _auth_advice(address: str, refused: str) -> RemoteError:
    have = "the token sent was rejected" if auth_headers() else "no token is set here"
    return RemoteError(
        f"Ray cluster at {address} {refused} ({have}); set RAY_AUTH_TOKEN, or RAY_AUTH_TOKEN_PATH, "
        f"or ~/.ray/auth_token to the cluster's token (`ray get-auth-token` on the head node prints it)"
    )


def _first_line(e: BaseException) -> str:
    lines = [l.strip() for l in str(e).splitlines() if l.strip()]
    return lines[0] if lines else type(e).__name__


def _translate(e: Exception, address: str, job_id: str | None = None) -> RemoteError:
    """One line a user can act on, from whatever the SDK raised."""
    from ray.exceptions import AuthenticationError

    text = str(e)
    if "Authentication failed" in text or "status code 403" in text:
        return _auth_advice(address, "refused the token")
    if isinstance(e, AuthenticationError) or "Authentication required" in text or "status code 401" in text:
        return _auth_advice(address, "requires authentication")
    if job_id is not None and ("does not exist" in text or "status code 404" in text):
        return RemoteError(
            f"no job '{job_id}' on the Ray cluster at {address}; `status --address {address}` lists them")
    if isinstance(e, ConnectionError) or "Failed to connect" in text or "Connection refused" in text:
        return RemoteError(
            f"cannot reach a Ray dashboard at {address}: is the cluster up and its dashboard port reachable?")
    return RemoteError(f"Ray cluster at {address}: {_first_line(e)}")


def client(address: str) -> Any:
    """A JobSubmissionClient for `address`, authenticated when a token is configured."""
    from ray.job_submission import JobSubmissionClient

    from .reach import ClusterUnreachable, check_dashboard

    address = _normalise(address)
    headers = auth_headers()
    # The SDK would wait on a port that never answers; ask once, briefly, first.
    try:
        refused = check_dashboard(address, headers)
    except ClusterUnreachable as e:
        raise RemoteError(str(e)) from None
    if refused:
        raise _auth_advice(address, "refused the token" if headers else "requires authentication")
    try:
        return JobSubmissionClient(address, headers=headers)
    except RemoteError:
        raise
    except Exception as e:  # the constructor already asks the cluster for its version
        raise _translate(e, address) from e


def project_root() -> Path | None:
    """This checkout's root (the parent of the package) when it is a source tree, else None."""
    root = Path(__file__).resolve().parents[2]
    return root if all((root / m).is_file() for m in PROJECT_MARKERS) else None


def shipped_dir(cwd: Path | None = None) -> Path:
    """What goes to the cluster: the project root when working inside it, else the current directory."""
    cwd = (cwd or Path.cwd()).resolve()
    root = project_root()
    if root is not None and (cwd == root or root in cwd.parents):
        return root
    return cwd


def entrypoint(job_rel: str, overrides: list[str], verbose: bool = False) -> str:
    """The command the cluster runs: the local `submit`, joined to the cluster it runs on."""
    kept = [o for o in overrides if not o.startswith("cluster.address=")]
    args = ["python", "-m", "orchestrator", "submit", job_rel, *kept, "cluster.address=auto"]
    if verbose:
        args.append("--verbose")
    return shlex.join(args)


def submit_remote(address: str, job_file: str, overrides: list[str], verbose: bool = False) -> tuple[str, Any]:
    """Submit `job_file` with `overrides` as a Ray job on the cluster at `address`; return its
    id and the config as loaded here.

    The config is loaded here first, so a bad key fails on this machine in a second rather
    than on the cluster after the upload. On the head, relative `monitor.runs_dir` and
    `checkpoint.path` are taken from the home directory (`rundir.anchored`).
    """
    from ..config import load_config

    cfg = load_config(job_file, overrides)
    workdir = shipped_dir()
    job_path = Path(job_file).resolve()
    if workdir not in job_path.parents:
        raise RemoteError(
            f"job file {job_file} is outside {workdir}, the directory shipped to the cluster; "
            f"put it inside, or run submit from a directory that contains it"
        )
    job_rel = job_path.relative_to(workdir).as_posix()
    from ..workloads.source import model_modules

    # The model's module, when it lives outside the shipped directory (e.g. on PYTHONPATH).
    modules = [p for p in model_modules(cfg.model) if Path(p) != workdir and workdir not in Path(p).parents]
    submission_id = f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    c = client(address)
    try:
        job_id = c.submit_job(
            entrypoint=entrypoint(job_rel, list(overrides), verbose),
            submission_id=submission_id,
            runtime_env={"working_dir": str(workdir), "excludes": EXCLUDES,
                         "env_vars": {REMOTE_RUN_ENV: "1", RUN_NAME_ENV: submission_id},
                         **({"py_modules": modules} if modules else {})},
            # `job_name` is the key the dashboard's Jobs page shows as the job's name.
            metadata={"job_name": cfg.name, "run_dir": head_run_dir(cfg.monitor.runs_dir, submission_id)},
        )
    except Exception as e:
        raise _translate(e, _normalise(address)) from e
    return job_id, cfg


def head_run_dir(runs_dir: str, run_name: str) -> str:
    """Where a Jobs API driver will create its run directory, as a person on the head finds it
    (a relative `monitor.runs_dir` is taken from the home directory there; see rundir.anchored)."""
    if "://" in runs_dir or runs_dir.startswith(("/", "~")):
        return f"{runs_dir.rstrip('/')}/{run_name}"
    return f"~/{runs_dir.rstrip('/')}/{run_name}"


def run_directory(address: str, job_id: str) -> str | None:
    """Where the job's driver put its run directory (on the node it runs on), from its log;
    None before the driver has said."""

    text = "".join(job_logs(address, job_id))
    found = [line.split(RUN_DIR_LINE, 1)[1].split("  (")[0].strip()
             for line in text.splitlines() if line.startswith(RUN_DIR_LINE)]
    return found[0] if found else None


def _as_job(info: Any) -> RemoteJob:
    def secs(ms: Any) -> float | None:
        return ms / 1000.0 if ms else None

    return RemoteJob(
        job_id=info.submission_id or info.job_id or "",
        status=str(getattr(info.status, "value", info.status)),
        entrypoint=info.entrypoint or "",
        start_time=secs(info.start_time),
        end_time=secs(info.end_time),
        message=(info.message or "").strip(),
        # `orchestrator_job`: jobs submitted by earlier versions.
        name=(info.metadata or {}).get("job_name") or (info.metadata or {}).get("orchestrator_job", ""),
    )


def job_status(address: str, job_id: str | None = None) -> list[RemoteJob]:
    """The job `job_id`, or every submitted job of the cluster, newest first."""
    c = client(address)
    address = _normalise(address)
    try:
        if job_id is not None:
            return [_as_job(c.get_job_info(job_id))]
        jobs = [_as_job(j) for j in c.list_jobs() if j.submission_id]
    except Exception as e:
        raise _translate(e, address, job_id) from e
    return sorted(jobs, key=lambda j: j.start_time or 0.0, reverse=True)


def job_logs(address: str, job_id: str, follow: bool = False) -> Iterator[str]:
    """The job's driver output so far; with `follow`, chunks as they come until the job ends."""
    c = client(address)
    address = _normalise(address)
    if not follow:
        try:
            yield c.get_job_logs(job_id)
        except Exception as e:
            raise _translate(e, address, job_id) from e
        return
    try:
        c.get_job_status(job_id)  # a wrong id fails here with a clear message, not inside the websocket
    except Exception as e:
        raise _translate(e, address, job_id) from e
    loop = asyncio.new_event_loop()
    stream = c.tail_job_logs(job_id)
    try:
        while True:
            try:
                yield loop.run_until_complete(stream.__anext__())
            except StopAsyncIteration:
                return
            except Exception as e:
                raise _translate(e, address, job_id) from e
    finally:
        loop.run_until_complete(stream.aclose())
        loop.close()


def stop_job(address: str, job_id: str, wait_s: float = 30.0) -> str:
    """Ask the cluster to stop `job_id` and wait up to `wait_s` for it to end; return its final status.

    Ray sends the driver SIGTERM, then SIGKILL if it is still there after
    `RAY_JOB_STOP_WAIT_TIME_S`; the job's actors and placement group die with the driver.
    """
    c = client(address)
    address = _normalise(address)
    try:
        c.stop_job(job_id)
        deadline = time.monotonic() + wait_s
        while True:
            status = str(getattr(c.get_job_status(job_id), "value", ""))
            if status in TERMINAL or time.monotonic() > deadline:
                return status
            time.sleep(0.5)
    except Exception as e:
        raise _translate(e, address, job_id) from e
