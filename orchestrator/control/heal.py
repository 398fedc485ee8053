"""Recovery that keeps the survivors.

After a failure, the healthy ranks leave the broken process group but keep their processes (the
imports, the device context, the warm caches), and only the dead or hung ranks' actors are
replaced, in their own bundles, so on the same devices. The plan, the placement and the rank
layout stay; the group re-forms under a new rendezvous and every rank restores the newest
checkpoint. Where that cannot be done, `leave` says why in one line and the driver restarts
the whole world as before (re-probing and re-planning: the world may have changed).
"""

from __future__ import annotations

import ray
from ray.exceptions import RayActorError, RayTaskError

from .failures import WorkerFailure


def precheck(placement, failure: WorkerFailure, keep_survivors: bool) -> str | None:
    """Why the survivors cannot stay, judged before anything is touched; None when they can."""
    world = len(placement.actors)
    if not keep_survivors:
        return "elastic.keep_survivors=false"
    if failure.ranks and len(failure.ranks) == world:
        return "every rank failed"
    lost = gone_node(failure)
    if lost:
        return lost
    if failure.train_refs is None:
        return "the failure came before training (its ranks had not started their steps)"
    return None


def gone_node(failure: WorkerFailure) -> str | None:
    """Why the failure's ranks cannot be replaced where they ran: a node of theirs Ray knows is
    gone (it says so seconds after the ranks die, so a caller may ask again later)."""
    if not failure.nodes:
        return None
    gone = {n["NodeID"] for n in ray.nodes() if not n.get("Alive")}
    lost = sorted(set(failure.nodes) & gone)
    return f"node {lost[0][:12]} is gone: its ranks cannot be replaced on their own devices" if lost else None


def leave(placement, failure: WorkerFailure, timeout_s: float) -> tuple[list[int], str | None]:
    """Every rank not to blame leaves the broken group and stays; the blamed ones are killed.
    Returns (the ranks to replace, None), or ([], why) when a survivor did not leave within
    `timeout_s` (still blocked in a collective) and the whole world must restart."""
    failed = set(failure.ranks)
    survivors = [r for r in range(len(placement.actors)) if r not in failed]
    for r in failed:  # a hung rank is alive: killing it closes its connections, ending its peers' waits
        ray.kill(placement.actors[r], no_restart=True)
    for r in survivors:  # NCCL waits end only by abort; it is harmless elsewhere
        placement.actors[r].abort_collectives.remote()
    waiting = [failure.train_refs[r] for r in survivors]
    done, pending = ray.wait(waiting, num_returns=len(waiting), timeout=timeout_s) if waiting else ([], [])
    if pending:
        stuck = sorted(survivors[waiting.index(p)] for p in pending)
        return [], (f"rank(s) {stuck} did not leave the broken collective within {timeout_s:g} s "
                    f"(elastic.leave_timeout_s)")
    # All at once: a rank whose step failed has left already, and this only confirms it.
    left = {placement.actors[r].leave.remote(): r for r in survivors}
    ready, late = ray.wait(list(left), num_returns=len(left), timeout=timeout_s)
    died = [left[ref] for ref in late]  # no answer in time: killed and replaced too (respawn kills first)
    for ref in ready:
        try:
            ray.get(ref)
        except (RayActorError, RayTaskError):
            died.append(left[ref])  # it did not survive leaving: it is replaced too
    if len(died) == len(survivors):
        return [], "no rank survived leaving the broken group"
    return sorted(failed | set(died)), None


def describe_kept(world: int, replaced: list[int]) -> str:
    return f"kept {world - len(replaced)} of {world} ranks, replaced rank(s) {replaced}"
