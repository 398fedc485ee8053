"""The run report: report.html, one self-contained page per run directory that shows what the
run chose (the plan and why, the topology, the rank layout), how it went (the loss curve, every
rank's step time, restarts, checkpoints) and how reality compared with the plan.

It is built from the run directory's files alone, so it can be rebuilt at any time
(`python -m orchestrator report RUN_DIR`), from any version's run directory, by a machine with
neither Ray nor torch. A section whose input is missing or damaged says so in one sentence and
the rest renders: a report is a view of a run and must never be the reason a run (or its
post-mortem) fails. The page loads nothing: every picture is inline SVG, the style is inline,
and there is no script.
"""

from __future__ import annotations

import html
import json
import logging
import math
import re
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

from ..planning.plan import Plan
from ..planning.render import render_svg as layout_svg
from ..planning.render import render_text as plan_text
from ..topology.model import ClusterTopology
from ..topology.render import render_svg as topology_svg
from ..units import format_bytes
from .curve import loss_svg
from .expert_map import WINDOW, expert_load_svg, summed_load
from .rundir import RunDir
from .straggler import SLOW_FACTOR

REPORT = "report.html"
RANK_TIMES = "rank_times.jsonl"
"""Every rank's own (step_s, exposed_comm_s) samples, one JSON line each, as `follow` receives them."""
REFRESH_S = 10.0
"""How often a running job's report is rewritten at most: it re-reads every file and redraws
every picture, cheap but not free."""
SAMPLES_PER_RANK = 1000
"""The newest samples per rank the per-rank chart takes its medians over: a long run's
rank_times.jsonl holds millions of lines, and what a rank does now is what matters."""
RUN_MARKERS = ("config.yaml", "plan.json", "summary.json")
"""A directory holding none of these is not a run directory."""
SECTIONS = ("run", "plan", "topology", "layout", "loss", "experts", "ranks", "predicted", "restarts", "checkpoints")

log = logging.getLogger(__name__)
esc = html.escape


# --- reading the run directory: every reader returns what it found or says why not -------------

@dataclass
class Loaded:
    """One input file: its content, or one clause saying why there is none."""

    data: Any = None
    missing: str | None = None


def load_json(path: Path, what: str) -> Loaded:
    """A JSON file; `what` says, for a missing file, why a run may lack it."""
    if not path.is_file():
        return Loaded(missing=f"{path.name} is absent ({what})")
    try:
        return Loaded(json.loads(path.read_text(errors="replace")))
    except (OSError, ValueError) as err:
        return Loaded(missing=f"{path.name} is unreadable ({type(err).__name__}: {str(err)[:120]})")


def load_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """The rows of a JSON-lines file; a line that does not parse (cut by a crash, or an append
    still under way) is skipped, not fatal."""
    try:
        with open(path, errors="replace") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if isinstance(row, dict):
                    yield row
    except OSError:
        return


def load_config(path: Path) -> dict[str, Any]:
    """config.yaml as plain data, {} when absent or damaged (only a few figures are taken from it)."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


@dataclass
class Inputs:
    """Everything the report shows, read once."""

    path: Path
    summary: Loaded
    plan_json: Loaded
    plan: Plan | None
    plan_missing: str | None
    topology: ClusterTopology | None
    topology_missing: str | None
    rows: list[dict[str, Any]] | None
    """metrics.jsonl's rows; None when the file is absent."""
    times: dict[int, list[tuple[float, float]]] | None
    """rank_times.jsonl by rank, the newest SAMPLES_PER_RANK each; None when the file is absent."""
    config: dict[str, Any]


def read_inputs(path: Path) -> Inputs:
    """Read the run directory; never raises for a damaged file."""
    summary = load_json(path / "summary.json", "written when the run ends")
    if summary.data is not None and not isinstance(summary.data, dict):
        summary = Loaded(missing="summary.json is not a JSON object")
    plan_json = load_json(path / "plan.json", "the run ended before it was planned")
    plan, plan_missing = parse_plan(plan_json)
    topology, topology_missing = parse_topology(path / "topology.json")
    rows = list(load_jsonl(path / "metrics.jsonl")) if (path / "metrics.jsonl").is_file() else None
    times = read_rank_times(path / RANK_TIMES) if (path / RANK_TIMES).is_file() else None
    return Inputs(path, summary, plan_json, plan, plan_missing, topology, topology_missing, rows, times,
                  load_config(path / "config.yaml"))


def parse_plan(plan_json: Loaded) -> tuple[Plan | None, str | None]:
    """plan.json as a Plan (the renderers want one), or why it is not one (a refused plan is
    still a plan; a plan.json of another version may lack a field)."""
    if plan_json.data is None:
        return None, plan_json.missing
    try:
        return Plan.from_dict(plan_json.data), None
    except Exception as err:  # any shape of damage: the report says so and goes on
        return None, f"plan.json does not read as a plan ({type(err).__name__}: {str(err)[:120]})"


