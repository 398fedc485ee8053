"""`submit` probes the object store `checkpoint.path` names before anything starts, against a
real S3 server (moto's, on 127.0.0.1): a missing bucket, refused credentials, an unreachable
endpoint and no credentials at all are each one line naming which and the key, exit 2, with no
cluster started, no run directory made and no credential in what is said. A store URI as
`monitor.runs_dir` is refused the same way."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import ray
from s3_server import ACCESS_KEY, SECRET_KEY, s3_server

from orchestrator.cli import main
from orchestrator.control.store_probe import PROBE_PREFIX, _why, check_writable, is_object_store
from orchestrator.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent

s3 = pytest.fixture(scope="module")(s3_server)


def test_a_refusal_that_would_quote_a_credential_masks_it(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-v4lue")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLEID")
    said = _why(PermissionError("AKIAEXAMPLEID: the signature made with s3cr3t-v4lue does not match"), "s3://bkt/run")
    assert said == ("the store refused the credentials writing s3://bkt/run (***: the signature made with *** does not "
                    "match); check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, and that they may "
                    "write and delete there")
    # each store's own credential settings are named, never another's
    assert "GOOGLE_APPLICATION_CREDENTIALS" in _why(PermissionError("denied"), "gs://bkt/run")
    assert is_object_store("s3://bkt/run") and is_object_store("gs://bkt/run")
    assert not is_object_store("/data/ckpt") and not is_object_store("file:///data/ckpt") and not is_object_store(None)


def _submit(tmp_path: Path, capsys, checkpoint_path: str, *overrides: str) -> tuple[int, str]:
    code = main(["submit", str(ROOT / "jobs" / "llm.yaml"), f"monitor.runs_dir={tmp_path / 'runs'}",
                 f"checkpoint.path={checkpoint_path}", "monitor.progress=false", "monitor.dashboard=false", *overrides])
    said = capsys.readouterr()
    return code, said.out + said.err


# A server start and a few HTTP round trips, one of them a refused connection: a second or more.
@pytest.mark.slow
def test_a_bad_bucket_credentials_or_endpoint_is_one_line_before_anything_starts(s3, tmp_path, capsys, monkeypatch):
    import boto3

    # the store as configured is writable, and the probe leaves nothing behind
    check_writable("checkpoint.path", s3.url("run"))
    listed = boto3.client("s3").list_objects_v2(Bucket=s3.bucket)
    assert not [o["Key"] for o in listed.get("Contents", []) if PROBE_PREFIX in o["Key"]]

    # --resume from a prefix that holds no checkpoint: one line naming where it looked
    code, said = _submit(tmp_path, capsys, s3.url("run"), "--resume", s3.url("empty"))
    assert code == 2 and said.strip() == (f"error: --resume {s3.url('empty')}: no whole checkpoint under "
                                          f"{s3.url('empty')}/checkpoints or {s3.url('empty')}"), said

    code, said = _submit(tmp_path, capsys, "s3://no-such-bucket/run")
    assert code == 2, said
    assert said.strip() == ("error: key 'checkpoint.path': the bucket 'no-such-bucket' does not exist "
                            "(s3://no-such-bucket/run); create it or name an existing one")

    s3.set_auth(True)  # the server now checks credentials: the test's keys are not among its users
    try:
        code, said = _submit(tmp_path, capsys, s3.url("run"))
    finally:
        s3.set_auth(False)
    assert code == 2, said
    assert said.startswith(f"error: key 'checkpoint.path': the store refused the credentials writing {s3.url('run')} "
                           "(The AWS Access Key Id you provided does not exist in our records.)"), said
    assert len(said.strip().splitlines()) == 1

    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    code, said = _submit(tmp_path, capsys, s3.url("run"))
    assert code == 2, said
    assert said.startswith(f"error: key 'checkpoint.path': the endpoint http://127.0.0.1:{port} of {s3.url('run')} "
                           "cannot be reached"), said
    assert len(said.strip().splitlines()) == 1

    # no credentials anywhere boto looks (environment, profiles, instance metadata)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    for name in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
        monkeypatch.setenv(name, str(tmp_path / "absent"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(ConfigError, match=r"^key 'checkpoint.path': no credentials to write s3://orchestrator-test/run "
                                          r"\(Unable to locate credentials\); set AWS_ACCESS_KEY_ID"):
        check_writable("checkpoint.path", s3.url("run"))

    # the run directory is the driver's own: a store URI there is refused, not made a local "s3:" folder
    code, said = _submit(tmp_path, capsys, s3.url("run"), f"monitor.runs_dir={s3.url('runs')}")
    assert code == 2 and said.startswith(f"error: key 'monitor.runs_dir': {s3.url('runs')} is not a directory"), said
    assert not Path("s3:").exists()

    # refused before anything started: no cluster, no run directory
    assert not ray.is_initialized()
    assert not (tmp_path / "runs").exists()
    assert ACCESS_KEY not in said and SECRET_KEY not in said
