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
    Path(fault.path_for(str(state))).write_text("Fatal Python error: Segmentation fault\n")
    assert fault.read(str(state)).signal == "SIGSEGV"
    assert fault.read(str(state), since=os.stat(fault.path_for(str(state))).st_mtime + 10) is None
    Path(fault.path_for(str(state))).write_text("")
    assert fault.read(str(state)) is None


def test_an_abort_says_why_in_the_backends_words_from_the_ranks_log(tmp_path: Path) -> None:
    """A backend's abort leaves its reason on stderr; a rank whose stderr is a file names it
    in its fault file, and the reader adds the last reason in that log's tail."""
    state = tmp_path / "rank-0.json"
    state.write_text("{}")
    log = tmp_path / "rank-0.log"
    log.write_text(
        "terminate called after throwing an instance of 'c10::Error'\n  what():  an earlier run's\n"
        + "x" * fault.LOG_TAIL_BYTES
        + "\ntraining...\n"
        "terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
        "  what():  [enforce fail at pair.cc:456] op.preamble.length <= op.nbytes. 4680 vs 4. "
        "Is there a distributed collective mismatch in your code?\n"
    )
    header = f"{fault.STDERR_LINE}{log}\n"
    Path(fault.path_for(str(state))).write_text(header + "Fatal Python error: Aborted\n")
    assert fault.read(str(state)).exception == (
        "SIGABRT (Aborted), after gloo::EnforceNotMet: [enforce fail at pair.cc:456] op.preamble.length <= "
        "op.nbytes. 4680 vs 4. Is there a distributed collective mismatch in your code?"
    )
    Path(fault.path_for(str(state))).write_text(header)  # attached, never signalled
    assert fault.read(str(state)) is None
    link = tmp_path / "link.log"
    link.symlink_to(log)
    Path(fault.path_for(str(state))).write_text(
        f"{fault.STDERR_LINE}{link}\nFatal Python error: Aborted\n"
    )
    assert fault.read(str(state)).exception == "SIGABRT (Aborted)"  # never through a link


@pytest.mark.skipif(os.geteuid() != 0, reason="files of another user's need root to make")
def test_a_fault_file_is_read_only_as_the_state_files_owner_wrote_it(tmp_path: Path) -> None:
    """The daemon reads every user's fault files as root and serves what it finds through
    /state: a user's link at ``rank-R.fault`` to a root-only file, or a file of someone
    else's beside the user's state file, is no record (the link is not followed)."""
    state = tmp_path / "rank-1.json"
    state.write_text("{}")
    os.chown(state, NOBODY, NOBODY)
    secret = tmp_path / "secret"
    secret.write_text(
        "Fatal Python error: Segmentation fault\n\nCurrent thread 0x1 (most recent call first):\n"
        '  File "/root/token=hunter2.py", line 1 in <module>\n'
    )
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