def parse_topology(path: Path) -> tuple[ClusterTopology | None, str | None]:
    if not path.is_file():
        return None, "topology.json is absent (the run ended before the cluster was probed)"
    try:
        return ClusterTopology.from_json(path.read_text(errors="replace")), None
    except Exception as err:  # truncated or from another version
        return None, f"topology.json is unreadable ({type(err).__name__}: {str(err)[:120]})"


def read_rank_times(path: Path) -> dict[int, list[tuple[float, float]]]:
    """Each rank's newest (step_s, exposed_comm_s) samples in the newest world (`world`: the
    restarts before it; a restarted world numbers its ranks afresh, so an older world's rank 3
    may have run elsewhere); rows with a non-numeric field are skipped."""
    by_rank: dict[int, deque[tuple[float, float]]] = {}
    newest = 0
    for row in load_jsonl(path):
        rank, step_s, exposed = row.get("rank"), num(row.get("step_s")), num(row.get("exposed_comm_s"))
        if not isinstance(rank, int) or isinstance(rank, bool) or step_s is None:
            continue
        world = row.get("world", 0) if isinstance(row.get("world", 0), int) else 0
        if world > newest:
            newest, by_rank = world, {}
        elif world < newest:
            continue
        by_rank.setdefault(rank, deque(maxlen=SAMPLES_PER_RANK)).append((step_s, exposed or 0.0))
    return {r: list(xs) for r, xs in sorted(by_rank.items())}


# --- numbers and small HTML pieces ---------------------------------------------------------------

