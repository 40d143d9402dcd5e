"""A rank's state file from its process's start, before any DDP model exists.

Under ``ddpmon run`` (and ``python -m ddpmon.launch``) ``begin()`` runs before the script: a
thread of its own writes ``rank-<R>.json`` about once a second with the rank's stage
(``schema.Stage``: starting, rendezvous, init_process_group, group_ready, building_ddp), how
long it has been there, and where its main thread is (``rank/sampler.Sampler``: "train.py:5 in
prepare_dataset"). ``init_process_group`` and the store rendezvous inside it are wrapped
once torch.distributed is imported (``patch_c10d``); DDP's constructor says building_ddp
(``ddpmon.launch``). So the doctor answers about a job that never reached its first step:
who arrived, who did not, where each one is.

When the first monitor attaches, ``hand_over()`` stops the thread (the monitor's writer
takes the file over) and gives the monitor the ``Startup`` record. Nothing here raises into
the script or blocks it: the thread does the file system's work, a failure is logged once
and the early file stops there.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import socket
import threading
import time
import traceback
import types
from typing import Any

from .. import version
from ..collectors import host
from ..config import Config
from ..frames import is_library, short_path
from ..fuses import bounded
from ..state import attempts, files, schema
from ..state import root as stateroot
from ..state.schema import Stage
from . import clock_offset
from .sampler import Sampler

log = logging.getLogger("ddpmon")

_WAITING = (Stage.RENDEZVOUS, Stage.INIT_PROCESS_GROUP, Stage.BUILDING_DDP)
"""Stages in which the rank waits on the others (or on the store)."""


class Early:
    """The state of one rank before its monitor: what ``snapshot()`` writes."""

    def __init__(self, identity: schema.Identity, started_unix: float) -> None:
        self.identity = identity
        self.stage = Stage.STARTING
        self.startup = schema.Startup(
            process_started_unix=started_unix, stage_since_unix=started_unix
        )
        self.exit: schema.Exit | None = None
        self._sampler = Sampler()
        self.writer: Any = None  # the StateWriter, once the directory is claimed

    def enter(self, stage: Stage, **facts: Any) -> None:
        """The rank moved to ``stage`` (with facts of the ``Startup`` record): written soon."""
        now = time.time()
        self.startup = dataclasses.replace(self.startup, stage_since_unix=now, **facts)
        self.stage = stage
        self.notify()

    def note(self, **facts: Any) -> None:
        self.startup = dataclasses.replace(self.startup, **facts)
        self.notify()

    def notify(self) -> None:
        writer = self.writer
        if writer is not None:
            writer.notify()

    def state(self) -> schema.RankState:
        now = time.time()
        since = self.startup.stage_since_unix or now
        self._sampler.sample()
        seen = self._sampler.activity(now - since, self.stage in _WAITING, None, now)
        identity = {
            f.name: getattr(self.identity, f.name) for f in dataclasses.fields(schema.Identity)
        }
        return schema.RankState(
            **identity,
            stage=self.stage,
            startup=self.startup,
            started_unix=self.startup.process_started_unix,
            last_progress_unix=since,
            now_unix=now,
            activity=seen,
            exit=self.exit,
            clock=clock_offset.measured(),
        )

    def snapshot(self) -> dict[str, Any]:
        return schema.to_json(self.state())


_early: Early | None = None
_lock = threading.Lock()
_handed_over = False


def begin(environ: dict[str, str] | None = None) -> Early | None:
    """Publish this process's state from now on, when it is a rank of a launched job
    (RANK and WORLD_SIZE set) and state files are on. Cheap for the caller: the state
    directory is prepared by the writer's own thread."""
    global _early
    env = os.environ if environ is None else environ
    try:
        rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    try:
        config = Config.from_env(env)
        job = config.resolved_job(env)
        state_dir = config.resolved_state_dir(job)
        if state_dir is None or _early is not None:
            return _early
        identity = schema.Identity(
            rank=rank,
            local_rank=int(env.get("LOCAL_RANK", rank)),
            world_size=world_size,
            group_rank=int(env.get("GROUP_RANK", "0") or 0),
            host=socket.gethostname(),
            pid=os.getpid(),
            job=job,
            attempt=attempts.attempt_of(env),
            version=version.__version__,
            state_interval=config.state_interval,
        )
        early = _early = Early(identity, host.process_started_unix() or time.time())
        explicit = config.state_dir is not None
        threading.Thread(
            target=_start_writer,
            args=(early, state_dir, explicit, config.state_interval),
            name="ddpmon-startup",
            daemon=True,
        ).start()
        return early
    except Exception as exc:  # never in the script's way
        log.warning("ddpmon: rank %s: no state file before its DDP model: %r", rank, exc)
        return None


