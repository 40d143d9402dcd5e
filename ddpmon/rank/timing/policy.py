"""Which source times DDP's buckets: one pure decision, written as a table.

Four sources exist. ``c10d``: NCCL's own per-collective timing through its completion
hook, with DDP's C++ all-reduce (or the user's hook) left in place. ``flight_recorder``: the
same timings read back from torch's flight recorder (on NCCL, each collective's duration
with collective timing on); nothing on the all-reduce path either, but each read of the
recorder holds the GIL (docs/performance.md), so it is only ever asked for. ``hook``: a Python comm
hook around the all-reduce, any backend, a few percent of step time (docs/performance.md).
``off``: no per-bucket timing; on a backend that completes buckets on the CPU, DDP's
buckets are still marked in flight between the end of backward compute and DDP having them
back, so a rank waiting in them is seen.

What decides: the ``bucket_timing`` option, whether c10d can time this group (NCCL),
whether the user gave a comm hook to ``attach``, and whether DDP still holds ddpmon's comm
hook from an earlier attach (DDP cannot unregister one). ``auto`` never adds a Python hook
of its own: it takes c10d where there is one and otherwise times buckets only when a Python
hook runs anyway. ``flight_recorder`` is tried on any backend: its self-check says what the
recorder lacks there (gloo's keeps no durations).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...config import BUCKET_TIMING_MODES

ANY = None
ERROR = "error"

# What ddpmon does with DDP's comm hook:
#   install  register ddpmon's timing hook (around the user's hook or DDP's all-reduce)
#   rebind   DDP still holds ddpmon's hook from an earlier attach: serve this monitor
#   user     register the user's hook as it is (nothing of ddpmon's on the all-reduce path)
#   none     register nothing
RULES: tuple[tuple[str | None, bool | None, bool | None, bool | None, str, str], ...] = (
    # option           c10d   user   earlier  -> source             comm hook
    ("c10d", False, ANY, ANY, ERROR, "none"),
    ("off", ANY, ANY, True, "off", "rebind"),  # a pass-through from now on
    ("off", ANY, True, False, "off", "user"),
    ("off", ANY, False, False, "off", "none"),
    ("hook", ANY, ANY, True, "hook", "rebind"),
    ("hook", ANY, ANY, False, "hook", "install"),
    (ANY, ANY, ANY, True, "hook", "rebind"),  # ddpmon's hook runs anyway
    ("flight_recorder", ANY, True, False, "flight_recorder", "user"),
    ("flight_recorder", ANY, False, False, "flight_recorder", "none"),
    (ANY, True, True, False, "c10d", "user"),
    (ANY, True, False, False, "c10d", "none"),
    ("auto", False, True, False, "hook", "install"),  # the user's hook runs in Python anyway
    ("auto", False, False, False, "off", "none"),
)

COMPLETION_SOURCES = ("c10d", "flight_recorder")
"""Sources that match timings torch reports after the fact to DDP's bucket layout."""


@dataclass(frozen=True)
class Plan:
    """What to install for one model."""

    source: str
    """``c10d``, ``flight_recorder``, ``hook`` or ``off``; ``error`` when the option cannot be
    had here."""
    comm_hook: str
    """``install``, ``rebind``, ``user`` or ``none`` (see RULES)."""
    time_later_hook: bool
    """Stand in for ``ddp.register_comm_hook``: a hook the user registers after attach runs
    in Python anyway, so it is registered inside ddpmon's and from then on times buckets."""
    mark_untimed: bool
    """Mark DDP's buckets in flight between the backward callbacks (no source times them
    and the backend completes them on the CPU)."""
    read_layout: bool
    """Read DDP's bucket layout from its logging data (no comm hook shows the buckets)."""


def plan(option: str, c10d: bool, user_hook: bool, earlier_hook: bool) -> Plan:
    """The first rule of RULES that matches; ``c10d`` is True when c10d can time this
    model's process group (NCCL serving its device)."""
    if option not in BUCKET_TIMING_MODES:
        raise ValueError(f"bucket_timing={option!r} is not one of {', '.join(BUCKET_TIMING_MODES)}")
    key = (option, c10d, user_hook, earlier_hook)
    for *pattern, source, comm_hook in RULES:
        if all(p is ANY or p == k for p, k in zip(pattern, key)):
            mark = source == "off" and not c10d
            return Plan(
                source=source,
                comm_hook=comm_hook,
                time_later_hook=option == "auto" and source == "off" and comm_hook == "none",
                mark_untimed=mark,
                read_layout=source in COMPLETION_SOURCES or mark,
            )
    raise AssertionError(f"no rule for {key}")  # the table covers every combination
