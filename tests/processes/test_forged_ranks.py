"""Another local user (nobody) forges ranks of root's job: state files in nobody's own root
(``<tmp>/ddpmon-65534``) that claim root's job and rank, name nobody's or root's processes,
and are stamped ten years ahead. A file's job and rank are its writer's word; its owner is
not (``state/owners.py``). Before, the daemon kept root's SIGKILLed rank up and stepping on
the forged file's word, and ``doctor --from`` called root's healthy finished job a desync."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from ddpmon.daemon import Daemon
from ddpmon.state import files
from tests.support import states
from tests.support.commands import run_doctor, start_daemon, terminate
from tests.support.roots import NOBODY

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(os.geteuid() != 0, reason="simulating another user needs root"),
]

HOST = os.uname().nodename
YEARS_AHEAD = 10 * 365 * 86400.0


def sleeper(uid: int = 0) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "sleep", "60"]
    )


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        p.kill()
        p.wait()


def user_root(tmp: Path, uid: int) -> Path:
    """``<tmp>/ddpmon-<uid>``, as ranks of that user make it (0700, theirs)."""
    root = tmp / f"ddpmon-{uid}"
    root.mkdir(mode=0o700)
    os.chown(root, uid, uid)
    return root


def write(directory: Path, uid: int, data: dict[str, Any]) -> None:
    directory.mkdir(exist_ok=True, mode=0o700)
    os.chown(directory, uid, uid)
    path = files.path_for(str(directory), data["rank"])
    files.write_atomic(path, data)
    os.chown(path, uid, uid)


def rank_state(rank: int, pid: int, **over: Any) -> dict[str, Any]:
    now = time.time()
    data = {
        "rank": rank,
        "local_rank": rank,
        "world_size": 2,
        "host": HOST,
        "pid": pid,
        "job": "jobV",
        "step": 12,
        "phase": "forward",
        "started_unix": now,
        "last_progress_unix": now,
        "now_unix": now,
        "hang": None,
        "activity": {"state": "stepping", "since_unix": now - 5},
    }
    data.update(over)
    return data


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    shared = tmp_path / "tmp"  # a stand-in for /tmp: sticky, everyone's
    shared.mkdir()
    shared.chmod(0o1777)
    return shared


def test_the_daemon_never_takes_a_forged_file_for_another_users_rank(
    tmp: Path, procs: list[subprocess.Popen[bytes]], caplog: pytest.LogCaptureFixture
) -> None:
    alive, killed, forger, bystander = sleeper(), sleeper(), sleeper(NOBODY), sleeper(NOBODY)
    procs += [alive, killed, forger, bystander]
    killed.kill()
    killed.wait()  # root's rank 1, SIGKILLed a moment ago
    victim_root, attacker_root = user_root(tmp, 0), user_root(tmp, NOBODY)
    victim, attacker = victim_root / "jobV", attacker_root / "jobV"
    write(victim, 0, rank_state(0, alive.pid))
    write(victim, 0, rank_state(1, killed.pid))
    # nobody's word: rank 1 of root's job is its own live process, stepping, ten years ahead
    ahead = time.time() + YEARS_AHEAD
    write(attacker, NOBODY, rank_state(1, forger.pid, now_unix=ahead, last_progress_unix=ahead))
    # and a job of nobody's own whose rank names root's live process
    write(attacker_root / "jobN", NOBODY, rank_state(0, alive.pid, job="jobN"))
    daemon = Daemon(str(tmp / "ddpmon-*"), gpus=False, stale_after=1.0, interval=0.5)
    daemon.refresh()
    registry = CollectorRegistry()
    registry.register(daemon)

    def up(job: str, rank: int) -> float | None:
        return registry.get_sample_value("ddpmon_rank_up", {"job": job, "rank": str(rank)})

    assert up("jobV", 1) is None and up("jobV", 0) is None  # nobody's file claims that name too
    assert (up("jobV@uid0", 0), up("jobV@uid0", 1)) == (1.0, 0.0)  # root's killed rank stays down
    assert (
        registry.get_sample_value(
            "ddpmon_rank_activity", {"job": "jobV@uid0", "rank": "1", "activity": "dead"}
        )
        == 1.0
    )
    assert up("jobV@uid65534", 1) == 1.0  # nobody's own process, under its own name
    assert up("jobN", 0) == 0.0  # root's process is not nobody's rank
    said = caplog.text
    assert "state files of 2 users claim job 'jobV' (uid 0, uid 65534)" in said
    assert (
        f"state files of uid {NOBODY} name processes of other users, which are not their ranks"
        in said
    )
    # the stamp ten years ahead keeps nobody's file fresh for stale_after past its last write, no more
    last = float(
        registry.get_sample_value(
            "ddpmon_rank_last_progress_timestamp_seconds", {"job": "jobV@uid65534", "rank": "1"}
        )
        or 0.0
    )
    assert last <= time.time() + 1.0
    time.sleep(2.2)
    daemon.refresh()
    assert up("jobV@uid65534", 1) == 0.0
    assert up("jobV@uid0", 0) == 0.0  # (root's rank 0 was written once, too)


def test_doctor_from_a_daemon_is_not_misled_by_a_forged_rank(tmp: Path) -> None:
    """Root's job ended well; nobody's file says rank 1 still waits in an all-reduce, which
    read as root's would make rank 0 a rank that left early (a desync)."""
    states.restart_clock()
    victim, attacker = user_root(tmp, 0) / "jobV", user_root(tmp, NOBODY) / "jobV"
    ended = {"unix": states.NOW, "exception": None, "code": 0}
    for r in (0, 1):
        write(victim, 0, states.state(r, job="jobV", host=HOST, exit=ended))
    write(
        attacker,
        NOBODY,
        states.state(
            1,
            job="jobV",
            host=HOST,
            steps=11,
            silent=10.0,
            in_flight=[states.waiting_in("all_reduce", 60, 10.0, bucket=0)],
        ),
    )
    daemon, port = start_daemon("--state-dir", str(tmp / "ddpmon-*"), "--serve-state", "--no-gpu")
    try:
        done = run_doctor("--from", f"127.0.0.1:{port}", "--job", "jobV", "--json", "--no-stacks")
        served = json.loads(
            subprocess.run(
                [
                    sys.executable,
                    "-c",
                    f"import urllib.request; print(urllib.request.urlopen("
                    f"'http://127.0.0.1:{port}/state').read().decode())",
                ],
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout
        )
    finally:
        terminate(daemon)
    report = json.loads(done.stdout)
    assert (done.returncode, report["verdict"]) == (0, "healthy"), done.stdout + done.stderr
    assert report["job"] == "jobV@uid0"  # the doctor's user's files of that name
    assert sorted((s["job"], s["rank"]) for s in served) == [
        ("jobV@uid0", 0),
        ("jobV@uid0", 1),
        ("jobV@uid65534", 1),
    ]


def test_thousands_of_files_of_one_user_cost_the_daemon_a_bounded_number(
    tmp: Path, procs: list[subprocess.Popen[bytes]], caplog: pytest.LogCaptureFixture
) -> None:
    """nobody writes 600 state files into its root; root's one rank is read and exported as
    always, nobody's files cost at most ``max_per_user`` ranks' reads and series."""
    alive = sleeper()
    procs.append(alive)
    write(user_root(tmp, 0) / "mine", 0, rank_state(0, alive.pid, job="mine"))
    flood = user_root(tmp, NOBODY) / "flood"
    for r in range(600):
        write(flood, NOBODY, rank_state(r, 1, job="flood", world_size=600))
    daemon = Daemon(str(tmp / "ddpmon-*"), gpus=False, max_per_user=50)
    daemon.refresh()
    registry = CollectorRegistry()
    registry.register(daemon)
    ups = [s.labels for m in registry.collect() for s in m.samples if s.name == "ddpmon_rank_up"]
    assert sum(1 for labels in ups if labels["job"] == "flood") == 50
    assert registry.get_sample_value("ddpmon_rank_up", {"job": "mine", "rank": "0"}) == 1.0
    daemon.refresh()
    said = [r.getMessage() for r in caplog.records if "more than 50 state files" in r.getMessage()]
    assert said == [
        f"ddpmon: daemon: uid {NOBODY} has more than 50 state files here, the most the daemon reads "
        "per user (--max-ranks-per-user): the 50 written last are read, the others skipped"
    ]
