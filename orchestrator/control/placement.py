"""Plan -> Ray placement group -> one named worker actor per rank, bound to its planned device.

Each rank gets one bundle (`{"CPU": c, "GPU": 1}`), pinned to the node the plan chose with a
label selector on Ray's built-in `ray.io/node-id` label, and, for a rank in a multi-node NVLink
domain, on the `orchestrator.io/nvlink-domain` label its node advertises. Ray, not us, picks which GPU of a node
a bundle holds, so on GPUs we first ask every bundle which GPU it got, then create the actor
of plan rank r in the bundle holding r's planned GPU. Every actor then reports where it really
runs, and a layout that differs from the plan stops the run before training.
"""

from __future__ import annotations

import os
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ..errors import PlacementError
from ..planning import Plan
from ..topology.cluster_probe import cpu_slots

NODE_ID_LABEL = "ray.io/node-id"
FENCE_S = 2.0
"""How long `release` waits for the ranks to confirm they commit no more checkpoints."""


@dataclass
class Placement:
    """What is running where: the placement group, the actors in rank order, their reports."""

    group: Any
    actors: list[Any]
    reports: list[dict[str, Any]] = field(default_factory=list)
    spawn: Any = None
    """spawn(slot) -> a new worker actor in the bundle of `slot` (`respawn`)."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds to reserve the group (`placement_s`) and to start the actors (`actor_start_s`)."""
    devices: list[tuple[str, int]] = field(default_factory=list)
    """(node id, device index) each slot holds: the planned rank's device when placed."""
    slots: list[int] = field(default_factory=list)
    """The slot of each rank, in rank order: the identity until a plan over the same devices
    lays the ranks out otherwise (`adopt`)."""
    restarting: set[int] = field(default_factory=set)
    """Ranks whose new actors `restart` started and `respawn` has not yet waited for."""

    def adopt(self, plan: Plan) -> None:
        """Re-rank the running actors for `plan`, a plan over the devices already held: the
        actor on each device becomes the rank `plan` puts there. No actor is restarted.
        PlacementError when `plan` needs a device this placement does not hold."""
        slot_at = {dev: i for i, dev in enumerate(self.devices)}
        want = [(r.node, r.gpu) for r in plan.ranks]
        missing = [f"{n[:8]}:{g}" for n, g in want if (n, g) not in slot_at]
        if missing or len(want) != len(self.devices):
            raise PlacementError(f"the plan needs devices {missing or want} that the placement of "
                                 f"{len(self.devices)} does not hold")
        actor_of = {self.slots[r]: a for r, a in enumerate(self.actors)}
        report_of = {self.slots[r]: rep for r, rep in enumerate(self.reports)}
        self.slots = [slot_at[d] for d in want]
        self.actors = [actor_of[s] for s in self.slots]
        self.reports = [{**report_of[s], "rank": r} for r, s in enumerate(self.slots)] if report_of else []

    def restart(self, ranks: list[int]) -> None:
        """Kill the actors of `ranks` and start new ones in their bundles (so on the same devices),
        without waiting for them: they start while the survivors leave (`respawn` waits)."""
        for r in ranks:
            try:
                ray.kill(self.actors[r], no_restart=True)
            except Exception:  # dead already
                pass
            self.actors[r] = self.spawn(self.slots[r])
            self.restarting.add(r)

    def respawn(self, ranks: list[int], timeout_s: float) -> float:
        """Replace the actors of `ranks` (dead) by new ones in the same bundles, so the same
        devices (those `restart` already replaced are only waited for); returns the seconds
        until they all answered. Raises what their start raised."""
        if not ranks:  # a rank raised and none died: every process stays
            return 0.0
        t0 = time.monotonic()
        nodes = {self.reports[r]["node_id"] for r in ranks} if self.reports else set()
        self.restart([r for r in ranks if r not in self.restarting])
        self.restarting -= set(ranks)
        refs = [self.actors[r].report.remote() for r in ranks]
        while True:
            # A bundle whose node died stays pending until the timeout: Ray tells a lost node
            # seconds after its workers died, so look again while waiting.
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=1.0)
            if len(ready) == len(refs):
                break
            gone = nodes & {n["NodeID"] for n in ray.nodes() if not n.get("Alive")}
            if gone:
                raise PlacementError(f"node {sorted(gone)[0][:12]} is gone: its ranks cannot start there again")
            if time.monotonic() - t0 > timeout_s:
                raise PlacementError(f"the replacement ranks {ranks} did not start within {timeout_s:g} s")
        for r, report in zip(ranks, ray.get(refs)):
            self.reports[r] = {**report, "rank": r}
        return time.monotonic() - t0

    def release(self, wait_s: float = 10.0, fence: bool = True) -> None:
        """Kill every actor and free the group; return once the actors are gone (at most
        `wait_s`). Every rank that answers is fenced first (`Worker.fence`): one killed while it
        commits a checkpoint could otherwise commit it after the next attempt chose where to
        resume from. One that does not answer within FENCE_S (stopped, or its node lost) cannot
        run until the kill below ends it. `fence=False`: workers that never trained (nothing to
        fence, and a fence would wait for one still starting)."""
        fences = [a.fence.remote() for a in self.actors] if fence else []
        if fences:
            try:
                ray.wait(fences, num_returns=len(fences), timeout=FENCE_S)
            except Exception:  # noqa: BLE001 - a dead rank commits nothing either
                pass
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # already dead: that is what we wanted
                pass
        deadline = time.monotonic() + wait_s
        try:
            # A call on a killed actor fails once it is dead.
            ray.wait([a.__ray_ready__.remote() for a in self.actors], num_returns=len(self.actors), timeout=wait_s)
        except Exception:
            pass
        # Ray calls a killed actor dead before its process has exited, and in between a rank's
        # checkpoint thread can still commit (and prune): wait for the processes this node can see.
        try:
            here = ray.get_runtime_context().get_node_id()
        except Exception:
            here = None
        pids = [r["pid"] for r in self.reports if r.get("node_id") == here and r.get("pid")]
        while any(map(_running, pids)) and time.monotonic() < deadline:
            time.sleep(0.05)
        try:
            remove_placement_group(self.group)
        except Exception:
            pass


