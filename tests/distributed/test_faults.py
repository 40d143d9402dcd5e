"""Fault injection, jobs: real gloo jobs under the faults a shared node produces. Training
is never harmed (final weights bit-identical to a run without ddpmon), the training
process keeps its thread count under a slowloris, a rank and the daemon answer every
scrape while one lasts, and concurrent jobs never collide."""

from __future__ import annotations

import http.client
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from ddpmon.httpd import HEADER_SECONDS
from tests.support.commands import start_daemon, terminate
from tests.support.harness import ROOT, collect, describe, start_ranks, states, stop

MODULE = "tests.distributed.fault_worker"
STEPS = "60"


def run_jobs(jobs: list[tuple[str, Path, dict[str, str]]], timeout: float = 120) -> list[list]:
    """Run several 2-rank jobs at once; every rank must succeed."""
    import time

    started = [
        start_ranks(mode, 2, workdir, env, (STEPS,), module=MODULE) for mode, workdir, env in jobs
    ]
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and any(
            p.poll() is None for procs in started for p in procs
        ):
            if any(p.poll() not in (None, 0) for procs in started for p in procs):
                time.sleep(3)
                break
            time.sleep(0.1)
    finally:
        for procs in started:
            stop(procs)
    results = [collect(procs, workdir) for procs, (_, workdir, _) in zip(started, jobs)]
    for r in results:
        assert all(x.returncode == 0 for x in r), describe(r)
    return results


def mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
        capture_output=True,
    )
    return r.returncode == 0


def reference_of(plain: list) -> str:
    """The final weights of the job without ddpmon (the same on both ranks)."""
    assert plain[0].result["digest"] == plain[1].result["digest"]
    return plain[0].result["digest"]


