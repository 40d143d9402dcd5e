"""ddpmon/daemon/ in-process: rank liveness from state files and real processes, every
bad state-dir input, /state over HTTP, and every GPU of a node through a fake driver."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from prometheus_client import CollectorRegistry

from ddpmon.daemon import Daemon
from ddpmon.httpd import serve
from ddpmon.state import files as statefile
from tests.support.nvml_fake import FakeDriver, two_gpus

HOST = socket.gethostname()


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen]:
    """A live process standing in for a rank (not reaped when killed: a zombie, as a
    SIGKILLed rank is until its launcher reaps it)."""
    p = subprocess.Popen(
        [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout.readline().strip() == "ready"
    yield p
    p.kill()
    p.wait()


def state(rank: int, pid: int, **over: Any) -> dict[str, Any]:
    now = time.time()
    data = {
        "rank": rank,
        "local_rank": rank,
        "world_size": 2,
        "host": HOST,
        "pid": pid,
        "job": "jobA",
        "step": 12,
        "phase": "forward",
        "started_unix": now,
        "last_progress_unix": now - 3,
        "now_unix": now,
        "hang": None,
        "format": 1,
    }
    data.update(over)
    return data


HANG = {
    "detected_unix": 1.0,
    "last_progress_unix": 0.5,
    "silent_seconds": 300.0,
    "timeout_seconds": 60.0,
    "timeout_source": "learned",
}


def write(directory: Path, data: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"rank-{data['rank']}.json"
    statefile.write_atomic(str(path), data)
    return path


class Scrape:
    def __init__(self, daemon: Daemon) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(daemon)

    def __call__(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(name, labels)

    def series(self, name: str) -> list[dict[str, str]]:
        return [s.labels for m in self.registry.collect() for s in m.samples if s.name == name]


def _lines(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


# -- ranks ------------------------------------------------------------------------------------


def test_rank_liveness(tmp_path: Path, sleeper: subprocess.Popen) -> None:
    # found in a per-job subdirectory, as with the ranks' default state_dir
    write(tmp_path / "jobA", state(0, sleeper.pid, last_progress_unix=1700000000.5))
    write(tmp_path / "jobA", state(1, sleeper.pid, now_unix=time.time() - 60))  # heartbeat stale
    write(tmp_path / "jobA", state(2, sleeper.pid, hang=HANG))
    write(tmp_path / "jobA", state(3, sleeper.pid, phase="detached"))  # finished on purpose
    write(tmp_path / "jobA", state(4, sleeper.pid, host="another-node"))  # another node's file
    write(
        tmp_path / "jobA", state(5, sleeper.pid, exit={"unix": 1.0, "exception": None})
    )  # ended normally
    write(
        tmp_path / "jobA", state(6, sleeper.pid, exit={"unix": 1.0, "exception": "ValueError: x"})
    )
    daemon = Daemon(str(tmp_path), gpus=False)
    daemon.refresh()
    scrape = Scrape(daemon)
    assert scrape("ddpmon_rank_up", job="jobA", rank="0") == 1
    assert (
        scrape("ddpmon_rank_last_progress_timestamp_seconds", job="jobA", rank="0") == 1700000000.5
    )
    assert scrape("ddpmon_rank_hang_suspected", job="jobA", rank="0") == 0
    assert scrape("ddpmon_rank_up", job="jobA", rank="1") == 0
    assert scrape("ddpmon_rank_up", job="jobA", rank="2") == 1
    assert scrape("ddpmon_rank_hang_suspected", job="jobA", rank="2") == 1
    assert [s["rank"] for s in scrape.series("ddpmon_rank_up")] == ["0", "1", "2", "6"]
    assert (
        scrape("ddpmon_daemon_info", host=HOST, version=__import__("ddpmon").__version__, gpus="0")
        == 1
    )

    daemon._ranks.node_local = True  # a hostPath shared with containers: every file is this node's
    daemon.refresh()
    assert scrape("ddpmon_rank_up", job="jobA", rank="4") == 1

    sleeper.kill()  # dies; not reaped yet: a zombie
    deadline = time.monotonic() + 1.0
    while scrape("ddpmon_rank_up", job="jobA", rank="0") != 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
        daemon.refresh()
    assert scrape("ddpmon_rank_up", job="jobA", rank="2") == 0


def test_rank_activity(tmp_path: Path, sleeper: subprocess.Popen) -> None:
    """What each rank is doing: the rank's own word from its file while it runs and writes,
    else what only the daemon sees (frozen, dead, crashed); a state set, 1 for the current."""
    import signal

    from ddpmon.metrics.catalog import DAEMON_ACTIVITIES

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        write(tmp_path, state(0, sleeper.pid, activity={"state": "waiting"}))
        write(tmp_path, state(1, sleeper.pid, activity={"state": "stuck"}, hang=HANG))
        write(
            tmp_path,
            state(2, sleeper.pid, activity={"state": "stepping"}, now_unix=time.time() - 60),
        )
        write(tmp_path, state(3, stopped.pid, activity={"state": "stepping"}))
        write(tmp_path, state(4, gone.pid, activity={"state": "stepping"}))  # killed: no word
        write(tmp_path, state(5, gone.pid, exit={"unix": 1.0, "exception": "ValueError: x"}))
        fault = write(tmp_path, state(6, gone.pid, started_unix=time.time() - 30))
        Path(str(fault)[:-5] + ".fault").write_text(FAULT)
        write(tmp_path, state(7, sleeper.pid))  # its watchdog is off: no one can tell
        stopped.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while psutil.Process(stopped.pid).status() != psutil.STATUS_STOPPED:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        daemon = Daemon(str(tmp_path), gpus=False)
        daemon.refresh()
        scrape = Scrape(daemon)

        def doing(rank: int) -> list[str]:
            values = {
                a: scrape("ddpmon_rank_activity", job="jobA", rank=str(rank), activity=a)
                for a in DAEMON_ACTIVITIES
            }
            return (
                [a for a, v in values.items() if v == 1] if set(values.values()) != {None} else []
            )

        assert [doing(r) for r in range(8)] == [
            ["waiting"],
            ["stuck"],
            ["frozen"],
            ["frozen"],
            ["dead"],
            ["crashed"],
            ["crashed"],
            [],
        ]
        assert (
            sum(
                scrape("ddpmon_rank_activity", job="jobA", rank="0", activity=a)
                for a in DAEMON_ACTIVITIES
            )
            == 1
        )
    finally:
        stopped.kill()
        stopped.wait()


def test_reused_pid_and_duplicate_ranks(tmp_path: Path, sleeper: subprocess.Popen) -> None:
    # ddpmon started in that process long before the process with this pid was created
    write(tmp_path / "old", state(0, sleeper.pid, started_unix=time.time() - 3600))
    write(tmp_path / "new", state(0, sleeper.pid))
    daemon = Daemon(str(tmp_path), gpus=False)
    daemon.refresh()
    scrape = Scrape(daemon)
    assert scrape.series("ddpmon_rank_up") == [{"job": "jobA", "rank": "0"}]  # the freshest file
    assert scrape("ddpmon_rank_up", job="jobA", rank="0") == 1


def test_state_dir_appears_later(
    tmp_path: Path, sleeper: subprocess.Popen, caplog: pytest.LogCaptureFixture
) -> None:
    missing = tmp_path / "later"
    daemon = Daemon(str(missing), gpus=False)
    for _ in range(3):
        daemon.refresh()
    assert Scrape(daemon).series("ddpmon_rank_up") == []
    (line,) = _lines(caplog, "does not exist yet")
    assert str(missing) in line and "waiting for it" in line
    write(missing, state(0, sleeper.pid))
    daemon.refresh()
    assert Scrape(daemon)("ddpmon_rank_up", job="jobA", rank="0") == 1
    assert len(_lines(caplog, "is there now")) == 1


@pytest.mark.parametrize(
    "body, words",
    [
        (b'{"rank": 0, "pid": ', "is not valid JSON"),
        (b"", "is empty"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"rank": 1}', "has no pid, host or now_unix"),
        (b'{"rank": 1, "pid": "x", "now_unix": 1}', "has an invalid pid 'x' (expected an integer)"),
        (b"\xff\xfe\x00", "is not UTF-8"),
        (b"[" * 50_000 + b"]" * 50_000, "nests JSON too deeply"),
        (b'{"rank": 123456789, "pid": 1}', "invalid rank 123456789"),
    ],
)
@pytest.mark.bad_state_files
def test_corrupt_state_file_one_line_and_keeps_serving(
    tmp_path: Path,
    sleeper: subprocess.Popen,
    caplog: pytest.LogCaptureFixture,
    body: bytes,
    words: str,
) -> None:
    write(tmp_path, state(0, sleeper.pid))
    bad = tmp_path / "rank-1.json"
    bad.write_bytes(body)
    daemon = Daemon(str(tmp_path), gpus=False)
    for _ in range(3):
        daemon.refresh()
    (line,) = _lines(caplog, str(bad))
    assert words in line and "skipped until it is fixed" in line
    scrape = Scrape(daemon)
    assert scrape("ddpmon_rank_up", job="jobA", rank="0") == 1
    assert [s["rank"] for s in scrape.series("ddpmon_rank_up")] == ["0"]
    write(tmp_path, state(1, sleeper.pid))  # fixed
    daemon.refresh()
    assert scrape("ddpmon_rank_up", job="jobA", rank="1") == 1
    assert len(_lines(caplog, str(bad))) == 2  # ... and said once that it is fine again


def test_unreadable_state_file(
    tmp_path: Path, sleeper: subprocess.Popen, caplog: pytest.LogCaptureFixture
) -> None:
    write(tmp_path, state(0, sleeper.pid))
    (tmp_path / "rank-1.json").mkdir()  # unreadable as a file, even for root
    daemon = Daemon(str(tmp_path), gpus=False)
    daemon.refresh()
    daemon.refresh()
    (line,) = _lines(caplog, "rank-1.json")
    assert "not a regular file" in line and "skipped until it is fixed" in line
    assert Scrape(daemon)("ddpmon_rank_up", job="jobA", rank="0") == 1


@pytest.mark.bad_state_files
def test_planted_fifo_and_symlinks_never_block_or_stop_a_pass(
    tmp_path: Path, sleeper: subprocess.Popen, caplog: pytest.LogCaptureFixture
) -> None:
    write(tmp_path, state(0, sleeper.pid))
    os.mkfifo(tmp_path / "rank-1.json")
    (tmp_path / "rank-2.json").symlink_to("/dev/zero")
    daemon = Daemon(str(tmp_path), gpus=False)
    started = time.monotonic()
    daemon.refresh()
    assert time.monotonic() - started < 5
    assert "not a regular file" in _lines(caplog, "rank-1.json")[0]
    assert "symbolic link" in _lines(caplog, "rank-2.json")[0]
    assert Scrape(daemon)("ddpmon_rank_up", job="jobA", rank="0") == 1


def test_a_killed_hung_rank_is_no_longer_hung(tmp_path: Path) -> None:
    """The last state file of a hung rank that was then killed still carries its hang
    report; the daemon shows the rank down and not hung."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    write(tmp_path, state(0, gone.pid, hang=HANG))
    daemon = Daemon(str(tmp_path), gpus=False)
    daemon.refresh()
    scrape = Scrape(daemon)
    assert scrape("ddpmon_rank_up", job="jobA", rank="0") == 0
    assert scrape("ddpmon_rank_hang_suspected", job="jobA", rank="0") == 0


