"""A rank whose files cannot be written (a full disk): each failed write of the state file or
the history is recorded (the state file's ``write_failures``, the metric, one log line a
spell), tried again with backoff, and the history resumes with the steps its ring still
holds, naming those it lost. (Real jobs on a tmpfs that fills up:
tests/distributed/test_full_disk.py.)"""

from __future__ import annotations

import errno
import os
import sqlite3
import time
from pathlib import Path

import pytest

from ddpmon.rank import writers
from ddpmon.rank.exporter import RankCollector
from ddpmon.rank.recorder import Recorder
from ddpmon.state import files, history, schema
from ddpmon.steps import StepRow

NO_SPACE = OSError(errno.ENOSPC, "No space left on device")


def lines(caplog: pytest.LogCaptureFixture, text: str) -> int:
    return sum(text in r.getMessage() for r in caplog.records)


def test_a_spell_of_failures_is_one_record_and_one_line_each_way(
    caplog: pytest.LogCaptureFixture,
) -> None:
    records: dict[str, schema.WriteFailure] = {}
    f = writers.WriteFailures("history", "/x/rank-0.history.sqlite", records, interval=0.01)
    for _ in range(3):
        f.failed(NO_SPACE)
    first = records["history"]
    assert (first.errno, first.error, first.count, first.total, first.ended_unix) == (
        "ENOSPC",
        "No space left on device",
        3,
        3,
        None,
    )
    assert f.failing and first.since_unix <= first.last_unix
    f.succeeded()
    assert records["history"].ended_unix is not None and not f.failing
    f.failed(NO_SPACE)  # a new spell: counted, the total goes on; not logged again so soon
    assert (records["history"].count, records["history"].total) == (1, 4)
    assert lines(caplog, "cannot write /x/rank-0.history.sqlite (No space left on device)") == 1
    assert lines(caplog, "works again, after 3 failed tries") == 1


def test_retries_back_off_and_resume_at_once_when_the_disk_has_room(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    f = writers.WriteFailures("state", "/x/rank-0.json", {}, interval=0.2)
    assert f.due()
    full = {"now": True}
    monkeypatch.setattr(files, "full", lambda directory: full["now"])
    f.failed(NO_SPACE)
    assert not f.due()  # the disk is full: wait out the interval
    time.sleep(0.25)
    assert f.due()
    f.failed(NO_SPACE)
    f.failed(NO_SPACE)  # doubled: 0.8 s now
    time.sleep(0.3)
    assert not f.due()
    full["now"] = False  # space came back: try at once
    assert f.due()
    f.failed(OSError(errno.EIO, "Input/output error"))  # not a question of space: the backoff holds
    assert not f.due()


def test_failures_are_described_in_the_systems_words() -> None:
    assert writers.describe(NO_SPACE) == ("No space left on device", "ENOSPC")
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE t (x BLOB)")
    db.execute(f"PRAGMA max_page_count = {db.execute('PRAGMA page_count').fetchone()[0]}")
    with pytest.raises(sqlite3.OperationalError) as full:
        db.execute("INSERT INTO t VALUES (randomblob(100000))")
    assert writers.describe(full.value) == ("No space left on device", "ENOSPC")
    assert writers.describe(ValueError("odd")) == ("ValueError: odd", None)


def test_the_state_file_records_the_spell_once_a_write_gets_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    rec = Recorder(schema.Identity(rank=0, job="j"), world_size=1)
    real = files.write_atomic
    tries = {"n": 0}

    def write_atomic(path: str, data: dict) -> None:
        tries["n"] += 1
        if tries["n"] <= 3:
            raise NO_SPACE
        real(path, data)

    monkeypatch.setattr(files, "write_atomic", write_atomic)
    w = writers.StateWriter(
        str(tmp_path / "rank-0.json"), rec.snapshot, interval=0.05, failures=rec.write_failures
    )
    w.start()
    deadline = time.monotonic() + 10
    while not (tmp_path / "rank-0.json").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    w.stop()
    state = files.read(str(tmp_path / "rank-0.json"))
    spell = state.write_failures["state"]
    assert (spell.count, spell.errno) == (3, "ENOSPC")
    assert spell.ended_unix is not None, "a file that was written says its writes work"
    assert lines(caplog, "cannot write") == 1 and lines(caplog, "works again") == 1
    # the metric counts every failed try, by file
    families = {f.name: f for f in RankCollector(rec).collect()}
    samples = families["ddpmon_state_write_failures"].samples  # (prometheus_client drops _total)
    assert [(s.labels["file"], s.value) for s in samples if s.name.endswith("_total")] == [
        ("state", 3.0)
    ]


def test_the_last_word_on_a_full_disk_goes_into_the_reserve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A clean end on a full disk: the exit record is written into the space set aside while
    there was room, so the rank does not read as killed; the reserve is gone afterwards."""
    rec = Recorder(schema.Identity(rank=0, job="j"), world_size=1)
    path = tmp_path / "rank-0.json"
    w = writers.StateWriter(str(path), rec.snapshot, interval=60, failures=rec.write_failures)
    assert w.write_now()
    reserve = tmp_path / ".rank-0.reserve"
    assert (
        reserve.stat().st_size == writers.RESERVE_BYTES
        and oct(reserve.stat().st_mode & 0o777) == "0o600"
    )

    def full(path: str, data: object) -> None:
        raise NO_SPACE

    monkeypatch.setattr(files, "write_atomic", full)
    rec.stage, rec.steps = "detached", 7
    rec.set_exit(schema.Exit(unix=time.time(), how="end", code=0))
    assert not w.write_now(), "a periodic write that fails is not a last word"
    w.stop()
    state = files.read(str(path))
    assert (state.stage, state.step, state.exit.how) == ("detached", 7, "end")
    spell = state.write_failures["state"]
    assert (spell.count, spell.ended_unix, spell.errno) == (2, None, "ENOSPC")  # it goes on
    assert not reserve.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["rank-0.json"]


class Ring:
    """A rank's bounded ring of recent steps (the recorder's ``history_since``)."""

    def __init__(self, keep: int) -> None:
        self.keep, self.last = keep, 0

    def run(self, steps: int) -> None:
        self.last += steps

    def since(self, step: int) -> list[StepRow]:
        first = max(step, self.last - self.keep) + 1
        buckets = [(i, 0.001, 1 << 20) for i in range(40)]  # about 1 KB a row: a few fill a page
        return [
            StepRow(s, 1000.0 + s, 1000.5 + s, 0.5, buckets=buckets)
            for s in range(first, self.last + 1)
        ]


def test_the_history_resumes_with_what_its_ring_kept_and_names_the_steps_it_lost(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A full disk (SQLite's page limit stands in for it: the same SQLITE_FULL) holds the
    history back; the steps the ring still has are written when there is room, and the
    ones it dropped are recorded as missing."""
    ring, records = Ring(keep=10), {}
    path = history.path_for(str(tmp_path), 0)
    w = writers.HistoryWriter(
        path,
        ring.since,
        lambda: {"step": ring.last},
        lambda: {"rank": 0},
        interval=0.01,
        hold_back=0,
        failures=records,
    )
    ring.run(5)
    w.flush(final=False)
    assert history.read(path)["steps"]["step"] == [1, 2, 3, 4, 5]
    db = w._store._db
    db.execute(f"PRAGMA max_page_count = {db.execute('PRAGMA page_count').fetchone()[0]}")
    ring.run(4)
    w.flush(final=False)
    assert records["history"].errno == "ENOSPC" and records["history"].ended_unix is None
    ring.run(4)  # steps 6-9 are still in the ring: nothing lost yet
    time.sleep(0.02)
    w.flush(final=False)
    db.execute("PRAGMA max_page_count = 1000000")
    time.sleep(0.05)
    w.flush(final=False)
    assert history.read(path)["steps"]["step"] == list(range(1, 14))
    assert history.missing_steps(history.read(path)["meta"]) == []
    db.execute(f"PRAGMA max_page_count = {db.execute('PRAGMA page_count').fetchone()[0]}")
    ring.run(25)  # 14-38 while full: the ring keeps 29-38
    w.flush(final=False)
    db.execute("PRAGMA max_page_count = 1000000")
    time.sleep(0.05)
    w.flush(final=False)
    ring.run(2)
    w.stop()
    h = history.read(path)
    assert h["steps"]["step"] == list(range(1, 14)) + list(range(29, 41))
    assert history.missing_steps(h["meta"]) == [(14, 28)]
    assert h["exit"]["how"] == "detached"
    assert (
        records["history"].count == 1
        and records["history"].total == 3
        and records["history"].ended_unix
    )
    assert lines(caplog, "lacks steps 14-28") == 1


