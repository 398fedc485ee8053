"""The run report (report.html): every section from a complete run directory, each section saying
what it lacks for an older, dead or damaged one, nothing loaded from outside the page, the
`report` command, the per-rank timings the driver now keeps, and the check a real run's report
passes in headless Chromium (run on test_prometheus_dashboard.py's run)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from orchestrator.cli import main
from orchestrator.config import load_config, to_yaml
from orchestrator.planning import plan_job
from orchestrator.record.report import (
    RANK_TIMES,
    REPORT,
    SECTIONS,
    LiveReport,
    build_report,
    write_report,
)
from orchestrator.record.report import (
    alternatives as report_alternatives,
)
from orchestrator.record.rundir import RunDir
from orchestrator.topology.files import load_topology_file
from orchestrator.topology.model import ClusterTopology

ROOT = Path(__file__).resolve().parent.parent
TOPOLOGY = ROOT / "tests/fixtures/topology/topo_4gpu_pcie_pxb_pix_nccl667.txt"
PICTURES = ("topology", "layout", "loss", "ranks")
SLOW_RANK = 2
DENSE_SECTIONS = [s for s in SECTIONS if s != "experts"]
"""A run that logged no expert load has no experts section."""


# --- synthetic run directories ------------------------------------------------------------------

@pytest.fixture(scope="module")
def planned():
    """A real plan of the default job on a 4-GPU PCIe box, as plan.json and topology.json hold it."""
    cfg = load_config(str(ROOT / "jobs/llm.yaml"), ["cluster.gpu=A100"])
    topology = ClusterTopology(nodes=[load_topology_file(str(TOPOLOGY))])
    return cfg, plan_job(cfg, topology), topology


def _metrics(steps: int = 20) -> list[dict]:
    return [{"step": s, "time": 1.0e9 + s, "loss": 5.0 - 0.1 * s, "lr": 1e-3, "tokens_per_s": 1000.0,
             "step_s": 0.2, "exposed_comm_s": 0.01, "grad_norm": 1.0, "mfu": 0.3,
             "val_loss": 5.0 - 0.1 * s if s % 5 == 0 else None} for s in range(1, steps + 1)]


def _rank_times(world: int = 4, slow: int | None = SLOW_RANK) -> list[dict]:
    # The slow rank works 2x as long; the others wait for it, which shows as their exposed comm.
    return [{"rank": r, "step_s": 0.4, "exposed_comm_s": 0.0 if r == slow else 0.2} for _ in range(8)
            for r in range(world)]


def _summary(plan, run: Path) -> dict:
    return {
        "job": "llm", "strategy": str(plan.strategy), "world_size": plan.world_size, "mesh": plan.mesh.to_dict(),
        "steps": 20, "first_val_loss": 4.5, "final_val_loss": 3.0, "tokens_per_s": 1000.0, "step_s": 0.2,
        "wall_s": 10.0, "checkpoints": [str(run / "checkpoints/step_00000010"), str(run / "checkpoints/step_00000020")],
        "predicted": {"step_s": 0.1, "exposed_comm_s": 0.005, "model_state_bytes_per_rank": 13_000_000,
                      "peak_memory_bytes_per_rank": 90_000_000},
        "measured": {"step_s": 0.2, "exposed_comm_s": 0.01,
                     "model_state_bytes_per_rank": [{"params": 3_000_000, "grads": 3_000_000,
                                                     "optimizer": 6_000_000}] * 4,
                     "peak_memory_bytes_per_rank": [500_000_000] * 4,
                     "baseline_memory_bytes_per_rank": [400_000_000] * 4,
                     "peak_reserved_bytes_per_rank": [None] * 4, "memory_source": "rss"},
        "warnings": ["measured step time 0.2s differs from the plan's 0.1s by more than 2x"],
        "restarts": [{"time": "2026-12-05T10:00:00+0000", "detected_at": "2026-12-05T09:59:58+0000",
                      "detected_unix_s": 1.0, "reason": "worker died: <killed> & gone", "ranks": [1],
                      "nodes": ["abcdef0123456789"], "failed_at_step": 14, "resumed_from_step": 10,
                      "steps_lost": 4, "recovery": {"kind": "kept_survivors", "replaced": [1], "kept": 3},
                      "breakdown": {"detection_s": 0.2, "actor_start_s": 3.1, "total_s": 5.5,
                                    "largest": "actor_start_s"}}],
        "stragglers": [{"rank": SLOW_RANK, "node": "node0", "gpu": SLOW_RANK, "link": None, "work_s": 0.4,
                        "median_work_s": 0.2, "ratio": 2.0}],
    }


def _trial(plan) -> dict:
    """plan.json's `trial` as a run writes it: the equal-links plan measured faster and kept."""
    row = {"strategy": str(plan.strategy), "mesh": plan.mesh.to_dict(), "sync": "hierarchical",
           "predicted_step_s": 0.1, "failed": None}
    return {"candidates": [{**row, "label": "planned", "measured_step_s": 0.3},
                           {**row, "label": "equal links", "sync": "flat", "measured_step_s": 0.2},
                           {**row, "label": "runner-up", "measured_step_s": None, "failed": "RuntimeError: <oom>"}],
            "winner": 1, "overruled": True, "timed_steps": 3, "cost_s": 4.2, "budget_s": None}


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _complete(tmp_path: Path, planned) -> Path:
    cfg, plan, topology = planned
    run = tmp_path / "llm-20261205-100000"
    run.mkdir()
    (run / "config.yaml").write_text(to_yaml(cfg))
    (run / "topology.json").write_text(topology.to_json())
    (run / "plan.json").write_text(json.dumps({**plan.to_dict(), "trial": _trial(plan)}))
    _write_jsonl(run / "metrics.jsonl", _metrics())
    _write_jsonl(run / RANK_TIMES, _rank_times())
    (run / "summary.json").write_text(json.dumps(_summary(plan, run)))
    for step in (10, 20):
        (run / f"checkpoints/step_{step:08d}").mkdir(parents=True)
    return run


