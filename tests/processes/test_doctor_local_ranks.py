"""The doctor on ranks of this host: real processes started by the test stand for them (a
frozen rank, a stopped one, a dead one, a pid reused by a later process)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from ddpmon.doctor import examine, stacks
from tests.support import states
from tests.support.states import state, waiting_in, write

HERE = socket.gethostname()


@pytest.fixture
def python_sleeper() -> Any:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time\ndef blocked():\n    time.sleep(120)\nblocked()"]
    )
    time.sleep(0.5)
    yield proc
    proc.kill()
    proc.wait(10)


def test_frozen_local_rank_gets_a_live_stack(
    tmp_path: Path, python_sleeper: subprocess.Popen
) -> None:
    """Its process is alive but its state file is no longer rewritten (the main thread holds
    the GIL, say): frozen; py-spy reads its stack from outside."""
    created = psutil.Process(python_sleeper.pid).create_time()
    # written 12 s ago (past the 10 s after which a file counts as no longer rewritten),
    # by a rank that attached right after its process started
    write(
        tmp_path,
        state(0, host=HERE, pid=python_sleeper.pid, started_unix=created + 12.2, silent=12.0),
        age=12.0,
    )
    write(tmp_path, state(1, silent=24.0, in_flight=[waiting_in("all_reduce", 5, 24.0)]))
    d = examine(str(tmp_path))
    assert (d.verdict, d.suspect_ranks) == ("hang", [0])
    rank0 = d.as_dict()["ranks"][0]
    assert rank0["status"] == "frozen" and rank0["alive"] is True
    if stacks.find_py_spy() and not (rank0["stack_error"] or "").startswith("py-spy may not read"):
        assert rank0["stack"]["source"] == "py-spy, live", rank0["stack_error"]
        assert rank0["stack"]["frames"][-1]["function"] == "blocked"
    else:  # no py-spy, or not permitted here: the doctor says why and what to do
        assert rank0["stack"] is None and rank0["stack_error"]
        assert any(f.kind == "no_stack" and f.ranks == [0] for f in d.findings)
    assert "py-spy dump --pid" in d.findings[0].fix


def test_stopped_and_dead_local_processes(tmp_path: Path, python_sleeper: subprocess.Popen) -> None:
    os.kill(python_sleeper.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 5
    while (
        psutil.Process(python_sleeper.pid).status() != psutil.STATUS_STOPPED
        and time.monotonic() < deadline
    ):
        time.sleep(0.01)
    try:
        write(tmp_path, state(0, host=HERE, pid=python_sleeper.pid, started_unix=states.NOW))
        write(tmp_path, state(1))
        d = examine(str(tmp_path), live_stacks=False)
        assert d.ranks[0].status == "frozen" and "stopped" in d.ranks[0].liveness.detail
        assert (d.verdict, d.suspect_ranks) == ("hang", [0])
    finally:
        os.kill(python_sleeper.pid, signal.SIGCONT)
    python_sleeper.kill()
    python_sleeper.wait(10)
    write(tmp_path, state(0, host=HERE, pid=python_sleeper.pid, started_unix=states.NOW), age=3.0)
    write(tmp_path, state(1, silent=3.0, in_flight=[waiting_in("all_reduce", 5, 3.0)]))
    d = examine(str(tmp_path), live_stacks=False)
    assert (d.verdict, d.suspect_ranks) == ("dead_rank", [0])
    assert d.ranks[0].liveness.alive is False and "does not exist" in d.ranks[0].liveness.detail


def test_pid_reused_by_a_later_process_is_not_the_rank(
    tmp_path: Path, python_sleeper: subprocess.Popen
) -> None:
    write(
        tmp_path,
        state(0, host=HERE, pid=python_sleeper.pid, started_unix=states.NOW - 3600.0),
        age=3.0,
    )
    write(tmp_path, state(1, silent=3.0))
    d = examine(str(tmp_path), live_stacks=False)
    assert d.ranks[0].status == "dead" and "later process" in d.ranks[0].liveness.detail