def num(x: Any) -> float | None:
    """x as a finite float, else None (None, NaN, inf, strings and booleans are all 'no value')."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x) if math.isfinite(x) else None


def fmt_s(x: Any) -> str:
    v = num(x)
    return "-" if v is None else f"{v * 1e3:,.1f} ms" if v < 10 else f"{v:,.1f} s"


def fmt_bytes(x: Any) -> str:
    return format_bytes(num(x), binary=True)


def fmt_num(x: Any, spec: str = ",.0f") -> str:
    v = num(x)
    return "-" if v is None else format(v, spec)


def ratio(measured: Any, predicted: Any) -> str:
    m, p = num(measured), num(predicted)
    return "-" if m is None or not p else f"{m / p:.2f}x"


def missing(sentence: str) -> str:
    """The one sentence a section shows for what it lacks."""
    return f'<p class="r-missing">{esc(sentence)}</p>'


def table(headers: list[str], rows: list[list[str]], cls: str = "") -> str:
    """A table of plain-text cells (escaped here)."""
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def scoped_svg(svg: str, scope: str) -> str:
    """An SVG with its <style> rules confined to `scope`: inlined in HTML, an SVG's style sheet
    applies to the whole page (the topology's `text { fill }` would recolour the labels of every
    other picture). The renderers write plain `selector { ... }` rules, no at-rules."""
    def scope_rules(css: str) -> str:
        return re.sub(r"([^{}]+)\{", lambda m: ", ".join(f"{scope} {s.strip()}" for s in m.group(1).split(","))
                      + " {", css)

    return re.sub(r"(<style[^>]*>)(.*?)(</style>)", lambda m: m.group(1) + scope_rules(m.group(2)) + m.group(3),
                  svg, flags=re.S)


def figure(svg: str, section: str, caption: str = "") -> str:
    cap = f"<figcaption>{esc(caption)}</figcaption>" if caption else ""
    return f'<figure class="r-figure">{scoped_svg(svg, "#" + section)}{cap}</figure>'


def drawn(section: str, draw: Callable[[], str], caption: str = "") -> str:
    """A picture, or the sentence saying why it could not be drawn (a renderer meeting data it
    does not expect must not take the report down)."""
    try:
        return figure(draw(), section, caption)
    except Exception as err:
        return missing(f"The picture could not be drawn ({type(err).__name__}: {str(err)[:120]}).")


# --- the sections --------------------------------------------------------------------------------

def run_state(inp: Inputs) -> str:
    """finished / stopped / failed from summary.json; without one the run is still going (or its
    driver died without a word, which the directory cannot tell apart)."""
    s = inp.summary.data
    if s is None:
        return "running" if "absent" in (inp.summary.missing or "") else "unknown"
    return "failed" if s.get("failed") else "stopped" if s.get("stopped") else "finished"


def last_updated(path: Path) -> str:
    """When anything in the run directory last changed, the report itself aside."""
    stamps = [p.stat().st_mtime for p in path.iterdir() if p.name not in (REPORT, REPORT + ".tmp") and p.exists()]
    return time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(max(stamps))) if stamps else "-"


def section_run(inp: Inputs) -> str:
    s = inp.summary.data or {}
    p = inp.plan_json.data if isinstance(inp.plan_json.data, dict) else {}
    state = run_state(inp)
    steps = s.get("steps") if s.get("steps") is not None else (inp.rows[-1].get("step") if inp.rows else None)
    max_steps = s.get("max_steps") or (inp.config.get("train") or {}).get("max_steps")
    items = [
        ("job", s.get("job") or inp.config.get("name") or inp.path.name),
        ("state", state + (f" ({s['signal']})" if s.get("signal") else "")),
        ("strategy", s.get("strategy") or p.get("strategy") or "-"),
        ("world size", s.get("world_size") or p.get("world_size") or "-"),
        ("steps", f"{steps if steps is not None else 0}" + (f" of {max_steps}" if max_steps else "")),
        ("final validation loss", fmt_num(s.get("final_val_loss"), ".4f")),
        ("last updated", last_updated(inp.path)),
        ("run directory", str(inp.path)),
    ]
    body = "".join(f"<dt>{esc(k)}</dt><dd>{esc(str(v))}</dd>" for k, v in items)
    failed = state == "failed"
    note = missing("The run failed: see Restarts for why, and logs/ for the ranks' output.") if failed else ""
    return f'<dl class="r-facts">{body}</dl>{note}'


def mesh_text(mesh: Any) -> str:
    """`dp_replicate=2 x dp_shard=1 x tp=1`, the named axes as the plan prints them."""
    if not isinstance(mesh, dict):
        return "-"
    return " x ".join(f"{k}={v}" for k, v in mesh.items() if k != "pp" or v != 1)


def section_plan(inp: Inputs) -> str:
    d = inp.plan_json.data
    if not isinstance(d, dict):
        return missing(f"No plan: {inp.plan_json.missing or 'plan.json is not a JSON object'}.")
    out = [f"<p><b>{esc(str(d.get('strategy', '?')))}</b> on {esc(mesh_text(d.get('mesh')))}: "
           f"{esc(str(d.get('reason', '')))}</p>"]
    if d.get("fits") is False:
        out.append(missing("The plan does not fit: the planner refused it, and plan.json says why."))
    out.append("<h3>Why</h3>")
    expl = d.get("explanation") or []
    out.append("<ul>" + "".join(f"<li>{esc(str(x))}</li>" for x in expl) + "</ul>" if expl
               else missing("plan.json has no explanation lines."))
    mesh = d["mesh"] if isinstance(d.get("mesh"), dict) else {}
    out.append("<h3>Mesh</h3>" + table(["axis", "size"], [[k, str(v)] for k, v in mesh.items()]))
    mem = d["memory_per_rank"] if isinstance(d.get("memory_per_rank"), dict) else {}
    out.append("<h3>Predicted memory per rank</h3>"
               + table(["part", "bytes"], [[k, fmt_bytes(v)] for k, v in mem.items()]))
    st = d["step_time"] if isinstance(d.get("step_time"), dict) else {}
    out.append("<h3>Predicted step time</h3>" + table(["part", "time"], [[k.removesuffix("_s"), fmt_s(v)]
                                                                            for k, v in st.items()]))
    out.append("<h3>Runners-up</h3>" + alternatives(d.get("alternatives")))
    out.append("<h3>Trial</h3>" + trial_text(d.get("trial")))
    if inp.plan is not None:
        text = plan_text(inp.plan, inp.topology)
        out.append("<details><summary>The plan as <code>plan</code> prints it</summary>"
                   f"<pre>{esc(text)}</pre></details>")
    else:
        out.append(missing(f"No full plan text: {inp.plan_missing}."))
    return "".join(out)


def alternatives(alts: Any) -> str:
    if not isinstance(alts, list) or not alts:
        return missing("plan.json lists no runners-up (one choice only, or a plan from before they were recorded).")
    rows = [[str(a.get("strategy", "?")), mesh_text(a.get("mesh")), str(a.get("micro_batch_size") or "-"),
             str(a.get("recompute") or "-"), fmt_s(a.get("step_time_s")), fmt_bytes(a.get("memory_per_rank")),
             "yes" if a.get("fits") else "no", str(a.get("reason", ""))] for a in alts if isinstance(a, dict)]
    headers = ["strategy", "mesh", "micro-batch", "recompute", "step time", "memory per rank", "fits", "why not"]
    if any(isinstance(a, dict) and a.get("cp_attention") for a in alts):
        # Context-parallel runners-up: how each one's attention sees the sequence.
        headers.insert(4, "cp attention")
        for row, a in zip(rows, [a for a in alts if isinstance(a, dict)]):
            row.insert(4, str(a.get("cp_attention") or "-"))
    return table(headers, rows)


def trial_text(trial: Any) -> str:
    """What the run's trial measured (plan.json's `trial`), or why there was none."""
    if not isinstance(trial, dict):
        return missing("plan.json records no trial (a plan from before trials were recorded).")
    if trial.get("skipped"):
        return f"<p>No trial: {esc(str(trial['skipped']))}.</p>"
    cands = [c for c in trial.get("candidates") or [] if isinstance(c, dict)]
    won = trial.get("winner")
    rows = [[str(c.get("label", "?")), str(c.get("strategy", "?")), mesh_text(c.get("mesh")), str(c.get("sync", "?")),
             fmt_s(c.get("predicted_step_s")), "failed: " + str(c["failed"]) if c.get("failed")
             else fmt_s(c.get("measured_step_s")), "kept" if i == won else ""] for i, c in enumerate(cands)]
    verdict = ("The measured steps overruled the cost model." if trial.get("overruled")
               else "The measured steps confirmed the cost model's choice.")
    cost = num(trial.get("cost_s"))
    return (f"<p>{verdict} {len(cands)} plans, {esc(str(trial.get('timed_steps', '?')))} timed steps each, in "
            f"{'?' if cost is None else f'{cost:.1f}'} s.</p>"
            + table(["plan", "strategy", "mesh", "sync", "predicted step", "measured step", ""], rows))


def section_topology(inp: Inputs) -> str:
    topology = inp.topology
    if topology is None:
        return missing(f"No topology picture: {inp.topology_missing}.")
    return drawn("topology", lambda: topology_svg(topology), "Devices and links of every node, as probed.")


def section_layout(inp: Inputs) -> str:
    plan, topology = inp.plan, inp.topology
    if plan is None:
        return missing(f"No rank layout: {inp.plan_missing}.")
    if topology is None:
        return missing(f"No rank layout: {inp.topology_missing}.")
    return drawn("layout", lambda: layout_svg(plan, topology), "Which rank runs on which device.")


def loss_points(rows: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    """(step, value) for the rows with an integer step and a finite value: gaps and NaN left out."""
    return [(r["step"], v) for r in rows
            if isinstance(r.get("step"), int) and (v := num(r.get(key))) is not None]


def section_loss(inp: Inputs) -> str:
    if inp.rows is None:
        return missing("No loss curve: metrics.jsonl is absent (the run has not finished a step yet, "
                       "or it died before its first).")
    train, val = loss_points(inp.rows, "loss"), loss_points(inp.rows, "val_loss")
    if not train and not val:
        return missing("No loss curve: metrics.jsonl holds no step with a finite loss yet.")
    s = inp.summary.data or {}
    # The untrained model's loss (step 0) is in the summary, not in metrics.jsonl; a resumed
    # run's first evaluation is not at step 0.
    first = num(s.get("first_val_loss"))
    if first is not None and not s.get("resumed_from") and not any(step == 0 for step, _ in val):
        val.insert(0, (0, first))
    restarts = [r["resumed_from_step"] for r in s.get("restarts") or []
                if isinstance(r, dict) and isinstance(r.get("resumed_from_step"), int)]
    title = f"{s.get('job') or inp.config.get('name') or 'run'}: train and validation loss"
    left_out = sum(1 for r in inp.rows if num(r.get("loss")) is None)
    note = f" {left_out} logged step(s) without a finite loss are left out." if left_out else ""
    return drawn("loss", lambda: loss_svg(train, val, title, restarts),
                 f"{len(train)} logged steps (every monitor.log_interval-th and every evaluation), "
                 f"{len(val)} validation points; dashed lines: restarts.{note}")


def has_experts(inp: Inputs) -> bool:
    """Whether the run logged expert load: a dense run's report has no experts section."""
    return any(isinstance(r.get("expert_tokens"), list) for r in inp.rows or [])


