"""Measured corrections to the cost model, from a trial on the real cluster.

A trial (`parallel.trial`) runs a few steps of several plans and records, for each, how its
measured compute and exposed communication compare with the planner's figures. The ratios
(measured / predicted, the median over the candidates that measured the term) are written to
the run directory's calibration.json; `parallel.calibration=RUN` (or `plan --calibration RUN`)
reads them back, so the next plan on the same cluster prices its candidates from what the
cluster really did instead of from the tables and the probe alone.

A run whose blocks ran compiled also measures what compiling bought (`CompileGain`: the
blocks' eager time over their compiled time on its ranks, and the seconds compiling took) and
adds it to the same file, so `train.compile=auto` on a later plan of the same model prices the
gain this cluster measured instead of the table's.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..serialize import to_plain

CALIBRATION_FILE = "calibration.json"
TERMS = ("compute", "communication")
"""The term kinds a trial measures apart: compute (step minus exposed communication, the
pipeline's bubble included) and exposed communication."""
MIN_PREDICTED_S = 1e-4
"""A term predicted below this is too small for its ratio to mean anything: it is left out."""


@dataclass(frozen=True)
class CompileGain:
    """What compiling the blocks measured on one run, for the same model's later plans."""

    model: str
    """The model it was measured on (`ModelSummary.name`)."""
    block_class: str
    """Its repeated block's class."""
    params: int
    """Its parameter count: the same factory at another width or depth measures apart."""
    speedup: float
    """The blocks' eager time over their compiled time (below 1: compiled ran slower)."""
    compile_s: float
    """Seconds compiling took on the slowest rank (with that run's inductor cache)."""

    def __post_init__(self) -> None:
        if not (isinstance(self.speedup, (int, float)) and 0 < self.speedup < 100):
            raise ValueError(f"compile 'speedup' must be a positive ratio below 100, got {self.speedup!r}")
        if not (isinstance(self.compile_s, (int, float)) and self.compile_s >= 0):
            raise ValueError(f"compile 'compile_s' must be seconds (0 or more), got {self.compile_s!r}")

    def same_model(self, name: str, block_class: str, params: int) -> bool:
        return (self.model, self.block_class, self.params) == (name, block_class, params)

    def to_dict(self) -> dict[str, Any]:
        return to_plain(self)


def block_speedup(eager_s: float, compiled_s: float, block_share: float) -> float:
    """The blocks' own eager / compiled time, from a whole forward and backward timed both ways
    (`eager_s`, `compiled_s`) of which the blocks take `block_share`: only they compile, so the
    whole pass's difference is theirs."""
    if eager_s <= 0 or compiled_s <= 0 or not 0 < block_share <= 1:
        raise ValueError(f"need positive pass times and a block share in (0, 1], got {eager_s}, {compiled_s}, "
                         f"{block_share}")
    return speedup_from_saving(eager_s * block_share, eager_s - compiled_s)


def speedup_from_saving(block_s: float, saving_s: float) -> float:
    """The speedup of blocks that take `block_s` eager which saves `saving_s` (below 1 where
    compiled ran slower): `compile.block_saving_s` turns it back into that saving."""
    if block_s <= 0:
        raise ValueError(f"need the blocks' positive eager seconds, got {block_s}")
    # A saving as large as the blocks' own time is timing noise on a tiny block: capped.
    return block_s / max(block_s - saving_s, block_s / MAX_SPEEDUP)


MAX_SPEEDUP = 10.0
"""The largest block speedup a measurement is taken at."""


@dataclass(frozen=True)
class Calibration:
    """Factors the cost model multiplies its terms by: 1.0 prices from the tables and the probe."""

    compute: float = 1.0
    """Measured / predicted compute seconds (the pipeline's bubble included)."""
    communication: float = 1.0
    """Measured / predicted exposed communication seconds."""
    source: str = ""
    """Where the figures came from (a run directory); empty for the uncalibrated model."""
    compile: CompileGain | None = None
    """What compiling the blocks measured there; None where they did not run compiled."""

    def __post_init__(self) -> None:
        for term in TERMS:
            value = getattr(self, term)
            if not (isinstance(value, (int, float)) and 0 < value < 1e3):
                raise ValueError(f"calibration '{term}' must be a positive ratio below 1000, got {value!r}")

    @property
    def applied(self) -> bool:
        return (self.compute, self.communication) != (1.0, 1.0)

    def describe(self) -> str:
        return (f"priced with the measured calibration of {self.source or 'a trial'}: compute x{self.compute:.2f}, "
                f"exposed communication x{self.communication:.2f}")

    def to_dict(self) -> dict[str, Any]:
        return to_plain(self)


UNCALIBRATED = Calibration()
"""Prices from the tables and the probe alone."""


def term_ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Per term kind, the median measured / predicted ratio over `rows` (one per candidate:
    `predicted_<term>_s`, `measured_<term>_s`); a term no row measured is left out."""
    out = {}
    for term in TERMS:
        ratios = [r[f"measured_{term}_s"] / r[f"predicted_{term}_s"] for r in rows
                  if r.get(f"measured_{term}_s") is not None and (r.get(f"predicted_{term}_s") or 0) >= MIN_PREDICTED_S]
        if ratios:
            out[term] = statistics.median(ratios)
    return out


def load(run_dir: str) -> Calibration:
    """The calibration a trial wrote into `run_dir` (or the calibration.json named directly);
    ConfigError in one line when there is none or it is damaged."""
    path = Path(run_dir)
    if path.is_dir():
        path = path / CALIBRATION_FILE
    key = "key 'parallel.calibration'"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{key}: no {CALIBRATION_FILE} at {path}; a run writes one when its trial "
                          f"(parallel.trial) measured at least one plan, or its blocks ran compiled") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}: {path} is not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{key}: {path} is not a JSON object")
    ratios, gain = data.get("ratios", {}), data.get("compile")
    if not isinstance(ratios, dict) or not (ratios or gain):
        raise ConfigError(f"{key}: {path} holds no 'ratios' (expected {', '.join(TERMS)}) and no 'compile' figure")
    unknown = sorted(set(ratios) - set(TERMS))
    if unknown:
        raise ConfigError(f"{key}: {path} names unknown term(s) {unknown}; allowed: {', '.join(TERMS)}")
    try:
        compiled = None
        if gain is not None:
            if not isinstance(gain, dict):
                raise ValueError(f"'compile' must be an object with {', '.join(f.name for f in fields(CompileGain))}")
            compiled = CompileGain(**gain)
        return Calibration(**{t: float(ratios[t]) for t in TERMS if t in ratios}, source=str(path.parent),
                           compile=compiled)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{key}: {path}: {e}") from None


def with_compile_gain(existing: dict[str, Any] | None, gain: CompileGain) -> dict[str, Any]:
    """calibration.json's contents with `gain` added: a trial's ratios, if it wrote any, kept."""
    return {**(existing or {}), "compile": gain.to_dict()}
