"""How ddpmon's parts behave when their process ends, in a real interpreter: a process group
with a completion hook destroyed at the interpreter's exit (and a destroy that hangs not
waited for), a fatal signal's stacks in the fault file, a history writer killed mid-run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from ddpmon.rank.timing import c10d as completion
from ddpmon.state import fault, history

ROOT = Path(__file__).resolve().parents[2]


# -- the c10d clock's group at exit -------------------------------------------------------------


def _exit_script(tmp_path, destroy: str = "") -> str:  # type: ignore[no-untyped-def]
    """A program that hooks WORLD through listen() (gloo refuses the real completion hook,
    so the class's registration is stood in for) and never destroys its group."""
    return f"""
import atexit, time
import torch.distributed as dist
from ddpmon.rank.timing import c10d
dist.init_process_group("gloo", store=dist.FileStore({str(tmp_path / "store")!r}, 1), rank=0, world_size=1)
atexit.register(lambda: print("initialized at the end:", dist.is_initialized(), flush=True))  # runs last
dist.ProcessGroup._register_on_completion_hook = lambda self, hook: None
dist.ProcessGroup._enable_collectives_timing = lambda self: None
{destroy}
c10d.listen(dist.group.WORLD, lambda info: None)
print("listening", flush=True)
"""


def test_groups_with_a_completion_hook_are_destroyed_at_exit(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """torch asks for destroy_process_group before exit once a completion hook is in; a
    program that skips it gets it from ddpmon's exit handler, run by the interpreter's
    own exit (a real gloo group)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _exit_script(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["listening", "initialized at the end: False"]


def test_a_destroy_that_hangs_at_exit_is_not_waited_for(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A crashed peer can keep destroy_process_group from returning: the exit goes on."""
    import subprocess
    import sys

    hang = "dist.destroy_process_group = lambda group=None: time.sleep(120)"
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", _exit_script(tmp_path, hang)],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert out.returncode == 0, out.stderr
    assert time.monotonic() - started < completion.DESTROY_AT_EXIT_SECONDS + 30
    assert "did not finish within" in out.stderr


# -- a fatal signal ---------------------------------------------------------------------------


def test_a_fatal_signal_leaves_every_threads_stack_in_the_fault_file(tmp_path: Path) -> None:
    state = tmp_path / "rank-0.json"
    state.write_text("{}")  # (a fault file counts beside its owner's state file)
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


def test_a_rank_names_its_stderr_only_when_it_is_a_file(tmp_path: Path) -> None:
    """Where a backend's abort says why: a per-rank log, yes; a pipe or a terminal, no."""
    code = "from ddpmon.rank import ending; print(ending.stderr_log())"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with open(tmp_path / "err.log", "w") as err:
        out = subprocess.run(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
            timeout=60,
        )
    assert out.stdout.strip() == str(tmp_path / "err.log")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.stdout.strip() == "None"


# -- a killed history writer -------------------------------------------------------------------


_KILLED = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[2])
    from ddpmon.rank import writers
    from ddpmon.steps import StepRow
    made = []
    def since(step):
        now = time.time()
        return [StepRow(s, now, now - 60, 0.01) for s in made if s > step]
    snap = lambda: {"step": len(made), "notes": {"advice": "seen"}}
    w = writers.HistoryWriter(sys.argv[1], since, snap, lambda: {"rank": 0, "job": "killed"}, interval=0.05)
    w.start()
    for s in range(1, 100001):
        made.append(s)
        if s == 200:
            print("ready", flush=True)
        time.sleep(0.001)
""")


def test_a_killed_writer_keeps_every_committed_batch(tmp_path):
    path = str(tmp_path / "rank-0.history.sqlite")
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED, path, str(ROOT)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (
            not os.path.exists(path) or history.max_step(path) < 200
        ):
            time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    h = history.read(path)
    kept = h["steps"]["step"]
    assert len(kept) >= 200 and kept == list(range(1, len(kept) + 1))  # whole batches, no gap
    assert h["exit"] is None  # killed: no exit record
    assert [f["text"] for f in h["findings"]] == ["advice: seen"]
    assert json.loads(h["meta"]["identity"])["job"] == "killed"
