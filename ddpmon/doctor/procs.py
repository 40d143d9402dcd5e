"""Is a rank's process still there? Checked with psutil for ranks on this host.

A pid alone can mislead (reused by a later process, or another pid namespace), so a process
only counts as the rank when it started before the rank attached.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import psutil

_START_SLACK = 2.0


@dataclass(frozen=True)
class Liveness:
    """``alive`` is None when the process is on another host and cannot be checked."""

    alive: bool | None
    detail: str
    stopped: bool = False


def this_host() -> str:
    return socket.gethostname()


def check(host: str | None, pid: object, started_unix: float | None, local_host: str) -> Liveness:
    """Liveness of the process ``pid`` on ``host``; ``started_unix`` (this host's clock) is
    when the rank attached."""
    if not host or host != local_host:
        return Liveness(None, f"on host {host or '?'}, not checked from {local_host}")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return Liveness(None, f"no valid pid in the state file ({pid!r})")
    try:
        proc = psutil.Process(pid)
        status = proc.status()
        created = proc.create_time()
    except psutil.NoSuchProcess:
        return Liveness(False, f"pid {pid} does not exist")
    except psutil.AccessDenied:
        return Liveness(True, f"pid {pid} exists (details not permitted)")
    except Exception as exc:  # psutil can fail in odd ways on odd systems
        return Liveness(None, f"pid {pid}: cannot be checked ({exc})")
    if status == psutil.STATUS_ZOMBIE:
        return Liveness(False, f"pid {pid} has exited (a zombie, not yet reaped by its parent)")
    if status == psutil.STATUS_DEAD:
        return Liveness(False, f"pid {pid} is dead")
    if started_unix is not None and created > started_unix + _START_SLACK:
        return Liveness(False, f"pid {pid} is a later process (the rank's process is gone)")
    if status in (psutil.STATUS_STOPPED, getattr(psutil, "STATUS_TRACING_STOP", "tracing-stop")):
        return Liveness(True, f"pid {pid} is stopped (SIGSTOP or a debugger)", stopped=True)
    return Liveness(True, f"pid {pid} is running ({status})")