def section_experts(inp: Inputs) -> str:
    load = summed_load(inp.rows or [])
    if load is None:
        return missing("No expert load: no logged step carries a well-formed expert_tokens.")
    layers, experts = len(load.tokens), len(load.tokens[0])
    worst = max(range(layers), key=load.imbalance)
    first, last = load.steps
    return drawn("experts", lambda: expert_load_svg(load, f"tokens per expert over the layer's mean, "
                                                          f"steps {first}-{last}"),
                 f"{layers} MoE layer(s) x {experts} experts, summed over the newest {load.rows} logged "
                 f"step(s) (at most {WINDOW}); white is the mean, red above it, blue below. The most uneven "
                 f"layer is {worst}: {load.imbalance(worst):.2f}x its mean.")


@dataclass
class RankTiming:
    rank: int
    work_s: float
    """Median own work per step: step time less exposed communication."""
    exposed_s: float
    """Median exposed communication per step: mostly waiting for the slowest rank."""
    samples: int


def rank_timings(times: dict[int, list[tuple[float, float]]]) -> list[RankTiming]:
    """Per-rank medians, the work time computed as straggler.py computes it."""
    return [RankTiming(r, median(max(0.0, s - e) for s, e in xs), median(e for _, e in xs), len(xs))
            for r, xs in times.items() if xs]


def slow_ranks(timings: list[RankTiming], named: set[int]) -> tuple[float, set[int]]:
    """The median work time over ranks, and the ranks to highlight: those summary.json names as
    stragglers, and those over SLOW_FACTOR x the median (the rule the driver warns by)."""
    mid = median(t.work_s for t in timings)
    over = {t.rank for t in timings if len(timings) > 1 and mid > 0 and t.work_s > SLOW_FACTOR * mid}
    return mid, over | (named & {t.rank for t in timings})


