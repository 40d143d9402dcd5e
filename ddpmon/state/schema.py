"""The one definition of a rank's state file, ``<state_dir>/rank-<R>.json``.

Every writer (the recorder's snapshot, the watchdog's hang report, the exit record) builds
these records, and every reader (doctor, daemon, top, report) gets them from ``parse``, so a
misspelt key is an error where it is written rather than a missing fact where it is read.
``FORMAT`` is the schema version written into each file; ``parse`` also reads the previous
one and names the version of a file it cannot read. ``docs/state.md`` describes the fields
and ``state-schema.json`` beside this module is the JSON Schema generated from them
(``python -m ddpmon.state.schema`` rewrites it).

Records are built once and then only read: the recorder publishes a fresh ``RankState`` for
each snapshot instead of changing one that a reader may hold.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from . import records
from .records import SchemaError

FORMAT = 2
"""The schema version this ddpmon writes (the state file's ``format`` key)."""
READABLE = (1, 2)
"""Versions ``parse`` reads. Version 1 lacks nothing that version 2 needs; its in-flight
entries spelt ``async`` for ``async_op``."""
MAX_RANKS = 1 << 20
"""Ranks and world sizes beyond this are not a real job's (a forged file)."""
SCHEMA_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "state-schema.json")


@dataclass(slots=True)
class Frame:
    """One frame of a Python stack."""

    file: str | None = None
    line: int | None = None
    function: str | None = None
    code: str | None = None


@dataclass(slots=True)
class Thread:
    """One Python thread's stack, innermost frame last."""

    name: str = ""
    ident: int | None = None
    main: bool = False
    daemon: bool | None = None
    owns_gil: bool | None = None
    """From py-spy: the thread held the GIL when read."""
    active: bool | None = None
    frames: list[Frame] = field(default_factory=list)


@dataclass(slots=True)
class Collective:
    """A collective this rank issued: in flight, or done (``completed_unix`` set)."""

    seq: int
    """Sequence number within its process group (``p2p:<group>`` for point-to-point)."""
    op: str
    """torch's name of the operation (``all_reduce``, ``barrier``, ...)."""
    group: str = "?"
    group_size: int = 0
    bytes: int | None = None
    """Bytes this rank sends, where known."""
    dtype: str | None = None
    """The tensor's dtype (``float32``; ``mixed`` for a list of several), where known."""
    numel: int | None = None
    """Elements this rank contributes (summed over a list of tensors), where known."""
    call_site: str = "?"
    """``file:line`` of the first frame outside torch and ddpmon (``DDP backward`` for a bucket)."""
    function: str = ""
    issued_unix: float = 0.0
    bucket: int | None = None
    """Index of the DDP gradient bucket this collective reduces."""
    step: int | None = None
    callers: list[str] = field(default_factory=list)
    p2p: bool = False
    async_op: bool = False
    completion: str | None = None
    """``unknown`` when the backend gives no way to see an async collective complete."""
    completed_unix: float | None = None
    seconds: float | None = None
    error: str | None = None
    age_seconds: float | None = None
    """Seconds in flight when a hang report was written."""
    source: str | None = None
    """Where a reader found it, when not the rank's own record (``flight recorder``)."""


@dataclass(slots=True)
class Summary:
    """Median, last and largest value over the recent steps."""

    median: float
    last: float
    max: float


@dataclass(slots=True)
class Timings:
    """Per-step times over the last ``window_steps`` steps (null: not measured)."""

    window_steps: int = 0
    step_seconds: Summary | None = None
    forward_seconds: Summary | None = None
    backward_seconds: Summary | None = None
    compute_seconds: Summary | None = None
    """Forward plus backward compute."""
    exposed_comm_seconds: Summary | None = None
    """End of backward compute to DDP having every bucket back."""