def _sections(page: str) -> dict[str, str]:
    """Each section's HTML by its id."""
    found = re.findall(r'<section id="([a-z]+)">(.*?)</section>', page, flags=re.S)
    return dict(found)


def _said(body: str) -> list[str]:
    """The sentences a section says about what it lacks."""
    return re.findall(r'<p class="r-missing">(.*?)</p>', body, flags=re.S)


# --- what the report shows ----------------------------------------------------------------------

def test_a_complete_run_has_every_section_each_picture_and_its_straggler_marked(tmp_path, planned):
    page = build_report(_complete(tmp_path, planned))
    sections = _sections(page)
    assert list(sections) == DENSE_SECTIONS
    for name in PICTURES:
        assert "<svg" in sections[name], name
    assert all(not _said(body) for body in sections.values()), {k: _said(v) for k, v in sections.items()}
    assert "finished" in sections["run"] and "20 of 300" in sections["run"]
    _, plan, _ = planned
    for line in plan.explanation:  # the plan's why, escaped
        assert line.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;") in sections["plan"]
    assert "dp_replicate" in sections["plan"] and "Runners-up" in sections["plan"]
    assert "The measured steps overruled the cost model. 3 plans, 3 timed steps each, in 4.2 s." in sections["plan"]
    assert re.search(r"<td>equal links</td>(<td>[^<]*</td>){4}<td>200.0 ms</td><td>kept</td>", sections["plan"])
    assert "failed: RuntimeError: &lt;oom&gt;" in sections["plan"]
    # The straggler is marked in the picture and listed under it.
    assert re.search(rf'<g class="r-rank r-slow" data-straggler="true" data-rank="{SLOW_RANK}">', sections["ranks"])
    assert sections["ranks"].count('data-straggler="true"') == 1
    assert "r-slow-table" in sections["ranks"]
    assert "2.00x" in sections["predicted"]  # measured step time over predicted
    assert "by more than 2x" in sections["predicted"]
    assert "worker died: &lt;killed&gt; &amp; gone" in sections["restarts"]  # escaped
    assert "kept 3 rank(s), replaced [1]" in sections["restarts"]
    assert "5.5 s (largest: actor start 3.1 s)" in sections["restarts"]
    assert "step_00000020" in sections["checkpoints"]


