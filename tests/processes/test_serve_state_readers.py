"""Whose files the daemon's ``/state`` and ``/history`` serve: a local user without
credentials (nobody, with curl) gets what that user may read and nothing of root's private
job, which root gets; on an address others can reach, ``--serve-state`` without credentials
is refused; with basic auth every request needs them (but ``/healthz``), and a client that
gives them gets every file of the node."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddpmon.state import files, history
from tests.support.commands import env, start_daemon, terminate
from tests.support.roots import NOBODY
from tests.support.tls import bcrypt_hash

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(os.geteuid() != 0, reason="simulating another user needs root"),
    pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed"),
]

HOST = os.uname().nodename


def job_of(tmp: Path, uid: int, job: str) -> None:
    """A job of user ``uid`` in its private root: rank 0's state file and history, 0600 in 0700."""
    root = tmp / f"ddpmon-{uid}"
    directory = root / job
    directory.mkdir(parents=True, mode=0o700)
    now = time.time()
    path = files.path_for(str(directory), 0)
    files.write_atomic(
        path,
        {
            "rank": 0,
            "local_rank": 0,
            "world_size": 1,
            "host": HOST,
            "pid": 1,
            "job": job,
            "step": 3,
            "phase": "forward",
            "started_unix": now,
            "last_progress_unix": now,
            "now_unix": now,
        },
    )
    store = history.HistoryStore(history.path_for(str(directory), 0), {"rank": 0, "job": job})
    store.close()
    for p in (root, directory, *directory.iterdir()):
        os.chown(p, uid, uid)
    root.chmod(0o700)


def curl(port: int, path: str, *args: str, uid: int = 0) -> tuple[int, str]:
    who = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"] if uid else []
    done = subprocess.run(
        [
            *who,
            "curl",
            "-s",
            "-o",
            "-",
            "-w",
            "\n%{http_code}",
            *args,
            f"http://127.0.0.1:{port}{path}",
        ],
        capture_output=True,
        text=True,
        timeout=20,
    )
    body, _, code = done.stdout.rpartition("\n")
    return int(code), body


@pytest.fixture
def tmp() -> Iterator[Path]:
    """A stand-in for /tmp that user nobody can reach (sticky, everyone's), in the system's
    temp directory: pytest's own directories are private to root."""
    shared = Path(tempfile.mkdtemp(prefix="ddpmon-readers-"))
    shared.chmod(0o1777)
    job_of(shared, 0, "roots-job")
    job_of(shared, NOBODY, "nobodys-job")
    yield shared
    shutil.rmtree(shared, ignore_errors=True)


def jobs(body: str) -> list[str]:
    return sorted(s["job"] for s in json.loads(body))


def test_a_local_user_gets_only_what_it_may_read(tmp: Path) -> None:
    daemon, port = start_daemon("--state-dir", str(tmp / "ddpmon-*"), "--serve-state", "--no-gpu")
    try:
        code, body = curl(port, "/state")
        assert code == 200 and jobs(body) == ["nobodys-job", "roots-job"]
        code, body = curl(port, "/state", uid=NOBODY)
        assert code == 200 and jobs(body) == ["nobodys-job"], body
        code, body = curl(port, "/history", uid=NOBODY)
        assert code == 200 and [h["job"] for h in json.loads(body)["histories"]] == [
            "nobodys-job"
        ], body
        code, body = curl(port, "/history?rank=0&job=roots-job", uid=NOBODY)
        assert code == 404 and "no history of rank 0 of job 'roots-job'" in body
        assert curl(port, "/history?rank=0&job=roots-job")[0] == 200
    finally:
        terminate(daemon)


def test_serve_state_on_a_reachable_address_needs_credentials(tmp: Path, tmp_path: Path) -> None:
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddpmon",
            "daemon",
            "--state-dir",
            str(tmp / "ddpmon-*"),
            "--serve-state",
            "--bind",
            "0.0.0.0",
            "--port",
            "0",
            "--no-gpu",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env=env(),
    )
    assert refused.returncode == 2
    assert (
        "--serve-state on 0.0.0.0 without credentials would serve every rank's state files"
        in refused.stderr
    )
    web = tmp_path / "web.yml"
    web.write_text(f"basic_auth_users:\n  doctor: {bcrypt_hash('pass-word')}\n")
    daemon, port = start_daemon(
        "--state-dir",
        str(tmp / "ddpmon-*"),
        "--serve-state",
        "--no-gpu",
        "--web-config-file",
        str(web),
    )
    try:
        code, body = curl(port, "/state", uid=NOBODY)
        assert code == 401 and "credentials needed" in body
        assert curl(port, "/metrics")[0] == 401
        assert curl(port, "/healthz", uid=NOBODY)[0] == 200
        code, body = curl(port, "/state", "-u", "doctor:pass-word", uid=NOBODY)
        assert code == 200 and jobs(body) == ["nobodys-job", "roots-job"]
        assert curl(port, "/state", "-u", "doctor:wrong")[0] == 401
    finally:
        terminate(daemon)
