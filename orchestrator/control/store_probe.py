"""Whether an object store the job names can be written, checked at `submit` before any worker
starts: a probe object is written under the URI and deleted again. A missing bucket, refused or
absent credentials, or an endpoint that cannot be reached is one line naming which and the key,
instead of a run that trains to its end and commits nothing.

The endpoint and credentials are whatever the store's own client reads (for S3, boto's
`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_PROFILE` and
`~/.aws/`): nothing here passes, stores or prints them, and a message that would quote one has
it masked first.
"""

from __future__ import annotations

import os
import uuid
from urllib.parse import urlsplit

import fsspec

from ..config import JobConfig
from ..errors import ConfigError

PROBE_PREFIX = ".orchestrator-probe-"

# The client's own connection settings, for the probe alone: an endpoint that drops packets
# is then refused in seconds, not after boto's and s3fs's retries (minutes).
_PROBE_OPTIONS = {"s3": {"config_kwargs": {"connect_timeout": 5, "retries": {"max_attempts": 1}}}}

# Where each store's client finds its credentials, named in a refusal (never their values).
_CREDENTIALS = {"s3": "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE",
                "gs": "GOOGLE_APPLICATION_CREDENTIALS, or the node's service account"}
_SECRET_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


def is_object_store(path: str | None) -> bool:
    """Whether `path` is an fsspec URI of a store other than the local disk (`s3://`, `gs://`)."""
    return bool(path) and "://" in str(path) and not str(path).startswith("file://")


def check_writable(key: str, url: str) -> None:
    """Write and delete a probe object under `url` (the value of config key `key`); ConfigError
    in one line naming what was wrong where either fails."""
    protocol = url.split("://", 1)[0]
    try:
        fs, base = fsspec.core.url_to_fs(url, skip_instance_cache=True, **_PROBE_OPTIONS.get(protocol, {}))
    except (ImportError, ValueError) as e:
        raise ConfigError(f"key '{key}': {url} cannot be opened: {_masked(e)} "
                          "(install the store's fsspec client: the `s3` extra for s3://, gcsfs for gs://)") from None
    if protocol == "s3":
        fs.retries = 1  # s3fs's own retry loop around boto's: a class attribute, no option of its init
    probe = f"{base.rstrip('/')}/{PROBE_PREFIX}{uuid.uuid4().hex}"
    try:
        fs.pipe_file(probe, b"")
        fs.rm_file(probe)
    except Exception as e:  # noqa: BLE001 - every client's failure is told apart below, in one line
        raise ConfigError(f"key '{key}': {_why(e, url)}") from None


def _why(e: Exception, url: str) -> str:
    """What a failed probe write says to the user: which of bucket, credentials or endpoint."""
    bucket = urlsplit(url).netloc
    credentials = _CREDENTIALS.get(url.split("://", 1)[0], "the store client's credentials")
    unreachable, no_credentials = _client_errors()
    if isinstance(e, unreachable) or _caused_by(e, unreachable):
        return (f"the endpoint {_endpoint(e)} of {url} cannot be reached ({_masked(e)}); "
                "check AWS_ENDPOINT_URL or the profile's endpoint_url")
    if isinstance(e, no_credentials):
        return f"no credentials to write {url} ({_masked(e)}); set {credentials}"
    if isinstance(e, PermissionError):
        return (f"the store refused the credentials writing {url} ({_masked(e)}); "
                f"check {credentials}, and that they may write and delete there")
    if isinstance(e, FileNotFoundError):
        return f"the bucket '{bucket}' does not exist ({url}); create it or name an existing one"
    return f"a probe object cannot be written and deleted under {url}: {type(e).__name__}: {_masked(e)}"


def _client_errors() -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
    """The S3 client's own classes for an unreachable endpoint and for absent credentials (no
    botocore installed: none)."""
    try:
        from botocore import exceptions as boto
    except ImportError:
        return (), ()
    return (boto.ConnectionError,), (boto.NoCredentialsError, boto.PartialCredentialsError, boto.ProfileNotFound)


def _caused_by(e: BaseException, kinds: tuple[type[BaseException], ...]) -> bool:
    cause = e.__cause__ or e.__context__
    return bool(kinds) and cause is not None and isinstance(cause, kinds)


def _endpoint(e: BaseException) -> str:
    """scheme://host:port of the endpoint the client tried, as its error names it."""
    for err in (e, e.__cause__ or e.__context__):
        tried = getattr(err, "kwargs", {}).get("endpoint_url") if err is not None else None
        if tried:
            parts = urlsplit(tried)
            return f"{parts.scheme}://{parts.netloc}"
    return os.environ.get("AWS_ENDPOINT_URL", "(the client's default)")


def _masked(e: BaseException) -> str:
    """The error's first line, with any credential from the environment masked."""
    text = (str(e).splitlines() or [type(e).__name__])[0]
    for name in _SECRET_ENV:
        secret = os.environ.get(name)
        if secret:
            text = text.replace(secret, "***")
    return text


def check_job_stores(cfg: JobConfig) -> None:
    """Probe the object store the job's checkpoints go to (`checkpoint.path` on one);
    ConfigError in one line where it cannot be written. The run directory is the driver's
    own (its files are appended to and replaced in place), so a store URI there is refused."""
    if is_object_store(cfg.monitor.runs_dir):
        raise ConfigError(f"key 'monitor.runs_dir': {cfg.monitor.runs_dir} is not a directory on the driver's disk, "
                          "where the run directory is written; put the checkpoints on the store with checkpoint.path")
    if cfg.checkpoint.enabled and is_object_store(cfg.checkpoint.path):
        check_writable("checkpoint.path", str(cfg.checkpoint.path))
