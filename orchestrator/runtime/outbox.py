"""What a rank sends the driver while it trains, sent in batches (`Outbox`), and the Protocol
the step loop sends through, which a launch without Ray fills with its own (`launch.py`)."""

from __future__ import annotations

import time
from typing import Any, Protocol

from .messages import Ended, Message

SEND_INTERVAL_S = 0.5
"""Rank 0's step rows wait at most this long before they go to the driver's sink, together: the
driver drains the sink every half second anyway, and each remote call costs the sending rank, the
sink's process and Ray's own processes CPU time that a step on a busy host then misses."""


class Sink(Protocol):
    """Where the step loop's messages go, in the order they are added."""

    def add(self, item: Message, urgent: bool = False) -> None:
        """Queue `item`; send it (and everything before it) at once where `urgent`."""

    def flush(self) -> None:
        """Send everything queued."""

    def end(self) -> None:
        """Rank 0's last call of a step range: returns once every item it added has arrived."""


class Outbox:
    """What a rank sends the driver's sink (a Ray actor handle with `put` and `put_many`), sent
    in batches: at once when `urgent`, else with the first item added once the oldest waiting
    one is SEND_INTERVAL_S old (so an item waits at most that and one step). Items keep their
    order: one caller's calls to an actor run in the order they were made."""

    def __init__(self, sink: Any, interval_s: float = SEND_INTERVAL_S) -> None:
        self._sink = sink
        self._interval_s = interval_s
        self._items: list[Message] = []
        self._since = 0.0

    def add(self, item: Message, urgent: bool = False) -> None:
        if not self._items:
            self._since = time.monotonic()
        self._items.append(item)
        if urgent or time.monotonic() - self._since >= self._interval_s:
            self.flush()

    def flush(self) -> None:
        if self._items:
            self._sink.put_many.remote(self._items)
            self._items = []

    def end(self) -> None:
        import ray

        self.flush()
        # Calls from one caller run in order: once this returns, the sink holds every item
        # added before, so the driver's last drain after `train` returns misses nothing.
        ray.get(self._sink.put.remote(Ended()))
