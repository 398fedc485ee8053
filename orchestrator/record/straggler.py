"""Which rank is consistently slow, from every rank's own step and exposed-communication times.

In a synchronous step every rank's step time is about the same (the fast ones wait in the
collective), so the signal is a rank's own work: its step time minus its exposed communication.
A rank whose median work time exceeds SLOW_FACTOR x the median over ranks in most of its
windows is a straggler; the others wait for it, which shows as their exposed communication.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import median
from typing import Any

SLOW_FACTOR = 1.3
"""A rank is slow when its work time exceeds this multiple of the median over ranks."""
MIN_STEPS = 5
"""Steps a rank must have reported before it is judged."""


@dataclass
class StragglerTracker:
    """Per-rank (step_s, exposed_comm_s) samples, as the ranks report them in batches."""

    samples: dict[int, list[tuple[float, float | None]]] = field(default_factory=dict)

    def add(self, rank: int, times: list[tuple[float, float | None]]) -> None:
        self.samples.setdefault(rank, []).extend(times)

    def report(self, where: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
        """Ranks whose median work time is over SLOW_FACTOR x the median of all ranks', slowest
        first, each with how much slower it is and where it runs: `where[rank]` is the plan's
        placement (`node`, `gpu`, and `nic`, the link it reaches other nodes by, where known)."""
        work = {r: median(max(0.0, s - (e or 0.0)) for s, e in xs)
                for r, xs in self.samples.items() if len(xs) >= MIN_STEPS}
        if len(work) < 2:
            return []
        mid = median(work.values())
        if mid <= 0:
            return []
        slow = [{"rank": r, "node": where.get(r, {}).get("node"), "gpu": where.get(r, {}).get("gpu"),
                 "link": where.get(r, {}).get("nic"), "work_s": w, "median_work_s": mid, "ratio": w / mid}
                for r, w in work.items() if w > SLOW_FACTOR * mid]
        return sorted(slow, key=lambda s: -s["ratio"])


def describe(slow: list[dict[str, Any]]) -> str:
    """One line for the progress view."""
    return "; ".join(f"rank {s['rank']} on {(s['node'] or '?')[:12]}"
                     + (f" GPU {s['gpu']}" if s.get("gpu") is not None else "")
                     + (f" (link {s['link']})" if s.get("link") else "")
                     + f" is {s['ratio']:.1f}x the median work time" for s in slow)
