"""Models the orchestrator did not write train under ddp, zero3, hsdp and tp=2 exactly as one
process trains them (4 gloo ranks, fp32, same batches)."""

from __future__ import annotations

import functools

import _model_parity_worker as pw
import pytest

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def results() -> dict[str, list[float]]:
    return pw.run_all()


@functools.cache
def _reference(model: str) -> list[float]:
    return pw.reference(model)


@pytest.mark.parametrize("model", list(pw.MODELS))
@pytest.mark.parametrize("case", list(pw.MESHES))
def test_matches_one_process(model: str, case: str, results) -> None:
    ref = _reference(model)
    got = results[f"{model}/{case}"]
    assert len(got) == pw.STEPS
    assert ref[-1] < ref[0]  # the trajectory moves, so a wrong reduction would show
    assert max(abs(a - b) for a, b in zip(got, ref)) <= 1e-5, (got, ref)
