"""Connecting to Ray: a private embedded cluster by default, or an existing one by address."""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager, nullcontext
from typing import Iterator

from ..errors import UserError

PRIVATE_CLUSTER_CONFIG = {
    # Ray starts workers at niceness 15 so its own processes win the CPU; in a private
    # cluster the workers are the training itself, and on a host whose cores they keep busy
    # every wake-up of the raylet, the GCS or an agent then stalls a step and, through the
    # next collective, every rank (benchmarks/README.md, "Start-up settings", says how much).
    "worker_niceness": 0,
    # The raylet connects to the object store it has just started, and a worker to its raylet,
    # retrying after this long: Ray's 1 s makes every other start of the cluster a second
    # slower. The same 10 s of patience in all.
    "raylet_client_connect_timeout_milliseconds": 100,
    "raylet_client_num_connect_attempts": 100,
}
"""The `_system_config` of the private local cluster `connect` starts (`address=None`)."""


@contextmanager
def connect(
    address: str | None,
    *,
    num_cpus: float | None = None,
    dashboard: bool = False,
    runtime_env: dict | None = None,
    name: str = "cluster.address",
    metadata: dict[str, str] | None = None,
) -> Iterator[str | None]:
    """Yield with Ray initialised; shut down only what this call started.

    `address=None` always starts a new private local cluster (`address="local"`), so neither
    RAY_ADDRESS nor a stale `/tmp/ray/ray_current_cluster` can attach the job to someone
    else's cluster by accident. Yields the dashboard URL when there is one. An address where
    no Ray cluster answers raises ClusterUnreachable naming `name` (the key or flag it came from).
    `metadata` is the driver's job metadata: the dashboard's Jobs page shows its `job_name` as
    the job's name and the rest on the job's page.
    """
    import ray

    if ray.is_initialized():
        yield None
        return
    kwargs: dict = dict(
        include_dashboard=dashboard,
        log_to_driver=True,
        logging_level=logging.WARNING,
        runtime_env=runtime_env,
        # Ray prints its own banner and usage-stats notice; our CLI says what matters.
        configure_logging=True,
    )
    if metadata:
        from ray.job_config import JobConfig

        kwargs["job_config"] = JobConfig(metadata=dict(metadata))
    if address is None:
        cpus = max(os.cpu_count() or 1, int(num_cpus or 0))
        kwargs.update(address="local", num_cpus=cpus, _system_config=PRIVATE_CLUSTER_CONFIG)
        # Our private cluster keeps Ray's token authentication on; its notice that it is on
        # speaks to people who started a cluster themselves.
        logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    else:
        from .reach import check_gcs

        # A cluster that is not there answers in seconds here, not after Ray's minutes of retries.
        # (A ray:// client address is Ray Client's to check.)
        kwargs.update(address=address if "://" in address else check_gcs(address, name))
    try:
        with registration_polled() if address is None else nullcontext():
            ctx = ray.init(**kwargs)
    except ConnectionError as e:
        raise UserError(f"{name}={address}: cannot connect to a Ray cluster there ({e})") from e
    try:
        yield getattr(ctx, "dashboard_url", None) or None
    finally:
        ray.shutdown()


REGISTRATION_POLL_S = 0.02
REGISTRATION_WAIT_S = 5.0
"""How often, and how long at most, a private cluster's start asks whether its raylet has
registered (`registration_polled`); Ray's own wait for it follows either way. Short: a raylet
that never registers is Ray's to report, and this wait comes before each of Ray's tries; past
a few seconds Ray's one-second retry costs little beside it."""


@contextmanager
def registration_polled() -> Iterator[None]:
    """While a head node starts in this process: wait for its raylet's registration with the
    GCS by polling, before Ray asks for it.

    Ray asks once, 0.1 s after it started the raylet, and where the node is not yet listed
    its `GlobalStateAccessor::GetNode` sleeps a fixed second before asking again. The raylet
    registers only once its agents are up, tenths of a second after its start, so without the
    poll a private cluster starts later than it could. Ray's own call then finds the node at its
    first try. Where this Ray has not the hook (`services.get_node`) or the
    poll fails, Ray waits as it always did.
    """
    import ray._private.services as services

    ray_get_node = getattr(services, "get_node", None)
    if ray_get_node is None:
        yield
        return

    def get_node(gcs_address, node_id, *args, **kwargs):
        wait_registered(gcs_address, node_id)
        return ray_get_node(gcs_address, node_id, *args, **kwargs)

    services.get_node = get_node
    try:
        yield
    finally:
        services.get_node = ray_get_node


def wait_registered(gcs_address: str, node_id: str, timeout_s: float = REGISTRATION_WAIT_S) -> bool:
    """True once the GCS at `gcs_address` lists the node `node_id` (hex); False after
    `timeout_s`, or at once where the GCS cannot be asked this way."""
    try:
        from ray._raylet import GcsClient

        client = GcsClient(address=gcs_address)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(n.hex() == node_id for n in client.get_all_node_info(timeout=5)):
                return True
            time.sleep(REGISTRATION_POLL_S)
    except Exception:  # another Ray's client: its own wait applies
        return False
    return False
