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
