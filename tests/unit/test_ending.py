"""How a rank's end is recorded: exit statuses, exception records, the faulthandler file
the doctor reads. (A real fatal signal: tests/processes/test_exits.py; real deaths of ranks,
mp.spawn included, are in tests/scenarios.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ddpmon.rank import ending
from ddpmon.state import fault
from tests.support.roots import NOBODY


def test_exit_status_as_the_interpreter_computes_it() -> None:
    assert [ending.exit_status(c) for c in (None, 0, 3, 256 + 4, "bad", True)] == [0, 0, 3, 4, 1, 1]


def test_no_fault_file_or_an_older_one_is_no_record(tmp_path: Path) -> None:
    state = tmp_path / "rank-1.json"
    state.write_text("{}")
    assert fault.read(str(state)) is None
    assert ending.fault_path(str(state)) == fault.path_for(str(state))
    Path(fault.path_for(str(state))).write_text("Fatal Python error: Segmentation fault\n")
    assert fault.read(str(state)).signal == "SIGSEGV"
    assert fault.read(str(state), since=os.stat(fault.path_for(str(state))).st_mtime + 10) is None
    Path(fault.path_for(str(state))).write_text("")
    assert fault.read(str(state)) is None


@pytest.mark.skipif(os.geteuid() != 0, reason="files of another user's need root to make")
def test_a_fault_file_is_read_only_as_the_state_files_owner_wrote_it(tmp_path: Path) -> None:
    """The daemon reads every user's fault files as root and serves what it finds through
    /state: a user's link at ``rank-R.fault`` to a root-only file, or a file of someone
    else's beside the user's state file, is no record (the link is not followed)."""
    state = tmp_path / "rank-1.json"
    state.write_text("{}")
    os.chown(state, NOBODY, NOBODY)
    secret = tmp_path / "secret"
    secret.write_text("Fatal Python error: Segmentation fault\n\nCurrent thread 0x1 (most recent call first):\n"
                      '  File "/root/token=hunter2.py", line 1 in <module>\n')
    secret.chmod(0o600)
    planted = Path(fault.path_for(str(state)))
    os.symlink(secret, planted)
    os.lchown(planted, NOBODY, NOBODY)
    assert fault.read(str(state)) is None
    planted.unlink()
    planted.write_text(secret.read_text())  # a regular file, of root's: not what the rank wrote
    assert fault.read(str(state)) is None
    os.chown(planted, NOBODY, NOBODY)
    got = fault.read(str(state))
    assert got is not None and got.signal == "SIGSEGV"