def _running(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie, dead and not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):  # no procfs: it answered the signal
        return True


def domain_selectors(plan: Plan, labels: dict[str, dict[str, str]]) -> list[dict[str, str]]:
    """Per rank, the `orchestrator.io/nvlink-domain` selector that keeps it in its planned
    multi-node NVLink domain, where its node advertises that label (`node-labels`); a node
    advertising another domain than the probe found stops placement before anything is held."""
    from .labels import NVLINK_DOMAIN_LABEL, domain_label

    out: list[dict[str, str]] = []
    for r in plan.ranks:
        have = labels.get(r.node, {}).get(NVLINK_DOMAIN_LABEL)
        if r.nvlink_domain is None or have is None:
            out.append({})
            continue
        want = domain_label(r.nvlink_domain)
        if have != want:
            raise PlacementError(f"node {r.node[:12]} advertises {NVLINK_DOMAIN_LABEL}={have} but its GPUs are in "
                                 f"NVLink domain {want}; restart it with `ray start --labels \"$(python -m "
                                 f"orchestrator node-labels)\"`")
        out.append({NVLINK_DOMAIN_LABEL: want})
    return out


def _bundles(plan: Plan, use_gpu: bool, cpus: float, pin: bool,
             labels: dict[str, dict[str, str]] | None = None) -> tuple[list[dict], list[dict] | None]:
    bundles, selectors = [], []
    for r, domain in zip(plan.ranks, domain_selectors(plan, labels or {})):
        b: dict[str, float] = {"CPU": cpus}
        if use_gpu:
            b["GPU"] = 1
        bundles.append(b)
        selectors.append({NODE_ID_LABEL: r.node, **domain} if pin else domain)
    return bundles, (selectors if pin or any(selectors) else None)


def never_fits(bundles: list[dict], selectors: list[dict] | None, nodes: list[dict]) -> str | None:
    """What no wait can give: a node pinned by `selectors` whose *total* resources (not what is
    free now) are less than its bundles need, or a bundle no node could hold at all; None where
    the group fits the cluster once other work frees it. `nodes`: `ray.nodes()`."""
    alive = {n["NodeID"]: n for n in nodes if n.get("Alive")}
    need: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for i, bundle in enumerate(bundles):
        node = (selectors[i] if selectors else {}).get(NODE_ID_LABEL)
        if node is None:
            if not any(all(n["Resources"].get(k, 0) >= v for k, v in bundle.items()) for n in alive.values()):
                wants = ", ".join(f"{k} {v:g}" for k, v in bundle.items())
                return f"no node of the cluster holds one worker's {wants} in total"
            continue
        for k, v in bundle.items():
            need[node][k] += v
    for node, resources in need.items():
        if node not in alive:
            return f"node {node[:12]} is not alive"
        total = alive[node]["Resources"]
        for k, v in resources.items():
            if total.get(k, 0) < v - 1e-9:
                return (f"node {node[:12]} ({alive[node].get('NodeManagerAddress', '?')}) needs {k} {v:g} for its "
                        f"workers and has {total.get(k, 0):g} in total")
    return None


