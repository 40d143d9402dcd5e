"""ddpmon's commands as a user runs them, each in a process of its own: the doctor, the daemon."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def env(**extra: str) -> dict[str, str]:
    """This environment, with the checkout first on the import path."""
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "PYTHONUNBUFFERED": "1",
        **extra,
    }


def run_doctor(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m ddpmon doctor ARGS``, with ``env`` on top of this environment."""
    return subprocess.run(
        [sys.executable, "-m", "ddpmon", "doctor", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})),
        timeout=30,
    )


def start_daemon(*args: str, timeout: float = 20.0) -> tuple[subprocess.Popen, int]:
    """Start ``ddpmon daemon --port 0 ARGS``; returns the process and its bound port."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpmon", "daemon", "--port", "0", "--bind", "127.0.0.1", *args],
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, serving_port(proc, timeout)


def serving_port(proc: subprocess.Popen, timeout: float = 30.0) -> int:
    """The port from the daemon's "serving http://HOST:PORT/metrics" line."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sel.select(0.1):
            line = proc.stdout.readline()
            if "serving http://" in line:
                return int(line.split("serving http://")[1].split("/")[0].rsplit(":", 1)[1])
            if not line and proc.poll() is not None:
                break
    proc.kill()
    out, err = proc.communicate()
    pytest.fail(f"the daemon did not start:\nstdout: {out}\nstderr: {err}")


def get(
    url: str, timeout: float = 10.0, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    """GET ``url``: (status, body), for an HTTP error's answer too."""
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, headers=headers or {}), timeout=timeout
        ) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def scrape(port: int, path: str = "/metrics") -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
        return r.read().decode()


def terminate(proc: subprocess.Popen, timeout: float = 10.0) -> tuple[int, str, str, float]:
    """SIGTERM; (exit code, stdout, stderr, seconds it took to exit)."""
    t = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"the daemon ignored SIGTERM:\n{out}\n{err}") from None
    return proc.returncode, out, err, time.monotonic() - t