def test_two_concurrent_default_jobs_never_collide(tmp_path: Path) -> None:
    shared_tmp = tmp_path / "tmp"  # both jobs' system temp dir
    shared_tmp.mkdir()
    shared_tmp.chmod(0o1777)
    env = {"TMPDIR": str(shared_tmp), "DDPMON_STATE_DIR": "", "DDPMON_JOB": ""}
    env_no_master = {k: "" for k in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    a, b, plain = run_jobs(
        [
            ("attached", tmp_path / "a", {**env, **env_no_master}),
            ("attached", tmp_path / "b", {**env, **env_no_master}),
            ("plain", tmp_path / "plain", {}),
        ]
    )
    reference = reference_of(plain)
    jobs = [{r.result["job"] for r in a}, {r.result["job"] for r in b}]
    assert len(jobs[0]) == 1 and len(jobs[1]) == 1, (
        "one job name per launch, the same on every rank"
    )
    assert jobs[0] != jobs[1], "two launches never share a job label"
    files = [r.result["state_file"] for r in a + b]
    assert len(set(files)) == 4, files
    assert all(f.startswith(str(shared_tmp / f"ddpmon-{os.geteuid()}")) for f in files)
    assert {r.result["digest"] for r in a + b} == {reference}


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs state directory needs root")
def test_slowloris_sigstop_and_a_read_only_state_dir_leave_training_alone(tmp_path: Path) -> None:
    state = tmp_path / "attacked" / "state"
    if not mount_tmpfs(state, "1m"):
        pytest.skip("cannot mount a tmpfs here")
    full = tmp_path / "full" / "state"
    try:
        full_ok = mount_tmpfs(full, "4k")  # a state directory with no room for a state file
        # (no step history: an open SQLite file keeps `mount -o remount,ro` from succeeding; a
        # file system the kernel turns read-only after an error does not ask)
        jobs = [
            ("attacked", tmp_path / "attacked", {"DDPMON_HISTORY": "0"}),
            ("plain", tmp_path / "plain", {}),
        ]
        if full_ok:
            jobs.append(("attached", tmp_path / "full", {"DDPMON_STATE_DIR": str(full)}))
        results = run_jobs(jobs)
    finally:
        subprocess.run(["umount", "-l", str(state)], capture_output=True)
        subprocess.run(["umount", "-l", str(full)], capture_output=True)
    attacked, reference = results[0], reference_of(results[1])
    rank0 = attacked[0].result
    assert rank0["attack_opened"] >= 200, rank0
    # 250 half-open connections (reopened as the server drops them) add no thread to the
    # training process (+1: the timer that wakes rank 1; +2 of noise)
    added = rank0["threads_peak"] - rank0["threads_before"]
    assert added <= 1 + 2, (added, rank0["threads_before"])
    assert {r.result["digest"] for rs in results for r in rs} == {reference}
    assert "Read-only file system" in attacked[0].stderr + attacked[1].stderr  # said, once per rank
    if full_ok:
        assert "No space left on device" in results[2][0].stderr + results[2][1].stderr


ATTACK_SECONDS = 12.0


def siege(port: int, pid: int, paths: list[str]) -> dict[str, Any]:
    """Attack 127.0.0.1:``port`` with 1,000 half-open connections and 50 that trickle a
    byte a second (every one the server closes reopened) for ATTACK_SECONDS, while a
    client scrapes ``paths`` every second, on a new connection and on one kept alive (as
    Prometheus does), and the threads of process ``pid`` (the server) are counted."""
    target = psutil.Process(pid)
    baseline = []
    for _ in range(5):
        baseline.append(target.num_threads())
        time.sleep(0.1)
    attacker = subprocess.Popen(  # at the lowest priority: the test measures the server, not it
        [
            "nice",
            "-n",
            "19",
            sys.executable,
            "-m",
            "tests.distributed.attacker",
            str(port),
            "--half-open",
            "1000",
            "--trickle",
            "50",
            "--seconds",
            str(ATTACK_SECONDS),
            "--grace",
            str(HEADER_SECONDS + 1.5),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    scrapes: list[tuple[str, str, Any, float]] = []
    threads: list[int] = []
    kept = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    kept_ports: list[
        int | None
    ] = []  # the kept-alive scraper's local port (None: closed after a response)

    def scrape(kind: str, path: str) -> None:
        conn = kept if kind == "kept" else http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        started = time.monotonic()
        try:
            conn.request("GET", path, headers={"Accept-Encoding": "gzip"})
            r = conn.getresponse()
            r.read()
            status: Any = r.status
            if conn is kept:
                kept_ports.append(kept.sock.getsockname()[1] if kept.sock else None)
        except (OSError, http.client.HTTPException) as exc:
            status = repr(exc)
            conn.close()  # (http.client connects again at the next request)
        scrapes.append((kind, path, status, time.monotonic() - started))
        if conn is not kept:
            conn.close()

    try:
        attacker.stdout.readline()  # "open N": the connections are made
        end = time.monotonic() + ATTACK_SECONDS - 0.5
        next_scrape = time.monotonic()
        while time.monotonic() < end:
            if time.monotonic() >= next_scrape:
                next_scrape += 1.0
                for path in paths:
                    scrape("new", path)
                    scrape("kept", path)
            threads.append(target.num_threads())
            time.sleep(0.1)
        out, _ = attacker.communicate(timeout=ATTACK_SECONDS + 30)
    finally:
        kept.close()
        attacker.kill()
        attacker.wait()
    # the scrapers' own connections closed just now: the server sees them end within moments
    deadline = time.monotonic() + 2.0
    while (
        lingering := [
            c.status
            for c in target.net_connections("tcp")
            if c.laddr.port == port and c.status != psutil.CONN_LISTEN
        ]
    ) and time.monotonic() < deadline:
        time.sleep(0.1)
    return {
        "baseline": statistics.median(baseline),
        "threads": threads,
        "scrapes": scrapes,
        "attack": json.loads(out.splitlines()[-1]),
        "kept_ports": kept_ports,
        "lingering": lingering,
    }


def check_siege(got: dict[str, Any], paths: list[str]) -> None:
    attack = got["attack"]
    print(
        f"attack {attack}; slowest scrape {max(s[3] for s in got['scrapes']):.3f} s of "
        f"{len(got['scrapes'])}; threads {got['baseline']} before, {min(got['threads'])} to "
        f"{max(got['threads'])} during"
    )
    assert attack["opened"] >= 1050, attack
    slow = [s for s in got["scrapes"] if s[2] != 200 or s[3] >= 1.0]
    assert not slow, f"scrapes not answered within 1 s under the attack: {slow}"
    for path in paths:  # one a second, each way
        assert sum(s[1] == path for s in got["scrapes"]) >= 2 * (ATTACK_SECONDS - 2), got["scrapes"]
    ports = set(got["kept_ports"])
    assert len(ports) == 1 and None not in ports, (
        "the kept-alive scraper keeps its connection through the attack"
    )
    off = [t for t in got["threads"] if abs(t - got["baseline"]) > 2]
    assert not off, f"threads {off} under the attack, {got['baseline']} before"
    # once the attack stops, the server closes everything it held within the head deadline
    assert attack["still_open"] == 0, attack
    assert not got["lingering"], (
        f"connections still held 2 s after the last scrape: {got['lingering']}"
    )


def test_a_rank_answers_every_scrape_under_a_slowloris(tmp_path: Path) -> None:
    """A rank of a real job at the common file-descriptor limit of 1,024 (so its endpoint
    holds at most 256 connections and the attack keeps it at the cap)."""
    procs = start_ranks("serving", 2, tmp_path, {"DDPMON_TEST_NOFILE": "1024"}, module=MODULE)
    try:
        deadline = time.monotonic() + 90
        while (states(tmp_path).get(0) or {}).get(
            "step", 0
        ) < 20:  # training, and its port published
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), describe(
                collect(procs, tmp_path)
            )
            time.sleep(0.2)
        before = states(tmp_path)[0]
        got = siege(before["port"], procs[0].pid, ["/metrics"])
        trained = states(tmp_path)[0]["step"] - before["step"]
        (tmp_path / "stop").write_text("")
        for p in procs:
            p.wait(30)
    finally:
        stop(procs)
    results = collect(procs, tmp_path)
    assert all(r.returncode == 0 for r in results), describe(results)
    check_siege(got, ["/metrics"])
    assert trained >= 50, f"{trained} steps in {ATTACK_SECONDS:.0f} s of attack: training stalled"


def test_the_daemon_answers_every_scrape_and_its_healthz_under_a_slowloris(tmp_path: Path) -> None:
    daemon, port = start_daemon("--state-dir", str(tmp_path), "--serve-state", "--no-gpu")
    try:
        got = siege(port, daemon.pid, ["/metrics", "/healthz", "/state"])
    finally:
        code, _, err, _ = terminate(daemon)
    assert code == 0, err
    check_siege(got, ["/metrics", "/healthz", "/state"])
