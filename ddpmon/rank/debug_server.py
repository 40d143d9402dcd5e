"""torch's debug server (``torch.distributed.debug``) beside ddpmon: started in every rank
for ``ddpmon run --debug-server``, and stopped in each rank as the rank ends, however it was
started.

Why a rank stops it itself: rank 0's frontend keeps fetching every rank's Python stacks from
that rank's worker server, whose thread takes the GIL to answer. Once a rank's interpreter
is finalizing, a thread that takes the GIL is ended (``pthread_exit``), and the unwinding
cannot pass torch's worker thread: the rank dies of SIGABRT ("FATAL: exception not
rethrown") after its training went well. Any rank that ends while rank 0 lives can meet it,
and ddpmon makes rank 0 end later than the others (it sums the run up, waiting up to 2 s for
their last state files): 2 jobs of 3 ended so with ddpmon, none of 4 without it, 3 of 3
without it when rank 0 ended 2 s after the others. Stopped at the start of the rank's exit,
the worker server refuses the frontend's requests before the interpreter finalizes; rank 0
ends its frontend process as well (bounded), before its own summary.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
from typing import Any

from ..config import DEBUG_SERVER_PACKAGES
from ..state import root
from . import torch_api

log = logging.getLogger("ddpmon")

STOP_SECONDS = 2.0
"""At most this long a rank waits for rank 0's frontend process to end when it stops it."""

DUMP_DIR = "debug-server"
"""The frontend's periodic dumps go into this directory of the job's state directory."""

FETCH_TIMEOUT = 10.0
"""Seconds the frontend waits for each rank's answer: torch's 60 s would hold every dump up
by a minute for a rank whose main thread keeps the GIL (its stacks cannot be fetched)."""


def start(port: int, dump_dir: str | None, interval: float, backend: str) -> None:
    """Start torch's debug server in this rank (the frontend on rank 0, with periodic dumps
    into ``dump_dir``). A rank where it cannot start logs one warning and trains on."""
    missing = [
        name
        for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
        if not os.environ.get(name)
    ]
    if missing:
        log.warning(
            "ddpmon: torch's debug server not started: it needs %s (torchrun sets them); "
            "training goes on",
            ", ".join(missing),
        )
        return
    try:
        from torch.distributed.debug import start_debug_server
    except ImportError as exc:
        log.warning(
            "ddpmon: torch's debug server not started (%s); training goes on. Fix: "
            "pip install 'ddpmon[debug-server]' (%s) into a torch that has "
            "torch.distributed.debug",
            exc,
            ", ".join(DEBUG_SERVER_PACKAGES),
        )
        return
    dumps = {"stacks"}
    if (
        "nccl" in backend
    ):  # torch's flight recorder tables fail on gloo's entries (KeyError), each dump
        dumps.add("fr_trace")
    if shutil.which("py-spy"):  # stacks without the GIL: a frozen rank's too
        dumps.add("pyspy_dump")
    try:
        if (
            dump_dir is not None
        ):  # the dumps hold stacks, as state files do: 0700, ours, never a link
            root.make_subdir(dump_dir)
        start_debug_server(
            port=port,
            dump_dir=dump_dir,
            dump_interval=interval,
            enabled_dumps=dumps,
            fetch_timeout=FETCH_TIMEOUT,
        )
    except Exception as exc:  # a port in use, a store that does not answer: training goes on
        log.warning("ddpmon: torch's debug server not started: %r; training goes on", exc)


def backend_of(ddp: Any) -> str:
    """The name of the backend ``ddp`` all-reduces with (``gloo``, ``nccl``, ...)."""
    import torch.distributed as dist

    return str(dist.get_backend(ddp.process_group))


def stop_at_exit() -> None:
    """Make ``stop`` the first thing this process does at exit (atexit runs the last
    registered first): before ddpmon's own last writes and rank 0's summary."""
    atexit.unregister(stop)
    atexit.register(stop)


def stop() -> None:
    """Stop this process's debug server, if the program started one: rank 0's frontend
    process (bounded), then the worker server. Never raises."""
    try:
        worker, frontend = torch_api.debug_server()
    except torch_api.Missing as missing:
        torch_api.off(missing)
        return
    except Exception:
        return
    if worker is None and frontend is None:
        return
    if frontend is not None:
        _end(frontend)
    if worker is not None:
        try:
            worker.shutdown()
        except Exception as exc:
            log.info("ddpmon: torch's debug server did not shut down: %r", exc)
    try:
        torch_api.forget_debug_server()
    except Exception:
        pass


def _end(process: Any) -> None:
    try:
        if process.is_alive():
            process.terminate()
            process.join(STOP_SECONDS)
            if process.is_alive():
                process.kill()
                process.join(STOP_SECONDS)
    except Exception as exc:
        log.info("ddpmon: torch's debug server frontend did not end: %r", exc)
