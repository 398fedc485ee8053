"""Recovery that keeps the survivors.

After a failure, the healthy ranks leave the broken process group but keep their processes (the
imports, the device context, the warm caches), and only the dead or hung ranks' actors are
replaced, in their own bundles, so on the same devices. The plan, the placement and the rank
layout stay; the group re-forms under a new rendezvous and takes its state from the survivors'
memory where every replica group kept a whole copy (`from_memory`), else from the newest
checkpoint. Whether the survivors may stay is decided before any of this (`recovery.py`); where
they then cannot (`leave` says why in one line), the driver restarts the whole world
(re-probing and re-planning: the world may have changed).
"""

from __future__ import annotations

import time

import ray
from ray.exceptions import RayActorError, RayTaskError

from ..planning.mesh import Mesh
from ..runtime.peer_state import PeerRestore
from .failures import WorkerFailure

KILL_SILENT_WAIT_S = 2.0
"""How long a survivor may take to kill a silent rank of its node; past it Ray's kill does."""

STUCK_GRACE_S = 3.0
"""How long a survivor still in its step may go on waiting once no other survivor has left for
as long: its collective waits on peers that have left, over connections that have not closed
(gloo under FSDP2 keeps them open after its group is destroyed; NCCL's abort ends such waits)."""


def leave(placement, failure: WorkerFailure, train_refs: list,
          timeout_s: float) -> tuple[list[int], list[int], str | None]:
    """Every rank not to blame leaves the broken group and stays; the blamed ones are killed, and
    so is a survivor stuck in its step once the others have left (it is replaced too).
    `train_refs`: every rank's step-loop future, which a survivor's ends as it leaves. Returns
    (the ranks to replace, the stuck ones among them, None), or ([], [], why) when no survivor
    left within `timeout_s` and the whole world must restart."""
    failed = set(failure.ranks)
    survivors = [r for r in range(len(placement.actors)) if r not in failed]
    # A hung rank is alive: killing it closes its connections, ending its peers' waits. Its
    # replacement starts at once (process, imports, device), while the survivors leave.
    kill_silent(placement, failure)
    placement.restart(sorted(failed))
    for r in survivors:  # NCCL waits end only by abort; it is harmless elsewhere
        placement.actors[r].abort_collectives.remote()
    rank_of = {train_refs[r]: r for r in survivors}
    pending, stuck = _wait_to_leave(placement, rank_of, timeout_s)
    if pending:
        return [], [], (f"rank(s) {sorted(rank_of[p] for p in pending)} did not leave the broken collective within "
                        f"{timeout_s:g} s (elastic.leave_timeout_s)")
    for r in stuck:
        ray.kill(placement.actors[r], no_restart=True)
    staying = [r for r in survivors if r not in stuck]
    if not staying:
        return [], [], "no rank survived leaving the broken group"
    # All at once: a rank whose step failed has left already, and this only confirms it.
    left = {placement.actors[r].leave.remote(): r for r in staying}
    ready, late = ray.wait(list(left), num_returns=len(left), timeout=timeout_s)
    died = [left[ref] for ref in late]  # no answer in time: killed and replaced too (respawn kills first)
    for ref in ready:
        try:
            ray.get(ref)
        except (RayActorError, RayTaskError):
            died.append(left[ref])  # it did not survive leaving: it is replaced too
    if len(died) == len(staying):
        return [], [], "no rank survived leaving the broken group"
    return sorted(failed | set(stuck) | set(died)), sorted(stuck), None


def kill_silent(placement, failure: WorkerFailure) -> None:
    """SIGKILL each silent rank's process from a rank of its node not to blame, where there is
    one: Ray's kill waits seconds for a stopped process to exit before it kills it
    (kill_worker_timeout_milliseconds), and both recovery and a whole-world release wait for it."""
    if not placement.reports or not failure.silent:
        return
    node = [rep["node_id"] for rep in placement.reports]
    blamed = set(failure.ranks)
    others = [r for r in range(len(placement.actors)) if r not in blamed]
    asks = []
    for r in failure.silent:
        peer = next((s for s in others if node[s] == node[r]), None)
        if peer is not None:
            asks.append(placement.actors[peer].kill_peer.remote(placement.reports[r]["pid"]))
    if asks:
        ray.wait(asks, num_returns=len(asks), timeout=KILL_SILENT_WAIT_S)