def test_a_rank_over_the_slow_factor_is_marked_while_the_run_goes(tmp_path, planned):
    run = _complete(tmp_path, planned)
    (run / "summary.json").unlink()  # running: no summary, so no named stragglers yet
    sections = _sections(build_report(run))
    assert "running" in sections["run"]
    assert f'data-straggler="true" data-rank="{SLOW_RANK}"' in sections["ranks"]
    assert any("summary.json is absent" in s for s in _said(sections["restarts"]))
    assert "<svg" in sections["loss"]


@pytest.mark.parametrize("summary, state", [({"stopped": True, "signal": "SIGTERM", "steps": 3}, "stopped (SIGTERM)"),
                                            ({"failed": True}, "failed")])
def test_the_state_comes_from_the_summary(tmp_path, planned, summary, state):
    run = _complete(tmp_path, planned)
    (run / "summary.json").write_text(json.dumps({"job": "llm", **summary}))
    sections = _sections(build_report(run))
    assert f"<dt>state</dt><dd>{state}</dd>" in sections["run"]
    assert "<svg" in sections["loss"] and "<svg" in sections["ranks"]


def test_no_rank_is_marked_when_all_run_alike(tmp_path, planned):
    run = _complete(tmp_path, planned)
    _write_jsonl(run / RANK_TIMES, _rank_times(slow=None))
    (run / "summary.json").write_text(json.dumps({**_summary(planned[1], run), "stragglers": []}))
    body = _sections(build_report(run))["ranks"]
    assert "data-straggler" not in body and "No rank is slower" in body


def test_an_older_run_directory_renders_and_says_what_it_lacks(tmp_path, planned):
    run = _complete(tmp_path, planned)
    (run / RANK_TIMES).unlink()
    summary = json.loads((run / "summary.json").read_text())
    for key in ("measured", "stragglers", "warnings"):
        del summary[key]
    (run / "summary.json").write_text(json.dumps(summary))
    sections = _sections(build_report(run))
    assert _said(sections["ranks"]) == ["No per-rank timings: rank_times.jsonl is absent (runs before this "
                                        "version do not write it)."]
    assert "has no `measured`" in _said(sections["predicted"])[0]
    plan = json.loads((run / "plan.json").read_text())
    del plan["trial"]
    (run / "plan.json").write_text(json.dumps(plan))
    assert _said(_sections(build_report(run))["plan"]) == [
        "plan.json records no trial (a plan from before trials were recorded)."]
    for name in ("topology", "layout", "loss"):
        assert "<svg" in sections[name] and not _said(sections[name]), name


def test_a_run_that_died_before_its_first_step_renders(tmp_path, planned):
    cfg, _, topology = planned
    run = tmp_path / "llm-dead"
    run.mkdir()
    (run / "config.yaml").write_text(to_yaml(cfg))
    (run / "topology.json").write_text(topology.to_json())
    (run / "summary.json").write_text(json.dumps({"job": "llm", "failed": True, "restarts": [
        {"time": "t", "reason": "rank raised: CUDA out of memory", "ranks": [0], "nodes": [], "failed_at_step": 0,
         "resumed_from_step": 0, "steps_lost": 0}]}))
    sections = _sections(build_report(run))
    assert list(sections) == DENSE_SECTIONS
    assert "failed" in sections["run"]
    assert _said(sections["plan"]) == ["No plan: plan.json is absent (the run ended before it was planned)."]
    assert "plan.json is absent" in _said(sections["layout"])[0]
    assert "metrics.jsonl is absent" in _said(sections["loss"])[0]
    assert "<svg" in sections["topology"]
    assert "CUDA out of memory" in sections["restarts"]
    assert "No committed checkpoint" in _said(sections["checkpoints"])[0]