def _start_writer(early: Early, state_dir: str, explicit: bool, interval: float) -> None:
    from .writers import StateWriter

    try:
        chosen = stateroot.claim(state_dir, early.identity.rank, explicit)
        if chosen is None:
            return
        bounded(
            lambda: attempts.keep_earlier(
                chosen, early.identity.rank, early.identity.job or "", early.identity.attempt
            ),
            stateroot.ATTACH_FS_SECONDS,
            "keeping the earlier attempt's state files",
        )
        with _lock:
            if _handed_over:
                return
            early.writer = StateWriter(
                files.path_for(chosen, early.identity.rank), early.snapshot, interval
            )
            early.writer.start()
    except Exception as exc:
        log.warning(
            "ddpmon: rank %s: no state file before its DDP model: %r", early.identity.rank, exc
        )


def current() -> Early | None:
    """This process's early state, while no monitor has taken it over."""
    return None if _handed_over else _early


def hand_over() -> schema.Startup | None:
    """The first monitor takes the state file over: stop writing it (one last write, so it
    says building_ddp), and give the monitor the ``Startup`` record."""
    global _handed_over
    with _lock:
        if _handed_over or _early is None:
            return None
        _handed_over = True
        writer = _early.writer
    if writer is not None:
        writer.stop()
    return _early.startup


def ended(exc: BaseException | None, code: int | None = None) -> None:
    """The script ended before a monitor took over: the exit record, written at once."""
    early = current()
    if early is None or early.exit is not None:
        return
    where = None
    if exc is not None:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if not is_library(f.filename)]
        if frames:
            where = f"{short_path(frames[-1].filename)}:{frames[-1].lineno} in {frames[-1].name}"
    early.exit = schema.Exit(
        unix=time.time(),
        exception=f"{type(exc).__name__}: {exc}" if exc is not None else None,
        where=where,
        code=code if code is not None else (1 if exc is not None else 0),
        how="exception" if exc is not None else "end",
    )
    writer = early.writer
    if writer is not None:
        writer.write_final()


# -- init_process_group, watched ------------------------------------------------------------


def patch_c10d(module: types.ModuleType) -> None:
    """Wrap ``init_process_group`` and the ``rendezvous`` it calls in torch's
    ``distributed_c10d`` (before ``torch.distributed`` copies the names), to publish the
    stages. The wrappers only note times; they change no argument and no result."""
    try:
        init = module.init_process_group
        meet = module.rendezvous
        if getattr(init, "_ddpmon_startup", False):
            return

        @functools.wraps(init)
        def init_process_group(*args: Any, **kwargs: Any) -> Any:
            _entered(Stage.RENDEZVOUS, _init_facts(args, kwargs))
            try:
                out = init(*args, **kwargs)
            except BaseException as exc:
                _noted(error=f"{type(exc).__name__}: {exc}"[:2000])
                raise
            _entered(Stage.GROUP_READY, {"init_done_unix": time.time()})
            clock_offset.start()
            return out

        @functools.wraps(meet)
        def rendezvous(*args: Any, **kwargs: Any) -> Any:
            for found in meet(*args, **kwargs):
                _entered(Stage.INIT_PROCESS_GROUP, {"store_reached_unix": time.time()})
                yield found

        init_process_group._ddpmon_startup = True  # type: ignore[attr-defined]
        module.init_process_group = init_process_group  # type: ignore[attr-defined]
        module.rendezvous = rendezvous  # type: ignore[attr-defined]
    except Exception as exc:
        log.warning("ddpmon: cannot watch init_process_group (%r); its stages stay unknown", exc)


def _init_facts(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    backend = kwargs.get("backend", args[0] if args else None)
    method = kwargs.get("init_method", args[1] if len(args) > 1 else None)
    if kwargs.get("store") is not None:
        store = "a store given by the script"
    elif method and not str(method).startswith("env://"):
        store = str(method)
    else:
        store = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    return {
        "backend": str(backend) if backend is not None else None,
        "store": store,
        "init_started_unix": time.time(),
        "error": None,
    }


def _entered(stage: Stage, facts: dict[str, Any]) -> None:
    try:
        early = current()
        if early is not None:
            early.enter(stage, **facts)
    except Exception as exc:  # never into the script
        log.warning("ddpmon: startup stage not recorded: %r", exc)


def _noted(**facts: Any) -> None:
    try:
        early = current()
        if early is not None:
            early.note(**facts)
    except Exception:
        pass


def building_ddp() -> None:
    """DDP's constructor starts (its parameter check is a collective over every rank)."""
    _entered(Stage.BUILDING_DDP, {"ddp_started_unix": time.time()})
