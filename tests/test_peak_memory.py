"""A rank's measured peak memory: what the worker reports, and the summary's warning when it is
far from the plan's per-rank total."""

from __future__ import annotations

import json
import subprocess
import sys

from orchestrator.record.summary import PEAK_MEMORY_TOLERANCE, peak_memory_warning

# In a fresh process, so no earlier test's allocations have already raised its high-water mark.
_ALLOCATE = r"""
import json, torch
from orchestrator.runtime.worker import memory_baseline, memory_use
cpu = torch.device("cpu")
torch.ones(1 << 10).sum()  # torch's first-use setup (its thread pool) before the baseline, as a rank's is
base = memory_baseline(cpu)
x = torch.ones(64 << 20)  # 256 MiB, every page written
del x
print(json.dumps(memory_use(cpu, base).__dict__))
"""


def test_a_cpu_rank_reports_its_peak_resident_memory_above_the_baseline():
    out = subprocess.run([sys.executable, "-c", _ALLOCATE], capture_output=True, text=True, check=True, timeout=120)
    use = json.loads(out.stdout.strip().splitlines()[-1])
    assert use["source"] == "rss" and use["peak_reserved_bytes"] is None
    grown = use["peak_bytes"] - use["baseline_bytes"]
    # The freed tensor still counts: a high-water mark, not the resident set at the end.
    assert 0.95 * (256 << 20) < grown < 2 * (256 << 20), use
    assert use["baseline_bytes"] > 50 << 20  # the interpreter and torch, which the plan leaves out


_EARLIER_PEAK = r"""
import json, torch
from orchestrator.runtime.worker import memory_baseline, memory_use
cpu = torch.device("cpu")
y = torch.ones(128 << 20)  # 512 MiB touched and released before the baseline, as a warm-up might
del y
base = memory_baseline(cpu)
x = torch.ones(16 << 20)  # 64 MiB after it
del x
print(json.dumps(memory_use(cpu, base).__dict__))
"""


def test_what_a_rank_released_before_its_baseline_is_not_counted_as_its_peak():
    out = subprocess.run([sys.executable, "-c", _EARLIER_PEAK], capture_output=True, text=True, check=True,
                         timeout=120)
    use = json.loads(out.stdout.strip().splitlines()[-1])
    grown = use["peak_bytes"] - use["baseline_bytes"]
    assert 0.95 * (64 << 20) < grown < 2 * (64 << 20), use


def _finals(*grown: int, base: int = 300 << 20) -> list[dict]:
    return [{"memory": {"peak_bytes": base + g, "baseline_bytes": base, "peak_reserved_bytes": None,
                        "source": "rss"}} for g in grown]


def test_the_warning_names_the_rank_that_grew_most_only_beyond_the_tolerance():
    plan_total = 1000 << 20
    inside = int(plan_total * (1 + PEAK_MEMORY_TOLERANCE * 0.9))
    assert peak_memory_warning(plan_total, _finals(plan_total, inside)) is None
    assert peak_memory_warning(plan_total, _finals(int(plan_total * 0.75))) is None
    over = int(plan_total * 1.5)
    said = peak_memory_warning(plan_total, _finals(plan_total, over, plan_total))
    assert said is not None and "\n" not in said
    assert said.startswith("measured peak memory of rank 1, ") and f"{over:,}" in said and "30%" in said
    assert "rank 0" in peak_memory_warning(plan_total, _finals(plan_total // 2, plan_total // 3))
    # The default job's ranks: 191 MiB against a plan of 87 MiB is the process, not the plan.
    assert peak_memory_warning(87 << 20, _finals(191 << 20)) is None
    # nothing to compare against: no plan figure, or no ranks
    assert peak_memory_warning(0, _finals(over)) is None
    assert peak_memory_warning(plan_total, []) is None
