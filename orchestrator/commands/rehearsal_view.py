"""`plan --rehearse`: rehearse the plan's step and set it beside the plan's predictions."""

from __future__ import annotations

from typing import Any

from ..config import JobConfig
from ..planning import Plan
from ..planning.model_spec import ModelSpec
from ..topology.model import ClusterTopology
from ..units import format_bytes


def rehearsal_report(cfg: JobConfig, plan: Plan, topo: ClusterTopology, spec: ModelSpec | None) -> dict[str, Any]:
    """The `rehearsal` object of `plan --rehearse --json`: every rehearsed rank's peak beside
    the predicted one, its collectives beside the predicted ones, and the differences in words."""
    from ..planning import job_context
    from ..planning.rehearsal import MEMORY_TOLERANCE, collective_rows, predicted_peak_bytes, relative_gap
    from ..planning.traffic import predicted_traffic
    from ..runtime.rehearse import rehearse

    ctx = job_context(cfg, topo, spec)
    done = rehearse(cfg, plan, vocab=spec.vocab if spec else None)
    ranks, collectives, differences = [], [], []
    for r in done.ranks:
        predicted = predicted_peak_bytes(ctx, plan, r.rank)
        ranks.append({"rank": r.rank, "stage": r.stage, "peak_bytes": r.peak_bytes,
                      "predicted_peak_bytes": predicted, "seconds": r.seconds, "notes": list(r.notes)})
        gap = relative_gap(r.peak_bytes, predicted)
        if gap > MEMORY_TOLERANCE:
            differences.append(f"rank {r.rank}: peak memory {_gb(r.peak_bytes)} rehearsed, {_gb(predicted)} "
                               f"predicted ({_pct(r.peak_bytes, predicted)})")
        rows = collective_rows([(c.op, c.axis, c.count, c.bytes) for c in r.collectives],
                               predicted_traffic(ctx, plan, r.rank))
        for row in rows:
            collectives.append({"rank": r.rank, **row.to_dict()})
            if row.differs:
                differences.append(f"rank {r.rank}: {row.op} on {row.axis}: {row.count} call(s), "
                                   f"{_gb(row.bytes)} rehearsed; {row.predicted_count} call(s), "
                                   f"{_gb(row.predicted_bytes)} predicted ({_pct(row.bytes, row.predicted_bytes)})")
    return {"ranks": ranks, "collectives": collectives, "differences": differences}


def _gb(x: float) -> str:
    # Two places of MB: a rehearsed collective is often a few MB, and its miss against the plan small.
    return format_bytes(x, megabyte_places=2)


def _pct(measured: float, predicted: float) -> str:
    if not measured:
        return "not rehearsed"
    if not predicted:
        return "not predicted"
    return f"plan {100 * (predicted / measured - 1):+.0f}%"


def render_rehearsal(report: dict[str, Any]) -> str:
    """The report as a short table per rehearsed rank, then the differences in words."""
    from io import StringIO

    from rich.console import Console
    from rich.table import Table

    buf = StringIO()
    console = Console(file=buf, width=120, highlight=False)
    for r in report["ranks"]:
        table = Table(title=f"rehearsal of rank {r['rank']} (stage {r['stage']}), {r['seconds']:.1f} s",
                      title_justify="left")
        for col in ("", "calls", "rehearsed", "calls (plan)", "plan"):
            table.add_column(col, justify="left" if not col else "right")
        table.add_row("peak memory", "", _gb(r["peak_bytes"]), "", _gb(r["predicted_peak_bytes"]))
        for c in (c for c in report["collectives"] if c["rank"] == r["rank"]):
            table.add_row(f"{c['op']} on {c['axis']}", str(c["count"]), _gb(c["bytes"]),
                          str(c["predicted_count"]), _gb(c["predicted_bytes"]))
        console.print(table)
        for note in r["notes"]:
            console.print(f"  note: {note}")
    if report["differences"]:
        console.print("plan and rehearsal differ by more than 10%:")
        for line in report["differences"]:
            console.print(f"  {line}")
    else:
        console.print("plan and rehearsal agree within 10% (memory and every collective's bytes)")
    return buf.getvalue().rstrip()
