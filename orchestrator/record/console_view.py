"""Every line a running job prints, in one place: the driver and what it calls say what
happened (a plan chosen, a rank failed, the survivors kept, a trial dropped a plan) and this
view words it. Nothing here decides anything; the text is what users and tests read, so it
changes only with the behaviour it describes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..planning import Plan
from .startup_clock import describe as describe_phases
from .straggler import describe as describe_stragglers


def kept_line(world: int, replaced: list[int]) -> str:
    """How many ranks a recovery kept and which it replaced."""
    return f"kept {world - len(replaced)} of {world} ranks, replaced rank(s) {replaced}"


class ConsoleView:
    """The job's console: one method per thing the user is told."""

    def __init__(self, console: Console) -> None:
        self.console = console
        """Where the lines go; the progress bar, the summary table and the checkpoint scan write
        to it too."""

    @contextmanager
    def status(self, what: str) -> Iterator[Callable[[str], None]]:
        """A spinner saying what the job waits for, while it waits; what it yields says more (a
        wait for resources: what the cluster still lacks) under the first line."""
        with self.console.status(what) as spinner:
            yield lambda more: spinner.update(f"{what}: {escape(more)}")

    def line(self, text: str) -> None:
        """A line the record wrote (the compile gain), as it is."""
        self.console.print(text, markup=False)

    def warning(self, text: str) -> None:
        self.console.print(f"[yellow]warning:[/] {escape(text)}")

    def note(self, text: str) -> None:
        self.console.print(f"[yellow]note:[/] {escape(text)}")

    # --- the plan ---------------------------------------------------------------------------

    def planned(self, plan: Plan, note: str | None, graph_break_warning: str | None, use_gpu: bool) -> None:
        """The plan the attempt runs: what it left out, the note of how it was chosen, a graph
        break that kept the blocks eager, and the plan itself."""
        for x in plan.left_out:
            self.console.print(f"left out: {escape(str(x))}")
        if note:
            self.note(note)
        if graph_break_warning:
            self.warning(graph_break_warning)
        self.console.print(
            f"plan: [bold]{plan.strategy}[/] on {plan.world_size} {'GPUs' if use_gpu else 'CPU workers'} "
            f"({plan.mesh}), micro-batch {plan.micro_batch_size} x {plan.sync.grad_accum_steps} accumulation steps"
            + (", blocks compiled" if plan.compile.enabled else "")
        )

    # --- the start of a world ---------------------------------------------------------------

    def restored_from_peers(self, step: int, restore: Any) -> None:
        self.console.print(f"restored step {step} from {restore}: no checkpoint read", markup=False)

    def resumed(self, checkpoint: str, step: int, plan_change: str) -> None:
        """`plan_change`: how the plan that wrote the checkpoint differs ("" when it is the same)."""
        self.console.print(f"resumed from {checkpoint} at step {step}{plan_change}", markup=False)

    def recovered(self, breakdown: dict[str, Any]) -> None:
        """A restarted world's first step: where its seconds went."""
        self.console.print(f"[green]recovered[/] in {escape(describe_phases(breakdown))}")

    def stragglers(self, slow: list[dict[str, Any]]) -> None:
        self.console.print(f"[yellow]straggler:[/] {escape(describe_stragglers(slow))}")

    # --- recovery ---------------------------------------------------------------------------

    def failure(self, reason: str, ranks: list[int], restart: int, max_failures: int, resume: Any,
                resume_step: int) -> None:
        """A failure the run restarts after: the `restart`-th of `max_failures`, from `resume`
        (a checkpoint, the survivors' memory, or None: step 0)."""
        self.console.print(
            f"[red]failure:[/] {escape(reason)} (ranks {ranks}); restart {restart}/{max_failures} from "
            + (f"step {resume_step} ({escape(str(resume))})" if resume else "step 0: no checkpoint was written yet")
        )

    def kept_survivors(self, world: int, replaced: list[int]) -> None:
        self.console.print(f"[green]{escape(kept_line(world, replaced))}[/]: the same plan resumes")

    def regrow(self, reason: str, step: int) -> None:
        self.console.print(f"[green]{escape(reason)}:[/] re-planning from step {step}")

    # --- the trial --------------------------------------------------------------------------

    def trial_skipped(self, why: str) -> None:
        self.console.print(f"trial: skipped: {escape(why)}")

    def trial_begins(self, plans: int, steps: int, budget_s: float | None) -> None:
        self.console.print(f"trial: {plans} plans, {steps} timed steps each"
                           + (f", within {budget_s:.0f} s" if budget_s is not None else ""))

    def trial_stopped(self, tried: int, plans: int, budget_s: float) -> None:
        self.console.print(f"trial: stopped after {tried} of {plans} plans, at its budget of {budget_s:.0f} s "
                           f"(parallel.trial_budget)")

    def trial_dropped(self, label: str, plan: Plan, why: str) -> None:
        self.console.print(f"[yellow]trial:[/] dropped {escape(label)} ({plan.strategy} on {plan.mesh}): "
                           f"{escape(why)}")

    def trial_ties(self, ties: int, again_s: float, passes_budget_s: float | None) -> None:
        """Near ties timed again; or not, where timing them again would pass the trial's budget
        (`passes_budget_s`, None where it does not)."""
        budget_s = passes_budget_s
        if budget_s is not None:
            self.console.print(f"trial: {ties} plans lie within their own step-to-step spread of the fastest, and "
                               f"timing them again (about {again_s:.0f} s) would pass the budget of {budget_s:.0f} s")
        else:
            self.console.print(f"trial: {ties} plans lie within their own step-to-step spread of the fastest; "
                               "timing them again, in reverse order")

    def trial_table(self, rows: list[tuple[str, ...]]) -> None:
        """Each candidate: label, strategy, mesh, sync, predicted and measured s/step, kept."""
        table = Table(title="trial: measured on the cluster", title_justify="left")
        for col in ("plan", "strategy", "mesh", "sync", "predicted s/step", "measured s/step (fastest)", ""):
            table.add_column(col)
        for row in rows:
            table.add_row(*row)
        self.console.print(table)

    def trial_overruled(self, line: str) -> None:
        self.console.print(f"[green]trial:[/] {escape(line)}")

    def trial_took(self, cost_s: float, calibration_file: str, run: Path) -> None:
        self.console.print(f"trial took {cost_s:.1f} s; {calibration_file} has its measured/predicted ratios "
                           f"(plan --calibration {run})", markup=False)
