"""torchrun, watched: ``python -m ddpmon.agent TORCHRUN-ARGS...`` is torchrun
(``torch.distributed.run``) run in this process, with a record of what it tries.

``ddpmon run`` starts torchrun this way. From the launcher's start (before torch loads, which
takes seconds: stage ``starting``, what its command line expects) and while it meets the
other nodes, a thread of its own rewrites ``<state_dir>/launcher-<host>-<pid>.json``
(``state/launcher.py``) about once a second: the rendezvous endpoint as given, the node count
expected, whether this node serves the store, and, on a node that does not, a TCP connection
to the endpoint tried every second, each failure folded by its error (refused, timed out, no
route, unknown host); in a dynamic (c10d) rendezvous, the nodes that joined it so far of how
many it needs, as torch's handler last saw them. What ends the launcher is written last: an
address already in use names the process that holds the port. Nothing here changes
torchrun's arguments, its output or its exit status; a failure of the record is logged once
and the record stops.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import sys
import threading
import time
from typing import Any

from .state import files, launcher
from .state.launcher import Attempt, LauncherStage, LauncherState

log = logging.getLogger("ddpmon")

PROBE_SECONDS = 1.0
PROBE_TIMEOUT = 2.0


class Record:
    """This launcher's ``LauncherState``, written by its own thread."""

    def __init__(self, state: LauncherState, path: str | None, interval: float = 1.0) -> None:
        self.state, self.path, self.interval = state, path, interval
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="ddpmon-launcher", daemon=True)
        self.handler: Any = None
        """torchrun's rendezvous handler, while the agent waits in it."""

    def start(self) -> None:
        self._thread.start()

    def stage(self, stage: LauncherStage, error: str | None = None) -> None:
        with self._lock:
            self.state.stage, self.state.stage_since_unix = stage, time.time()
            if error is not None:
                self.state.error = error[:2000]
        self.write()

    def failed(self, exc: BaseException) -> None:
        text = f"{type(exc).__name__}: {exc}"
        if "EADDRINUSE" in text or "address already in use" in text.lower():
            from .collectors import host

            port = int(self.state.endpoint.rsplit(":", 1)[-1] or 0)
            self.state.port_holder = host.port_holder(port) if port else None
        # failed before its ranks ran (the launch failed), or ended on their failure
        ended = self.state.stage not in (LauncherStage.STARTING, LauncherStage.RENDEZVOUS)
        self.stage(LauncherStage.ENDED if ended else LauncherStage.FAILED, text)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(PROBE_TIMEOUT + 1)
        self.write()

    def discard(self) -> None:
        """Stop, and remove the record (a launch that will not happen as it said)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(PROBE_TIMEOUT + 1)
        path, self.path = self.path, None
        if path is not None:
            try:
                os.unlink(path)
            except OSError:
                pass

    def write(self) -> None:
        if self.path is None:
            return
        with self._lock:
            self.state.now_unix = time.time()
            data = launcher.to_json(self.state)
        try:
            files.write_atomic(self.path, data)
        except OSError as exc:
            log.warning("ddpmon: the launcher's record %s stops: %s", self.path, exc)
            self.path = None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                s = self.state
                if s.stage == LauncherStage.RENDEZVOUS and not s.serves_store:
                    self.probe()
                if s.stage == LauncherStage.RENDEZVOUS and self.handler is not None:
                    seen = rendezvous_facts(self.handler)
                    with self._lock:
                        s.rendezvous = seen or s.rendezvous
                self.write()
            except Exception as exc:  # the record stops; torchrun goes on
                log.warning("ddpmon: the launcher's record stops: %r", exc)
                return
            self._stop.wait(self.interval)

    def probe(self) -> None:
        """One TCP connection to the endpoint: a failure is folded into ``attempts``."""
        host, _, port = self.state.endpoint.rpartition(":")
        now = time.time()
        try:
            with socket.create_connection((host.strip("[]"), int(port)), PROBE_TIMEOUT):
                pass
        except OSError as exc:
            kind = classify(exc)
            with self._lock:
                attempts = self.state.attempts
                for a in attempts:
                    if a.error == kind:
                        a.last_unix, a.count, a.detail = now, a.count + 1, str(exc)
                        break
                else:
                    attempts.append(Attempt(kind, str(exc), now, now))
                    del attempts[: -launcher.MAX_ATTEMPTS]
            return
        with self._lock:
            self.state.reached_unix = now


def rendezvous_facts(handler: Any) -> launcher.Rendezvous | None:
    """A dynamic rendezvous handler's last synced state (torch's private
    ``_state_holder.state``, read without a call to the store); None for a static one, or
    where torch keeps it elsewhere."""
    try:
        state = handler._state_holder.state
        settings = handler.settings
        return launcher.Rendezvous(
            min_nodes=int(settings.min_nodes),
            max_nodes=int(settings.max_nodes),
            joined=sorted(str(node.addr) for node in list(state.participants)),
            waiting=sorted(str(node.addr) for node in list(state.wait_list)),
            round=int(state.round),
            complete=bool(state.complete),
        )
    except Exception:  # static, another torch, or changed while read: the next pass
        return None


def classify(exc: OSError) -> str:
    """A failed connection in one word, as the doctor prints it."""
    if isinstance(exc, socket.gaierror):
        return "unknown host"
    if isinstance(exc, (socket.timeout, TimeoutError)) or exc.errno == errno.ETIMEDOUT:
        return "timed out"
    if isinstance(exc, ConnectionRefusedError):
        return "refused"
    if exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        return "no route"
    return "failed"


def open_record(
    state: LauncherState, path: str | None = None, environ: dict[str, str] | None = None
) -> Record | None:
    """Start writing ``state`` into the job's state directory (``path``, else the launcher's
    own name there); None when state files are off or the directory cannot be used. Reads
    the job from DDPMON_* in ``environ`` (this process's; set by ``ddpmon run``) and never
    imports torch."""
    from .config import Config
    from .fuses import bounded
    from .state import root

    ours = Config.from_env(environ)
    job = ours.resolved_job(environ)
    state_dir = ours.resolved_state_dir(job)
    if state_dir is None:
        return None
    explicit = ours.state_dir is not None

    def prepare() -> bool:
        root.prepare(state_dir, explicit)
        return True

    if not bounded(prepare, 5.0, state_dir):
        log.warning("ddpmon: the launcher's record is off: %s cannot be prepared", state_dir)
        return None  # (unsafe, or a hung file system): torchrun starts without it
    state.job = job
    record = Record(state, path or launcher.path_for(state_dir, state.host, state.pid))
    record.write()
    record.start()
    return record


def _starting(argv: list[str]) -> Record | None:
    """The record from this launcher's start, before torch loads: what its command line
    expects, in stage ``starting``. Under ``ddpmon run`` it goes on with the record that
    ``ddpmon run`` began (``HANDOFF_VARIABLE``: same file, same start)."""
    path = os.environ.pop(launcher.HANDOFF_VARIABLE, None)  # not passed on to the ranks
    state = launcher.starting(
        launcher.read_argv(argv), socket.gethostname(), os.getpid(), time.time(), None
    )
    if path:
        try:
            begun, _ = launcher.read(path)
            state.started_unix, state.command = begun.started_unix, begun.command  # the user's
        except Exception:  # (gone, or unreadable): this launcher's own start
            path = None
    return open_record(state, path)


def _begin(config: Any) -> None:
    """torchrun's ``LaunchConfig`` read: the record says what torchrun itself will try
    (its parser's values replace those read from the command line), and it meets the
    other nodes now."""
    global _record
    static = config.rdzv_backend == "static"
    node_rank = int(config.rdzv_configs.get("rank", 0)) if static else None
    nodes = (config.min_nodes, config.max_nodes)
    if _record is None:
        return
    with _record._lock:
        s = _record.state
        s.endpoint = str(config.rdzv_endpoint or "?")
        s.rdzv_backend = str(config.rdzv_backend)
        s.nnodes = str(nodes[0]) if nodes[0] == nodes[1] else f"{nodes[0]}:{nodes[1]}"
        s.node_rank = node_rank
        s.nproc_per_node = str(config.nproc_per_node)
        s.serves_store = static and node_rank == 0
    _record.stage(LauncherStage.RENDEZVOUS)


_record: Record | None = None


def _watch() -> None:
    """Wrap torchrun's ``launch_agent`` (to read its launch configuration) and the agent's
    rendezvous (to know when the nodes met); neither changes an argument or a result."""
    from torch.distributed.elastic.agent.server import api
    from torch.distributed.launcher import api as launcher_api

    original_launch = launcher_api.launch_agent

    def launch_agent(config: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            _begin(config)
        except Exception as exc:
            log.warning("ddpmon: the launcher's record is off: %r", exc)
        return original_launch(config, *args, **kwargs)

    launcher_api.launch_agent = launch_agent
    original_rendezvous = api.SimpleElasticAgent._rendezvous

    def _rendezvous(self: Any, worker_group: Any) -> None:
        if _record is not None:
            _record.handler = getattr(worker_group.spec, "rdzv_handler", None)
            _record.stage(LauncherStage.RENDEZVOUS)
        original_rendezvous(self, worker_group)
        if _record is not None:
            _record.handler = None
            _record.stage(LauncherStage.RUNNING)

    api.SimpleElasticAgent._rendezvous = _rendezvous  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> None:
    """torchrun's ``__main__`` with ``argv``, as ``python -m torch.distributed.run`` runs it
    (its logging and output the same)."""
    import runpy

    global _record
    argv = sys.argv[1:] if argv is None else argv
    try:
        _record = _starting(argv)
    except Exception as exc:
        log.warning("ddpmon: the launcher's record is off: %r", exc)
    try:
        _watch()
    except Exception as exc:
        log.warning("ddpmon: the launcher's record is off: %r", exc)
    sys.argv[:] = [sys.argv[0], *argv]
    try:
        runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
    except BaseException as exc:
        if _record is not None and not isinstance(exc, SystemExit):
            _record.failed(exc)
        raise
    finally:
        if _record is not None:
            if _record.state.stage != LauncherStage.FAILED:
                _record.state.stage = LauncherStage.ENDED
            _record.stop()


if __name__ == "__main__":
    from ddpmon.agent import main as _main  # the module's one copy, not this __main__ one

    _main()
