"""A real S3 server for tests: moto's standalone server on 127.0.0.1 (a free port), with one
bucket, reached through s3fs as a user's job reaches an object store. The endpoint and
credentials are set where boto reads them (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, ...), in
this process's environment: Ray nodes started after it (`ray.cluster_utils.Cluster`, an
embedded `ray.init`) and their workers inherit it, as the nodes of a cloud cluster each read
their own.

A module takes it as a fixture of its own: `s3 = pytest.fixture(scope="module")(s3_server)`."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass

BUCKET = "orchestrator-test"
ACCESS_KEY = "AKIAORCHESTRATORTEST"
SECRET_KEY = "orchestrator-test-secret-key-never-logged"


@dataclass(frozen=True)
class S3Store:
    """A running moto server and the bucket made on it."""

    endpoint: str
    """`http://127.0.0.1:PORT`, as AWS_ENDPOINT_URL holds it."""
    bucket: str
    """The bucket the tests write under (`s3://<bucket>/...`)."""
    env: dict[str, str]
    """What was set in the environment: the endpoint, the credentials and the region."""

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix.strip('/')}"

    def set_auth(self, checked: bool) -> None:
        """Make the server check every request's credentials against its IAM users (moto
        accepts any by default), or stop checking. The server runs in this process: moto's
        own switch is flipped here (what its `/moto-api/reset-auth` endpoint sets)."""
        from moto import settings
        from moto.core.authorization import ActionAuthenticatorMixin

        settings.INITIAL_NO_AUTH_ACTION_COUNT = 0 if checked else float("inf")
        ActionAuthenticatorMixin.request_count = 0


ENV_KEYS = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def s3_server() -> Iterator[S3Store]:
    """Start the server, set the environment, make the bucket; undo all three afterwards."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
           "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in ENV_KEYS}
    os.environ.update(env)
    _forget_clients()  # an s3fs instance cached before reads the old environment
    try:
        boto3.client("s3").create_bucket(Bucket=BUCKET)
        yield S3Store(endpoint, BUCKET, env)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _forget_clients()
        server.stop()


def _forget_clients() -> None:
    """Drop fsspec's cached s3fs instances: the next test module's server is on another port."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
