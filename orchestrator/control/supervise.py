"""Failure detection from the work itself, and blame for the dead only.

The driver waits on every rank's `train` future: an actor that dies fails its future at once.
Ranks blocked in a collective behind a dead peer (NCCL waits, gloo may error) are not failed:
the liveness question goes to each actor's `control` concurrency group, which answers while the
training thread is busy, so only actors that are gone (or stopped) fail to answer. A group
where no step finishes for too long is hung: every rank's stack is saved and the silent ranks are
blamed. Either way the result is a `WorkerFailure` record for the driver to decide on.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayActorError

from ..errors import UserError
from ..record.rundir import RunDir
from .failures import WorkerFailure

PING_TIMEOUT_S = 10.0
"""How long a live actor may take to answer on its control thread (a loaded host, a GIL held
by a long op); an actor that is gone fails its call well before this, so the wait is paid in
full only when some rank is stopped or unreachable, and once for all ranks."""


SETTLE_S = 1.0
"""Pause between the two liveness questions, where a node may be going: long enough for a
worker whose node has just gone to notice and exit."""


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


def dead_from_futures(errors: dict[int, Exception]) -> dict[int, Exception]:
    """The ranks whose own train future says their actor died (not a rank that raised), with
    what it said."""
    return {r: e for r, e in sorted(errors.items()) if isinstance(e, RayActorError)}


WORKER_DIED_ON_A_LIVE_NODE = "because its worker process has died"
"""How Ray's GCS words an actor's death that its node's raylet reported (a killed or crashed
process); a lost node's actors die "because its node has died", or go unavailable."""


def _ping(actors: list[Any], skip: set[int], timeout_s: float) -> tuple[dict[int, Exception], set[int]]:
    """(dead with their errors, silent) among the ranks not in `skip`, from one wait for all."""
    refs = {a.alive.remote(): rank for rank, a in enumerate(actors) if rank not in skip}
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    dead = {}
    for ref in ready:
        try:
            ray.get(ref)
        except Exception as e:  # noqa: BLE001 - whatever it raised, it did not answer alive
            dead[refs[ref]] = e
    return dead, set(refs.values()) - {refs[r] for r in ready}


def _node_may_be_going(dead: dict[int, Exception]) -> bool:
    """Whether a rank that answered may yet die with its node: unless every dead rank is known
    to have died alone (its raylet, alive, reported its process's death), a node may be going."""
    return not dead or not all(isinstance(e, RayActorError) and WORKER_DIED_ON_A_LIVE_NODE in str(e)
                               for e in dead.values())


def blame(actors: list[Any], known_dead: dict[int, Exception] | None = None, node_of: list[str] | None = None,
          timeout_s: float = PING_TIMEOUT_S, settle_s: float = SETTLE_S) -> Blame:
    """Ask every actor, all at once, whether it is alive: one wait for all of them, not one
    timeout per rank. Asked twice, `settle_s` apart: a worker whose node's raylet has just died
    can still answer once before it exits. Where every dead rank's own raylet reported its
    process's death, no node is going and the second question is not asked. Ranks on nodes
    Ray reports dead (`node_of[rank]`) are dead whatever they answered."""
    known_dead = known_dead or {}
    died, silent = _ping(actors, set(known_dead), timeout_s)
    dead = set(known_dead) | set(died)
    if _node_may_be_going({**known_dead, **died}):
        time.sleep(settle_s)
        more, later = _ping(actors, dead | silent, timeout_s)
        dead |= set(more)
        silent |= later
    if node_of:
        gone = {n["NodeID"] for n in ray.nodes() if not n.get("Alive")}
        dead |= {r for r, node in enumerate(node_of) if node in gone} - silent
    return Blame(dead=sorted(dead), silent=sorted(silent))


def save_stacks(actors: list[Any], out_dir: Path, timeout_s: float = PING_TIMEOUT_S,
                silent: Collection[int] = ()) -> Blame:
    """Every answering rank's Python stacks (all threads, faulthandler) in out_dir/rank_NNNN.txt;
    a rank that cannot answer (stopped, gone) gets a file saying so. The same single wait says
    who is to blame: the ranks whose actor is gone and those that did not answer. The ranks
    already known `silent` are not waited for: only taken if they answer by then."""
    out_dir.mkdir(parents=True, exist_ok=True)
    refs = {a.stacks.remote(): rank for rank, a in enumerate(actors)}
    others = [ref for ref, rank in refs.items() if rank not in silent]
    late = [ref for ref, rank in refs.items() if rank in silent]
    ready = ray.wait(others, num_returns=len(others), timeout=timeout_s)[0] if others else []
    ready += ray.wait(late, num_returns=len(late), timeout=0)[0] if late else []
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


