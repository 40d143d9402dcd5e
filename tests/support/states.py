"""State files as ranks write them, for the doctor's and the advice's tests.

State files are built from the state schema's records, then get the times and fields a
scenario needs. Ranks on another host are not checked with psutil, so those files stand for
ranks anywhere.

Every test has its own "now", ``NOW``, set before it runs (tests/conftest.py): files are
written as of that moment, minus their age. Read it as ``states.NOW``: a name imported with
``from tests.support.states import NOW`` keeps the moment of its import, which ages as other
tests run before it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddpmon.state import files as statefile
from ddpmon.state import schema

if TYPE_CHECKING:
    from ddpmon.doctor import Diagnosis

NOW = time.time()
PID_BASE = 4_194_304
"""A written rank's pid is this plus its rank: above Linux's largest pid_max, so no live
process has it (a small pid may be one of the suite's own processes at the moment of a read)."""


def restart_clock() -> float:
    """A new "now" for the next test."""
    global NOW
    NOW = time.time()
    return NOW


def state(
    rank: int,
    world: int = 2,
    job: str = "job",
    host: str = "node-b",
    *,
    steps: int = 20,
    step_s: float = 0.05,
    forward_s: float = 0.01,
    backward_s: float = 0.02,
    exposed_s: float | None = 0.01,
    silent: float = 0.1,
    skew: float = 0.0,
    backend: str = "gloo",
    **fields: Any,
) -> dict[str, Any]:
    """A rank's state file body: ``silent`` seconds since its last progress at writing,
    its writer's clock ``skew`` seconds off."""

    def summary(value: float | None) -> schema.Summary | None:
        return None if value is None else schema.Summary(value, value, value)

    snap = schema.to_json(
        schema.RankState(
            rank=rank,
            local_rank=rank,
            world_size=world,
            host=host,
            pid=PID_BASE + rank,
            port=None,
            job=job,
            backend=backend,
            debug_level="OFF",
            state_interval=1.0,
            step=steps,
            timings=schema.Timings(
                window_steps=steps,
                step_seconds=summary(step_s),
                forward_seconds=summary(forward_s),
                backward_seconds=summary(backward_s),
                compute_seconds=summary(forward_s + backward_s),
                exposed_comm_seconds=summary(exposed_s),
            ),
        )
    )
    now = NOW + skew
    snap.update(
        now_unix=now, last_progress_unix=now - silent, started_unix=now - 100, stage="forward"
    )
    snap.update(fields)
    return snap


def hang_report(**fields: Any) -> dict[str, Any]:
    """A watchdog's hang report, as the schema has it."""
    report = {
        "detected_unix": NOW,
        "last_progress_unix": NOW - 60,
        "silent_seconds": 60.0,
        "timeout_seconds": 60.0,
        "timeout_source": "learned",
        "threads": [],
        "in_flight": [],
    }
    report.update(fields)
    return report


def waiting_in(
    op: str,
    seq: int,
    age: float,
    site: str = "train.py:88",
    group: str = "0",
    size: int = 2,
    skew: float = 0.0,
    **extra: Any,
) -> dict[str, Any]:
    entry = {
        "seq": seq,
        "op": op,
        "group": group,
        "group_size": size,
        "bytes": 4096,
        "call_site": site,
        "function": "train_step",
        "issued_unix": NOW + skew - age,
    }
    entry.update(extra)
    return entry


def write(directory: Path, data: dict[str, Any], age: float = 0.2) -> Path:
    """Write a state file as its rank would have ``age`` seconds ago: the times in ``data``
    are as of its writing, and move back by ``age`` with it."""
    directory.mkdir(parents=True, exist_ok=True)
    path = Path(statefile.path_for(str(directory), data["rank"]))
    data = json.loads(json.dumps(data))
    for key in ("now_unix", "last_progress_unix", "started_unix"):
        data[key] -= age
    for entry in data.get("in_flight") or []:
        entry["issued_unix"] -= age
    if isinstance(data.get("exit"), dict):
        data["exit"]["unix"] -= age
    statefile.write_atomic(str(path), data)
    os.utime(path, (NOW - age, NOW - age))
    return path


def kinds(d: Diagnosis) -> list[str]:
    return [f.kind for f in d.findings]
