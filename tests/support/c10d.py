"""c10d's WorkInfo for the c10d clock's tests: made by hand (``info``), or recorded from a
live clock and replayed into a fresh one.

A recording is the clock's input in order, each with the wall-clock moment it happened:
the step hooks' calls, the boundaries (``new_step``, ``collect``, with how many steps the
live clock resolved there and their bucket durations) and c10d's WorkInfo records as they
arrived (op, seq, enqueue time, GPU duration). ``replay`` runs it through a new clock with
time stood in for, so a sequence recorded in a real job (tests/fixtures/workinfo/) pins
down the matching as unit tests do. Recorded by tests/gpu/c10d_record_job.py.
"""

from __future__ import annotations

import datetime
import time
import types
from typing import Any

import torch._C._distributed_c10d as torch_c10d

from ddpmon.fuses import Fuse
from ddpmon.rank.timing import c10d as completion
from ddpmon.rank.timing.c10d import CompletionClock


def info(op: str, seq: int, started_unix: float, ms: float) -> types.SimpleNamespace:
    """What ProcessGroupNCCL hands the hook: naive local datetimes, a timedelta."""
    started = datetime.datetime.fromtimestamp(started_unix)
    return types.SimpleNamespace(
        op_type=getattr(torch_c10d.OpType, op),
        seq=seq,
        time_started=started,
        time_finished=started + datetime.timedelta(milliseconds=ms),
        active_duration=datetime.timedelta(milliseconds=ms),
    )


def durations(steps: list[Any]) -> list[list[float]]:
    return [[round(t.end - t.start, 9) for t in s.buckets] for s in steps]


def record(clock: CompletionClock, events: list[list[Any]]) -> Any:
    """Wrap ``clock``'s step-hook and boundary methods to append to ``events``; returns the
    completion listener to add beside the clock's own (``c10d.listen``)."""

    def wrap(name: str, *, result: bool = False) -> None:
        real = getattr(clock, name)

        def call(*args: Any) -> Any:
            now = time.time()
            kept = args
            if name == "backward_started":  # a perf_counter moment: kept as seconds before now
                kept = (time.perf_counter() - args[0],)
            out = real(*args)
            events.append([now, name, *kept, *([durations(out)] if result else [])])
            return out

        setattr(clock, name, call)

    for name in ("backward_started", "backward_done", "sync_done", "new_step"):
        wrap(name)
    wrap("collect", result=True)

    def on_completion(info: Any) -> None:
        op = getattr(info.op_type, "name", str(info.op_type).rpartition(".")[2])
        events.append(
            [
                time.time(),
                "completion",
                op,
                int(getattr(info, "seq", 0) or 0),
                completion._unix(info.time_started),
                completion._seconds(info.active_duration),
            ]
        )

    return on_completion


def replay(
    events: list[list[Any]], used_map_allreduce: bool, monkeypatch: Any
) -> tuple[CompletionClock, list[Any]]:
    """Feed a recording to a fresh clock at its recorded moments: (the clock, for each
    recorded ``collect``, the live clock's bucket durations and the replayed ones)."""
    now = [0.0]
    monkeypatch.setattr(
        completion, "time", types.SimpleNamespace(time=lambda: now[0], perf_counter=lambda: now[0])
    )
    clock = CompletionClock("cpu", used_map_allreduce, Fuse("replay"))
    pairs = []
    for t, name, *args in events:
        now[0] = t
        if name == "completion":
            op, seq, started, seconds = args
            clock.on_completion(
                types.SimpleNamespace(
                    op_type=types.SimpleNamespace(name=op),
                    seq=seq,
                    time_started=started,
                    active_duration=seconds * 1000.0,
                )
            )
        elif name == "backward_started":
            clock.backward_started(t - args[0])
        elif name == "collect":
            pairs.append((args[0], durations(clock.collect())))
        else:
            getattr(clock, name)(*args)
    return clock, pairs
