"""SIGTERM ends a run the way Ctrl-C does: the driver's cleanup runs, the run is marked stopped.

`stop`, Kubernetes and batch schedulers end a driver with SIGTERM. Python's default for it
kills the process on the spot, and `ray.init` replaces any handler installed before it with
Ray's own (which tears its processes down and exits 1, with a stack dump): so the handler is
installed again once Ray is up. It raises :class:`Stopped`, a KeyboardInterrupt, so every
`finally` that releases actors and the placement group runs as it does for Ctrl-C.
"""

from __future__ import annotations

import signal

_received: int | None = None
"""The signal that asked this process to stop (Ray's blocking calls re-raise Stopped as a plain
KeyboardInterrupt, so the exception alone does not tell)."""


def received() -> int | None:
    """The signal number that stopped the process, None when none did (Ctrl-C is SIGINT's own)."""
    return _received


def exit_code(e: KeyboardInterrupt) -> int:
    """128 + the signal that stopped the process: 143 for SIGTERM, 130 for Ctrl-C."""
    return 128 + (getattr(e, "signum", None) or _received or signal.SIGINT)


def signal_name(e: KeyboardInterrupt) -> str:
    return signal.Signals(exit_code(e) - 128).name


class Stopped(KeyboardInterrupt):
    """The process was asked to stop by a signal; exits 128 + the signal number (143 for SIGTERM)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def stop_on_sigterm() -> None:
    """Turn the first SIGTERM into :class:`Stopped`; later ones are ignored while cleanup runs
    (whoever sent it will SIGKILL after its grace period if cleanup takes too long)."""

    def handler(signum, frame):
        global _received
        _received = signum
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Stopped(signum)

    signal.signal(signal.SIGTERM, handler)
