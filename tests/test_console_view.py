"""The console lines of a running job, worded in one place (`record/console_view.py`): the text
users and the recovery tests read, checked word for word."""

from __future__ import annotations

from rich.console import Console

from orchestrator.record.console_view import ConsoleView, kept_line


def _view() -> tuple[ConsoleView, Console]:
    console = Console(record=True, width=300)
    return ConsoleView(console), console


def test_a_failure_says_which_restart_it_is_and_where_the_run_resumes():
    view, console = _view()
    view.failure("worker died: gone", [1], 2, 3, "/ckpt/step_00000010", 10)
    view.failure("hang: [x]", [0, 2], 1, 1, None, 0)
    assert console.export_text().splitlines() == [
        "failure: worker died: gone (ranks [1]); restart 2/3 from step 10 (/ckpt/step_00000010)",
        "failure: hang: [x] (ranks [0, 2]); restart 1/1 from step 0: no checkpoint was written yet",
    ]


def test_a_recovery_that_kept_the_survivors_and_a_regrow_say_so():
    view, console = _view()
    view.kept_survivors(6, [1, 4])
    view.regrow("grow: 6 devices available, the plan was made for 4", 12)
    view.recovered({"total_s": 4.25, "largest": "actor_start_s", "actor_start_s": 2.5})
    assert kept_line(6, [1, 4]) == "kept 4 of 6 ranks, replaced rank(s) [1, 4]"
    assert console.export_text().splitlines() == [
        "kept 4 of 6 ranks, replaced rank(s) [1, 4]: the same plan resumes",
        "grow: 6 devices available, the plan was made for 4: re-planning from step 12",
        "recovered in 4.2 s (largest part: actor start 2.5 s)",
    ]


def test_text_from_the_run_is_printed_as_it_is_not_read_as_markup():
    view, console = _view()
    view.warning("rank [bold]3[/bold] is slow")
    view.note("[1, 2] left out")
    view.resumed("/runs/a[1]/checkpoints/step_4", 4, ", written under ddp on dp4 and resharded to zero3 on dp2")
    assert console.export_text().splitlines() == [
        "warning: rank [bold]3[/bold] is slow",
        "note: [1, 2] left out",
        "resumed from /runs/a[1]/checkpoints/step_4 at step 4, written under ddp on dp4 and resharded to zero3 on dp2",
    ]


def test_the_trial_says_when_it_times_near_ties_again_and_when_its_budget_forbids_it():
    view, console = _view()
    view.trial_ties(2, 30.4, None)
    view.trial_ties(3, 45.0, 40.0)
    view.trial_stopped(2, 5, 60.0)
    assert console.export_text().splitlines() == [
        "trial: 2 plans lie within their own step-to-step spread of the fastest; timing them again, in reverse order",
        "trial: 3 plans lie within their own step-to-step spread of the fastest, and timing them again (about 45 s) "
        "would pass the budget of 40 s",
        "trial: stopped after 2 of 5 plans, at its budget of 60 s (parallel.trial_budget)",
    ]
