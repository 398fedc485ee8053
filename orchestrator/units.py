"""Byte counts as people read them: one formatter for the planner, the rehearsal view and the
run report, so that the same count prints the same way wherever it appears."""

from __future__ import annotations


def format_bytes(count: float | None, binary: bool = False, megabyte_places: int = 1) -> str:
    """`count` bytes in decimal units, as GPU datasheets state memory: GB from a tenth of a GB up
    (two places), else MB (`megabyte_places` places). `binary` counts as torch and the kernel do:
    GiB from one GiB up (two places), else MiB (one place), thousands separated. None is "-"."""
    if count is None:
        return "-"
    if binary:
        return f"{count / 2**30:,.2f} GiB" if abs(count) >= 2**30 else f"{count / 2**20:,.1f} MiB"
    return f"{count / 1e9:.2f} GB" if abs(count) >= 1e8 else f"{count / 1e6:.{megabyte_places}f} MB"
