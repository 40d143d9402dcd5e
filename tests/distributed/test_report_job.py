"""History, report and compare on real 2-rank gloo jobs: finished, killed, live, and two
runs that differ in a known way (rank 1 sleeps in forward)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from ddpmon.state import history
from tests.support import harness
from tests.support.commands import start_daemon

pytestmark = pytest.mark.timeout(240)

STEPS = 30
DELAY = 0.1  # seconds rank 1 sleeps in every forward of the slow run
SLOW_STEPS = 140
"""The slow run's steps: over 12 s of them, the time a straggler's gap must last before the
doctor names it, in a job that ended too (ddpmon/steps.py: sustained)."""


def start(
    workdir: Path,
    delay: float,
    end: str = "detach",
    job: str = "report",
    env: dict[str, str] | None = None,
    steps: int = STEPS,
) -> list[subprocess.Popen]:
    """A 2-rank job of tests/distributed/report_worker.py."""
    return harness.start_ranks(
        "train",
        2,
        workdir,
        env={"DDPMON_TEST_JOB": job, **(env or {})},
        args=(str(steps), "1", str(delay), end),
        module="tests.distributed.report_worker",
    )


def finish(procs: list[subprocess.Popen], workdir: Path) -> list[harness.RankResult]:
    """Wait for a job of ``start`` to end (bounded); every rank must exit 0."""
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.05)
    finally:
        harness.stop(procs)
    results = harness.collect(procs, workdir)
    assert all(r.returncode == 0 for r in results), harness.describe(results)
    return results


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ddpmon", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=harness.ROOT,
        env=dict(os.environ, PYTHONPATH=str(harness.ROOT)),
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("runs")
    # side by side: the short runs are done while the slow one sleeps in rank 1's forwards
    started = {
        "slow": start(base / "slow", DELAY, job="slow", steps=SLOW_STEPS),
        "fast": start(base / "fast", 0.0, end="exit", job="fast"),  # the interpreter's exit
        "same": start(base / "same", 0.0, job="same", env={"DDPMON_TEST_SAME_DATA": "1"}),
    }
    return {name: (base / name, finish(procs, base / name)) for name, procs in started.items()}


def test_every_step_is_in_the_history_with_its_phases_and_buckets(runs):
    workdir, _ = runs["slow"]
    for rank in (0, 1):
        h = history.read(history.path_for(str(workdir / "state"), rank))
        cols = h["steps"]
        assert cols["step"] == list(range(1, SLOW_STEPS + 1)), cols["step"]
        assert h["identity"]["rank"] == rank and h["identity"]["job"] == "slow"
        assert all(s > 0 for s in cols["step_seconds"]) and all(
            f is not None for f in cols["forward_seconds"]
        )
        assert sum(e is not None for e in cols["exposed_comm_seconds"]) >= SLOW_STEPS - 2
        assert sum(bool(b) for b in cols["buckets"]) >= SLOW_STEPS - 2
        assert all(m and m > 10 * 2**20 for m in cols["process_resident_memory_bytes"])
        assert h["exit"]["how"] == "detached"
    forward = history.read(history.path_for(str(workdir / "state"), 1))["steps"]["forward_seconds"]
    assert sorted(forward)[len(forward) // 2] >= DELAY  # rank 1's sleep is in its forward


def test_rank_0_logs_the_run_summary_at_the_end(runs):
    _, results = runs["slow"]
    text = results[0].stderr
    assert f"ddpmon: run summary of job 'slow': {SLOW_STEPS} steps on 2 ranks" in text, text[-3000:]
    assert "straggler: rank 1 is" in text and "in forward" in text
    assert "report: ddpmon report" in text
    assert "run summary" not in results[1].stderr


def test_a_finding_first_made_at_the_end_reaches_the_log_with_its_fix(runs):
    """Same data on every rank in a short job: rank 0's end-of-run summary is where the
    doctor first sees it, and it says what to do."""
    from ddpmon.advice import FIX

    _, results = runs["same"]
    logs = "\n".join(r.stderr for r in results)
    line = next((ln for ln in logs.splitlines() if "[same_data]" in ln), None)
    assert line is not None, logs[-3000:]
    assert FIX["same_data"] in line, line


def test_a_job_that_exits_without_detach_keeps_its_history_and_summary(runs):
    workdir, results = runs["fast"]
    for rank in (0, 1):
        h = history.read(history.path_for(str(workdir / "state"), rank))
        assert h["exit"]["how"] == "exited" and h["exit"]["record"]["exception"] is None
        assert h["steps"]["step"] == list(range(1, STEPS + 1))  # each closed at its optimizer step
    assert f"ddpmon: run summary of job 'fast': {STEPS} steps on 2 ranks" in results[0].stderr


def test_report_json_of_a_finished_job(runs):
    workdir, _ = runs["slow"]
    done = cli("report", str(workdir / "state"), "--json")
    assert done.returncode == 0, done.stderr
    s = json.loads(done.stdout)
    assert (
        s["steps"] == SLOW_STEPS
        and s["ranks"] == 2
        and s["devices"] == ["cpu"]
        and s["backend"] == "gloo"
    )
    assert s["slowest_rank"]["rank"] == 1 and s["slowest_rank"]["part"] == "forward"
    # one scale ("N% slower") from one rule in the summary, the per-rank table and the verdict
    slower = {r["rank"]: r["slower"] for r in s["per_rank"]}
    assert (
        slower[1] == s["slowest_rank"]["score"] == s["straggler"]["score"] > 0.5 and slower[0] < 0
    )
    assert s["verdict"] == "straggler" and s["suspect_ranks"] == [1]  # the finished job keeps it
    assert s["median_step_seconds"] >= DELAY
    assert [r["status"]["status"] for r in s["per_rank"]] == ["exited", "exited"]
    assert s["exposed_comm_share"] > 0.3  # rank 0 waits for rank 1 in the all-reduce


def test_the_doctor_on_a_finished_job_says_what_happened_in_the_run(runs):
    workdir, _ = runs["slow"]
    done = cli("doctor", str(workdir / "state"), "--json")
    report = json.loads(done.stdout)
    assert (
        done.returncode == 1 and report["verdict"] == "straggler" and report["suspect_ranks"] == [1]
    )
    kinds = [f["kind"] for f in report["findings"]]
    assert kinds[:2] == ["straggler", "finished"], kinds
    assert (
        "rank 1 is" in report["findings"][0]["summary"]
        and "in forward" in report["findings"][0]["summary"]
    )
    fast = json.loads(cli("doctor", str(runs["fast"][0] / "state"), "--json").stdout)
    assert fast["verdict"] == "healthy" and [f["kind"] for f in fast["findings"]][:1] == [
        "finished"
    ]


def test_compare_two_real_runs_explains_the_difference(runs):
    fast, slow = runs["fast"][0] / "state", runs["slow"][0] / "state"
    done = cli("compare", str(fast), str(slow), "--html", str(runs["slow"][0] / "compare.html"))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "step time up" in out and "rank 1 explains it" in out and "most in forward" in out, out
    result = json.loads(cli("compare", str(fast), str(slow), "--json").stdout)
    step = result["rows"][0]
    assert (
        step["delta"] > DELAY / 2
    )  # every step of B waits for rank 1's sleep (a busy machine adds noise)
    rank1 = next(r for r in result["ranks"] if r["rank"] == 1)
    assert rank1["part"] == "forward" and rank1["part_delta"] >= DELAY / 2
    # how much slower, the report's figure, with the window it is over (the whole run)
    line = next(x for x in out.splitlines() if x.lstrip().startswith("rank 1 "))
    report = json.loads(cli("report", str(slow), "--json").stdout)
    steps = next(r for r in report["per_rank"] if r["rank"] == 1)["slower_steps"]
    assert rank1["b_slower_steps"] == steps and steps > 10, result
    assert "than the others: A " in line and (
        f"B {rank1['b_slower'] * 100:.0f}% slower over the whole run ({steps} steps)" in line
    ), line


def test_killed_and_live_jobs(tmp_path):
    procs = start(tmp_path, 0.0, end="hold", job="held")
    state = tmp_path / "state"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not all(
            (tmp_path / f"trained-{r}").exists() for r in (0, 1)
        ):
            assert all(p.poll() is None for p in procs), harness.describe(
                harness.collect(procs, tmp_path)
            )
            time.sleep(0.1)
        time.sleep(3.5)  # training paused: the writer's next batches hold every step
        live = json.loads(cli("report", str(state), "--json").stdout)
        assert live["steps"] >= STEPS - 1
        statuses = [r["status"]["status"] for r in live["per_rank"]]
        assert all(st in ("stepping", "stuck", "frozen") for st in statuses), (
            statuses
        )  # alive, idle after training
    finally:
        harness.stop(procs)  # SIGKILL: no detach, no exit record
    killed = cli("report", str(state), "-o", str(tmp_path / "killed.html"))
    assert killed.returncode == 0, killed.stderr
    s = json.loads(cli("report", str(state), "--json").stdout)
    assert all(r["status"]["status"].startswith("dead") for r in s["per_rank"]), s["per_rank"]
    for rank in (0, 1):
        h = history.read(history.path_for(str(state), rank))
        assert h["exit"] is None and h["steps"]["step"][-1] >= STEPS - 1


def test_report_through_the_node_daemon(runs):
    """The daemon serves the job's state files and histories: the report read through it has
    every rank's steps, with the values of the local files, and the figures of the directory."""
    workdir, _ = runs["slow"]
    state = str(workdir / "state")
    daemon, port = start_daemon("--state-dir", state, "--serve-state")
    address = f"127.0.0.1:{port}"
    try:
        pages = {}
        for rank in (0, 1):
            with urllib.request.urlopen(f"http://{address}/history?rank={rank}", timeout=10) as r:
                pages[rank] = json.loads(r.read())
        done = cli("report", "--from", address, "--json")
        page = cli("report", "--from", address, "-o", str(workdir / "remote.html"))
    finally:
        daemon.kill()
        daemon.communicate()
    for rank, p in pages.items():
        assert (p["job"], p["rank"], p["identity"]["rank"], p["next_since"]) == (
            "slow",
            rank,
            rank,
            None,
        )
        local = history.read(history.path_for(state, rank), decode_buckets=False)
        assert [dict(zip(p["columns"], row)) for row in p["rows"]] == [
            {c: local["steps"][c][i] for c in p["columns"]} for i in range(SLOW_STEPS)
        ]
        assert p["exit"]["how"] == "detached" and p["findings"] == local["findings"]
    assert done.returncode == 0 and page.returncode == 0, done.stderr + page.stderr
    s = json.loads(done.stdout)
    assert (
        s["ranks"] == 2 and s["steps"] == SLOW_STEPS and s["job"] == "slow" and s["problems"] == []
    )
    assert [r["status"]["status"] for r in s["per_rank"]] == ["exited", "exited"]
    assert [r["history_rows"] for r in s["per_rank"]] == [SLOW_STEPS, SLOW_STEPS]
    assert s["slowest_rank"]["rank"] == 1 and s["slowest_rank"]["part"] == "forward"
    near = json.loads(cli("report", state, "--json").stdout)
    assert [{k: v for k, v in r.items() if k != "history"} for r in near["per_rank"]] == [
        {k: v for k, v in r.items() if k != "history"} for r in s["per_rank"]
    ]
    for key in ("median_step_seconds", "parts", "buckets", "slowest_rank", "straggler", "verdict"):
        assert near[key] == s[key], key
    assert cli("report", state, "-o", str(workdir / "local.html")).returncode == 0

    def charts(path):
        text = path.read_text()
        return json.loads(
            text.split('<script id="ddpmon-data" type="application/json">')[1].split("</script>")[0]
        )["charts"]

    assert charts(workdir / "remote.html") == charts(workdir / "local.html")