def _wait_to_leave(placement, rank_of: dict, timeout_s: float) -> tuple[list, list[int]]:
    """Wait for the survivors' steps to end. Returns (the steps still running at `timeout_s`:
    none left at all, or one not stuck that took too long; the ranks found stuck in their step
    once the others had left)."""
    pending = list(rank_of)
    stuck: list[int] = []
    start = time.monotonic()
    quiet_since = None  # when a survivor last left
    while pending and (now := time.monotonic()) - start < timeout_s:
        done, pending = ray.wait(pending, num_returns=len(pending), timeout=min(0.25, timeout_s - (now - start)))
        if done:
            quiet_since = time.monotonic()
        if pending and quiet_since is not None and time.monotonic() - quiet_since >= STUCK_GRACE_S:
            # Still training (not holding its state or leaving): blocked for good.
            try:
                stages = ray.get([placement.actors[rank_of[p]].stage.remote() for p in pending], timeout=5)
            except Exception:  # noqa: BLE001 - one that cannot answer is as stuck
                stages = ["training"] * len(pending)
            stuck += [rank_of[p] for p, s in zip(pending, stages) if s == "training"]
            pending = [p for p, s in zip(pending, stages) if s != "training"]
            quiet_since = time.monotonic()
    return pending, sorted(stuck)


def from_memory(placement, replaced: list[int], mesh: Mesh, last_step: int, max_steps: int,
                timeout_s: float) -> tuple[PeerRestore | None, list[dict], str | None]:
    """Ask every survivor what it holds (`Worker.held_state`) and choose where the recovered
    group's state comes from: (the restore, the metrics rows of its steps the driver has not
    seen yet, None), or (None, [], why a checkpoint is read instead)."""
    survivors = [r for r in range(len(placement.actors)) if r not in set(replaced)]
    refs = [placement.actors[r].held_state.remote(last_step) for r in survivors]
    try:
        held = dict(zip(survivors, ray.get(refs, timeout=timeout_s)))
    except Exception as e:  # noqa: BLE001 - a survivor that cannot say what it holds holds nothing usable
        return None, [], f"a survivor did not say what it holds ({type(e).__name__})"
    return choose_restore(mesh, held, last_step, max_steps)


def choose_restore(mesh: Mesh, held: dict[int, dict | None], last_step: int,
                   max_steps: int) -> tuple[PeerRestore | None, list[dict], str | None]:
    """The restore from memory that `held` (each survivor's `held_state`, None where it holds no
    whole step) allows: the newest step any survivor holds, taken by every replica group (the
    ranks that differ only along dp_replicate) from its lowest survivor holding it. Refused,
    with the reason, where a replica group has no survivor at that step, where survivors of one
    group hold that step with different contents, or where the survivors no longer keep the
    metrics rows of the steps between the driver's last and that step, and where that step is
    the run's last (`max_steps`): its final checkpoint, committed or written again from the one
    before, ends the run."""
    if mesh.dp_replicate < 2:
        return None, [], "the plan keeps one copy of each state (dp_replicate=1): no survivor holds the lost rank's"
    whole = {r: h for r, h in held.items() if h is not None and h.get("step") is not None}
    if not whole:
        why = next((f"rank {r}: {h['why']}" for r, h in sorted(held.items()) if h and h.get("why")), None)
        return None, [], "no survivor holds a whole step's state" + (f" ({why})" if why else "")
    step = max(h["step"] for h in whole.values())
    if step >= max_steps:
        return None, [], "the failure came after the last step: its final checkpoint ends the run"
    source: dict[int, int] = {}
    for group in mesh.groups()["dp_replicate"]:
        holders = [r for r in group if r in whole and whole[r]["step"] == step]
        if not holders:
            have = "; ".join(f"rank {r}: " + (f"step {h['step']}" if h.get("step") is not None
                                               else h.get("why", "nothing"))
                             for r in group if (h := held.get(r)))
            return None, [], f"no survivor of replica group {group} holds step {step}" + (f" ({have})" if have else "")
        if len({whole[r]["digest"] for r in holders}) > 1:
            return None, [], f"ranks {holders} hold step {step} with different contents (their state digests differ)"
        source.update({r: holders[0] for r in group})
    need = range(last_step + 1, step + 1)
    rows = {row["step"]: row for row in whole[min(source.values())]["rows"]}
    if any(s not in rows for s in need):
        return None, [], f"the survivors no longer keep the metrics of steps {need.start}-{need.stop - 1}"
    return PeerRestore(step=step, source=source), [rows[s] for s in need], None
