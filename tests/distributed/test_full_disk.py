"""A real 2-rank gloo job whose state directory, a small tmpfs, fills up mid-run, empties
again, and fills up once more until the job ends cleanly (tests/distributed/full_disk_worker.py).

Asserted: training is unchanged (the final weights of a run without ddpmon); while the disk
is full the doctor says the ranks cannot write their state (not a hang), the rank's metric
counts the failed writes, each rank logs it once; once there is room the files are fresh
within seconds and the history resumes, naming the steps its ring had dropped; the clean
end on a full disk reads as one (the exit records go through the space set aside), not as an
OOM kill; the report names the missing steps and gives the run's real duration.
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from ddpmon.rank.writers import RETRY_MAX_SECONDS
from ddpmon.state import files, history
from tests.support import harness
from tests.support.commands import run_doctor

pytestmark = [
    pytest.mark.timeout(420),
    pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs state directory needs root"),
]

MODULE = "tests.distributed.full_disk_worker"
FULL_SECONDS = 13.0  # past the doctor's 10 s after which a live rank's stale file read as frozen
RING = 1024  # the rank keeps its last 1,024 steps in memory (rank/books.py)


class Filler:
    """Fills a file system and keeps it full: writes until ENOSPC, then takes every page
    that is freed (a rank's failed temporary file) within 10 ms, until ``free``, which
    removes its file."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "filler"
        self._stop = threading.Event()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.full = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        big, small = b"\0" * (1 << 20), b"\0" * 4096
        chunk = big
        while not self._stop.is_set():
            try:
                os.write(self._fd, chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                if chunk is small:
                    self.full.set()
                    self._stop.wait(0.01)
                chunk = small

    def free(self) -> None:
        self._stop.set()
        self._thread.join(10)
        os.close(self._fd)
        os.unlink(self.path)


def steps_of(port: int) -> float:
    """ddpmon_steps_total from the rank's own endpoint (its state file is stale meanwhile)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return float(re.search(r"^ddpmon_steps_total\{[^}]*\} (\S+)$", text, re.M).group(1))


def write_failures_of(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(
            r'^ddpmon_state_write_failures_total\{[^}]*file="(\w+)"[^}]*\} (\S+)$', text, re.M
        )
    }


def doctor(state: Path, *args: str) -> dict[str, Any]:
    done = run_doctor(str(state), "--json", *args)
    assert done.returncode in (0, 1), done.stderr
    return json.loads(done.stdout)


def wait_for(what: str, condition: Any, timeout: float, procs: list, must: bool = True) -> bool:
    """Whether ``condition`` came true within ``timeout`` (an AssertionError when it ``must``:
    the test's own steps; what ddpmon should do is checked by the tests, from ``job``)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert all(p.poll() is None for p in procs), f"a rank ended while waiting for {what}"
        if time.monotonic() >= deadline:
            assert not must, f"timed out waiting for {what}"
            return False
        time.sleep(0.1)
    return True


def recorded(state: Path, rank: int) -> int:
    """The last step in the rank's history; 0 before it holds its tables (the rank creates
    the file, then SQLite its schema)."""
    try:
        return history.max_step(history.path_for(str(state), rank))
    except history.HistoryError:
        return 0


def newest_write(state: Path) -> float:
    return min(files.written_unix(os.stat(state / f"rank-{r}.json")) for r in (0, 1))


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    workdir = tmp_path_factory.mktemp("full")
    state = workdir / "state"
    state.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=32m,mode=0700", "tmpfs", str(state)],
        capture_output=True,
    )
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    seen: dict[str, Any] = {}
    # the reference run without ddpmon trains beside it, to the steps the attached job took
    plain_procs = harness.start_ranks("plain", 2, workdir / "plain", module=MODULE)
    procs = harness.start_ranks("attached", 2, workdir, module=MODULE)
    filler = None
    try:
        wait_for(
            "the first writes",
            lambda: (
                all((workdir / f"port-{r}").exists() for r in (0, 1))
                and all(os.path.exists(history.path_for(str(state), r)) for r in (0, 1))
            ),
            60,
            procs,
        )
        port = int((workdir / "port-0").read_text())
        wait_for(
            "200 steps in the histories",
            lambda: min(recorded(state, r) for r in (0, 1)) >= 200,
            60,
            procs,
        )

        # -- the disk fills up under the running job ------------------------------------------------
        filler = Filler(state)
        assert filler.full.wait(30), "the filler did not fill the tmpfs"
        filled_at, step_at_fill = time.time(), steps_of(port)
        seen["written_before"] = {
            r: history.max_step(history.path_for(str(state), r)) for r in (0, 1)
        }
        time.sleep(5.0)
        seen["doctor_5s"] = doctor(state)
        wait_for(
            "steps past the ring",
            lambda: (
                steps_of(port) > step_at_fill + 2 * RING and time.time() > filled_at + FULL_SECONDS
            ),
            120,
            procs,
        )
        seen["file_age_at_doctor"] = time.time() - newest_write(state)
        seen["doctor_full"] = doctor(state)
        seen["doctor_full_text"] = run_doctor(str(state))
        seen["metric_full"] = write_failures_of(port)
        seen["steps_while_full"] = steps_of(port) - step_at_fill

        # -- room again: the files are fresh, the history resumes ------------------------------------
        tries = write_failures_of(port)[
            "state"
        ]  # space comes back just after a failed try, so that
        wait_for(
            "a try", lambda: write_failures_of(port)["state"] > tries, 30, procs
        )  # the next is 8 s off
        filler.free()
        filler = None
        freed_at = time.time()
        wait_for("fresh state files", lambda: newest_write(state) > freed_at, 15, procs, must=False)
        seen["fresh_after_seconds"] = newest_write(state) - freed_at
        step_at_free = steps_of(port)
        wait_for(
            "the histories to resume",
            lambda: min(recorded(state, r) for r in (0, 1)) > step_at_free,
            20,
            procs,
            must=False,
        )
        seen["doctor_room"] = doctor(state, "--no-stacks")
        time.sleep(2.0)

        # -- full again, and the job ends cleanly while it is -------------------------------------------
        filler = Filler(state)
        assert filler.full.wait(30)
        time.sleep(4.0)
        seen["doctor_full_again"] = doctor(state, "--no-stacks")
        (workdir / "stop").write_text("1")
        for p in procs:
            p.wait(60)
        results = harness.collect(procs, workdir)
        assert all(r.returncode == 0 for r in results), harness.describe(results)
        (workdir / "plain" / "steps").write_text(str(results[0].result["steps"]))
        seen["doctor_ended_full"] = doctor(state, "--no-stacks")
        filler.free()
        filler = None
        seen["doctor_ended"] = doctor(state, "--no-stacks")
        seen["doctor_ended_text"] = run_doctor(str(state), "--no-stacks")
        report = subprocess.run(
            [harness.sys.executable, "-m", "ddpmon", "report", str(state), "--json"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=harness.ROOT,
            env=dict(os.environ, PYTHONPATH=str(harness.ROOT)),
        )
        assert report.returncode == 0, report.stderr
        seen["report"] = json.loads(report.stdout)
        seen["histories"] = {r: history.read(history.path_for(str(state), r)) for r in (0, 1)}
        seen["states"] = {r: json.loads((state / f"rank-{r}.json").read_text()) for r in (0, 1)}
        seen["leftovers"] = sorted(p.name for p in state.iterdir())
        wait_for("the plain run", lambda: all(p.poll() is not None for p in plain_procs), 240, [])
    finally:
        if filler is not None:
            filler.free()
        harness.stop(procs)
        harness.stop(plain_procs)
        subprocess.run(["umount", "-l", str(state)], capture_output=True)
    seen["results"] = results
    seen["plain"] = harness.collect(plain_procs, workdir / "plain")
    assert all(r.returncode == 0 for r in seen["plain"]), harness.describe(seen["plain"])
    return seen


def test_training_is_unchanged(job: dict[str, Any]) -> None:
    results, plain = job["results"], job["plain"]
    assert results[0].result["steps"] == results[1].result["steps"] == plain[0].result["steps"]
    assert (
        {r.result["digest"] for r in results}
        == {plain[0].result["digest"]}
        == {plain[1].result["digest"]}
    )
    assert job["steps_while_full"] > 2 * RING  # it trained on while its files could not be written


def test_while_full_the_doctor_says_the_ranks_cannot_write_not_a_hang(job: dict[str, Any]) -> None:
    assert job["file_age_at_doctor"] > 10  # the old doctor called this "frozen": a hang
    for key in ("doctor_5s", "doctor_full"):
        d = job[key]
        assert (d["verdict"], d["suspect_ranks"]) == ("cannot_write", [0, 1]), (key, d["findings"])
        f = d["findings"][0]
        assert (f["kind"], f["severity"]) == ("cannot_write", "error")
        assert f["summary"] == "ranks 0, 1 cannot write their state: no space left on device"
        assert "KiB free (under 1 MiB: full)" in f["evidence"][0]
        assert any("its process runs" in line for line in f["evidence"])
        assert "DDPMON_STATE_DIR" in f["fix"] and "df -h" in f["fix"]
        assert [r["status"] for r in d["ranks"]] == ["unknown", "unknown"]
        assert [r["cannot_write"] for r in d["ranks"]] == ["no space left on device"] * 2
    stacks = [
        line
        for line in job["doctor_full"]["findings"][0]["evidence"]
        if "from py-spy, live" in line
    ]
    assert len(stacks) == 2, job["doctor_full"]["findings"][0]["evidence"]  # what they do now
    text = job["doctor_full_text"]
    assert text.returncode == 1
    assert text.stdout.startswith(
        "ddpmon doctor: CANNOT WRITE - ranks cannot write their state files"
    )
    assert "root cause: ranks 0, 1 cannot write their state: no space left on device" in text.stdout
    assert "frozen" not in text.stdout and "HANG" not in text.stdout
    for rank in (0, 1):  # its old file's silence and wait are not facts of now
        assert re.search(
            rf"^{rank}\s+unknown\s+.*\(\d+ s old\)\s+\S+\s+\?\s+-$", text.stdout, re.M
        ), text.stdout


def test_every_failed_write_is_counted_and_logged_once(job: dict[str, Any]) -> None:
    metric = job["metric_full"]
    assert metric.get("state", 0) >= 2 and metric.get("history", 0) >= 2, metric
    for r in job["results"]:
        log = r.stderr
        for name in (f"rank-{r.rank}.json", f"rank-{r.rank}.history.sqlite"):
            starts = [
                ln
                for ln in log.splitlines()
                if "cannot write" in ln and ln.split("(")[0].endswith(name + " ")
            ]
            assert len(starts) == 1, (name, log[-4000:])  # two spells, the second within 5 minutes
            assert "(No space left on device); training goes on" in starts[0]
            assert sum(name + " works again" in ln for ln in log.splitlines()) == 1, log[-4000:]
    states = job["states"]
    for r in (0, 1):
        spells = states[r]["write_failures"]
        assert spells["history"]["errno"] == spells["state"]["errno"] == "ENOSPC"
        assert spells["state"]["total"] > spells["state"]["count"] >= 1  # two spells


def test_with_room_again_the_files_are_fresh_at_once_and_the_history_resumes(
    job: dict[str, Any],
) -> None:
    # not after the backoff's next try (8 s); a second or two on a loaded machine
    assert job["fresh_after_seconds"] < RETRY_MAX_SECONDS - 3.0, job["fresh_after_seconds"]
    assert job["doctor_room"]["verdict"] not in ("cannot_write", "hang", "dead_rank"), job[
        "doctor_room"
    ]
    for r in (0, 1):
        h = job["histories"][r]
        steps = h["steps"]["step"]
        missing = history.missing_steps(h["meta"])
        assert missing and missing[0][0] > job["written_before"][r], (
            missing
        )  # lost while full, past the ring
        assert any(f["kind"] == "write_failed" for f in h["findings"]), h["findings"]
        kept = set(steps)
        lost = {s for a, b in missing for s in range(a, b + 1)}
        assert not kept & lost
        first_lost, last_lost = missing[0]
        assert steps[: first_lost - 1] == list(range(1, first_lost))  # whole up to the fill
        assert (
            set(range(last_lost + 1, last_lost + RING - 2)) <= kept
        )  # the ring it kept (less the 2 held back)


def test_a_clean_end_on_a_full_disk_reads_as_one(job: dict[str, Any]) -> None:
    full = job["doctor_full_again"]
    assert full["verdict"] == "cannot_write" and full["findings"][0]["kind"] == "cannot_write", full
    for key in ("doctor_ended_full", "doctor_ended"):  # while still full, and after
        d = job[key]
        assert d["verdict"] in ("healthy", "straggler"), (key, d["findings"])
        assert "finished" in [f["kind"] for f in d["findings"]], (key, d["findings"])
        assert [r["status"] for r in d["ranks"]] == ["exited", "exited"]
    text = job["doctor_ended_text"].stdout
    assert "OOM" not in text and "vanished" not in text and "DEAD" not in text, text
    assert all(
        s["stage"] == "detached" for s in job["states"].values()
    )  # its last word got through
    assert [n for n in job["leftovers"] if n.startswith(".")] == [], job[
        "leftovers"
    ]  # reserves and temp files gone


def test_the_report_names_the_missing_steps_and_the_runs_duration(job: dict[str, Any]) -> None:
    s = job["report"]
    done = job["results"][0].result["steps"]
    assert s["steps"] == done
    for r in s["per_rank"]:
        h = job["histories"][r["rank"]]
        ranges = [list(x) for x in history.missing_steps(h["meta"])]
        tail = (
            [[h["last"][0] + 1, done]] if h["last"][0] < done else []
        )  # lost at the end, on a full disk
        assert r["missing_steps"] == ranges + tail, r["missing_steps"]
        assert r["status"]["status"] == "exited"
    assert s["missing_steps"] == [
        {"rank": r["rank"], "first": a, "last": b}
        for r in s["per_rank"]
        for a, b in r["missing_steps"]
    ]
    trained = max(r.result["last_step_unix"] for r in job["results"]) - min(
        r.result["first_step_unix"] for r in job["results"]
    )
    print(
        f"{done} steps in {trained:.1f} s (report: {s['duration_seconds']:.1f} s); "
        f"{job['steps_while_full']:.0f} steps while full; missing {s['missing_steps']}; "
        f"files fresh {job['fresh_after_seconds']:.2f} s after the space came back; "
        f"doctor at a file age of {job['file_age_at_doctor']:.1f} s: {job['doctor_full']['verdict']}"
    )
    assert abs(s["duration_seconds"] - trained) < 1.5, (s["duration_seconds"], trained)
