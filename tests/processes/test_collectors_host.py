"""collectors/host.py against real processes: this one, real children, and a process in its
own pid namespace (as in a container)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import psutil
import pytest

from ddpmon.collectors import host

LABELS = {"job": "j", "rank": "2"}
BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n{after}"


def sleeper(env: dict[str, str] | None = None) -> subprocess.Popen:
    """A sleeping python process, returned once it runs (exec done, as a rank's is)."""
    p = subprocess.Popen(
        [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(30)"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout.readline().strip() == "ready"
    return p


def _values(sampler: host.ProcessSampler) -> dict[str, float]:
    samples = sampler.samples()
    assert all(labels == LABELS for _, labels, _ in samples)
    return {name: value for name, _, value in samples}


def test_process_metrics_match_psutil() -> None:
    sampler = host.ProcessSampler(LABELS)
    before = _values(sampler)
    t = time.process_time()
    while time.process_time() - t < 0.2:
        pass
    after = _values(sampler)
    me = psutil.Process()
    assert (
        after["ddpmon_process_cpu_seconds_total"] - before["ddpmon_process_cpu_seconds_total"]
        >= 0.18
    )
    assert after["ddpmon_process_resident_memory_bytes"] == pytest.approx(
        me.memory_info().rss, rel=0.1
    )
    assert after["ddpmon_process_threads"] == me.num_threads()
    memory = psutil.virtual_memory()
    assert after["ddpmon_host_memory_total_bytes"] == memory.total
    assert after["ddpmon_host_memory_used_bytes"] == pytest.approx(
        memory.total - memory.available, rel=0.1
    )
    assert set(after) == {
        "ddpmon_process_cpu_seconds_total",
        "ddpmon_process_resident_memory_bytes",
        "ddpmon_process_threads",
        "ddpmon_host_memory_used_bytes",
        "ddpmon_host_memory_total_bytes",
        "ddpmon_dataloader_workers",
        "ddpmon_dataloader_workers_cpu_seconds_total",
    }


def test_children_cpu_is_a_counter_across_exits() -> None:
    sampler = host.ProcessSampler(LABELS)
    assert _values(sampler)["ddpmon_dataloader_workers"] == 0
    child = subprocess.Popen([sys.executable, "-c", BURN.format(s=0.3, after="time.sleep(30)")])
    try:
        deadline = time.monotonic() + 20
        while True:
            v = _values(sampler)
            if v["ddpmon_dataloader_workers_cpu_seconds_total"] >= 0.3:
                break
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert v["ddpmon_dataloader_workers"] == 1
        running = v["ddpmon_dataloader_workers_cpu_seconds_total"]
    finally:
        child.kill()
        child.wait()
    v = _values(sampler)
    assert v["ddpmon_dataloader_workers"] == 0
    assert v["ddpmon_dataloader_workers_cpu_seconds_total"] >= running  # never goes back


def test_locate_process_same_namespace() -> None:
    child = sleeper()
    try:
        started = time.time()
        proc = host.locate_process(child.pid, started, same_host=True)
        assert proc is not None and proc.pid == child.pid and host.is_alive(proc)
        # a process created after the rank started ddpmon is a reused pid, not the rank
        assert host.locate_process(child.pid, started - 60, same_host=True) is None
    finally:
        child.kill()
        child.wait()
    assert not host.is_alive(proc)
    assert host.locate_process(child.pid, started, same_host=True) is None


def test_locate_process_checks_rank_in_environment() -> None:
    env = {**os.environ, "RANK": "3"}
    child = sleeper(env)
    try:
        started = time.time()
        assert host.locate_process(child.pid, started, same_host=True, rank=3).pid == child.pid
        assert host.locate_process(child.pid, started, same_host=True, rank=7) is None
    finally:
        child.kill()
        child.wait()


def test_zombie_is_not_alive() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    proc = psutil.Process(child.pid)
    deadline = time.monotonic() + 10
    while proc.status() != psutil.STATUS_ZOMBIE:  # exited, not yet reaped by us
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert not host.is_alive(proc)
    child.wait()


def _unshare_works() -> bool:
    if not sys.platform.startswith("linux") or not shutil.which("unshare"):
        return False
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
    return r.returncode == 0


@pytest.mark.skipif(not _unshare_works(), reason="needs unshare --pid (root or user namespaces)")
def test_locate_process_in_its_own_pid_namespace() -> None:
    """A rank in a container writes the pid it sees inside (here 1); the host's pid 1 is
    another process. The nested process must be found, by its NSpid."""
    child = subprocess.Popen(
        [
            "unshare",
            "--pid",
            "--fork",
            "--kill-child",
            "--mount-proc",
            sys.executable,
            "-c",
            "import os, time; print(os.getpid(), flush=True); time.sleep(30)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        inner = int(child.stdout.readline())
        started = time.time()
        proc = host.locate_process(inner, started, same_host=False)
        assert proc is not None
        assert proc.pid != inner and host.namespace_pids(proc.pid)[-1] == inner
        assert "time.sleep(30)" in " ".join(proc.cmdline())
    finally:
        child.kill()
        child.wait()


def _kernel_thread(pid: int) -> bool:
    try:
        return not psutil.Process(pid).cmdline()
    except psutil.Error:
        return False


@pytest.mark.skipif(
    not _unshare_works() or not _kernel_thread(2),
    reason="needs unshare --pid, and this host's pid 2 a kernel thread",
)
def test_the_doctor_and_the_daemon_judge_a_containerised_rank_alike(tmp_path) -> None:
    """A rank in its own pid namespace, on a host of the same name, writes the pid it sees
    (2); this host's pid 2 is a kernel thread. One rule (``locate_process`` and ``judge``)
    finds the rank's process in the namespace while it runs and calls it gone once it is,
    for the doctor (``host.check``) and the daemon alike, where reading the host's pid 2
    would say "running" throughout."""
    import json
    import socket

    from ddpmon.daemon import Daemon

    child = subprocess.Popen(
        [
            "unshare",
            "--pid",
            "--fork",
            "--kill-child",
            "--mount-proc",
            sys.executable,
            "-c",
            "import subprocess, sys, time\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
            "print(p.pid, flush=True); p.wait()",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        inner = int(child.stdout.readline())
        assert inner == 2
        here, started = socket.gethostname(), time.time()
        (tmp_path / "rank-0.json").write_text(
            json.dumps(
                {"rank": 0, "host": here, "pid": inner, "job": "j", "format": 1}
                | {"started_unix": started, "now_unix": started, "last_progress_unix": started}
            )
        )
        daemon = Daemon(str(tmp_path), gpus=False)
        life = host.check(here, inner, started, here, rank=0)
        assert life.alive is True and "in a container" in life.detail, life
        assert [v.up for v in daemon.ranks()] == [True]
    finally:
        child.kill()
        child.wait()
    # The killed process takes a moment to be torn down (longer on a busy machine), and the
    # daemon judges the process it found earlier: both must come to "dead" within the limit.
    deadline = time.monotonic() + 10
    while host.check(here, inner, started, here, rank=0).alive is not False or [
        (v.up, v.activity) for v in daemon.ranks()
    ] != [(False, "dead")]:
        assert time.monotonic() < deadline, [(v.up, v.activity) for v in daemon.ranks()]
        time.sleep(0.05)
    assert "another process" in host.check(here, inner, started, here, rank=0).detail


def test_a_process_start_is_read_within_a_clock_tick() -> None:
    """Between the moment before the fork and the child's first line, within a tick: psutil's
    creation time counts from the boot time in whole seconds (up to a second early), which
    made a restarted job's restart gap read as none (goodput)."""
    tick = 1 / os.sysconf("SC_CLK_TCK")
    for _ in range(5):
        before = time.time()
        p = subprocess.Popen(
            [sys.executable, "-c", "import time; print(time.time(), flush=True); time.sleep(30)"],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            first_line = float(p.stdout.readline())
            started = host.process_started_unix(p.pid)
        finally:
            p.kill()
            p.wait()
        assert started is not None and before - tick <= started <= first_line, (
            before,
            started,
            first_line,
        )