def test_gaps_nan_and_truncated_files_do_not_break_it(tmp_path, planned):
    run = _complete(tmp_path, planned)
    rows = _metrics()
    del rows[3:7]  # missing steps
    rows[0]["loss"] = float("nan")  # json writes NaN, and reads it back
    rows[1]["loss"] = None
    rows[2]["step_s"] = None
    rows[4]["val_loss"] = float("inf")
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "not json\n"
                                       + json.dumps(rows[-1])[:25])  # a line cut by a crash
    (run / RANK_TIMES).write_text('{"rank": 0, "step_s": "fast"}\n{"rank": 1, "step_s": NaN}\n[1, 2]\n{"rank": 2, "st')
    (run / "plan.json").write_text(json.dumps(planned[1].to_dict())[:500])
    (run / "summary.json").write_text('{"job": "llm", "failed"')
    sections = _sections(build_report(run))
    assert list(sections) == DENSE_SECTIONS
    assert "<svg" in sections["loss"] and "2 logged step(s) without a finite loss" in sections["loss"]
    assert "rank_times.jsonl holds no sample yet" in _said(sections["ranks"])[0]
    assert "plan.json is unreadable" in _said(sections["plan"])[0]
    assert "plan.json is unreadable" in _said(sections["layout"])[0]
    assert "unknown" in sections["run"]
    assert "medians of metrics.jsonl so far" in sections["predicted"]
    # A plan.json of another shape still parses as JSON but not as a plan.
    (run / "plan.json").write_text(json.dumps({"strategy": "ddp", "explanation": ["kept"], "mesh": "odd"}))
    sections = _sections(build_report(run))
    assert "kept" in sections["plan"] and "does not read as a plan" in _said(sections["layout"])[0]
    (run / "topology.json").write_text("{")
    assert "topology.json is unreadable" in _said(_sections(build_report(run))["topology"])[0]


def test_the_page_loads_nothing_from_outside(tmp_path, planned):
    page = build_report(_complete(tmp_path, planned))
    for bad in ("<script", "<link", "@import", "url(", "<img", "<iframe", "<object", "<embed", "src="):
        assert bad not in page.lower(), bad
    assert all(h.startswith("#") for h in re.findall(r'href="([^"]*)"', page))
    # The only http(s) text is the SVG namespace, which names and fetches nothing.
    assert set(re.findall(r"https?://[^\s\"'<>]+", page)) == {"http://www.w3.org/2000/svg"}
    # An SVG's style sheet is scoped to its section: the topology's `text { fill }` must not
    # recolour the rank labels of the layout picture.
    assert re.search(r"<style>\s*#topology text \{", page)


def test_write_report_is_atomic_and_never_raises(tmp_path, planned):
    run = RunDir(_complete(tmp_path, planned))
    path = write_report(run)
    assert path == run.path / REPORT and path.read_text().startswith("<!DOCTYPE html>")
    assert not list(run.path.glob("*.tmp"))
    assert write_report(RunDir(tmp_path / "gone")) is None


def test_the_live_report_rewrites_at_most_every_interval_and_warns_once(tmp_path, planned):
    run = RunDir(_complete(tmp_path, planned))
    clock = [100.0]
    warned: list[str] = []
    live = LiveReport(run, warned.append, every_s=10.0, clock=lambda: clock[0])
    live.maybe()
    first = (run.path / REPORT).stat().st_mtime_ns
    (run.path / REPORT).unlink()
    clock[0] = 105.0
    live.maybe()  # too soon: not rewritten
    assert not (run.path / REPORT).exists()
    clock[0] = 110.0
    live.maybe()
    assert (run.path / REPORT).stat().st_mtime_ns >= first
    # A rewrite that takes 1 s (on this clock) puts the next one BACKOFF s later, not 10.
    ticks = iter([200.0, 201.0, 215.0, 221.0, 221.0, 222.0])
    slow = LiveReport(run, warned.append, every_s=10.0, clock=lambda: next(ticks))
    slow.now()  # 200 -> 201: took 1 s
    (run.path / REPORT).unlink()
    slow.maybe()  # 215 < 220: not yet
    assert not (run.path / REPORT).exists()
    slow.maybe()  # 221: due
    assert (run.path / REPORT).exists()
    broken = LiveReport(RunDir(tmp_path / "gone"), warned.append, every_s=0.0)
    broken.maybe()
    broken.now()
    assert len(warned) == 1 and "could not write report.html" in warned[0]


