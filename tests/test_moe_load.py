"""Per-expert load: the step's tokens per expert and imbalance reach metrics.jsonl, and a
collapsing router is named the step it collapses."""

from __future__ import annotations

import io
import json

import torch
from rich.console import Console

from orchestrator.control.follow import consume
from orchestrator.record.run_state import RunState
from orchestrator.record.rundir import RunDir
from orchestrator.runtime.expert_parallel import expert_load, install_load_balancing
from orchestrator.runtime.messages import Stepped
from orchestrator.workloads import moe


def test_a_step_records_each_layers_tokens_per_expert_and_imbalance() -> None:
    torch.manual_seed(0)
    model = moe.build("tiny")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    install_load_balancing(model, opt, None)
    assert expert_load([model]) is None  # before any step
    model(torch.randint(0, 256, (2, 16))).float().square().mean().backward()
    opt.step()
    load = expert_load([model])
    assert len(load["expert_tokens"]) == 2  # the tiny model's two MoE blocks
    for tokens, imbalance in zip(load["expert_tokens"], load["expert_imbalance"]):
        assert sum(tokens) == 2 * 16 * 2 and len(tokens) == 8
        assert imbalance == max(tokens) / (sum(tokens) / 8)


class _View:
    def __init__(self) -> None:
        self.out = io.StringIO()
        self.console = Console(file=self.out, width=300)

    def update(self, *_: object) -> None:
        pass


def _row(step: int, tokens: list[int]) -> Stepped:
    mean = sum(tokens) / len(tokens)
    return Stepped(row={"step": step, "loss": 5.0, "val_loss": None, "expert_tokens": [[8] * 8, tokens],
                        "expert_imbalance": [1.0, max(tokens) / mean]})


def test_metrics_keep_the_load_and_a_collapse_is_named_once(tmp_path) -> None:
    view, state = _View(), RunState()
    rows = [_row(1, [8] * 8), _row(2, [40, 8, 8, 8, 0, 0, 0, 0]), _row(3, [64, 0, 0, 0, 0, 0, 0, 0])]
    consume(rows, state, RunDir(tmp_path), view, 1)
    written = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert written[2]["expert_tokens"][1] == [64, 0, 0, 0, 0, 0, 0, 0] and written[2]["expert_imbalance"] == [1.0, 8.0]
    warnings = [line for line in view.out.getvalue().splitlines() if "warning" in line]
    assert warnings == ["warning: step 2: the router of MoE layer 1 is collapsing: expert 0 got 40 of 64 routed "
                        "tokens, 5.0x the mean (max/mean imbalance)"]


def test_a_dense_runs_rows_read_as_before(tmp_path) -> None:
    consume([Stepped(row={"step": 1, "loss": 5.0, "val_loss": None})], RunState(), RunDir(tmp_path), _View(), 1)
    assert "expert" not in (tmp_path / "metrics.jsonl").read_text()
