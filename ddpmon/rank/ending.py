"""How this rank's process ends, recorded where the doctor can read it.

A rank that ends while the others still need it is the root cause of what follows (their
timeouts and closed connections are consequences), so its end must say what it was:

- an uncaught exception (plain ``python``, ``torchrun``): ``sys.excepthook``, chained;
- an exception under ``torch.multiprocessing.spawn``: torch's ``_wrap`` catches it, writes
  the traceback into an error file for the parent and calls ``sys.exit(1)``, so the hook
  never sees it; the ``sys.exit`` wrapper below does, with the exception being handled;
- ``sys.exit(n)``: its code (non-zero is a failure); ``os._exit(n)``: its code too;
- a fatal signal (SIGSEGV, SIGABRT from a backend abort, SIGBUS, SIGFPE, SIGILL):
  ``faulthandler`` writes every thread's Python stack into ``rank-<R>.fault`` beside the
  state file (no Python can run then; the doctor reads that file);
- nothing at all (SIGKILL, the OOM killer): no record, which the doctor reports as such.

A failure is written to the state file at once (bounded), since a forked child (torch's
``fork`` start method) leaves through ``os._exit`` without running ``atexit``. Everything is
guarded, runs only in the process that attached (not in forked DataLoader workers) and never
changes how the process ends.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import stat
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from ..frames import is_library
from ..state import fault, files, schema
from .recorder import Recorder

log = logging.getLogger("ddpmon")

_FORK_HOOKED = False
_ACTIVE: list[Ending] = []


class Ending:
    """Records this process's end into ``recorder`` (``flush`` writes the state file)."""

    def __init__(
        self,
        recorder: Recorder,
        flush: Callable[[], Any] | None = None,
        state_file: str | None = None,
    ) -> None:
        self._recorder = recorder
        self._flush = flush
        self._fault_path = fault.path_for(state_file) if state_file else None
        self._fault_file: Any = None
        self._pid = os.getpid()
        self._installed = False
        self._exit_code: int | None = None
        self._hook: Any = None
        self._sys_exit: Any = None
        self._os_exit: Any = None

    # -- lifecycle ------------------------------------------------------------------------

    def install(self) -> None:
        self._hook, sys.excepthook = sys.excepthook, self._excepthook
        self._sys_exit, sys.exit = sys.exit, self._exit_wrapper
        self._os_exit, os._exit = os._exit, self._os_exit_wrapper  # type: ignore[assignment]
        self._installed = True
        _ACTIVE.append(self)
        if self._fault_path:
            self._enable_faulthandler()

    def remove(self) -> None:
        if not self._installed:
            return
        self._installed = False
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._hook
        if sys.exit == self._exit_wrapper:
            sys.exit = self._sys_exit
        if os._exit == self._os_exit_wrapper:
            os._exit = self._os_exit
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        if self._fault_file is not None:
            try:
                faulthandler.disable()
                self._fault_file.close()
            except Exception:
                pass
            self._fault_file = None

    def _enable_faulthandler(self) -> None:
        global _FORK_HOOKED
        if faulthandler.is_enabled():
            self._recorder.note(
                "faulthandler",
                "faulthandler was already enabled by the program: "
                "fatal signals go where it writes, not to the rank's .fault file",
            )
            return
        try:
            # truncates an earlier run's; as private as the state file (it holds stacks)
            self._fault_file = os.fdopen(files.open_private(self._fault_path), "w")  # type: ignore[arg-type]
            log = stderr_log()
            if log is not None:  # where a backend's abort says why (state/fault.py)
                self._fault_file.write(f"{fault.STDERR_LINE}{log}\n")
                self._fault_file.flush()
            faulthandler.enable(file=self._fault_file, all_threads=True)
            if not _FORK_HOOKED:
                os.register_at_fork(after_in_child=_forked)
                _FORK_HOOKED = True
        except Exception as exc:
            self._recorder.record_error("faulthandler", f"{type(exc).__name__}: {exc}")

    # -- the paths out --------------------------------------------------------------------

    def _excepthook(self, kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        try:
            if self._mine():
                self._failed(exception_record(exc, "exception", 1))
        except Exception:
            pass
        (self._hook or sys.__excepthook__)(kind, exc, tb)

    def _exit_wrapper(self, code: Any = None) -> Any:
        try:
            if self._mine():
                status = exit_status(code)
                self._exit_code = status
                if status:
                    handled = sys.exc_info()[1]
                    if handled is not None and not isinstance(handled, SystemExit):
                        # torch.multiprocessing's _wrap: sys.exit(1) while handling the error
                        self._failed(exception_record(handled, "exception", status))
                    else:
                        record = schema.Exit(
                            unix=time.time(),
                            code=status,
                            how="sys.exit",
                            where=caller_site(sys._getframe(1)),
                        )
                        if isinstance(code, str):
                            record.exception = f"SystemExit: {code}"[:2000]
                        self._failed(record)
        except Exception:
            pass
        return self._sys_exit(code)

    def _os_exit_wrapper(self, code: int) -> Any:
        try:
            if self._mine() and self._recorder.exit is None:
                record = schema.Exit(
                    unix=time.time(),
                    code=int(code),
                    how="os._exit",
                    where=caller_site(sys._getframe(1)),
                )
                self._recorder.set_exit(record)
                self._write(1.0)
        except Exception:
            pass
        return self._os_exit(code)

    def at_exit(self) -> None:
        """Interpreter exit: the record of a failure stays; otherwise a clean end, or an
        uncaught exception the hook did not see (``sys.last_value``)."""
        if os.getpid() != self._pid or self._recorder.exit is not None:
            return
        exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
        if exc is not None:
            self._recorder.set_exit(exception_record(exc, "exception", 1))
        else:
            self._recorder.set_exit(
                schema.Exit(unix=time.time(), code=self._exit_code or 0, how="end")
            )

    def _failed(self, record: schema.Exit) -> None:
        """The first failure is the one that counts (spawn's own sys.exit follows _wrap's)."""
        current = self._recorder.exit
        if current is not None and (current.exception or current.code):
            return
        self._recorder.set_exit(record)
        self._write(2.0)

    def _write(self, timeout: float) -> None:
        if self._flush is not None:
            try:
                self._flush(timeout)  # type: ignore[call-arg]
            except TypeError:
                self._flush()

    def _mine(self) -> bool:
        return self._installed and os.getpid() == self._pid


def stderr_log() -> str | None:
    """The path of this process's stderr when it is a regular file (a per-rank log), else
    None (a terminal, a pipe)."""
    try:
        if not stat.S_ISREG(os.fstat(2).st_mode):
            return None
        path = os.readlink("/proc/self/fd/2")
    except OSError:
        return None
    return path if path.startswith("/") and "\n" not in path else None


def _forked() -> None:
    """A forked child (a DataLoader worker) is not the rank: its faults are not the rank's."""
    for ending in _ACTIVE:
        ending._installed = False
        if ending._fault_file is not None:
            try:
                faulthandler.disable()
            except Exception:
                pass


def exit_status(code: Any) -> int:
    """The process exit status ``sys.exit(code)`` gives."""
    if code is None:
        return 0
    if isinstance(code, bool):
        return int(code)
    if isinstance(code, int):
        return code & 0xFF if code >= 0 else code
    return 1


def exception_record(exc: BaseException, how: str, code: int | None) -> schema.Exit:
    """An exit record for an exception: ``Type: message`` and its innermost user frame."""
    record = schema.Exit(unix=time.time(), code=code, how=how)
    record.exception = f"{type(exc).__name__}: {exc}"[:2000]
    where = innermost = None
    for fs in traceback.extract_tb(exc.__traceback__):
        innermost = fs
        if not is_library(fs.filename):
            where = fs
    chosen = where or innermost
    if chosen is not None:
        record.where = f"{chosen.filename}:{chosen.lineno} in {chosen.name}"
    return record


def caller_site(frame: Any) -> str | None:
    """``file:line in function`` of the first user frame from ``frame`` out."""
    fallback = None
    while frame is not None:
        code = frame.f_code
        here = f"{code.co_filename}:{frame.f_lineno} in {code.co_name}"
        if not is_library(code.co_filename) and not code.co_filename.startswith("<"):
            return here
        fallback = fallback or here
        frame = frame.f_back
    return fallback
