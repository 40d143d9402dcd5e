"""How a rank's end is recorded: exit statuses, exception records, the faulthandler file
the doctor reads. (Real deaths, mp.spawn included, are in tests/scenarios.)"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from ddpmon.rank import ending
from ddpmon.state import fault


def test_exit_status_as_the_interpreter_computes_it() -> None:
    assert [ending.exit_status(c) for c in (None, 0, 3, 256 + 4, "bad", True)] == [0, 0, 3, 4, 1, 1]


def test_a_fatal_signal_leaves_every_threads_stack_in_the_fault_file(tmp_path: Path) -> None:
    state = tmp_path / "rank-0.json"
    script = textwrap.dedent(f"""
        import faulthandler, os, threading, time
        f = open({str(fault.path_for(str(state)))!r}, "w")
        faulthandler.enable(file=f, all_threads=True)
        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
        def save_checkpoint():
            os.abort()
        save_checkpoint()
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert proc.returncode == -6
    record = fault.read(str(state))
    assert record is not None and record.signal == "SIGABRT" and record.how == "signal"
    assert record.where == "<string>:7 in save_checkpoint"
    assert record.threads[0].main and record.threads[0].frames[-1].function == "save_checkpoint"
    assert len(record.threads) == 2 and not record.threads[1].main


def test_no_fault_file_or_an_older_one_is_no_record(tmp_path: Path) -> None:
    state = tmp_path / "rank-1.json"
    assert fault.read(str(state)) is None
    assert ending.fault_path(str(state)) == fault.path_for(str(state))
    Path(fault.path_for(str(state))).write_text("Fatal Python error: Segmentation fault\n")
    assert fault.read(str(state)).signal == "SIGSEGV"
    assert fault.read(str(state), since=os.stat(fault.path_for(str(state))).st_mtime + 10) is None
    Path(fault.path_for(str(state))).write_text("")
    assert fault.read(str(state)) is None
