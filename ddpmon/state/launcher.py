"""What a node's launcher tried: ``<state_dir>/launcher-<host>-<pid>.json``.

``ddpmon run`` runs torchrun's agent in its own process (``ddpmon/agent.py``), which writes
this file about once a second from its start to its end: the rendezvous endpoint (the
master address and port as given), the node count it expects, whether this node serves
the store, each failed attempt to reach the endpoint with the error (refused, timed out, no
route, unknown host; folded by error), and what ended it (an address already in use, with
the process that holds the port), and, in a dynamic (c10d) rendezvous, the nodes that
joined it so far of how many it needs. A node whose ranks never start has only this file, so
the daemon serves it (``/launchers``) beside the ranks' and the doctor reads it. Nothing
here imports torch.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ..errors import StateFileError
from . import files, records
from .records import SchemaError

FORMAT = 1
NAME_PATTERN = re.compile(r"^launcher-([A-Za-z0-9_.-]{1,80})-(\d{1,10})\.json$")
MAX_ATTEMPTS = 16
"""Distinct errors kept (each with its count): the file stays small however long it tries."""
MAX_COMMAND = 32
"""Words of the command kept (each at most ``MAX_WORD`` characters): a file stays small."""
MAX_WORD = 200
HANDOFF_VARIABLE = "DDPMON_LAUNCHER_RECORD"
"""Set by ``ddpmon run`` for the agent it starts: the record ``ddpmon run`` began, which the
agent goes on writing (one record per launch, from the moment the user started it)."""


class LauncherStage(str, Enum):
    STARTING = "starting"
    """The launcher is starting (``ddpmon run`` reads its arguments, torch is loading):
    nothing tried yet; what it expects is read from its command line."""
    RENDEZVOUS = "rendezvous"
    """Meeting the other nodes at the endpoint: no rank of this node runs yet."""
    RUNNING = "running"
    """The nodes met; this node's ranks were started."""
    FAILED = "failed"
    """The launcher ended on an error (``error``)."""
    ENDED = "ended"

    def __str__(self) -> str:
        return self.value


@dataclass(slots=True)
class Attempt:
    """Failed attempts to reach the endpoint with one error, folded."""

    error: str
    """``refused``, ``timed out``, ``no route``, ``unknown host`` or ``failed``."""
    detail: str
    """The system's words (``[Errno 113] No route to host``)."""
    first_unix: float
    last_unix: float
    count: int = 1


@dataclass(slots=True)
class Rendezvous:
    """What a dynamic rendezvous (``--rdzv-backend c10d``) knows while it waits, as torch's
    rendezvous handler last synced it with the other nodes."""

    min_nodes: int
    max_nodes: int
    joined: list[str] = field(default_factory=list)
    """The nodes of this round so far, by the address the rendezvous knows them by (a host
    name, or ``--local-addr``), one entry per launcher."""
    waiting: list[str] = field(default_factory=list)
    """Nodes that wait for the next round (they came after it closed)."""
    round: int = 0
    complete: bool = False


@dataclass(slots=True)
class LauncherState:
    """One node's launcher (torchrun's agent under ``ddpmon run``)."""

    host: str
    pid: int
    started_unix: float
    endpoint: str
    """``host:port`` of the rendezvous as given (``--master-addr``/``--master-port``, or
    ``--rdzv-endpoint``)."""
    rdzv_backend: str = "static"
    nnodes: str = "1"
    """The node count it expects (``2``, or ``1:4`` elastic)."""
    node_rank: int | None = None
    """``--node-rank`` (static rendezvous), null when the rendezvous assigns it."""
    nproc_per_node: str | None = None
    command: list[str] = field(default_factory=list)
    """The script and its arguments, as given (bounded)."""
    job: str | None = None
    serves_store: bool = False
    """This node hosts the rendezvous store (static rendezvous, node 0)."""
    stage: LauncherStage = LauncherStage.RENDEZVOUS
    stage_since_unix: float | None = None
    attempts: list[Attempt] = field(default_factory=list)
    """Failed attempts to reach the endpoint, one entry per error."""
    reached_unix: float | None = None
    """The last time a connection to the endpoint succeeded."""
    error: str | None = None
    """What ended the launcher (``Type: message``)."""
    port_holder: str | None = None
    """With an address already in use: the process that holds the port
    (``pid 123: python -m http.server 29500``), where this host lets it be seen."""
    rendezvous: Rendezvous | None = None
    """A dynamic rendezvous's own view while this node waits in it (null: a static one, or
    not read yet)."""
    now_unix: float | None = None
    format: int = FORMAT
    file_mtime_unix: float | None = None
    """Added by the node daemon's ``/launchers``."""
    served_unix: float | None = None
    """Added by the node daemon's ``/launchers``: its clock when it answered."""

    @property
    def node(self) -> str:
        """``node 1 (host-b)``, or ``host-b`` where the node's rank is not known."""
        return f"node {self.node_rank} ({self.host})" if self.node_rank is not None else self.host