def rank_svg(timings: list[RankTiming], slow: set[int], mid: float) -> str:
    """Stacked bars per rank: own work (blue; red when slow) under exposed communication (grey),
    with the median work and the SLOW_FACTOR threshold drawn across."""
    w, h, left, right, top, bottom = 720, 300, 64, 20, 30, 40
    n = len(timings)
    top_s = max(max(t.work_s + t.exposed_s for t in timings), SLOW_FACTOR * mid) * 1.1 or 1.0
    slot = (w - left - right) / n
    bar = max(1.0, min(40.0, slot * 0.7))
    label_every = max(1, math.ceil(n / 32))

    def y(v: float) -> float:
        return top + (h - top - bottom) * (1 - v / top_s)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
           'font-family="Helvetica, Arial, sans-serif" font-size="11">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<line x1="{left}" y1="{h - bottom}" x2="{w - right}" y2="{h - bottom}" stroke="#333"/>',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{h - bottom}" stroke="#333"/>',
           f'<text x="{left - 6}" y="{y(top_s / 1.1) + 4:.1f}" text-anchor="end">{top_s / 1.1 * 1e3:.3g}</text>',
           f'<text x="{left - 6}" y="{h - bottom + 4}" text-anchor="end">0</text>',
           f'<text transform="translate(16 {(top + h - bottom) / 2}) rotate(-90)" '
           'text-anchor="middle">ms per step</text>',
           f'<text x="{(left + w - right) / 2}" y="{h - 6}" text-anchor="middle">rank</text>']
    for i, t in enumerate(timings):
        x = left + slot * i + (slot - bar) / 2
        is_slow = t.rank in slow
        tip = (f"rank {t.rank}: work {t.work_s * 1e3:.1f} ms, exposed comm {t.exposed_s * 1e3:.1f} ms "
               f"({t.samples} samples)" + (f"; slow: {t.work_s / mid:.2f}x the median work" if is_slow and mid else ""))
        marked = ' class="r-rank r-slow" data-straggler="true"' if is_slow else ' class="r-rank"'
        out.append(f'<g{marked} data-rank="{t.rank}"><title>{esc(tip)}</title>')
        out.append(f'<rect x="{x:.1f}" y="{y(t.work_s):.1f}" width="{bar:.1f}" '
                   f'height="{y(0) - y(t.work_s):.1f}" fill="{"#d62728" if is_slow else "#4c78a8"}"/>')
        out.append(f'<rect x="{x:.1f}" y="{y(t.work_s + t.exposed_s):.1f}" width="{bar:.1f}" '
                   f'height="{y(t.work_s) - y(t.work_s + t.exposed_s):.1f}" fill="#bbbbbb"/>')
        if is_slow:
            out.append(f'<text x="{x + bar / 2:.1f}" y="{y(t.work_s + t.exposed_s) - 4:.1f}" text-anchor="middle" '
                       f'fill="#d62728" font-weight="bold">slow</text>')
        if i % label_every == 0:
            out.append(f'<text x="{x + bar / 2:.1f}" y="{h - bottom + 14}" text-anchor="middle">{t.rank}</text>')
        out.append("</g>")
    for v, label, dash in ((mid, f"median work {mid * 1e3:.1f} ms", "4 3"),
                           (SLOW_FACTOR * mid, f"{SLOW_FACTOR}x median", "2 3")):
        out.append(f'<line x1="{left}" y1="{y(v):.1f}" x2="{w - right}" y2="{y(v):.1f}" stroke="#555" '
                   f'stroke-dasharray="{dash}"/>')
        out.append(f'<text x="{w - right}" y="{y(v) - 3:.1f}" text-anchor="end" fill="#555" paint-order="stroke" '
                   f'stroke="white" stroke-width="3">{esc(label)}</text>')  # the halo keeps it legible over a bar
    out.append(f'<rect x="{left + 8}" y="8" width="10" height="10" fill="#4c78a8"/>'
               f'<text x="{left + 22}" y="17">own work</text>'
               f'<rect x="{left + 88}" y="8" width="10" height="10" fill="#bbbbbb"/>'
               f'<text x="{left + 102}" y="17">exposed communication</text>'
               f'<rect x="{left + 238}" y="8" width="10" height="10" fill="#d62728"/>'
               f'<text x="{left + 252}" y="17">slow rank</text>')
    out.append("</svg>")
    return "\n".join(out)