def test_a_history_that_cannot_be_created_is_tried_again_and_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "blocker").write_text("a file where the directory should be")
    calls: list[int] = []
    ring, records = Ring(keep=10), {}
    w = writers.HistoryWriter(
        str(tmp_path / "blocker" / "rank-0.history.sqlite"),
        lambda s: calls.append(s) or ring.since(s),
        dict,
        lambda: {"rank": 0},
        interval=0.02,
        failures=records,
    )
    w.start()
    time.sleep(0.3)
    w.stop()
    assert w.failures.failing and records["history"].count >= 3
    assert lines(caplog, "cannot write") == 1
    assert calls == []  # never got as far as draining: the store could not open


def test_a_history_that_fails_as_it_is_made_leaves_no_file_open(tmp_path: Path) -> None:
    """The writer makes its store again and again while the disk is full: each failed try
    closes what it opened (20 tries an hour would otherwise run the process out of files)."""
    path = history.path_for(str(tmp_path), 0)
    unwritable = {
        "rank": 0,
        (1, 2): "a key JSON cannot write",
    }  # fails where SQLITE_FULL would: its first insert
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        with pytest.raises(TypeError):
            history.HistoryStore(path, unwritable)
    assert len(os.listdir("/proc/self/fd")) <= before


def test_a_spell_that_ended_becomes_a_finding_of_the_history() -> None:
    snap = {
        "write_failures": {
            "state": {
                "error": "No space left on device",
                "since_unix": 10.0,
                "last_unix": 40.0,
                "count": 30,
                "ended_unix": 41.0,
            },
            "history": {
                "error": "No space left on device",
                "since_unix": 10.0,
                "last_unix": 40.0,
                "count": 5,
                "ended_unix": None,
            },
        }
    }
    assert list(writers.events(snap)) == [
        (
            "write_failed",
            "write:state:10.0",
            "the state file could not be written for 31 s (30 failed tries): No space left on device",
        )
    ]