@dataclass(slots=True)
class Bucket:
    """One DDP gradient bucket: its layout and its all-reduces so far."""

    index: int
    bytes: int = 0
    dtype: str = ""
    num_parameters: int = 0
    parameters: list[str] = field(default_factory=list)
    """Parameter names, at most 200."""
    count: int = 0
    """All-reduces timed."""
    last_seconds: float | None = None
    mean_seconds: float | None = None
    ready_seconds: float | None = None
    """When its gradients were all ready, seconds after its step began (last step)."""
    busbw_bytes_per_second: float | None = None
    bytes_total: int = 0


@dataclass(slots=True)
class Counts:
    issued: int = 0
    completed: int = 0


@dataclass(slots=True)
class Hang:
    """The watchdog's report of a rank without progress."""

    detected_unix: float
    last_progress_unix: float
    silent_seconds: float
    timeout_seconds: float
    timeout_source: str
    """``configured``, ``learned`` or ``warm-up``."""
    step: int = 0
    phase: str = ""
    in_flight: list[Collective] = field(default_factory=list)
    last_collective: Collective | None = None
    threads: list[Thread] = field(default_factory=list)
    """Every Python thread's stack, the main thread first."""
    flight_recorder: dict[str, Any] | None = None
    """torch's flight recorder: latest entries and per-group status (NCCL)."""
    flight_recorder_error: str | None = None
    extras_error: str | None = None


@dataclass(slots=True)
class Activity:
    """What the rank's main thread does, sampled by its watchdog about once a second
    (``ddpmon/liveness.py``)."""

    state: str
    """``stepping``, ``busy``, ``waiting`` or ``stuck``."""
    sampled_unix: float = 0.0
    still_seconds: float = 0.0
    """Seconds the main thread's stack has not changed."""
    cpu_share: float = 0.0
    """Share of one core the main thread used over the last seconds (0..1)."""
    io_bytes_per_second: float = 0.0
    """Bytes the process read and wrote per second over the last seconds."""
    where: str | None = None
    """``file:line in function`` of the main thread's innermost user frame."""
    hang_timeout_seconds: float | None = None
    """The rank's hang timeout when sampled (null: off)."""


@dataclass(slots=True)
class Exit:
    """How the interpreter ended."""

    unix: float
    exception: str | None = None
    """``Type: message`` of the uncaught exception, null for a clean exit."""
    where: str | None = None
    """``file:line in function`` of the innermost user frame of that exception (for
    ``sys.exit`` and ``os._exit``: of their caller)."""
    code: int | None = None
    """The exit status, where known: non-zero is a failure (``sys.exit(3)``: 3)."""
    how: str | None = None
    """``exception``, ``sys.exit``, ``os._exit``, ``end`` (the interpreter ended normally),
    or ``signal`` (a reader's record from the rank's faulthandler file)."""
    signal: str | None = None
    """The fatal signal (``SIGSEGV``, ``SIGABRT``, ...): never written by the rank, which
    cannot run Python then; readers fill it from ``rank-<R>.fault``."""
    threads: list[Thread] = field(default_factory=list)
    """With ``signal``: every thread's Python stack as faulthandler wrote it."""


