"""The node daemon against a real 2-rank gloo job: both ranks up, one SIGKILLed and shown
down within 5 s while the other stays up, /state served, SIGTERM stops the daemon; and the
ranks' own host metrics (psutil) scraped from their endpoints."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import harness
from tests.support.commands import scrape, start_daemon, terminate

pytestmark = pytest.mark.timeout(120)

JOB = "daemon-test"


def start_ranks(world_size: int, workdir: Path) -> list[subprocess.Popen]:
    """harness.start_ranks, with this test's own worker module."""
    workdir.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in range(world_size):
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.distributed.daemon_worker"],
                cwd=harness.ROOT,
                env=harness.rank_env(rank, world_size, workdir),
                stdout=open(workdir / f"stdout-{rank}.txt", "w"),
                stderr=open(workdir / f"stderr-{rank}.txt", "w"),
                start_new_session=True,
            )
        )
    return procs


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def rank_up(port: int) -> dict[str, float]:
    return {
        dict(labels)["rank"]: v
        for (name, labels), v in samples(scrape(port)).items()
        if name == "ddpmon_rank_up" and dict(labels)["job"] == JOB
    }


def wait_for(what: str, check, timeout: float, procs: list[subprocess.Popen], workdir: Path):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out waiting for {what}:\n"
                + harness.describe(harness.collect(procs, workdir))
            )
        time.sleep(0.1)


def test_daemon_rank_liveness_against_a_real_job(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"  # does not exist yet: the ranks create it
    daemon, port = start_daemon(
        "--state-dir", str(state_dir), "--serve-state"
    )  # default --interval 1
    procs: list[subprocess.Popen] = []
    try:
        procs = start_ranks(2, tmp_path)
        wait_for(
            "both ranks up", lambda: rank_up(port) == {"0": 1.0, "1": 1.0}, 60, procs, tmp_path
        )

        # the ranks' own endpoints carry their host metrics; the data loader's worker is a child
        states = {s["rank"]: s for s in json.loads(scrape(port, "/state"))}
        assert sorted(states) == [0, 1] and {s["pid"] for s in states.values()} == {
            p.pid for p in procs
        }

        def host_metrics(rank: int) -> dict[str, float] | None:
            got = {
                name: v
                for (name, labels), v in samples(scrape(states[rank]["port"])).items()
                if dict(labels).get("rank") == str(rank) and dict(labels).get("job") == JOB
            }
            ready = (
                got.get("ddpmon_dataloader_workers") == 1
                and got["ddpmon_dataloader_workers_cpu_seconds_total"] > 0
            )
            return got if ready else None

        for rank in (0, 1):
            got = wait_for(
                f"rank {rank}'s data-loader worker",
                lambda rank=rank: host_metrics(rank),
                30,
                procs,
                tmp_path,
            )
            proc = psutil.Process(procs[rank].pid)
            assert got["ddpmon_process_resident_memory_bytes"] == pytest.approx(
                proc.memory_info().rss, rel=0.25
            )
            assert got["ddpmon_process_threads"] >= 2
            assert 0 < got["ddpmon_process_cpu_seconds_total"] <= sum(proc.cpu_times()[:2]) + 0.5
            assert got["ddpmon_host_memory_total_bytes"] == psutil.virtual_memory().total
            assert not any(name.startswith(("ddpmon_gpu_", "ddpmon_torch_memory_")) for name in got)

        os.killpg(procs[1].pid, signal.SIGKILL)
        killed = time.monotonic()
        wait_for("rank 1 down", lambda: rank_up(port).get("1") == 0.0, 5, procs, tmp_path)
        took = time.monotonic() - killed
        print(
            f"ddpmon_rank_up went to 0 {took:.2f} s after SIGKILL (daemon --interval 1, scraped every 0.1 s)"
        )
        assert took < 5.0
        assert rank_up(port)["0"] == 1.0
        time.sleep(2.0)  # two more sampling passes
        assert rank_up(port) == {"0": 1.0, "1": 0.0}
        assert procs[0].poll() is None

        # the doctor reads the same files through the daemon, as it would from another node
        doctor = subprocess.run(
            [
                sys.executable,
                "-m",
                "ddpmon",
                "doctor",
                "--from",
                f"127.0.0.1:{port}",
                "--json",
                "--no-stacks",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=harness.ROOT,
        )
        diagnosis = json.loads(doctor.stdout)
        assert doctor.returncode == 1, doctor.stderr
        assert diagnosis["verdict"] == "dead_rank" and diagnosis["suspect_ranks"] == [1]
        assert sorted(r["rank"] for r in diagnosis["ranks"]) == [0, 1]
    finally:
        harness.stop(procs)
        code, out, err, took = terminate(daemon)
    assert code == 0, err  # terminate() fails the test when SIGTERM takes over 10 s
    assert err.count("does not exist yet; waiting for it") == 1, err
    assert "Traceback" not in err
