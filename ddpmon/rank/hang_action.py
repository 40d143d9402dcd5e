"""What a proven hang does beyond its report: ``hang_action=abort`` ends this rank, so that a
launcher that restarts (torchrun ``--max-restarts``) starts the next attempt.

The watchdog calls ``HangAbort`` once, at the moment it publishes a hang report: a proven
stall by the activity rule (a busy rank never is, nor a rank that waits for busy peers; a
waiting rank only once its culprit is known stuck or gone: ``sampler.holdouts``). On the watchdog's thread, each step bounded in time:

1. the exit record (``how="hang_abort"``, exit status 87, the culprit ranks) joins the hang
   report already in the recorder (every thread's stack, torch's flight recorder);
2. the state file is written at once, then the step history's last batch and its exit;
3. the process groups are aborted where the backend can: NCCL (``_abort_process_group``,
   else each group's ``abort()``), so that no communicator stays wedged on the GPU; gloo has
   no abort, and its peers see closed connections once this process is gone;
4. ``os._exit(87)``: the main thread is stuck (in C++ or in the script), so only ending the
   process ends it; exit hooks do not run, their work is done above.

The launcher sees a failed worker, ends the others and starts the next attempt.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from .. import activity
from ..fuses import bounded
from ..state import attempts, files, schema
from .recorder import Recorder

log = logging.getLogger("ddpmon")

WRITE_SECONDS = 2.0
ABORT_SECONDS = 5.0


class HangAbort:
    """``hang_action=abort``: called with the hang report at the moment it is proven."""

    def __init__(
        self,
        recorder: Recorder,
        state_file: str | None,
        flush: Callable[..., Any] | None,
        history: Callable[[], Any] | None = None,
        exit: Callable[[int], Any] | None = None,
        abort_groups: Callable[[], str] | None = None,
    ) -> None:
        self._recorder = recorder
        self._state_file = state_file
        self._flush = flush
        self._history = history
        self._exit = exit or os._exit
        self._abort_groups = abort_groups or abort_process_groups
        self.fired = False

    def __call__(self, report: schema.Hang) -> None:
        if self.fired:
            return
        self.fired = True
        rec = self._recorder
        culprits = self.culprits(report)
        record = schema.Exit(
            unix=time.time(), code=attempts.HANG_EXIT_CODE, how="hang_abort", culprits=culprits
        )
        main = next((t for t in report.threads if t.main and t.frames), None)
        if main is not None:
            f = main.frames[-1]
            record.where = f"{f.file}:{f.line} in {f.function}"
        rec.set_exit(record)
        log.error(
            "ddpmon: rank %s ends itself after a proven hang (hang_action=abort): no progress for "
            "%.1f s, culprit rank%s %s; exit status %d so that the launcher restarts the job",
            rec.identity.rank,
            report.silent_seconds,
            "s" if len(culprits) != 1 else "",
            ", ".join(map(str, culprits)) or "unknown",
            attempts.HANG_EXIT_CODE,
        )
        if self._flush is not None:
            bounded(
                lambda: self._flush(WRITE_SECONDS),  # type: ignore[misc]
                WRITE_SECONDS + 0.5,
                "the state file before ending",
            )
        if self._history is not None:
            bounded(self._history, WRITE_SECONDS + 1.0, "the step history before ending")
        said = bounded(self._abort_groups, ABORT_SECONDS, "aborting the process groups")
        log.error(
            "ddpmon: rank %s: %s; exiting with status %d",
            rec.identity.rank,
            said or "the process groups did not abort in time",
            attempts.HANG_EXIT_CODE,
        )
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        self._exit(attempts.HANG_EXIT_CODE)

    def culprits(self, report: schema.Hang) -> list[int]:
        """This rank when it is stuck itself; when it waits in a
        collective, the peers whose state files say they have not joined it."""
        rec = self._recorder
        seen = rec.activity
        waiting = [e for e in report.in_flight if e.seq is not None]
        if (
            seen is None
            or seen.state != activity.Status.WAITING
            or not waiting
            or not self._state_file
        ):
            return [rec.identity.rank]
        entry = min(waiting, key=lambda e: e.issued_unix)
        out = []
        for path in files.list_files(os.path.dirname(self._state_file)):
            try:
                peer = files.read(path)
            except Exception:
                continue
            if peer.rank != rec.identity.rank and not peer.has_issued(entry):
                out.append(peer.rank)
        return out


def abort_process_groups() -> str:
    """Abort every process group where the backend can; says what was done."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return "no process group to abort"
    backend = str(dist.get_backend())
    if "nccl" not in backend:
        return (
            f"the {backend} backend has no abort: its peers see closed connections once this "
            "process has ended"
        )
    c10d = dist.distributed_c10d
    abort_all = getattr(c10d, "_abort_process_group", None)
    if abort_all is not None:
        abort_all()
        return "aborted the NCCL process groups"
    for pg in list(c10d._world.pg_names):
        abort = getattr(pg, "abort", None)
        if abort is not None:
            abort()
    return "aborted each NCCL process group"
