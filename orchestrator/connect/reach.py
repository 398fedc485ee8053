"""Is there a Ray cluster where the user points? Answered in seconds, before Ray is asked.

`ray.init` retries an unreachable GCS for minutes, printing its C++ client's warnings with the
address rewritten; the Jobs SDK waits on a port that never answers. A typo'd port must instead
be one line naming what was tried and what to check, so both are probed first: a TCP connect
and an HTTP/2 (gRPC) handshake for a GCS address, one `GET /api/version` for a dashboard URL.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import UserError

TIMEOUT_S = 3.0
"""How long each probe waits for an answer (the whole check stays well under 15 s)."""
GCS_ADVICE = ("check the head's address and GCS port (`ray start --head` prints it; the default port is 6379), "
              "or leave cluster.address unset for a private local cluster")


class ClusterUnreachable(UserError):
    """No Ray cluster answers at the address the user gave (or `auto` found)."""


def _split(address: str, name: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ClusterUnreachable(
            f"{name}={address}: expected HOST:PORT of a Ray head's GCS (e.g. 10.0.0.5:6379) or `auto`")
    return host.strip("[]"), int(port)


def resolve_auto(name: str = "cluster.address") -> tuple[str, str]:
    """(HOST:PORT, where it was found) for `auto`, in Ray's own order: $RAY_ADDRESS, the address
    file of the last `ray start` on this machine, a GCS process running here."""
    env = os.environ.get("RAY_ADDRESS", "").strip()
    if env:
        if env.startswith(("http://", "https://", "ray://")):
            raise ClusterUnreachable(
                f"{name}=auto: RAY_ADDRESS={env} is a dashboard or client URL; joining a cluster needs its GCS "
                f"HOST:PORT (default port 6379): set RAY_ADDRESS to that, or use `submit --address {env}`"
            )
        return env, "RAY_ADDRESS"
    from ray._common.utils import get_ray_address_file
    from ray._private.services import find_gcs_addresses

    path = get_ray_address_file(None)
    if os.path.isfile(path):
        with open(path) as f:
            found = f.read().strip()
        if found:
            return found, path
    running = sorted(find_gcs_addresses())
    if len(running) == 1:
        return running[0], "the GCS process running on this machine"
    if running:
        raise ClusterUnreachable(
            f"{name}=auto: {len(running)} Ray clusters run on this machine ({', '.join(running)}) and nothing says "
            f"which: give one as {name}=HOST:PORT"
        )
    raise ClusterUnreachable(
        f"{name}=auto: no Ray cluster to join (RAY_ADDRESS is unset, {path} does not exist, no GCS runs here); "
        f"start one with `ray start --head`, give {name}=HOST:PORT, or leave it unset for a private local cluster"
    )


def check_gcs(address: str, name: str = "cluster.address") -> str:
    """The HOST:PORT of a Ray GCS that answers for `address` (`auto` or HOST:PORT); raises
    ClusterUnreachable, one line naming what was tried and what to check, when none does."""
    if address == "auto":
        found, where = resolve_auto(name)
        tried = f"{name}=auto: {found} (from {where})"
        advice = ("that cluster is gone or unreachable: start one with `ray start --head`, give "
                  f"{name}=HOST:PORT, or leave it unset for a private local cluster")
    else:
        found, tried, advice = address, f"{name}={address}", GCS_ADVICE
    host, port = _split(found, name)
    try:
        with socket.create_connection((host, port), timeout=TIMEOUT_S):
            pass
    except ConnectionRefusedError:
        raise ClusterUnreachable(f"{tried}: nothing listens there (connection refused); {advice}") from None
    except socket.gaierror:
        raise ClusterUnreachable(f"{tried}: host {host} is not known (DNS); {advice}") from None
    except (socket.timeout, TimeoutError):
        raise ClusterUnreachable(f"{tried}: no answer within {TIMEOUT_S:g} s (a firewall, or a wrong host); "
                                 f"{advice}") from None
    except OSError as e:
        raise ClusterUnreachable(f"{tried}: cannot connect ({e.strerror or e}); {advice}") from None
    if not _speaks_grpc(host, port):
        raise ClusterUnreachable(
            f"{tried}: the port accepts connections but does not answer as a Ray GCS (gRPC); is it another "
            f"service, or the dashboard port (8265, for `submit --address http://...`) instead of the GCS port? "
            f"{GCS_ADVICE}"
        )
    refused = _token_refused(host, port)
    if refused:
        raise ClusterUnreachable(f"{tried}: {refused}")
    return f"{host}:{port}"


TOKEN_ADVICE = ("with the cluster's token in RAY_AUTH_TOKEN, the file RAY_AUTH_TOKEN_PATH names, or ~/.ray/auth_token "
                "(`ray get-auth-token` on the head node prints it)")


def _token_refused(host: str, port: int) -> str | None:
    """Why the GCS turned this process away, when its token authentication did (a cluster that
    `ray start` started asks for a token by default, and a driver sends one only in token mode);
    None when it lets this process in. ray.init would instead retry for 20 s and then say only
    that it could not connect."""
    from ray._raylet import GcsClient
    from ray.exceptions import AuthenticationError

    try:
        with _quiet_stderr():  # Ray's C++ client logs the refusal itself; the user gets one line
            GcsClient(address=f"{host}:{port}")
    except AuthenticationError:
        if os.environ.get("RAY_AUTH_MODE", "").lower() == "token":
            return f"the cluster refused this process's token; set it {TOKEN_ADVICE}"
        return f"the cluster asks for a token (Ray's token authentication); export RAY_AUTH_MODE=token {TOKEN_ADVICE}"
    except Exception:  # noqa: BLE001 - anything else is ray.init's to report, as it does
        return None
    return None


@contextmanager
def _quiet_stderr() -> Iterator[None]:
    """File descriptor 2 goes to /dev/null meanwhile: what native code writes there too."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _speaks_grpc(host: str, port: int) -> bool:
    import grpc

    channel = grpc.insecure_channel(f"{host}:{port}")
    try:
        grpc.channel_ready_future(channel).result(timeout=TIMEOUT_S)
        return True
    except grpc.FutureTimeoutError:
        return False
    finally:
        # Closing waits out the channel's polling thread (0.2 s, on every connect): it can
        # finish while Ray starts its own connection.
        threading.Thread(target=channel.close, name="gcs-check-close", daemon=True).start()


