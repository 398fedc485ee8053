"""The loss curve of a run as an SVG picture (no plotting library needed on a cluster head)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from xml.sax.saxutils import escape

W, H = 720, 400
LEFT, RIGHT, TOP, BOTTOM = 64, 20, 40, 48


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = min((m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw), default=raw)
    first = math.ceil(lo / step) * step
    out, v = [], first
    while v <= hi + 1e-12:
        out.append(round(v, 10))
        v += step
    return out


def loss_svg(train: list[tuple[int, float]], val: list[tuple[int, float]], title: str,
             restarts: Sequence[int] = ()) -> str:
    """Train loss per step (line) and validation loss (points joined), on shared axes; a dashed
    line at each step a restart resumed from."""
    pts = train + val
    if not pts:
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}">'
                '<text x="20" y="40">no steps</text></svg>')
    x_hi = max(1, max(s for s, _ in pts))
    losses = [v for _, v in pts if math.isfinite(v)]
    y_lo, y_hi = min(losses), max(losses)
    pad = (y_hi - y_lo) * 0.05 or 0.5
    y_lo, y_hi = y_lo - pad, y_hi + pad

    def X(s: float) -> float:
        return LEFT + (W - LEFT - RIGHT) * s / x_hi

    def Y(v: float) -> float:
        return TOP + (H - TOP - BOTTOM) * (1 - (v - y_lo) / (y_hi - y_lo))

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
        'font-family="Helvetica, Arial, sans-serif" font-size="12">',
        f'<rect width="{W}" height="{H}" fill="white"/>',
        f'<text x="{W / 2}" y="22" text-anchor="middle" font-size="15" font-weight="bold">{escape(title)}</text>',
    ]
    for t in _ticks(y_lo, y_hi):
        y = Y(t)
        out.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{W - RIGHT}" y2="{y:.1f}" stroke="#e5e5e5"/>')
        out.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{t:g}</text>')
    for t in _ticks(0, x_hi):
        x = X(t)
        out.append(f'<line x1="{x:.1f}" y1="{H - BOTTOM}" x2="{x:.1f}" y2="{H - BOTTOM + 5}" stroke="#333"/>')
        out.append(f'<text x="{x:.1f}" y="{H - BOTTOM + 18}" text-anchor="middle">{t:g}</text>')
    out.append(f'<line x1="{LEFT}" y1="{H - BOTTOM}" x2="{W - RIGHT}" y2="{H - BOTTOM}" stroke="#333"/>')
    out.append(f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{H - BOTTOM}" stroke="#333"/>')
    out.append(f'<text x="{(LEFT + W - RIGHT) / 2}" y="{H - 10}" text-anchor="middle">optimizer step</text>')
    out.append(f'<text transform="translate(16 {(TOP + H - BOTTOM) / 2}) rotate(-90)" '
               'text-anchor="middle">loss (nats/token)</text>')
    for step in restarts:
        x = X(step)
        out.append(f'<line x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{H - BOTTOM}" stroke="#888" '
                   'stroke-dasharray="4 3"/>')
        out.append(f'<text x="{x + 4:.1f}" y="{TOP + 12}" fill="#666">restart</text>')
    if train:
        path = " ".join(f"{X(s):.1f},{Y(v):.1f}" for s, v in train if math.isfinite(v))
        out.append(f'<polyline points="{path}" fill="none" stroke="#4c78a8" stroke-width="1.5" opacity="0.8"/>')
    if val:
        path = " ".join(f"{X(s):.1f},{Y(v):.1f}" for s, v in val)
        out.append(f'<polyline points="{path}" fill="none" stroke="#e45756" stroke-width="2"/>')
        out += [f'<circle cx="{X(s):.1f}" cy="{Y(v):.1f}" r="3.5" fill="#e45756"/>' for s, v in val]
    lx = W - RIGHT - 150
    out.append(f'<rect x="{lx}" y="{TOP + 6}" width="140" height="44" fill="white" stroke="#ccc"/>')
    out.append(f'<line x1="{lx + 10}" y1="{TOP + 20}" x2="{lx + 34}" y2="{TOP + 20}" stroke="#4c78a8" '
               'stroke-width="2"/>')
    out.append(f'<text x="{lx + 40}" y="{TOP + 24}">train loss</text>')
    out.append(f'<circle cx="{lx + 22}" cy="{TOP + 38}" r="3.5" fill="#e45756"/>')
    out.append(f'<text x="{lx + 40}" y="{TOP + 42}">validation loss</text>')
    out.append("</svg>")
    return "\n".join(out)