def section_ranks(inp: Inputs) -> str:
    if inp.times is None:
        return missing(f"No per-rank timings: {RANK_TIMES} is absent (runs before this version do not write it).")
    timings = rank_timings(inp.times)
    if not timings:
        return missing(f"No per-rank timings: {RANK_TIMES} holds no sample yet.")
    named_rows = [s for s in (inp.summary.data or {}).get("stragglers") or [] if isinstance(s, dict)]
    named = {s["rank"] for s in named_rows if isinstance(s.get("rank"), int)}
    mid, slow = slow_ranks(timings, named)
    out = [drawn("ranks", lambda: rank_svg(timings, slow, mid),
                 f"Median per step over each rank's newest {SAMPLES_PER_RANK} samples; a rank whose own work is over "
                 f"{SLOW_FACTOR}x the median ({mid * 1e3:.1f} ms) holds every other rank back.")]
    if slow:
        by_rank = {t.rank: t for t in timings}
        where = {s["rank"]: s for s in named_rows if isinstance(s.get("rank"), int)}
        out.append(table(["slow rank", "work per step", "x median", "node", "GPU", "link"],
                         [[str(r), fmt_s(by_rank[r].work_s), f"{by_rank[r].work_s / mid:.2f}" if mid else "-",
                           str(where.get(r, {}).get("node") or "-"), str(where.get(r, {}).get("gpu", "-")),
                           str(where.get(r, {}).get("link") or "-")] for r in sorted(slow)], "r-slow-table"))
    else:
        out.append(f"<p>No rank is slower than {SLOW_FACTOR}x the median work time.</p>")
    return "".join(out)


def tokens_per_step(config: dict[str, Any]) -> int | None:
    """Sequences per optimizer step times tokens per sequence, from config.yaml."""
    batch = (config.get("train") or {}).get("global_batch_size")
    block = (config.get("model") or {}).get("block_size")
    return batch * block if isinstance(batch, int) and isinstance(block, int) else None


def model_state_bytes(measured: Any) -> float | None:
    """The largest rank's params + grads + optimizer bytes, as summary.py compares them."""
    if not isinstance(measured, list):
        return None
    sums = [sum(v for v in m.values() if num(v) is not None) for m in measured if isinstance(m, dict)]
    return max(sums) if sums else None


def so_far(rows: list[dict[str, Any]] | None, key: str) -> float | None:
    """The median of a metrics column, for a run that has no measured summary yet."""
    vals = [v for r in rows or [] if (v := num(r.get(key))) is not None]
    return median(vals) if vals else None


def section_predicted(inp: Inputs) -> str:
    s = inp.summary.data or {}
    pred = s["predicted"] if isinstance(s.get("predicted"), dict) else predicted_from_plan(inp.plan_json.data)
    meas = s["measured"] if isinstance(s.get("measured"), dict) else None
    out = []
    if meas is None:
        why = ("summary.json has no `measured` (written by runs before this version, or by a run that did not "
               "finish)" if inp.summary.data is not None else inp.summary.missing)
        out.append(missing(f"No final measurements: {why}; the measured figures below are medians of "
                           "metrics.jsonl so far."))
        meas = {"step_s": so_far(inp.rows, "step_s"), "exposed_comm_s": so_far(inp.rows, "exposed_comm_s"),
                "tokens_per_s": so_far(inp.rows, "tokens_per_s")}
    else:
        meas = {**meas, "tokens_per_s": s.get("tokens_per_s")}
    tps = tokens_per_step(inp.config)
    pred = {**pred, "tokens_per_s": tps / pred["step_s"] if tps and num(pred.get("step_s")) else None}
    out.append(comparison(pred, meas))
    out.append(peak_memory(pred, meas))
    warnings = [w for w in s.get("warnings") or [] if isinstance(w, str)]
    out.append("<h3>Warnings</h3>" + ("<ul>" + "".join(f"<li>{esc(w)}</li>" for w in warnings) + "</ul>"
                                      if warnings else "<p>none</p>"))
    return "".join(out)


def predicted_from_plan(plan: Any) -> dict[str, Any]:
    """The predictions summary.json would hold, from plan.json (a run without a summary yet)."""
    plan = plan if isinstance(plan, dict) else {}
    st = plan.get("step_time") if isinstance(plan.get("step_time"), dict) else {}
    mem = plan.get("memory_per_rank") if isinstance(plan.get("memory_per_rank"), dict) else {}
    state = [num(mem.get(k)) for k in ("params", "grads", "optimizer")]
    return {"step_s": st.get("total_s"), "exposed_comm_s": st.get("exposed_comm_s"),
            "model_state_bytes_per_rank": sum(state) if None not in state else None,
            "peak_memory_bytes_per_rank": mem.get("total")}


def comparison(pred: dict[str, Any], meas: dict[str, Any]) -> str:
    """Step time, exposed communication, tokens/s and model-state bytes: predicted, measured, ratio."""
    state_meas = model_state_bytes(meas.get("model_state_bytes_per_rank"))
    rows = [[what, fmt(pred.get(key)), fmt(meas.get(key)), ratio(meas.get(key), pred.get(key))]
            for what, key, fmt in (("step time", "step_s", fmt_s),
                                   ("exposed communication", "exposed_comm_s", fmt_s),
                                   ("tokens/s", "tokens_per_s", fmt_num))]
    rows.append(["model-state bytes per rank (largest)", fmt_bytes(pred.get("model_state_bytes_per_rank")),
                 fmt_bytes(state_meas), ratio(state_meas, pred.get("model_state_bytes_per_rank"))])
    return table(["", "predicted", "measured", "measured / predicted"], rows)