def check_dashboard(url: str, headers: dict[str, str]) -> int | None:
    """Ask the dashboard at `url` for its version; returns the HTTP status of an authentication
    refusal (401/403) for the caller to explain, None when a Ray dashboard answered. Raises
    ClusterUnreachable when nothing answers, or something that is not a Ray dashboard does."""
    import requests

    advice = ("is the cluster up and its dashboard port reachable? (`ray dashboard CLUSTER.yaml` forwards it "
              "to http://127.0.0.1:8265)")
    try:
        r = requests.get(f"{url}/api/version", headers=headers, timeout=TIMEOUT_S)
    except requests.exceptions.ConnectionError as e:
        why = "connection refused" if "refused" in str(e).lower() else "no connection"
        if isinstance(e, requests.exceptions.ConnectTimeout):
            why = f"no answer within {TIMEOUT_S:g} s"
        raise ClusterUnreachable(f"cannot reach a Ray dashboard at {url} ({why}): {advice}") from None
    except requests.exceptions.Timeout:
        raise ClusterUnreachable(f"{url} accepted the connection but sent no answer within {TIMEOUT_S:g} s; "
                                 f"is it a Ray dashboard? {advice}") from None
    except requests.exceptions.RequestException as e:
        raise ClusterUnreachable(f"cannot reach a Ray dashboard at {url} ({type(e).__name__}): {advice}") from None
    if r.status_code in (401, 403):
        return r.status_code
    try:
        is_ray = r.ok and "ray_version" in r.json()
    except ValueError:
        is_ray = False
    if not is_ray:
        what = f"HTTP {r.status_code}, {r.headers.get('content-type', 'no content type')}"
        raise ClusterUnreachable(
            f"{url} answers HTTP but is not a Ray dashboard (GET /api/version gave {what}); check the host and "
            f"port: the dashboard listens on 8265 by default"
        )
    return None