@dataclass(slots=True)
class Reading:
    """What a torchrun command line says, read without torch (torch's own parser reads it
    again once torch is loaded; this is what the record says until then)."""

    endpoint: str
    rdzv_backend: str
    nnodes: str
    node_rank: int | None
    nproc_per_node: str
    command: list[str]
    rdzv_id: str | None
    starts_python: bool
    """torchrun starts ``python SCRIPT`` (not ``--no-python`` or ``--run-path``)."""


FLAGS = frozenset(
    ("--standalone", "--no-python", "--run-path", "-m", "--module", "--virtual-local-rank")
)
"""torchrun's options without a value (every other option takes one)."""


def read_argv(argv: list[str]) -> Reading:
    """torchrun's arguments (``--nnodes=2 --node-rank 1 ... train.py --lr 0.1``), as
    torchrun reads them, with its defaults."""
    options: dict[str, str] = {}
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "--":
        name, eq, value = argv[i].partition("=")
        name = "--" + name.lstrip("-").replace("_", "-") if name.startswith("--") else name
        if not eq and name not in FLAGS and i + 1 < len(argv):
            value, i = argv[i + 1], i + 1
        options[name] = value
        i += 1
    command = [w[:MAX_WORD] for w in argv[i + (i < len(argv) and argv[i] == "--") :]]
    standalone = "--standalone" in options
    backend = "c10d" if standalone else options.get("--rdzv-backend", "static")
    if standalone:
        endpoint = "localhost:0"
    elif backend == "static":
        endpoint = (
            f"{options.get('--master-addr', '127.0.0.1')}:{options.get('--master-port', '29500')}"
        )
    else:
        endpoint = options.get("--rdzv-endpoint", "?")
    nnodes = options.get("--nnodes", "1")
    low, _, high = nnodes.partition(":")
    node_rank = options.get("--node-rank", "0") if backend == "static" else None
    return Reading(
        endpoint=endpoint,
        rdzv_backend=backend,
        nnodes=low if not high or low == high else nnodes,
        node_rank=int(node_rank) if node_rank is not None and node_rank.isdigit() else None,
        nproc_per_node=options.get("--nproc-per-node", "1"),
        command=command[:MAX_COMMAND],
        rdzv_id=options.get("--rdzv-id")
        if options.get("--rdzv-id") not in (None, "none")
        else None,
        starts_python="--no-python" not in options and "--run-path" not in options,
    )


def starting(reading: Reading, host: str, pid: int, now: float, job: str | None) -> LauncherState:
    """The record of a launcher that has read its command line and nothing more."""
    static = reading.rdzv_backend == "static"
    return LauncherState(
        host=host,
        pid=pid,
        started_unix=now,
        endpoint=reading.endpoint,
        rdzv_backend=reading.rdzv_backend,
        nnodes=reading.nnodes,
        node_rank=reading.node_rank,
        nproc_per_node=reading.nproc_per_node,
        command=reading.command,
        job=job,
        serves_store=static and reading.node_rank == 0,
        stage=LauncherStage.STARTING,
        stage_since_unix=now,
    )


def path_for(state_dir: str, host: str, pid: int) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", host)[:80] or "host"
    return os.path.join(state_dir, f"launcher-{safe}-{pid}.json")


def parse(data: object) -> LauncherState:
    if not isinstance(data, dict):
        raise SchemaError("", "a JSON object", data, "is not a ddpmon launcher file")
    version = data.get("format", FORMAT)
    if version != FORMAT:
        raise SchemaError("format", f"launcher format {FORMAT}", version)
    return records.load(LauncherState, data)


def to_json(state: LauncherState) -> dict[str, Any]:
    dumped: dict[str, Any] = records.dump(state)
    return dumped


def read(path: str) -> tuple[LauncherState, float]:
    """One launcher file (never through a link) and when it was written; StateFileError
    says what is wrong."""
    raw, info = files._read_opened(path, files.MAX_BYTES)
    try:
        return parse(files.decode(path, raw)), files.written_unix(info)
    except SchemaError as exc:
        raise StateFileError(path, str(exc)) from None


def list_paths(directory: str) -> list[str]:
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(os.path.join(directory, n) for n in names if NAME_PATTERN.match(n))
