"""ddpmon beside torch's debug server (torch.distributed.debug): real 2-rank gloo jobs under
``ddpmon run`` (torchrun, TCP rendezvous), the servers read over real HTTP while the job
waits, then everything must end on its own: no rank killed at exit, no process left."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ddpmon.state import fault
from tests.support.commands import get, run_doctor, scrape

for _package in ("jinja2", "aiohttp", "tabulate"):  # the test extra installs them
    pytest.importorskip(_package, reason="torch's debug server needs it: pip install -e '.[test]'")
pytest.importorskip("torch.distributed.debug", reason="this torch has no debug server")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(Path(__file__).with_name("debug_server_train.py"))
STEPS = 8
TIMEOUT = 150
pytestmark = pytest.mark.timeout(2 * TIMEOUT + 60)


def free_port() -> int:
    """A port free on every interface, as the frontend binds ("::", both families)."""
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
        s.bind(("::", 0))
        return s.getsockname()[1]


def start(
    tmp_path: Path, name: str, run_args: tuple[str, ...] = (), script_args: tuple[str, ...] = ()
) -> tuple[subprocess.Popen, Path, Path]:
    """``ddpmon run [run_args] --nproc-per-node=2 debug_server_train.py OUT [script_args]``."""
    out, state_dir = tmp_path / name, tmp_path / name / "state"
    out.mkdir()
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
    )
    for var in ("DDPMON_STATE_DIR", "DDPMON_JOB"):
        env.pop(var, None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ddpmon",
            "run",
            "--port",
            "0",
            "--state-dir",
            str(state_dir),
            *run_args,
            "--nproc-per-node=2",
            "--max-restarts=0",
            SCRIPT,
            str(out),
            "--steps",
            str(STEPS),
            *script_args,
        ],
        cwd=out,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return proc, out, state_dir


def until(what: str, check, proc: subprocess.Popen, timeout: float = 90.0):
    """``check()``'s first true value, polled while the job runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            found = check()
        except OSError:
            found = None
        if found:
            return found
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"{what}: not seen\n{proc.communicate()[0]}")


def finish(proc: subprocess.Popen, out: Path) -> str:
    (out / "release").touch()
    try:
        return proc.communicate(timeout=TIMEOUT)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the job did not end:\n{proc.communicate()[0]}")


def frontend_page(port: int, path: str) -> str | None:
    status, body = get(f"http://127.0.0.1:{port}{path}", timeout=30)
    return body.decode() if status == 200 else None


def stacks_of_both_ranks(port: int) -> str | None:
    page = frontend_page(port, "/stacks")
    return page if page and "Rank 1:" in page and "Failed to fetch" not in page else None


def attached_state(state_dir: Path, rank: int) -> dict | None:
    state = json.loads((state_dir / f"rank-{rank}.json").read_text())
    return state if state.get("port") else None


def result(out: Path, rank: int) -> dict:
    return json.loads((out / f"result-{rank}.json").read_text())


def check_ddpmon_saw_a_clean_run(state_dir: Path, log: str) -> None:
    for rank in (0, 1):
        state = json.loads((state_dir / f"rank-{rank}.json").read_text())
        assert (state["rank"], state["step"], state["stage"]) == (rank, STEPS, "detached"), log
        assert (state["exit"]["how"], state["exit"]["code"], state["exit"]["signal"]) == (
            "end",
            0,
            None,
        ), log
        assert state["pid"] != os.getpid()
        assert fault.read(str(state_dir / f"rank-{rank}.json")) is None, log  # no fatal signal
    doctor = run_doctor(str(state_dir))
    assert doctor.returncode == 0 and "HEALTHY" in doctor.stdout, doctor.stdout + doctor.stderr


def check_nothing_left(out: Path, port: int) -> None:
    """No process of the job lives on (rank 0's frontend is a forked child of rank 0), and
    the frontend's port is free again."""
    left = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if str(out) in " ".join(proc.info["cmdline"] or []):
                left.append((proc.pid, proc.info["cmdline"]))
        except psutil.Error:
            pass
    assert not left, left
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
        s.setsockopt(
            socket.SOL_SOCKET, socket.SO_REUSEADDR, 1
        )  # as the frontend binds: no listener left
        s.bind(("::", port))


def test_a_debug_server_the_script_starts_leaves_the_job_and_ddpmon_alone(tmp_path: Path) -> None:
    """The script starts the debug server itself (dumps every 0.2 s) and rank 0 ends 2 s
    after rank 1. Each rank stops its debug server as it ends (ddpmon/rank/debug_server.py):
    without that, rank 1 died of SIGABRT at exit in most such runs, its training done."""
    plain, plain_out, _ = start(tmp_path, "plain")
    plain_log = finish(plain, plain_out)
    assert plain.returncode == 0, plain_log

    port = free_port()
    proc, out, state_dir = start(
        tmp_path, "served", script_args=("--own-server", str(port), "--tail", "2")
    )
    # both servers answer over HTTP while the job runs: ddpmon's metrics, torch's frontend
    state = until(  # a rank publishes from process start; its port once the model is attached
        "rank 0's endpoint in its state file", lambda: attached_state(state_dir, 0), proc
    )
    metrics = until("rank 0's metrics", lambda: scrape(state["port"]), proc)
    assert "ddpmon_steps_total{job=" in metrics
    assert "Torch Distributed Debug Server" in until(
        "the frontend", lambda: frontend_page(port, "/"), proc
    )
    page = until("both ranks' stacks on the frontend", lambda: stacks_of_both_ranks(port), proc)
    assert "debug_server_train.py" in page
    dumps = until("a stacks dump", lambda: sorted((out / "dumps").glob("stacks_*.txt")), proc)
    log = finish(proc, out)

    assert proc.returncode == 0, log
    assert "FATAL" not in log and "SIGABRT" not in log, log
    for rank in (0, 1):  # the same training, exactly
        assert result(out, rank) == result(plain_out, rank)
    text = dumps[-1].read_text()
    assert "=== Rank 0:" in text and "=== Rank 1:" in text, text
    check_ddpmon_saw_a_clean_run(state_dir, log)
    check_nothing_left(out, port)


def test_ddpmon_run_debug_server(tmp_path: Path) -> None:
    """``ddpmon run --debug-server=PORT``: a script that knows nothing of it gets the debug
    server in every rank, its dumps in the state directory, and a clean end."""
    port = free_port()
    proc, out, state_dir = start(
        tmp_path,
        "run",
        (f"--debug-server={port}", "--debug-server-interval", "0.3"),
        ("--tail", "2"),
    )
    page = until("both ranks' stacks on the frontend", lambda: stacks_of_both_ranks(port), proc)
    assert "debug_server_train.py" in page
    dump_dir = state_dir / "debug-server"
    dumps = until(
        "a stacks dump with both ranks",
        lambda: [
            p for p in sorted(dump_dir.glob("stacks_*.txt")) if "=== Rank 1:" in p.read_text()
        ],
        proc,
    )
    log = finish(proc, out)

    assert proc.returncode == 0, log
    assert f"torch's debug server: http://<rank 0's host>:{port}/; dumps into {dump_dir}" in log, (
        log
    )
    assert "=== Rank 0:" in dumps[-1].read_text()
    assert dump_dir.stat().st_mode & 0o777 == 0o700  # the dumps hold stacks, as state files do
    assert not list(dump_dir.glob("fr_trace_*")), (
        "gloo: torch's flight recorder tables are not asked for"
    )
    check_ddpmon_saw_a_clean_run(state_dir, log)
    check_nothing_left(out, port)
