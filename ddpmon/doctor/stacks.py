"""Live Python stacks of local rank processes, read from outside with py-spy.

A rank whose main thread holds the GIL (a C extension that never releases it) cannot run
its own watchdog or state writer; py-spy still reads its stack. py-spy needs permission to
read the process's memory: the same user with ptrace allowed, or root (in a container: the
SYS_PTRACE capability). Every failure comes back as a sentence that says what to do.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..state.schema import Frame, Thread

MAX_PARALLEL = 8


@dataclass
class Stack:
    """The threads of one process (innermost frame last), or why there are none."""

    threads: list[Thread] | None
    error: str | None = None


def find_py_spy() -> str | None:
    """py-spy next to this Python (a venv's bin/), else on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    if os.path.isfile(beside) and os.access(beside, os.X_OK):
        return beside
    return shutil.which("py-spy")


def dump(pid: int, py_spy: str, timeout: float = 5.0) -> Stack:
    """``py-spy dump --pid PID --json``, turned into ddpmon's thread layout."""
    try:
        out = subprocess.run(
            [py_spy, "dump", "--pid", str(pid), "--json"],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return Stack(None, f"py-spy did not answer within {timeout:.0f} s for pid {pid}")
    except OSError as exc:
        return Stack(None, f"cannot run {py_spy} ({exc.strerror or exc})")
    if out.returncode != 0:
        return Stack(None, explain(pid, (out.stderr or out.stdout).strip()))
    try:
        raw = json.loads(out.stdout)
    except ValueError:
        return Stack(None, f"py-spy printed something that is not JSON for pid {pid}")
    return Stack(convert(raw, pid))


def dump_many(pids: list[int], timeout: float = 5.0) -> dict[int, Stack]:
    """Stacks of several processes at once (in parallel, each bounded by ``timeout``)."""
    py_spy = find_py_spy()
    if py_spy is None:
        missing = Stack(
            None,
            "py-spy is not installed: `pip install py-spy` (or ddpmon[stacks]) for live "
            "stacks of ranks that cannot report their own",
        )
        return {pid: missing for pid in pids}
    if not pids:
        return {}
    with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL, len(pids))) as pool:
        results = pool.map(lambda p: dump(p, py_spy, timeout), pids)
        return dict(zip(pids, results))


def convert(raw: Any, pid: int) -> list[Thread]:
    """py-spy's JSON (innermost frame first) as the state file's threads (innermost last,
    main first)."""
    threads = []
    for t in raw if isinstance(raw, list) else []:
        frames = [
            Frame(file=f.get("filename"), line=f.get("line"), function=f.get("name"))
            for f in reversed(t.get("frames") or [])
        ]
        threads.append(
            Thread(
                name=t.get("thread_name")
                or f"thread {t.get('os_thread_id') or t.get('thread_id')}",
                ident=t.get("thread_id"),
                main=t.get("os_thread_id") == pid,
                owns_gil=bool(t.get("owns_gil")),
                active=bool(t.get("active")),
                frames=frames,
            )
        )
    threads.sort(key=lambda t: not t.main)
    return threads


def explain(pid: int, message: str) -> str:
    """py-spy's error as a sentence with the next step."""
    lowered = message.lower()
    first = message.splitlines()[0] if message else "no output"
    if "permission denied" in lowered or "operation not permitted" in lowered:
        return (
            f"py-spy may not read pid {pid} ({first}): run `ddpmon doctor` as root (sudo) or "
            "as the job's user with kernel.yama.ptrace_scope=0; in a container, add the "
            "SYS_PTRACE capability"
        )
    if (
        "no such file" in lowered
        or "no such process" in lowered
        or "check that the process is running" in lowered
    ):
        return f"pid {pid} exited before py-spy could read it"
    return f"py-spy could not read pid {pid}: {first}"
