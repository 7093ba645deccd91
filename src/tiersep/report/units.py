"""Number formatting shared by the tables and the plots (binary units: 1 GiB = 2**30 bytes)."""
from __future__ import annotations

import math

MISSING = "—"
_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and not math.isfinite(value))


def format_bytes(value: float | None, digits: int = 2) -> str:
    """1536 -> '1.50 KiB'; with digits=0 (axis ticks) -> '2 KiB'."""
    if _missing(value):
        return MISSING
    value = float(value)
    unit = 0
    while abs(value) >= 1024 and unit < len(_BYTE_UNITS) - 1:
        value /= 1024
        unit += 1
    if unit == 0:
        return f"{value:.0f} B"
    return f"{value:.{digits}f} {_BYTE_UNITS[unit]}"


def format_duration(seconds: float | None) -> str:
    if _missing(seconds):
        return MISSING
    seconds = float(seconds)
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        minutes, rest = divmod(round(seconds), 60)
        return f"{minutes} min {rest:02d} s"
    hours, rest = divmod(round(seconds), 3600)
    return f"{hours} h {rest // 60:02d} min"


def format_percent(ratio: float | None) -> str:
    """Signed relative error: 0.031 -> '+3.1 %'."""
    if _missing(ratio):
        return MISSING
    return f"{ratio * 100:+.1f} %"


def format_db(value: float | None) -> str:
    if _missing(value):
        return MISSING
    return f"{float(value):.2f}"


def format_int(value: float | None) -> str:
    if _missing(value):
        return MISSING
    return f"{int(value):,}"


def format_rate(value: float | None) -> str:
    """Three significant figures: 5.17, 0.412, 123."""
    if _missing(value):
        return MISSING
    value = float(value)
    if value == 0:
        return "0"
    digits = max(0, 2 - int(math.floor(math.log10(abs(value)))))
    return f"{value:.{digits}f}"


def format_seconds(value: float | None) -> str:
    """Short lengths such as a training segment: 2.0 s, 0.25 s."""
    if _missing(value):
        return MISSING
    return f"{float(value):.3g} s"
