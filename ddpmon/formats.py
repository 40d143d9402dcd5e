"""How ddpmon writes numbers for people: one way for every command (doctor, report, compare,
capture), so that a duration reads the same wherever it is shown."""

from __future__ import annotations


def format_seconds(seconds: float | None) -> str:
    """A duration given in seconds as every command writes it: "12.3 ms", from 10 s on
    "42.0 s", "-" unknown."""
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


def format_milliseconds(milliseconds: float) -> str:
    """Milliseconds as a bare number, the caller writing the unit ("ms/step"): "0.42" below
    1 ms (an operator's self time is often that small), else "9.3"."""
    return f"{milliseconds:.2f}" if abs(milliseconds) < 1 else f"{milliseconds:.1f}"


def format_bytes(n: float) -> str:
    """A size in decimal units, as memory rates are read: "812 kB", "4.0 MB", "1.44 GB"."""
    size = abs(n)
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            value = n / scale
            return f"{value:.2f} {unit}" if unit == "GB" else f"{value:.1f} {unit}"
    return f"{n:.0f} B"


def format_time_left(seconds: float) -> str:
    """A long duration to the minute: "under a minute", "42 min", "3 h 05 min", "2 d 4 h"."""
    minutes = int(seconds // 60)
    if minutes < 1:
        return "under a minute"
    if minutes < 60:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h {minutes:02d} min"
    return f"{hours // 24} d {hours % 24} h"
