"""torch's flight recorder, read for hang reports (TORCH_FR_BUFFER_SIZE on torch 2.13,
TORCH_NCCL_TRACE_BUFFER_SIZE before): the latest entries and each group's status.

The dump goes through torch's own API (``torch_api.flight_recorder_dump``; without one, hang
reports say so) on a thread of its own, waited for a bounded time.
At most one dump runs at a time: while a hung job keeps a dump from returning, later hang
reports say so instead of starting another thread each time.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

ENTRIES = 32
WAIT_SECONDS = 2.0
KEEP = (
    "record_id",
    "pg_id",
    "process_group",
    "collective_seq_id",
    "p2p_seq_id",
    "op_id",
    "profiling_name",
    "input_sizes",
    "input_dtypes",
    "state",
    "time_created_ns",
    "time_discovered_started_ns",
    "time_discovered_completed_ns",
    "retired",
    "is_p2p",
    "timeout_ms",
)

_running: threading.Thread | None = None


def read(limit: int = ENTRIES, wait: float = WAIT_SECONDS) -> dict[str, Any] | None:
    """``{"flight_recorder": {...}}``, ``{"flight_recorder_error": why}`` or None (no
    entries, or torch is not loaded)."""
    global _running
    if _running is not None and _running.is_alive():
        return {"flight_recorder_error": "an earlier dump has not returned yet (not started again)"}
    box: dict[str, Any] = {}

    def dump() -> None:
        try:
            box["value"] = _dump()
        except Unavailable as exc:
            box["error"] = str(exc)
        except Exception as exc:
            box["error"] = f"{type(exc).__name__}: {exc}"

    worker = _running = threading.Thread(target=dump, name="ddpmon-flight-recorder", daemon=True)
    worker.start()
    worker.join(wait)
    if worker.is_alive():
        return {"flight_recorder_error": f"the dump did not return within {wait:.0f} s"}
    if "error" in box:
        return {"flight_recorder_error": box["error"]}
    raw = box.get("value")
    if not raw or not raw.get("entries"):
        return None
    entries = raw["entries"]
    return {
        "flight_recorder": {
            "version": raw.get("version"),
            "pg_status": raw.get("pg_status"),
            "total_entries": len(entries),
            "entries": [{k: e[k] for k in KEEP if k in e} for e in entries[-limit:]],
        }
    }


def _dump() -> dict[str, Any] | None:
    if "torch" not in sys.modules:
        return None
    from . import torch_api

    try:
        return torch_api.flight_recorder_dump()
    except torch_api.Missing as missing:
        raise Unavailable(torch_api.off(missing)) from None


class Unavailable(Exception):
    """This torch has no flight recorder dump (the message is the line said once)."""
