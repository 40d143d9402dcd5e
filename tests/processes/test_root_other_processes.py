"""The state root against other processes: another user reading a private job's files (run
as user nobody), and a state file of another live launch never overwritten."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ddpmon.state import files, root
from tests.support.roots import NOBODY, as_root

ROOT = Path(__file__).resolve().parents[2]


def as_nobody(*argv: str) -> subprocess.CompletedProcess[str]:
    """ARGV run by user nobody, with this checkout first on the import path."""
    return subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv],
        capture_output=True,
        text=True,
        timeout=30,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )


def why_nobody_cannot_run_this_checkout() -> str | None:
    """None when user nobody can run this Python and import this checkout's ddpmon; else why
    not. A checkout (or a virtualenv) inside a directory only its owner may enter, such as a
    clone under ``mktemp -d``, is out of nobody's reach: nobody would get "No module named
    'ddpmon'", or the ddpmon of another checkout that an editable install points to."""
    if shutil.which("setpriv") is None:
        return "setpriv (util-linux) is not installed"
    r = as_nobody(sys.executable, "-c", "import typing")
    if r.returncode != 0:
        return f"user nobody cannot run this Python ({sys.executable}): {r.stderr.strip()[-200:]}"
    r = as_nobody(
        sys.executable, "-c", "import os, ddpmon; print(os.path.realpath(ddpmon.__file__))"
    )
    mine = os.path.realpath(ROOT / "ddpmon" / "__init__.py")
    if r.returncode != 0 or r.stdout.strip() != mine:
        got = (
            r.stderr.strip().splitlines()[-1]
            if r.returncode
            else f"it imports {r.stdout.strip()} instead"
        )
        return (
            f"user nobody cannot read this checkout ({ROOT}): {got}; "
            "is a directory above it private to its owner, as mktemp -d makes it?"
        )
    return None


@as_root
def test_another_user_reading_a_private_job_gets_the_real_reason(tmp_root: Path) -> None:
    why_not = why_nobody_cannot_run_this_checkout()
    if why_not:
        pytest.skip(why_not)
    state_dir = root.claim(root.job_dir("j"), 0, explicit=False)
    files.write_atomic(files.path_for(state_dir, 0), {"rank": 0})
    r = as_nobody(sys.executable, "-m", "ddpmon", "doctor", state_dir, "--no-stacks")
    assert r.returncode == 2 and "Permission denied" in r.stderr and state_dir in r.stderr, r.stderr


def test_a_live_process_of_another_launch_keeps_its_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        state_dir = tmp_path / "job"
        state_dir.mkdir()
        files.write_atomic(
            files.path_for(str(state_dir), 0),
            {
                "rank": 0,
                "world_size": 2,
                "job": "j",
                "pid": other.pid,
                "host": os.uname().nodename,
                "started_unix": psutil.Process(other.pid).create_time() + 1,
                "now_unix": time.time(),
            },
        )
        chosen = root.claim(str(state_dir), 0, explicit=True)
        assert chosen == f"{state_dir}-{root.launch_id()}"
        assert f"pid {other.pid}" in caplog.text and chosen in caplog.text
    finally:
        other.kill()
        other.wait()
    assert root.claim(str(state_dir), 0, explicit=True) == str(state_dir), (
        "a dead owner's file is taken over"
    )
