"""Measured corrections to the cost model, from a trial on the real cluster.

A trial (`parallel.trial`) runs a few steps of several plans and records, for each, how its
measured compute and exposed communication compare with the planner's figures. The ratios
(measured / predicted, the median over the candidates that measured the term) are written to
the run directory's calibration.json; `parallel.calibration=RUN` (or `plan --calibration RUN`)
reads them back, so the next plan on the same cluster prices its candidates from what the
cluster really did instead of from the tables and the probe alone.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError

CALIBRATION_FILE = "calibration.json"
TERMS = ("compute", "communication")
"""The term kinds a trial measures apart: compute (step minus exposed communication, the
pipeline's bubble included) and exposed communication."""
MIN_PREDICTED_S = 1e-4
"""A term predicted below this is too small for its ratio to mean anything: it is left out."""


@dataclass(frozen=True)
class Calibration:
    """Factors the cost model multiplies its terms by: 1.0 prices from the tables and the probe."""

    compute: float = 1.0
    """Measured / predicted compute seconds (the pipeline's bubble included)."""
    communication: float = 1.0
    """Measured / predicted exposed communication seconds."""
    source: str = ""
    """Where the figures came from (a run directory); empty for the uncalibrated model."""

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
        return asdict(self)


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
                          f"(parallel.trial) measured at least one plan") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}: {path} is not readable JSON ({e})") from None
    ratios = data.get("ratios") if isinstance(data, dict) else None
    if not isinstance(ratios, dict) or not ratios:
        raise ConfigError(f"{key}: {path} holds no 'ratios' (expected {', '.join(TERMS)})")
    unknown = sorted(set(ratios) - set(TERMS))
    if unknown:
        raise ConfigError(f"{key}: {path} names unknown term(s) {unknown}; allowed: {', '.join(TERMS)}")
    try:
        return Calibration(**{t: float(ratios[t]) for t in TERMS if t in ratios}, source=str(path.parent))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{key}: {path}: {e}") from None