def peak_memory(pred: dict[str, Any], meas: dict[str, Any]) -> str:
    """Each rank's measured peak beside the plan's per-rank total; peak less baseline is what the
    plan counts (the baseline is the interpreter and its libraries)."""
    peaks = meas.get("peak_memory_bytes_per_rank")
    if not isinstance(peaks, list) or not peaks:
        return missing("No peak memory per rank: summary.json's `measured` does not hold it.")
    bases = meas.get("baseline_memory_bytes_per_rank")
    bases = bases if isinstance(bases, list) and len(bases) == len(peaks) else [None] * len(peaks)
    total = pred.get("peak_memory_bytes_per_rank")
    rows = []
    for r, (p, b) in enumerate(zip(peaks, bases)):
        peak, base = num(p), num(b)
        grown = peak - base if peak is not None and base is not None else None
        rows.append([str(r), fmt_bytes(p), fmt_bytes(b), fmt_bytes(grown), fmt_bytes(total), ratio(grown, total)])
    source = meas.get("memory_source") or "-"
    headers = ["rank", "peak", "baseline", "peak - baseline", "predicted", "(peak - baseline) / predicted"]
    return f"<h3>Peak memory per rank ({esc(str(source))})</h3>" + table(headers, rows)


def section_restarts(inp: Inputs) -> str:
    s = inp.summary.data
    if s is None:
        return missing(f"Restarts are not known yet: {inp.summary.missing}.")
    restarts = [r for r in s.get("restarts") or [] if isinstance(r, dict)]
    if not restarts:
        return "<p>none</p>"
    rows = [[str(r.get("detected_at") or r.get("time") or "-"), "grow" if r.get("grow") else "failure",
             str(r.get("reason", "-")), ", ".join(map(str, r.get("ranks") or [])) or "-",
             ", ".join(str(n)[:12] for n in r.get("nodes") or []) or "-", str(r.get("failed_at_step", "-")),
             str(r.get("resumed_from_step", "-")), str(r.get("steps_lost", "-")), recovery_text(r.get("recovery")),
             cost_text(r.get("breakdown")), str(r.get("stacks") or "-")]
            for r in restarts]
    lost = sum(r.get("steps_lost") or 0 for r in restarts if isinstance(r.get("steps_lost"), int))
    return (f"<p>{len(restarts)} restart(s), {lost} step(s) trained again.</p>"
            + table(["detected", "kind", "cause", "ranks", "nodes", "at step", "resumed from", "steps lost",
                     "recovery", "cost", "stacks"], rows))


def recovery_text(recovery: Any) -> str:
    """How the run recovered: survivors kept (which ranks were replaced) or the whole world restarted (why)."""
    if not isinstance(recovery, dict):
        return "-"
    if recovery.get("kind") == "kept_survivors":
        return f"kept {recovery.get('kept', '?')} rank(s), replaced {recovery.get('replaced', '?')}"
    return f"whole world restarted: {recovery.get('why', '?')}"


def cost_text(breakdown: Any) -> str:
    """The restart's seconds to its first step, and its largest part."""
    if not isinstance(breakdown, dict) or num(breakdown.get("total_s")) is None:
        return "-"
    largest = breakdown.get("largest")
    part = (f" (largest: {str(largest).removesuffix('_s').replace('_', ' ')} {num(breakdown.get(largest)) or 0:.1f} s)"
            if largest else "")
    return f"{num(breakdown['total_s']):.1f} s{part}"


STEP_DIR = re.compile(r"step_(\d+)$")


def section_checkpoints(inp: Inputs) -> str:
    s = inp.summary.data or {}
    listed = s.get("checkpoints")
    if isinstance(listed, list) and listed:
        rows = [[m.group(1).lstrip("0") or "0" if (m := STEP_DIR.search(str(c).rstrip("/"))) else "-", str(c)]
                for c in listed]
        return table(["step", "checkpoint"], rows)
    found = sorted(p for p in (inp.path / "checkpoints").glob("step_*") if p.is_dir())
    if not found:
        return missing("No committed checkpoint: summary.json lists none and checkpoints/ holds no step_* directory.")
    # meta.json is written last, when every rank's shards are in: without it the step is unfinished.
    rows = [[str(int(m.group(1))) if (m := STEP_DIR.search(p.name)) else "-", str(p),
             "committed" if (p / "meta.json").is_file() else "not committed"] for p in found]
    return (missing("summary.json lists no checkpoints; these are the step_* directories of checkpoints/.")
            + table(["step", "checkpoint", "state"], rows))


