"""Failure detection from the work itself, and blame for the dead only.

The driver waits on every rank's `train` future: an actor that dies fails its future at once.
Ranks blocked in a collective behind a dead peer (NCCL waits, gloo may error) are not failed:
the liveness question goes to each actor's `control` concurrency group, which answers while the
training thread is busy, so only actors that are gone (or stopped) fail to answer. A group
where no step finishes for too long is hung: every rank's stack is saved, the silent ranks are
blamed, and the group restarts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayActorError

PING_TIMEOUT_S = 10.0
"""How long a live actor may take to answer on its control thread (a loaded host, a GIL held
by a long op); an actor that is gone fails its call well before this, so the wait is paid in
full only when some rank is stopped or unreachable, and once for all ranks."""


SETTLE_S = 1.0
"""Pause between the two liveness questions: long enough for a worker whose node has just
gone to notice and exit, short beside any restart."""


@dataclass(frozen=True)
class Blame:
    """Who failed: `dead` actors are gone, `silent` ones did not answer within PING_TIMEOUT_S."""

    dead: list[int]
    silent: list[int]

    @property
    def ranks(self) -> list[int]:
        return sorted(self.dead + self.silent)


def hang_timeout_s(predicted_step_s: float | None, factor: float, floor_s: float) -> float:
    """Seconds without a finished step after which the group counts as hung."""
    return max(floor_s, factor * (predicted_step_s or 0.0))


def dead_from_futures(errors: dict[int, Exception]) -> list[int]:
    """Ranks whose own train future says their actor died (not a rank that raised)."""
    return sorted(r for r, e in errors.items() if isinstance(e, RayActorError))


def _ping(actors: list[Any], skip: set[int], timeout_s: float) -> tuple[set[int], set[int]]:
    """(dead, silent) among the ranks not in `skip`, from one wait for all of them."""
    refs = {a.alive.remote(): rank for rank, a in enumerate(actors) if rank not in skip}
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    dead = set()
    for ref in ready:
        try:
            ray.get(ref)
        except Exception:
            dead.add(refs[ref])
    return dead, set(refs.values()) - {refs[r] for r in ready}


def blame(actors: list[Any], known_dead: list[int] = (), node_of: list[str] | None = None,
          timeout_s: float = PING_TIMEOUT_S, settle_s: float = SETTLE_S) -> Blame:
    """Ask every actor, all at once, whether it is alive: one wait for all of them, not one
    timeout per rank. Asked twice, `settle_s` apart: a worker whose node's raylet has just died
    can still answer once before it exits. Ranks on nodes Ray reports dead (`node_of[rank]`)
    are dead whatever they answered."""
    dead = set(known_dead)
    more, silent = _ping(actors, dead, timeout_s)
    dead |= more
    time.sleep(settle_s)
    more, later = _ping(actors, dead | silent, timeout_s)
    dead |= more
    silent |= later
    if node_of:
        gone = {n["NodeID"] for n in ray.nodes() if not n.get("Alive")}
        dead |= {r for r, node in enumerate(node_of) if node in gone} - silent
    return Blame(dead=sorted(dead), silent=sorted(silent))


def save_stacks(actors: list[Any], out_dir: Path, timeout_s: float = PING_TIMEOUT_S) -> Blame:
    """Every answering rank's Python stacks (all threads, faulthandler) in out_dir/rank_NNNN.txt;
    a rank that cannot answer (stopped, gone) gets a file saying so. The same single wait says
    who is to blame: the ranks whose actor is gone and those that did not answer."""
    out_dir.mkdir(parents=True, exist_ok=True)
    refs = {a.stacks.remote(): rank for rank, a in enumerate(actors)}
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    texts = {rank: f"rank {rank}: no answer within {timeout_s:g} s (stopped, gone or holding the GIL)\n"
             for rank in refs.values()}
    dead = []
    for ref in ready:
        try:
            texts[refs[ref]] = ray.get(ref)
        except Exception as e:  # noqa: BLE001 - the reason goes into the file instead
            texts[refs[ref]] = f"rank {refs[ref]}: {type(e).__name__}: {e}\n"
            dead.append(refs[ref])
    for rank, text in sorted(texts.items()):
        (out_dir / f"rank_{rank:04d}.txt").write_text(text)
    answered = {refs[r] for r in ready}
    return Blame(dead=sorted(dead), silent=sorted(set(refs.values()) - answered))


class Watchdog:
    """Tracks when the group last made progress (any metrics item: a step, an evaluation, a
    checkpoint) and says when it has been silent past the hang timeout."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.last = time.monotonic()

    def progressed(self) -> None:
        self.last = time.monotonic()

    def hung(self) -> bool:
        return time.monotonic() - self.last > self.timeout_s