def _nodes_of(placement, ranks: list[int]) -> list[str]:
    return sorted({placement.reports[r]["node_id"] for r in ranks}) if placement.reports else []


def user_error_of(err: BaseException) -> UserError | None:
    """The mistake a rank reported in one line (a GPU plan on a node without CUDA, say), which no
    restart mends: the run stops with it as it is, not as a failure to recover from; None for
    anything else."""
    cause = getattr(err, "cause", None)  # Ray's task error carries what the rank raised
    return cause if isinstance(cause, UserError) else None


def failure_from_error(err: Exception, placement, known_dead: dict[int, Exception] | None = None) -> WorkerFailure:
    """A rank's error as a WorkerFailure naming only the ranks whose actors are dead (or no
    longer answer): survivors stuck in a collective behind them are not failed.
    `known_dead`: ranks whose own futures said they died, with what they said."""
    detected = time.time()
    node_of = [r["node_id"] for r in placement.reports] if placement.reports else None
    who = blame(placement.actors, known_dead, node_of)
    dead = who.ranks
    kind = "worker died" if dead else "rank raised"
    lines = str(err).strip().splitlines()
    detail = next((ln for ln in reversed(lines) if ln.strip()), type(err).__name__)[:200]
    return WorkerFailure(f"{kind}: {detail}", dead, _nodes_of(placement, dead), detected, silent=who.silent)


def hang_failure(run: RunDir, placement, timeout_s: float, step: int, silent: list[int] | None = None) -> WorkerFailure:
    """No step finished for `timeout_s`, or (`silent`) these ranks' control threads have not
    answered for `timeout_s` while no step finished: every rank's stacks saved, the silent
    ones blamed."""
    detected = time.time()
    folder = f"stacks/restart_{step:08d}_{time.strftime('%H%M%S')}"
    # The ranks already known silent are not waited for again: the others answer at once.
    who = save_stacks(placement.actors, run.path / folder, PING_TIMEOUT_S, silent or [])
    what = (f"rank(s) {silent} did not answer for {timeout_s:g} s and no step finished after step {step}" if silent
            else f"no step finished within {timeout_s:.0f} s after step {step}")
    return WorkerFailure(f"hang: {what}; stacks in {folder}", who.ranks, _nodes_of(placement, who.ranks), detected,
                         folder, who.silent)


class Watchdog:
    """Tracks when the group last made progress (any metrics item: a step, an evaluation, a
    checkpoint) and says when it has been silent past the hang timeout."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.last = time.monotonic()

    def progressed(self) -> None:
        self.last = time.monotonic()

    def hung(self) -> bool:
        return self.quiet_s() > self.timeout_s

    def quiet_s(self) -> float:
        """Seconds since the group last made progress."""
        return time.monotonic() - self.last


class Heartbeat:
    """Asks every rank's control thread whether it is alive, one question outstanding per rank,
    and says which have left theirs unanswered for `silent_after_s`: stopped, frozen, or a
    process holding the GIL, which only the step-based hang timeout would catch otherwise.
    A rank whose actor is gone answers with an error and is left to its train future."""

    def __init__(self, actors: list[Any], silent_after_s: float, every_s: float | None = None) -> None:
        # Once a second, or less often where that would be more than ~256 questions a second
        # for the driver to send: silence counts from the question, so it is found as soon.
        self.actors, self.silent_after_s = actors, silent_after_s
        self.every_s = every_s if every_s is not None else max(1.0, len(actors) / 256)
        self.asked: dict[Any, tuple[int, float]] = {}
        """Each outstanding question: (rank, when it was asked)."""
        self.answered = [float("-inf")] * len(actors)
        """When each rank's last answer was seen."""

    def silent(self) -> list[int]:
        """The ranks whose question has waited `silent_after_s` or more; asks again those that
        answered their last one `every_s` ago."""
        now = time.monotonic()
        if self.asked:
            ready, _ = ray.wait(list(self.asked), num_returns=len(self.asked), timeout=0)
            for ref in ready:
                rank, _when = self.asked.pop(ref)
                self.answered[rank] = now
        waiting = {rank for rank, _ in self.asked.values()}
        for rank, actor in enumerate(self.actors):
            if rank not in waiting and now - self.answered[rank] >= self.every_s:
                self.asked[actor.alive.remote()] = (rank, now)
        return sorted(rank for rank, when in self.asked.values() if now - when >= self.silent_after_s)