def test_the_driver_keeps_every_ranks_timings_and_a_rewind_keeps_them(tmp_path):
    from orchestrator.control.follow import RunState, consume
    from orchestrator.runtime.messages import RankTimes, Stepped

    class View:
        def update(self, row, val):
            pass

    run, state = RunDir(tmp_path), RunState()
    consume([RankTimes(rank=1, times=((0.5, 0.1), (0.4, 0.0))),
             Stepped(row={"step": 1, "loss": 5.0, "step_s": 0.5, "val_loss": None})], state, run, View(), 1)
    rows = [json.loads(x) for x in (tmp_path / RANK_TIMES).read_text().splitlines()]
    assert rows == [{"rank": 1, "world": 0, "step_s": 0.5, "exposed_comm_s": 0.1},
                    {"rank": 1, "world": 0, "step_s": 0.4, "exposed_comm_s": 0.0}]
    state.rewind(0, run)
    assert (tmp_path / "metrics.jsonl").read_text() == "" and len((tmp_path / RANK_TIMES).read_text().splitlines()) == 2


def test_after_a_restart_only_the_new_worlds_ranks_are_drawn(tmp_path, planned):
    # Before the restart rank 3 was slow; the new world numbers its ranks afresh and none is.
    run = _complete(tmp_path, planned)
    (run / "summary.json").unlink()
    new = [{**r, "world": 1} for r in _rank_times(world=2, slow=None)]
    _write_jsonl(run / RANK_TIMES, _rank_times() + new)
    ranks = _sections(build_report(run))["ranks"]
    assert 'data-straggler="true"' not in ranks
    assert re.findall(r'data-rank="(\d+)"', ranks) == ["0", "1"]


def test_the_loss_curve_starts_from_the_untrained_models_loss(tmp_path, planned):
    run = _complete(tmp_path, planned)
    loss = _sections(build_report(run))["loss"]
    assert "5 validation points" in loss  # step 0 from the summary, then steps 5, 10, 15, 20


# --- the command ----------------------------------------------------------------------------------

def test_the_report_command_rebuilds_it_and_prints_its_path(tmp_path, planned, capsys):
    run = _complete(tmp_path, planned)
    assert main(["report", str(run)]) == 0
    assert capsys.readouterr().out.strip() == str(run / REPORT)
    assert "<svg" in (run / REPORT).read_text()