def _missing(bundles: list[dict], selectors: list[dict] | None) -> str:
    """Say what the cluster lacks, per node, for a group that did not become ready."""
    need: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for i, b in enumerate(bundles):
        node = selectors[i].get(NODE_ID_LABEL, "any node") if selectors else "any node"
        for k, v in b.items():
            need[node][k] += v
    alive = {n["NodeID"]: n for n in ray.nodes() if n.get("Alive")}
    parts = []
    for node, res in need.items():
        if node != "any node" and node not in alive:
            parts.append(f"node {node[:12]} is not alive")
            continue
        have = alive[node]["Resources"] if node in alive else ray.cluster_resources()
        short = [f"{k} {v:g} (has {have.get(k, 0):g})" for k, v in res.items() if have.get(k, 0) < v]
        if short:
            parts.append(f"{'cluster' if node == 'any node' else 'node ' + node[:12]} needs " + ", ".join(short))
    return "; ".join(parts) or "resources are held by other jobs"


@ray.remote(num_cpus=0)
def _bundle_gpu() -> tuple[str, int]:
    from ..runtime.gpu_ids import gpu_indices

    return ray.get_runtime_context().get_node_id(), gpu_indices(ray.get_gpu_ids()[:1])[0]


def place(
    plan: Plan,
    *,
    job: str,
    use_gpu: bool,
    cpus_per_worker: float,
    threads_per_worker: int,
    timeout_s: float,
    pin_nodes: bool = True,
    on_wait: Callable[[str], None] | None = None,
) -> Placement:
    """Reserve the plan's devices and start one worker actor per rank, in rank order. What no
    wait can change fails at once (`never_fits`); a wait for resources other work holds is said
    to `on_wait`."""
    labels = {n["NodeID"]: dict(n.get("Labels") or {}) for n in ray.nodes() if n.get("Alive")}
    bundles, selectors = _bundles(plan, use_gpu, cpus_per_worker, pin_nodes, labels)
    impossible = never_fits(bundles, selectors, ray.nodes())
    if impossible:  # said now: waiting out cluster.placement_timeout_s cannot change a node's totals
        raise PlacementError(f"the cluster can never hold the plan's {len(bundles)} workers: {impossible}")
    t_group = time.monotonic()
    pg = placement_group(bundles, strategy="PACK", name=f"{job}/workers", bundle_label_selector=selectors)
    _wait_ready(pg, bundles, selectors, timeout_s, on_wait)

    ranks = plan.ranks
    bundle_of_rank = list(range(len(ranks)))
    if use_gpu:
        held = ray.get([
            _bundle_gpu.options(
                num_gpus=1,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
            ).remote()
            for i in range(len(bundles))
        ])
        bundle_at = {(node, gpu): i for i, (node, gpu) in enumerate(held)}
        try:
            bundle_of_rank = [bundle_at[(r.node, r.gpu)] for r in ranks]
        except KeyError:
            remove_placement_group(pg)
            got = sorted(f"{n[:8]}:{g}" for n, g in held)
            want = sorted(f"{r.node[:8]}:{r.gpu}" for r in ranks)
            raise PlacementError(f"Ray reserved GPUs {got} but the plan needs {want}; "
                                 f"plan for all GPUs of each node or free the others") from None

    spawn = _spawner(pg, job, [r.node for r in ranks], bundle_of_rank, use_gpu, cpus_per_worker, threads_per_worker)
    t_actors = time.monotonic()
    placement = Placement(group=pg, actors=[spawn(r.rank) for r in ranks], spawn=spawn,
                          devices=[(r.node, r.gpu) for r in ranks], slots=list(range(len(ranks))))
    try:
        placement.reports = ray.get([a.report.remote() for a in placement.actors], timeout=timeout_s)
    except Exception:
        placement.release()
        raise
    placement.timings = {"placement_s": t_actors - t_group, "actor_start_s": time.monotonic() - t_actors}
    check_layout(plan, placement.reports, use_gpu)
    return placement


WAIT_SAID_EVERY_S = 5.0
"""While a placement waits for resources other work holds, what it waits for is said this often."""