# --- the page ------------------------------------------------------------------------------------

TITLES = {"run": "Run", "plan": "Plan and why", "topology": "Topology", "layout": "Rank layout", "loss": "Loss",
          "experts": "Expert load", "ranks": "Per-rank step time", "predicted": "Predicted against measured",
          "restarts": "Restarts", "checkpoints": "Checkpoints"}
BUILDERS: dict[str, Callable[[Inputs], str]] = {
    "run": section_run, "plan": section_plan, "topology": section_topology, "layout": section_layout,
    "loss": section_loss, "experts": section_experts, "ranks": section_ranks, "predicted": section_predicted,
    "restarts": section_restarts, "checkpoints": section_checkpoints}

STYLE = """
body { font-family: Helvetica, Arial, sans-serif; margin: 0 auto; max-width: 1200px; padding: 0 16px 48px;
       color: #222; }
nav { position: sticky; top: 0; background: #fff; padding: 8px 0; border-bottom: 1px solid #ddd; }
nav a { margin-right: 12px; color: #1f5fa8; text-decoration: none; }
section { border-bottom: 1px solid #eee; padding: 8px 0 16px; }
h1 { font-size: 22px; } h2 { font-size: 18px; } h3 { font-size: 14px; margin: 14px 0 4px; }
table { border-collapse: collapse; font-size: 13px; margin: 4px 0; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f5f5f5; }
.r-facts { display: grid; grid-template-columns: max-content auto; gap: 2px 16px; }
.r-facts dt { font-weight: bold; } .r-facts dd { margin: 0; }
.r-missing { color: #8a5a00; background: #fff8e6; padding: 4px 8px; border-left: 3px solid #e0a800; }
.r-figure { margin: 8px 0; overflow-x: auto; }
.r-figure figcaption { font-size: 12px; color: #555; }
.r-slow-table td { background: #fdecea; }
pre { font-size: 12px; background: #f7f7f7; padding: 8px; overflow-x: auto; }
"""


def section(name: str, inp: Inputs) -> str:
    """One section; a builder that raises (data this code did not foresee) costs that section only."""
    try:
        body = BUILDERS[name](inp)
    except Exception as err:
        body = missing(f"This section could not be built ({type(err).__name__}: {str(err)[:160]}).")
    return f'<section id="{name}"><h2>{esc(TITLES[name])}</h2>{body}</section>'


def build_report(run_path: str | Path) -> str:
    """report.html's text for the run directory at `run_path`; reads files only, never raises for a
    damaged or partial run directory."""
    path = Path(run_path)
    inp = read_inputs(path)
    name = (inp.summary.data or {}).get("job") or inp.config.get("name") or path.name
    shown = [n for n in SECTIONS if n != "experts" or has_experts(inp)]
    nav = "".join(f'<a href="#{n}">{esc(TITLES[n])}</a>' for n in shown)
    body = "\n".join(section(n, inp) for n in shown)
    made = time.strftime("%Y-%m-%d %H:%M:%S %z")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{esc(str(name))}: run report</title><style>{STYLE}</style></head><body>"
            f"<h1>{esc(str(name))}: {esc(path.name)}</h1><nav>{nav}</nav>\n{body}\n"
            f"<footer><p>Built {esc(made)} by <code>python -m orchestrator report</code> from the files of this run "
            "directory.</p></footer></body></html>\n")


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and any((path / m).is_file() for m in RUN_MARKERS)


def write_report(run: RunDir) -> Path | None:
    """Write report.html (atomically: a browser reloading it never sees half a page); returns its
    path, or None after logging why not: the report must never fail the run that writes it."""
    try:
        return run.write_text(REPORT, build_report(run.path))
    except Exception as err:
        log.warning("could not write %s: %s: %s", run.path / REPORT, type(err).__name__, err)
        return None


class LiveReport:
    """report.html kept current while a run goes: rewritten at most every `every_s` (longer when
    a rewrite is slow, so the driver's loop, which also watches for hangs, spends no more than
    about 1/BACKOFF of its time on it), and its first failure said once through `warn`: the run
    goes on regardless."""

    BACKOFF = 20

    def __init__(self, run: RunDir, warn: Callable[[str], None], every_s: float = REFRESH_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.run, self.warn, self.every_s, self.clock = run, warn, every_s, clock
        self.next_at: float | None = None
        self.warned = False

    def maybe(self) -> None:
        """Rewrite unless the next rewrite is not due yet."""
        if self.next_at is None or self.clock() >= self.next_at:
            self.now()

    def now(self) -> None:
        started = self.clock()
        try:
            self.run.write_text(REPORT, build_report(self.run.path))
        except Exception as err:
            if not self.warned:
                self.warned = True
                self.warn(f"could not write {REPORT} ({type(err).__name__}: {err}); the run goes on without it")
        took = self.clock() - started
        self.next_at = started + max(self.every_s, self.BACKOFF * took)
