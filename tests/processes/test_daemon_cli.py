"""``python -m ddpmon daemon`` as a real process: the NVML-absent path for real, bad
arguments, SIGTERM, and no torch import."""

from __future__ import annotations

import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from tests.support.commands import ROOT, env, scrape, start_daemon, terminate
from tests.support.nvml_fake import real_nvml_works


def test_runs_without_nvml_and_stops_on_sigterm(tmp_path: Path) -> None:
    state_dir = tmp_path / "not-yet"
    proc, port = start_daemon("--state-dir", str(state_dir), "--interval", "0.2")
    try:
        text = scrape(port)
        assert "ddpmon_daemon_info{" in text
        assert "ddpmon_rank_up" not in text
        with pytest.raises(urllib.error.HTTPError) as not_served:  # off unless --serve-state
            scrape(port, "/state")
        assert not_served.value.code == 404 and b"--serve-state" in not_served.value.read()
    finally:
        code, out, err, took = terminate(proc)
    assert code == 0, err  # terminate() fails the test when SIGTERM takes over 10 s
    assert "ddpmon daemon: stopped" in out
    # said once; that repeated passes say it no more is test_daemon.py::test_state_dir_appears_later
    assert err.count("does not exist yet; waiting for it") == 1, err
    if not real_nvml_works():
        assert err.count("GPU metrics are off") == 1, err
        assert "libnvidia-ml.so.1" in err
        assert 'gpus="0"' in text
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "args, words",
    [
        (("--interval", "0"), "--interval=0.0 is not valid: expected a positive number of seconds"),
        (("--stale-after", "-1"), "--stale-after=-1.0 is not valid"),
        (("--interval", "5", "--stale-after", "2"), "expected more than --interval=5.0"),
        (("--port", "70000"), "--port=70000 is not valid"),
        (("--interval", "soon"), "invalid float value: 'soon'"),
    ],
)
def test_bad_arguments_exit_2(args: tuple[str, ...], words: str, tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "ddpmon", "daemon", "--state-dir", str(tmp_path), *args],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2, r.stderr
    assert words in r.stderr


def test_state_dir_is_a_file_and_port_in_use(tmp_path: Path) -> None:
    afile = tmp_path / "file"
    afile.write_text("x")
    r = subprocess.run(
        [sys.executable, "-m", "ddpmon", "daemon", "--state-dir", str(afile)],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2 and "it is a file, expected a directory" in r.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "ddpmon",
                "daemon",
                "--state-dir",
                str(tmp_path),
                "--no-gpu",
                "--bind",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            cwd=ROOT,
            env=env(),
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert r.returncode == 2, r.stderr
    assert f"cannot serve on 127.0.0.1:{port}" in r.stderr and "choose another --port" in r.stderr


def test_daemon_never_imports_torch(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from ddpmon.cli import daemon as cli\n"
        "from ddpmon.daemon import Daemon\n"
        f"d = Daemon({str(tmp_path)!r})\n"
        "d.start(); d.refresh(); d.stop()\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr


def test_the_daemon_raises_its_descriptor_limit_to_hold_more_connections(tmp_path) -> None:
    proc, _ = start_daemon("--state-dir", str(tmp_path), "--no-gpu")
    try:
        soft, hard = psutil.Process(proc.pid).rlimit(psutil.RLIMIT_NOFILE)
    finally:
        terminate(proc)
    assert soft >= min(hard, 16384), (soft, hard)