def _wait_ready(pg, bundles: list[dict], selectors: list[dict] | None, timeout_s: float,
                on_wait: Callable[[str], None] | None = None) -> None:
    """Wait for the group's bundles, saying to `on_wait` every WAIT_SAID_EVERY_S what the cluster
    lacks while it waits; PlacementError saying what it lacks after `timeout_s`."""
    ready, t0 = pg.ready(), time.monotonic()
    done: list = []
    while not done and (left := timeout_s - (time.monotonic() - t0)) > 0:
        done, _ = ray.wait([ready], timeout=min(left, WAIT_SAID_EVERY_S))
        if not done and on_wait is not None:
            on_wait(f"waiting {time.monotonic() - t0:.0f} of {timeout_s:g} s (cluster.placement_timeout_s) for "
                    f"other work to free: {_missing(bundles, selectors)}")
    if not done:
        msg = _missing(bundles, selectors)
        remove_placement_group(pg)
        raise PlacementError(
            f"the cluster cannot hold the plan's {len(bundles)} workers after {timeout_s:g}s "
            f"(cluster.placement_timeout_s): {msg}"
        )


def _spawner(pg, job: str, node_of_slot: list[str], bundle_of_slot: list[int], use_gpu: bool,
             cpus_per_worker: float, threads_per_worker: int):
    """spawn(slot) -> a worker actor in the bundle of `slot`, named by slot, not rank: a trial
    (or a plan made after the actors started) may give the actor on a device another rank."""
    from ..runtime.worker import Worker

    on_node: dict[str, int] = defaultdict(int)
    cpu_slot = []  # the slot's index among its node's: which CPU slot a CPU rank takes
    for node in node_of_slot:
        cpu_slot.append(on_node[node])
        on_node[node] += 1

    def spawn(slot: int) -> Any:
        actor_class: Any = Worker  # @ray.remote made it an actor class, which its own type does not say
        return actor_class.options(
            name=f"{job}/worker-{slot}",
            num_cpus=cpus_per_worker,
            num_gpus=1 if use_gpu else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle_of_slot[slot]),
            # Ray would mask CUDA_VISIBLE_DEVICES to the actor's own GPU, which hides its
            # peers from NCCL and turns NVLink/P2P off; each worker exposes the job's GPUs
            # of its node itself, numbered in PCI bus order as NVML (and the topology) does.
            runtime_env={"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
                                      "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}} if use_gpu else None,
            max_restarts=0,
        ).remote(slot, len(node_of_slot), cpu_slot[slot], threads_per_worker)

    return spawn


@dataclass
class EarlyStart:
    """Workers started on every device Ray offers before the probe, so their processes start,
    import torch and ready their device while the driver probes and plans: a plan over
    exactly these devices takes them (`claim`), any other releases them."""

    placement: Placement
    use_gpu: bool
    bundles: list[dict]
    """Each slot's bundle: what `claim` reports missing when the group cannot be held."""
    selectors: list[dict]
    """Each bundle's label selector, pinning it to its node."""
    node_of_slot: list[str]
    """The node each slot's worker runs on."""

    @property
    def slots_per_node(self) -> dict[str, int]:
        """How many devices of each node the workers hold."""
        return dict(Counter(self.node_of_slot))

    def probers(self, wait_s: float = 1.0) -> dict[str, Any]:
        """One worker per node to probe that node in (`probe_cluster(on=...)`), once the group
        is placed, which takes milliseconds where the devices are free; {} where it is not
        within `wait_s` (held by another job: the probe's tasks need no device)."""
        done, _ = ray.wait([self.placement.group.ready()], timeout=wait_s)
        if not done:
            return {}
        out: dict[str, Any] = {}
        for node, actor in zip(self.node_of_slot, self.placement.actors):
            out.setdefault(node, actor)
        return out


