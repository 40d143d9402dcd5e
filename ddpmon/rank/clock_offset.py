"""This rank's clock against rank 0's, measured once, as soon as the job's store is there.

Imported by ``rank/startup.py`` before the script runs, so it imports torch only when
started. A thread of its own runs ``clocks``' round trips through the job's c10d store (under a
prefix of ddpmon's): rank 0 answers the others, each other rank asks. The training thread
only starts it (after ``init_process_group`` under ``ddpmon run``, else at attach); the
result lands in ``measured()``, which the state file carries (``schema.Clock``), so the
doctor and the report put every rank's times on rank 0's clock.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time

from .. import clocks
from ..state import schema

log = logging.getLogger("ddpmon")

DEADLINE_SECONDS = 300.0
"""The reference answers askers for this long; an asker waits as long for its turn."""
EXIT_SECONDS = 2.0
"""At the process's exit the thread is stopped and waited for this long at most: a daemon
thread still inside a store call when the interpreter finalizes aborts the process."""
PREFIX = "ddpmon/clock/"

_lock = threading.Lock()
_started = False
_measured: schema.Clock | None = None
_stop = threading.Event()


def measured() -> schema.Clock | None:
    """This rank's clock against rank 0's; None until measured (or when it could not be)."""
    return _measured


def start() -> None:
    """Measure once per process, on a thread of its own, if a process group is up."""
    global _started
    with _lock:
        if _started:
            return
        _started = True
    from . import torch_api  # imports torch: not before the script does (rank/startup.py)

    try:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            with _lock:
                _started = False  # a later call (attach) tries again
            return
        rank, world = dist.get_rank(), dist.get_world_size()
        store = dist.PrefixStore(PREFIX, torch_api.default_store())
    except torch_api.Missing as missing:
        torch_api.off(missing)
        return
    except Exception as exc:
        log.warning("ddpmon: the clock's offset from rank 0's is not measured: %r", exc)
        return
    thread = threading.Thread(
        target=_run, args=(store, rank, world), name="ddpmon-clock", daemon=True
    )
    thread.start()
    atexit.register(_stop_at_exit, thread)


def _stop_at_exit(thread: threading.Thread) -> None:
    _stop.set()
    thread.join(EXIT_SECONDS)


def _run(store: object, rank: int, world: int) -> None:
    global _measured
    deadline = time.monotonic() + DEADLINE_SECONDS
    try:
        if rank == 0:
            _measured = schema.Clock(0.0, 0.0, time.time())
            clocks.serve(store, world - 1, deadline, stop=_stop)  # type: ignore[arg-type]
            return
        found = clocks.measure(store, rank, deadline, stop=_stop)  # type: ignore[arg-type]
        if found is not None:
            _measured = schema.Clock(
                round(found.offset_seconds, 6), round(found.delay_seconds, 6), time.time()
            )
    except Exception as exc:  # the job's store went away (it ended): the doctor estimates
        log.info("ddpmon: rank %d: the clock's offset from rank 0's not measured: %r", rank, exc)
