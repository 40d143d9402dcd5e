"""How a rank's end is recorded: exit statuses, exception records, the faulthandler file
the doctor reads. (A real fatal signal: tests/processes/test_exits.py; real deaths of ranks,
mp.spawn included, are in tests/scenarios.)"""

from __future__ import annotations

import os
from pathlib import Path

from ddpmon.rank import ending
from ddpmon.state import fault


def test_exit_status_as_the_interpreter_computes_it() -> None:
    assert [ending.exit_status(c) for c in (None, 0, 3, 256 + 4, "bad", True)] == [0, 0, 3, 4, 1, 1]


def test_no_fault_file_or_an_older_one_is_no_record(tmp_path: Path) -> None:
    state = tmp_path / "rank-1.json"
    assert fault.read(str(state)) is None
    assert ending.fault_path(str(state)) == fault.path_for(str(state))
    Path(fault.path_for(str(state))).write_text("Fatal Python error: Segmentation fault\n")
    assert fault.read(str(state)).signal == "SIGSEGV"
    assert fault.read(str(state), since=os.stat(fault.path_for(str(state))).st_mtime + 10) is None
    Path(fault.path_for(str(state))).write_text("")
    assert fault.read(str(state)) is None