def start_early(*, job: str, num_workers: int, max_workers: int, cpus_per_worker: float,
                threads_per_worker: int, measure: bool = False) -> EarlyStart | None:
    """Reserve and start a worker on every GPU of every alive node (a GPU-less cluster of one
    node: the CPU slots the probe will count there, `cpu_slots`), without waiting; None where
    the plan's devices cannot be foreseen from Ray's resources alone: several GPU-less nodes,
    or more devices than elastic.max_workers lets a plan use; and None where the probe will
    `measure` the links: its own actors need every device the early workers would hold."""
    if measure:
        return None
    alive = [n for n in ray.nodes() if n.get("Alive")]
    gpus = {n["NodeID"]: int(n.get("Resources", {}).get("GPU", 0)) for n in alive}
    use_gpu = any(gpus.values())
    if use_gpu:
        slots_per_node = {node: count for node, count in gpus.items() if count}
    elif len(alive) == 1 and (slots := cpu_slots(alive[0].get("Resources", {}).get("CPU", 0), cpus_per_worker,
                                                  num_workers)):
        slots_per_node = {alive[0]["NodeID"]: slots}  # as many as the probe will count there
    else:
        return None
    if max_workers and sum(slots_per_node.values()) > max_workers:
        return None
    node_of_slot = [node for node, count in slots_per_node.items() for _ in range(count)]
    bundles = [{"CPU": cpus_per_worker, **({"GPU": 1} if use_gpu else {})} for _ in node_of_slot]
    selectors = [{NODE_ID_LABEL: node} for node in node_of_slot]
    pg = placement_group(bundles, strategy="PACK", name=f"{job}/workers", bundle_label_selector=selectors)
    spawn = _spawner(pg, job, node_of_slot, list(range(len(node_of_slot))), use_gpu, cpus_per_worker,
                     threads_per_worker)
    placement = Placement(group=pg, actors=[spawn(i) for i in range(len(node_of_slot))], spawn=spawn,
                          slots=list(range(len(node_of_slot))))
    return EarlyStart(placement, use_gpu, bundles, selectors, node_of_slot)


def claim(early: EarlyStart, plan: Plan, use_gpu: bool, timeout_s: float,
          on_wait: Callable[[str], None] | None = None) -> Placement | None:
    """The early workers, re-ranked for `plan` (`Placement.adopt`), where `plan` runs on exactly
    their devices (raising, once they are released, what `place` would: the cluster cannot
    hold them, one did not start); otherwise they are released and None returned, and the
    plan is placed afresh. Timings count only the wait after the plan."""
    p = early.placement
    if use_gpu != early.use_gpu or Counter(plan.node_of_rank) != Counter(early.node_of_slot):
        p.release(fence=False)
        return None
    labels = {n["NodeID"]: dict(n.get("Labels") or {}) for n in ray.nodes() if n.get("Alive")}
    try:
        domain_selectors(plan, labels)  # a node advertising another NVLink domain than probed stops here
        t0 = time.monotonic()
        _wait_ready(p.group, early.bundles, early.selectors, timeout_s, on_wait)
        t_actors = time.monotonic()
        p.reports = ray.get([a.report.remote() for a in p.actors], timeout=timeout_s)
        p.reports = [{**rep, "rank": i} for i, rep in enumerate(p.reports)]
        p.devices = [(rep["node_id"], rep["gpu"] if use_gpu else rep["cpu_slot"]) for rep in p.reports]
        if sorted(p.devices) != sorted((r.node, r.gpu) for r in plan.ranks):
            # Ray gave the bundles other GPUs than the plan's (a node offering Ray fewer than
            # it has): `place` asks for the plan's own, or says why it cannot.
            p.release(fence=False)
            return None
        p.adopt(plan)
        check_layout(plan, p.reports, use_gpu)
    except BaseException:
        p.release(fence=False)
        raise
    p.timings = {"placement_s": t_actors - t0, "actor_start_s": time.monotonic() - t_actors}
    return p


def check_layout(plan: Plan, reports: list[dict[str, Any]], use_gpu: bool) -> None:
    """Stop before training when an actor does not run on its planned node and device."""
    for want, got in zip(plan.ranks, reports):
        if got["node_id"] != want.node or (use_gpu and got["gpu"] != want.gpu):
            where = f"node {got['node_id'][:12]} GPU {got['gpu']}" if use_gpu else f"node {got['node_id'][:12]}"
            raise PlacementError(
                f"rank {want.rank} runs on {where} but the plan put it on node {want.node[:12]} "
                f"device {want.gpu}; the layout does not match the plan"
            )



def cpu_affinity(plan: Plan, topology) -> list[str | None]:
    """Each rank's CPU list near its device, as the probe found it (None when unknown)."""
    by_node = {n.node_id: {d.index: d.cpu_affinity for d in n.devices} for n in topology.nodes}
    return [by_node.get(r.node, {}).get(r.gpu) for r in plan.ranks]


def nccl_settings(plan: Plan, topology) -> list:
    """Each rank's NCCL settings, decided per node from its probed topology (`nccl_env`)."""
    from ..runtime.nccl_env import nccl_setup

    multi = len(set(plan.node_of_rank)) > 1
    by_node = {n.node_id: nccl_setup(n, multi) for n in topology.nodes if n.node_id in set(plan.node_of_rank)}
    return [by_node.get(r.node) for r in plan.ranks]
