"""The experts' load of a Mixture-of-Experts run as an SVG heat map: one row per MoE layer, one
cell per expert, coloured by the tokens it got over its layer's mean (white at the mean, red
above, blue below), with each layer's max/mean imbalance at the row's end. No plotting library:
the report is drawn on a cluster head.

The load is summed over the newest logged steps (`WINDOW`), so the picture shows what the router
does now, not an average that a long run's first steps dominate."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from xml.sax.saxutils import escape

WINDOW = 50
"""The newest logged steps (metrics.jsonl rows) the map sums over."""
MAX_W, ROW_H_MAX, ROW_H_MIN = 640, 28, 6
LEFT, RIGHT, TOP, BOTTOM = 72, 112, 40, 44
SATURATE = 4.0
"""Load over the mean at which a cell is fully red (and 1/SATURATE fully blue): the imbalance
at which `run_state.COLLAPSING_IMBALANCE` names a collapsing router."""


@dataclass(frozen=True)
class ExpertLoad:
    """Tokens per expert per MoE layer, summed over a window of logged steps."""

    tokens: list[list[int]]
    """tokens[layer][expert]."""
    steps: tuple[int, int]
    """The first and last step summed."""
    rows: int
    """How many logged steps were summed."""

    def ratio(self, layer: int, expert: int) -> float:
        """The expert's tokens over its layer's mean (1.0 for a layer that routed nothing)."""
        row = self.tokens[layer]
        mean = sum(row) / len(row)
        return row[expert] / mean if mean > 0 else 1.0

    def imbalance(self, layer: int) -> float:
        """The layer's busiest expert over its mean."""
        return max(self.ratio(layer, e) for e in range(len(self.tokens[layer])))


def summed_load(rows: Sequence[dict[str, Any]], window: int = WINDOW) -> ExpertLoad | None:
    """The load of the newest `window` rows that carry `expert_tokens` of the run's latest shape
    (a resume onto another model would change it); None where no row carries any."""
    loaded = [r for r in rows if _shape(r.get("expert_tokens")) is not None and isinstance(r.get("step"), int)]
    if not loaded:
        return None
    shape = _shape(loaded[-1]["expert_tokens"])
    recent = [r for r in loaded if _shape(r["expert_tokens"]) == shape][-window:]
    layers, experts = shape  # type: ignore[misc]
    tokens = [[sum(int(r["expert_tokens"][layer][e]) for r in recent) for e in range(experts)]
              for layer in range(layers)]
    return ExpertLoad(tokens=tokens, steps=(recent[0]["step"], recent[-1]["step"]), rows=len(recent))


def _shape(tokens: Any) -> tuple[int, int] | None:
    """(layers, experts) of a well-formed `expert_tokens` (every layer the same expert count)."""
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, list) and t for t in tokens):
        return None
    experts = len(tokens[0])
    if any(len(t) != experts or not all(isinstance(n, int) and n >= 0 for n in t) for t in tokens):
        return None
    return len(tokens), experts


def colour(ratio: float) -> str:
    """White at the mean, toward red above it and blue below, on a log scale saturating at
    SATURATE and 1/SATURATE."""
    if ratio <= 0:
        t = -1.0
    else:
        t = max(-1.0, min(1.0, math.log(ratio) / math.log(SATURATE)))
    fade = round(255 * (1 - abs(t)))
    return f"rgb(255,{fade},{fade})" if t >= 0 else f"rgb({fade},{fade},255)"


def expert_load_svg(load: ExpertLoad, title: str) -> str:
    """The heat map of `load`: layer rows, expert columns, each layer's imbalance at its right."""
    layers, experts = len(load.tokens), len(load.tokens[0])
    cell_w = max(1.0, MAX_W / experts)
    row_h = max(ROW_H_MIN, min(ROW_H_MAX, 480 // layers))
    w = LEFT + cell_w * experts + RIGHT
    h = TOP + row_h * layers + BOTTOM
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w:.0f}" height="{h}" viewBox="0 0 {w:.0f} {h}" '
           'font-family="sans-serif" font-size="11">',
           f'<text x="{LEFT}" y="20" font-size="13">{escape(title)}</text>']
    label_every = max(1, math.ceil(layers / (480 / 12)))
    for layer in range(layers):
        y = TOP + layer * row_h
        for e in range(experts):
            ratio = load.ratio(layer, e)
            out.append(f'<rect x="{LEFT + e * cell_w:.2f}" y="{y}" width="{cell_w:.2f}" height="{row_h}" '
                       f'fill="{colour(ratio)}" data-layer="{layer}" data-expert="{e}">'
                       f'<title>layer {layer}, expert {e}: {load.tokens[layer][e]:,} tokens, '
                       f'{ratio:.2f}x the mean</title></rect>')
        if layer % label_every == 0:
            out.append(f'<text x="{LEFT - 6}" y="{y + row_h / 2 + 4:.1f}" text-anchor="end">layer {layer}</text>')
        imb = load.imbalance(layer)
        weight = ' font-weight="bold" fill="#b00"' if imb >= SATURATE else ""
        out.append(f'<text x="{LEFT + cell_w * experts + 8:.1f}" y="{y + row_h / 2 + 4:.1f}"{weight}>'
                   f'{imb:.2f}x max/mean</text>')
    base = TOP + row_h * layers
    out.append(f'<rect x="{LEFT}" y="{TOP}" width="{cell_w * experts:.2f}" height="{row_h * layers}" '
               'fill="none" stroke="#888"/>')
    ticks = sorted({0, experts - 1} | set(range(0, experts, max(1, math.ceil(experts / 8)))))
    for e in ticks:
        out.append(f'<text x="{LEFT + (e + 0.5) * cell_w:.1f}" y="{base + 14}" text-anchor="middle">{e}</text>')
    out.append(f'<text x="{LEFT + cell_w * experts / 2:.1f}" y="{base + 32}" text-anchor="middle">expert</text>')
    out.append("</svg>")
    return "".join(out)
