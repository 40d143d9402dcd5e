"""Refusing every new process while a test runs (tests/unit/conftest.py applies it to every
unit test, its fixtures included).

Every way a Python program starts another process ends in one of the patched calls: the
subprocess module (and os.popen, asyncio) in ``Popen._execute_child``, multiprocessing's
every start method in ``BaseProcess.start``, and the os module's fork, spawn, exec and
system functions. A refused start raises ProcessStarted and is recorded, so a start that the
code under test catches (a fallback, a background thread) still fails the test.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

OS_CALLS = (
    "fork",
    "forkpty",
    "posix_spawn",
    "posix_spawnp",
    "system",
    "execv",
    "execve",
    "execl",
    "execle",
    "execlp",
    "execlpe",
    "execvp",
    "execvpe",
    "spawnv",
    "spawnve",
    "spawnvp",
    "spawnvpe",
    "spawnl",
    "spawnle",
    "spawnlp",
    "spawnlpe",
)
WHERE = "tests/processes, tests/distributed or tests/integration"


class ProcessStarted(RuntimeError):
    """A test that may start no process tried to."""


@contextmanager
def refused(attempts: list[str]) -> Iterator[None]:
    """Within the block, every process start raises ProcessStarted and is appended to ``attempts``."""

    def refuse(what: str) -> Any:
        def refused_call(*args: Any, **kwargs: Any) -> Any:
            shown = args[1] if what == "subprocess.Popen" and len(args) > 1 else args[:1]
            attempts.append(f"{what}({shown!r})")
            raise ProcessStarted(
                f"a unit test may not start a process ({what}): move it to {WHERE}"
            )

        return refused_call

    patch = pytest.MonkeyPatch()
    try:
        patch.setattr(subprocess.Popen, "_execute_child", refuse("subprocess.Popen"))
        patch.setattr(multiprocessing.process.BaseProcess, "start", refuse("multiprocessing start"))
        for name in OS_CALLS:
            if hasattr(os, name):
                patch.setattr(os, name, refuse(f"os.{name}"))
        yield
    finally:
        patch.undo()
