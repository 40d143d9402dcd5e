"""Fault injection, readers: every kind of bad state file against the doctor, ``top`` and
the daemon. A bad file is reported by name with its reason; it never crashes, hangs or
blinds a reader to the good files beside it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpmon.daemon import Daemon
from ddpmon.state import files

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.bad_state_files


def good_state(rank: int, world: int = 2) -> dict:
    now = time.time()
    return {
        "format": 1,
        "rank": rank,
        "world_size": world,
        "local_rank": rank,
        "job": "j",
        "host": os.uname().nodename,
        "pid": os.getpid(),
        "started_unix": now - 5,
        "now_unix": now,
        "last_progress_unix": now,
        "step": 10,
        "phase": "forward",
    }


def plant(path: Path, kind: str) -> None:
    """One bad ``rank-N.json`` of the given kind at ``path``."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink_dev_zero":
        os.symlink("/dev/zero", path)
    elif kind == "symlink_regular":
        target = path.parent / "elsewhere.json"
        target.write_text(json.dumps(good_state(1)))
        os.symlink(target, path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "huge":
        with open(path, "wb") as f:
            f.truncate(files.MAX_BYTES + 1)
    elif kind == "deep":
        path.write_bytes(b"[" * 200_000 + b"]" * 200_000)
    elif kind == "deep_in_object":
        path.write_bytes(b'{"rank": 1, "notes": ' + b'{"a":' * 50_000 + b"1" + b"}" * 50_001)
    elif kind == "not_utf8":
        path.write_bytes(b"\xff\xfe\x00{")
    elif kind == "truncated":
        path.write_text(json.dumps(good_state(1))[:40])
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "not_object":
        path.write_text("[1, 2, 3]")
    elif kind == "wrong_types":
        path.write_text(
            json.dumps({**good_state(1), "step": "x", "timings": 7, "buckets": {"a": 1}})
        )
    elif kind == "forged_world":
        path.write_text(json.dumps({**good_state(1), "world_size": 10**12}))
    elif kind == "forged_rank":
        path.write_text(json.dumps({**good_state(1), "rank": 10**9}))
    elif kind == "rank_beyond_world":
        path.write_text(json.dumps({**good_state(1), "rank": 500, "world_size": 2}))
    elif kind == "unreadable":
        path.write_text(json.dumps(good_state(1)))
        path.chmod(0)
    else:
        raise AssertionError(kind)


KINDS = [
    "fifo",
    "symlink_dev_zero",
    "symlink_regular",
    "directory",
    "huge",
    "deep",
    "deep_in_object",
    "not_utf8",
    "truncated",
    "empty",
    "not_object",
    "wrong_types",
    "forged_world",
    "forged_rank",
    "rank_beyond_world",
] + (["unreadable"] if os.geteuid() != 0 else [])


@pytest.fixture
def job_dir(tmp_path: Path) -> Path:
    """A job directory: one good file (rank 0) and one bad file of every kind beside it."""
    d = tmp_path / "job"
    d.mkdir()
    files.write_atomic(str(d / "rank-0.json"), good_state(0))
    for i, kind in enumerate(KINDS, start=1):
        plant(d / f"rank-{i}.json", kind)
    return d


def cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ddpmon", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        timeout=timeout,
    )


def test_doctor_reports_every_bad_file_and_reads_the_good_one(job_dir: Path) -> None:
    r = cli("doctor", str(job_dir), "--json", "--no-stacks")
    assert r.returncode in (0, 1, 2), r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    report = json.loads(r.stdout)
    flagged = json.dumps([f for f in report["findings"] if f["kind"] == "bad_state_file"])
    for i, kind in enumerate(KINDS, start=1):
        assert f"rank-{i}.json" in flagged, (kind, report["findings"])
    assert 0 in [x["rank"] for x in report["ranks"]], "the good file beside the bad ones is read"


def test_top_reports_every_bad_file_and_shows_the_good_one(job_dir: Path) -> None:
    r = cli("top", str(job_dir), "--once")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    unreadable = [line for line in r.stdout.splitlines() if line.startswith("unreadable: ")]
    for i, kind in enumerate(KINDS, start=1):
        assert any(f"rank-{i}.json:" in line for line in unreadable), (kind, r.stdout)
    assert r.stdout.splitlines()[2].split()[0] == "0", r.stdout


def test_daemon_pass_survives_every_bad_file_at_once(tmp_path: Path, job_dir: Path) -> None:
    daemon = Daemon(str(tmp_path), interval=0.2, gpus=False)
    started = time.monotonic()
    daemon.refresh()
    assert time.monotonic() - started < 10
    up = [s for s in daemon._samples if s[0] == "ddpmon_rank_up"]
    assert [(s[1]["rank"], s[2]) for s in up] == [("0", 1.0)]
    problems = daemon.files._problems
    for i, kind in enumerate(KINDS, start=1):
        assert any(f"rank-{i}.json" in k for k in problems), (kind, problems)


@pytest.mark.parametrize("body", [b"[" * 200_000 + b"]" * 200_000, b""], ids=["deep", "endless"])
def test_doctor_from_a_hostile_state_endpoint_says_why(body: bytes) -> None:
    """``doctor --from`` reads a daemon's /state over HTTP: an answer nested too deep or one
    that never ends is a reason on the address, not a traceback or a hang."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            try:
                self.wfile.write(body or b"[")
                while not body:  # endless: "[1,1,1,..." until the reader goes away
                    self.wfile.write(b"1," * 65536)
            except OSError:
                pass

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        r = cli(
            "doctor",
            "--from",
            f"127.0.0.1:{server.server_address[1]}",
            "--json",
            "--no-stacks",
            timeout=8,
        )
    finally:
        server.shutdown()
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.returncode == 2
    report = json.loads(r.stdout)
    assert any(f["kind"] == "bad_state_file" for f in report["findings"]), report


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a read-only state directory needs root")
def test_doctor_on_a_read_only_state_dir_of_a_live_job_does_not_call_it_hung(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(state)]
    ).returncode:
        pytest.skip("cannot mount a tmpfs here")
    ranks = [
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)
    ]
    try:
        import psutil

        for rank, proc in enumerate(ranks):  # live ranks whose last writes were 60 s ago
            data = {
                **good_state(rank),
                "pid": proc.pid,
                "started_unix": psutil.Process(proc.pid).create_time() + 1,
                "now_unix": time.time() - 60,
                "last_progress_unix": time.time() - 60,
            }
            path = state / f"rank-{rank}.json"
            files.write_atomic(str(path), data)
            os.utime(path, (time.time() - 60, time.time() - 60))
        subprocess.run(["mount", "-o", "remount,ro", str(state)], check=True)
        r = cli("doctor", str(state), "--json", "--no-stacks")
        report = json.loads(r.stdout)
        assert report["verdict"] != "hang", report["findings"]
        assert "read-only" in json.dumps(report["findings"])
    finally:
        for proc in ranks:
            proc.kill()
        subprocess.run(["umount", "-l", str(state)], capture_output=True)