@pytest.mark.parametrize("make", [lambda p: p / "missing", lambda p: p])
def test_the_report_command_refuses_what_is_no_run_directory(tmp_path, capsys, make):
    path = make(tmp_path)
    assert main(["report", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(path) in err and "run directory" in err


# --- a real run in real Chromium ------------------------------------------------------------------

def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed; CI needs it (apt-get install chromium)")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return found


def _open(page: Path, *args: str) -> subprocess.CompletedProcess:
    """Chromium headless on `page`; run as root, it needs --no-sandbox. --enable-logging=stderr
    puts the page's console on stderr."""
    cmd = [_chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
           *args, page.as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def console_errors(stderr: str) -> list[str]:
    """The page's console messages and uncaught exceptions in Chromium's log. Chromium 150 logs
    every console message as `INFO:CONSOLE` whatever its level (console.error included), so the
    level cannot single out errors: the report runs no script, so any console line is one."""
    return [ln for ln in stderr.splitlines() if ":CONSOLE" in ln or "Uncaught" in ln]


def test_the_console_check_catches_errors_and_exceptions(tmp_path):
    page = tmp_path / "bad.html"
    page.write_text('<html><body><p>x</p><script>console.error("deliberate error"); '
                    'throw new Error("boom");</script></body></html>')
    found = console_errors(_open(page, "--virtual-time-budget=2000", "--dump-dom").stderr)
    assert any("deliberate error" in ln for ln in found), found
    assert any("Uncaught Error: boom" in ln for ln in found), found


def check_in_chromium(page: Path, shot: Path) -> dict[str, str]:
    """Open a run's report in real headless Chromium: no console errors, every section there
    with its picture; a screenshot is kept at `shot` and in tests/artifacts/. Returns the
    sections' HTML as the browser built them. (Run on a real run by test_prometheus_dashboard.py,
    whose run it shares.)"""
    dom = _open(page, "--virtual-time-budget=2000", "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert console_errors(dom.stderr) == []
    sections = _sections(dom.stdout)
    assert list(sections) == DENSE_SECTIONS
    for name in PICTURES:
        assert "<svg" in sections[name], name
    r = _open(page, f"--screenshot={shot}", "--window-size=1280,4000")
    assert r.returncode == 0 and shot.stat().st_size > 10_000, r.stderr[-2000:]
    assert console_errors(r.stderr) == []
    artifacts = ROOT / "tests/artifacts"
    artifacts.mkdir(exist_ok=True)
    shutil.copy(shot, artifacts / "report.png")
    return sections


def test_an_moe_run_draws_its_expert_load_as_a_layer_by_expert_map(tmp_path, planned):
    """Every cell is one expert of one layer, coloured by its tokens over the layer's mean, summed
    over the newest logged steps: the router as it is now, the most uneven layer named."""
    from orchestrator.record.expert_map import WINDOW, colour

    run = _complete(tmp_path, planned)
    rows = _metrics(WINDOW + 10)
    for r in rows:
        # Layer 0 even; layer 1 sends 5 of 8 routed tokens to expert 2 late in the run only.
        late = r["step"] > 10
        r["expert_tokens"] = [[2, 2, 2, 2], [1, 1, 5, 1] if late else [2, 2, 2, 2]]
        r["expert_imbalance"] = [1.0, 2.5 if late else 1.0]
    rows[3]["expert_tokens"] = "damaged"  # a bad row is left out, not fatal
    _write_jsonl(run / "metrics.jsonl", rows)
    sections = _sections(build_report(run))
    assert list(sections) == list(SECTIONS)
    body = sections["experts"]
    cells = re.findall(r'<rect [^>]*fill="([^"]+)" data-layer="(\d)" data-expert="(\d)"', body)
    assert len(cells) == 8
    fills = {(int(l), int(e)): f for f, l, e in cells}
    assert {fills[(0, e)] for e in range(4)} == {colour(1.0)} == {"rgb(255,255,255)"}
    assert fills[(1, 2)] == colour(2.5) and fills[(1, 0)] == colour(0.5)
    assert fills[(1, 2)].startswith("rgb(255,") and fills[(1, 0)].endswith(",255)")  # red above, blue below
    assert f"newest {WINDOW} logged" in body and "most uneven layer is 1: 2.50x" in body


def test_the_heat_map_colour_rises_with_load_and_saturates():
    from orchestrator.record.expert_map import SATURATE, colour

    reds = [int(colour(r).split(",")[1]) for r in (1.0, 1.5, 2.0, SATURATE, 2 * SATURATE)]
    assert reds == sorted(reds, reverse=True) and reds[-1] == reds[-2] == 0
    assert colour(0.0) == colour(1 / SATURATE) == "rgb(0,0,255)"


def test_the_runners_up_table_names_each_context_parallel_row_s_attention():
    row = {"strategy": "zero3", "mesh": {"dp_shard": 2}, "micro_batch_size": 1, "recompute": "none",
           "step_time_s": 0.5, "memory_per_rank": 10**9, "fits": True, "reason": "slower by 3.0%"}
    plain = report_alternatives([row])
    assert "cp attention" not in plain
    mixed = report_alternatives([{**row, "mesh": {"dp_shard": 1, "cp": 2}, "cp_attention": "ulysses"}, row])
    heads = re.findall(r"<th>(.*?)</th>", mixed)
    assert heads[4] == "cp attention"
    cells = [re.findall(r"<td>(.*?)</td>", r) for r in re.findall(r"<tr>(.*?)</tr>", mixed.split("<tbody>")[1])]
    assert [c[4] for c in cells] == ["ulysses", "-"] and all(len(c) == len(heads) for c in cells)