@dataclass(slots=True)
class RankState:
    """Everything one rank publishes: who it is, where it is, what it measured."""

    rank: int
    local_rank: int | None = None
    world_size: int | None = None
    """The job's world size."""
    ddp_world_size: int | None = None
    """Size of DDP's process group (a subgroup under HSDP or 2-D parallelism)."""
    group_rank: int | None = None
    host: str | None = None
    pid: int | None = None
    port: int | None = None
    """The bound metrics port, null when the endpoint is off."""
    job: str | None = None
    backend: str | None = None
    device: str | None = None
    torch_version: str | None = None
    debug_level: str | None = None
    """TORCH_DISTRIBUTED_DEBUG as torch reads it."""
    version: str | None = None
    """ddpmon's version."""
    find_unused_parameters: bool | None = None
    num_parameters: int | None = None
    bucket_timing: str | None = None
    """Where bucket timing comes from on this rank: ``hook``, ``c10d`` or ``off``."""
    state_interval: float | None = None
    """Seconds between rewrites of this file."""
    ddp: dict[str, Any] = field(default_factory=dict)
    """Facts from DDP's own logging data."""
    step: int = 0
    phase: str = "init"
    """init, forward, after_forward, backward, allreduce, after_backward or detached."""
    started_unix: float | None = None
    last_progress_unix: float | None = None
    now_unix: float | None = None
    """The writer's clock when written."""
    collectives: Counts = field(default_factory=Counts)
    in_flight: list[Collective] = field(default_factory=list)
    last_collective: Collective | None = None
    collective_log: list[Collective] = field(default_factory=list)
    """The last 32 completed collectives."""
    collective_seq: dict[str, int] = field(default_factory=dict)
    """Last sequence number per process group."""
    collective_sites: dict[str, int] = field(default_factory=dict)
    """Collectives issued per op and call site."""
    unused_parameters: list[str] = field(default_factory=list)
    buckets: list[Bucket] = field(default_factory=list)
    timings: Timings = field(default_factory=Timings)
    notes: dict[str, str] = field(default_factory=dict)
    """Advice and warnings by topic."""
    errors: dict[str, str] = field(default_factory=dict)
    """Parts of ddpmon that failed and switched themselves off, with the error."""
    hang: Hang | None = None
    exit: Exit | None = None
    activity: Activity | None = None
    """What the main thread does (stepping, busy, waiting, stuck), from the watchdog."""
    format: int = FORMAT
    file_mtime_unix: float | None = None
    """Added by the node daemon's ``/state``: the file's modification time on its host."""
    served_unix: float | None = None
    """Added by the node daemon's ``/state``: its clock when it answered."""


def parse(data: object) -> RankState:
    """A state file's parsed JSON as a RankState; SchemaError says what is wrong."""
    if not isinstance(data, dict):
        raise SchemaError("", "a JSON object", data, "is not a ddpmon state file (not a JSON object)")
    version = data.get("format", 1)
    if version not in READABLE:
        newer = isinstance(version, int) and version > FORMAT
        raise SchemaError(
            "format", f"a state format this ddpmon reads ({', '.join(map(str, READABLE))})"
            + ("; it was written by a newer ddpmon: upgrade ddpmon here" if newer else ""), version,
        )
    if "rank" not in data:
        raise SchemaError("rank", "a rank", None, "is not a ddpmon state file (no 'rank' key)")
    if version == 1:
        data = _from_format_1(data)
    state = records.load(RankState, data)
    if not 0 <= state.rank < MAX_RANKS:
        raise SchemaError("rank", f"an integer from 0 to {MAX_RANKS - 1}", state.rank)
    for name in ("world_size", "ddp_world_size"):
        size = getattr(state, name)
        if size is not None and not 1 <= size <= MAX_RANKS:
            raise SchemaError(name, f"an integer from 1 to {MAX_RANKS}", size)
    return state


def to_json(state: RankState) -> dict[str, Any]:
    """The state as plain JSON data, the file's body."""
    return records.dump(state)


def _from_format_1(data: dict[str, Any]) -> dict[str, Any]:
    def entry(e: Any) -> Any:
        if isinstance(e, dict) and "async" in e:
            e = dict(e)
            e["async_op"] = bool(e.pop("async"))
        return e

    out = dict(data)
    for key in ("in_flight", "collective_log"):
        if isinstance(out.get(key), list):
            out[key] = [entry(e) for e in out[key]]
    out["last_collective"] = entry(out.get("last_collective"))
    timings = out.get("timings")
    if isinstance(timings, dict) and timings.get("window_steps") is None:
        out["timings"] = dict(timings, window_steps=0)
    return out


def generated_schema() -> dict[str, Any]:
    schema = records.json_schema(RankState)
    schema["$id"] = "https://ddpmon.dev/schemas/rank-state.json"
    schema["title"] = f"ddpmon rank state file (format {FORMAT})"
    schema["properties"]["format"]["const"] = FORMAT
    return schema


def main() -> int:
    """Rewrite state-schema.json from the records above."""
    with open(SCHEMA_FILE, "w") as f:
        json.dump(generated_schema(), f, indent=2)
        f.write("\n")
    print(SCHEMA_FILE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