def test_state_dir_is_a_file(
    tmp_path: Path, sleeper: subprocess.Popen, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "state"
    path.write_text("not a directory")
    daemon = Daemon(str(path), gpus=False)
    daemon.refresh()
    daemon.refresh()
    (line,) = _lines(caplog, "is not a directory")
    assert str(path) in line
    path.unlink()
    write(path, state(0, sleeper.pid))
    daemon.refresh()
    assert Scrape(daemon)("ddpmon_rank_up", job="jobA", rank="0") == 1


def test_unreadable_state_dir(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    if os.geteuid() == 0:
        pytest.skip("root reads every directory")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0)
    daemon = Daemon(str(locked), gpus=False)
    daemon.refresh()
    daemon.refresh()
    assert len(_lines(caplog, "cannot be listed")) == 1


# -- HTTP: /metrics and /state -----------------------------------------------------------------


def test_serves_metrics_and_state(tmp_path: Path, sleeper: subprocess.Popen) -> None:
    write(tmp_path, state(0, sleeper.pid))
    write(tmp_path, state(1, sleeper.pid, host="another-node"))
    daemon = Daemon(str(tmp_path), gpus=False, interval=0.2)
    daemon.start()
    endpoint = serve(daemon, 0, "127.0.0.1", {"/state": daemon.routes.state_route})
    try:
        base = f"http://127.0.0.1:{endpoint.port}"
        text = urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
        assert 'ddpmon_rank_up{job="jobA",rank="0"} 1.0' in text
        with urllib.request.urlopen(base + "/state", timeout=5) as r:
            assert r.headers["Content-Type"] == "application/json"
            states = json.loads(r.read())
        assert [(s["rank"], s["pid"], s["host"]) for s in states] == [(0, sleeper.pid, HOST)]
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(
                urllib.request.Request(base + "/state", data=b"x", method="POST"), timeout=5
            )
        assert err.value.code == 405
    finally:
        endpoint.close()
        daemon.stop()


FAULT = """Fatal Python error: Aborted

Thread 0x00007f0000000002 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait

Current thread 0x00007f0000000001 (most recent call first):
  File "/job/train.py", line 51 in reduce_metrics
  File "/job/train.py", line 88 in <module>
"""


def test_a_fatal_signal_travels_to_a_doctor_on_another_node(tmp_path: Path) -> None:
    """``doctor --from`` cannot read a rank's faulthandler file: the daemon that serves the
    state file carries the signal and the stacks in its exit record."""
    from ddpmon.doctor import examine

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    path = write(tmp_path, state(0, gone.pid, started_unix=time.time() - 30))
    Path(str(path)[:-5] + ".fault").write_text(FAULT)
    daemon = Daemon(str(tmp_path), gpus=False, interval=0.2)
    daemon.start()
    endpoint = serve(daemon, 0, "127.0.0.1", {"/state": daemon.routes.state_route})
    try:
        d = examine("", remote=[f"127.0.0.1:{endpoint.port}"], live_stacks=False)
    finally:
        endpoint.close()
        daemon.stop()
    (rank0,) = d.ranks
    assert (
        rank0.ending.signal == "SIGABRT"
        and rank0.ending.where == "/job/train.py:51 in reduce_metrics"
    )
    assert rank0.status == "crashed" and rank0.stack_source == "its faulthandler file (SIGABRT)"
    assert rank0.stack[0].frames[-1].function == "reduce_metrics"


# -- GPUs (fake driver) ------------------------------------------------------------------------


def test_every_gpu_mapped_to_ranks_xid_and_lost_gpu(
    tmp_path: Path,
    sleeper: subprocess.Popen,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "ddpmon")
    stranger = os.getpid()  # a process on GPU 0 that is no rank
    driver = FakeDriver(two_gpus(pids=[sleeper.pid, stranger])).install(monkeypatch)
    write(tmp_path, state(1, sleeper.pid))
    daemon = Daemon(str(tmp_path), interval=60, slow_interval=60)
    daemon.start()
    try:
        scrape = Scrape(daemon)
        uuid0, uuid1 = (g.uuid for g in driver.gpus)
        g0 = {"job": "jobA", "rank": "1", "gpu": "0", "gpu_uuid": uuid0}
        g1 = {"job": "", "rank": "", "gpu": "1", "gpu_uuid": uuid1}
        assert scrape("ddpmon_gpu_utilization_ratio", **g0) == pytest.approx(0.37)
        assert scrape("ddpmon_gpu_memory_total_bytes", **g1) == 80 * 2**30
        assert scrape("ddpmon_gpu_energy_joules_total", **g0) == pytest.approx(123456.789)
        assert scrape("ddpmon_gpu_clock_event_active", **g1, reason="gpu_idle") == 1
        assert (
            scrape(
                "ddpmon_gpu_process_info",
                gpu="0",
                gpu_uuid=uuid0,
                pid=str(sleeper.pid),
                job="jobA",
                rank="1",
            )
            == 1
        )
        assert (
            scrape(
                "ddpmon_gpu_process_info",
                gpu="0",
                gpu_uuid=uuid0,
                pid=str(stranger),
                job="",
                rank="",
            )
            == 1
        )
        assert (
            scrape(
                "ddpmon_daemon_info", host=HOST, version=__import__("ddpmon").__version__, gpus="2"
            )
            == 1
        )

        for _ in range(5):
            daemon.refresh()
        assert (
            driver.calls["nvmlDeviceGetTotalEnergyConsumption"] == 2
        )  # once per GPU per slow_interval

        driver.xid(0, 48)
        driver.xid(0, 48)
        t = time.time()
        deadline = time.monotonic() + 5
        while scrape("ddpmon_gpu_xid_errors_total", **g0, xid="48") != 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
            daemon.refresh()
        assert abs(scrape("ddpmon_gpu_last_xid_timestamp_seconds", **g0, xid="48") - t) < 5

        driver.gpus[0].lost = True
        daemon.refresh()
        daemon.refresh()
        assert scrape("ddpmon_gpu_utilization_ratio", **g0) is None
        assert scrape("ddpmon_gpu_utilization_ratio", **g1) == 0  # the other GPU goes on
        assert scrape("ddpmon_gpu_xid_errors_total", **g0, xid="48") == 2
        assert scrape("ddpmon_rank_up", job="jobA", rank="1") == 1
        (line,) = _lines(caplog, "is lost")
        assert "GPU 0" in line and "until the daemon restarts" in line
    finally:
        daemon.stop()
    assert driver.initialised == 0


def test_gpu_without_xid_events(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    gpus = two_gpus()
    for g in gpus:
        g.xid_events = False
    FakeDriver(gpus).install(monkeypatch)
    daemon = Daemon(str(tmp_path), interval=60)
    daemon.start()
    try:
        assert len(_lines(caplog, "XID errors are not watched")) == 2
        assert (
            Scrape(daemon)(
                "ddpmon_gpu_temperature_celsius", job="", rank="", gpu="1", gpu_uuid=gpus[1].uuid
            )
            == 41
        )
    finally:
        daemon.stop()
