"""The per-step history store: schema, WAL batches, bounds. (A writer killed mid-run:
tests/processes/test_exits.py; writes that fail: test_write_failures.py.)"""

from __future__ import annotations

import os
import sqlite3
import stat
import time
from pathlib import Path

import pytest

from ddpmon.rank import writers
from ddpmon.rank.recorder import BucketTiming, Recorder, StepTimings
from ddpmon.state import history
from ddpmon.state.schema import Identity
from tests.support.roots import as_root, plant_link


def steps(first: int, last: int, buckets: int = 4) -> list[dict]:
    return [
        {
            "step": s,
            "start_unix": 1000.0 + s,
            "end_unix": 1000.5 + s,
            "step_seconds": 0.5,
            "forward_seconds": 0.1,
            "backward_seconds": 0.2,
            "exposed_comm_seconds": 0.05 if s % 2 else None,
            "buckets": [
                {"index": i, "seconds": 0.01 * (i + 1), "bytes": 1 << 20} for i in range(buckets)
            ],
        }
        for s in range(first, last + 1)
    ]


def test_an_older_ddpmon_still_reads_the_file(tmp_path):
    """Histories keep a ``straggler_score`` column that nothing writes (who is slow needs
    every rank: readers compute it), because an older ddpmon's reader selects it."""
    path = history.path_for(str(tmp_path), 0)
    store = history.HistoryStore(path, {"rank": 0, "job": "j"})
    store.add_steps(steps(1, 3))
    store.close()
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT step, straggler_score FROM steps").fetchall() == [
            (1, None),
            (2, None),
            (3, None),
        ]
    assert "straggler_score" not in history.read(path)["steps"]


def test_round_trip_keeps_every_column_and_the_identity(tmp_path):
    path = history.path_for(str(tmp_path), 3)
    store = history.HistoryStore(path, {"rank": 3, "job": "j", "world_size": 4})
    store.add_steps(
        steps(1, 10), {"process_resident_memory_bytes": 123, "gpu_utilization_ratio": 0.5}
    )
    store.add_finding("note", "note:x", "x: something", 7)
    store.set_exit("exited", 10, {"unix": 5.0, "exception": None})
    store.close()
    h = history.read(path)
    assert h["rank"] == 3 and h["identity"]["job"] == "j" and h["rows"] == 10
    cols = h["steps"]
    assert cols["step"] == list(range(1, 11))
    assert cols["exposed_comm_seconds"][:2] == [0.05, None]
    assert cols["data_wait_seconds"] == [None] * 10 and "straggler_score" not in cols
    assert cols["buckets"][0] == [
        [0, 0.01, 1 << 20],
        [1, 0.02, 1 << 20],
        [2, 0.03, 1 << 20],
        [3, 0.04, 1 << 20],
    ]
    assert (
        cols["process_resident_memory_bytes"] == [123] * 10
        and cols["gpu_utilization_ratio"] == [0.5] * 10
    )
    assert h["findings"][0]["text"] == "x: something" and h["findings"][0]["step"] == 7
    assert h["exit"]["how"] == "exited" and h["exit"]["step"] == 10
    assert h["meta"]["schema_version"] == str(history.SCHEMA_VERSION)
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_bounded_older_half_thinned_recent_steps_whole(tmp_path):
    path = str(tmp_path / "rank-0.history.sqlite")
    store = history.HistoryStore(path, {"rank": 0}, max_rows=100)
    for first in range(1, 1001, 50):
        store.add_steps(steps(first, first + 49, buckets=0))
    store.close()
    h = history.read(path)
    kept = h["steps"]["step"]
    assert len(kept) <= 100
    assert kept[-40:] == list(range(961, 1001))  # the newest steps are all there
    assert kept[0] == 1  # the oldest step survives, sparser around it
    assert int(h["meta"]["thinned_through_step"]) > 1


def test_bytes_per_step_stays_small(tmp_path):
    path = str(tmp_path / "rank-0.history.sqlite")
    store = history.HistoryStore(path, {"rank": 0})
    for first in range(1, 5001, 500):
        store.add_steps(
            steps(first, first + 499, buckets=4), {"process_resident_memory_bytes": 1 << 30}
        )
    store.close()
    per_step = history.bytes_per_step(path)
    assert per_step is not None and 60 < per_step < 400, (
        per_step
    )  # docs/report.md: about 210 with 4 buckets


def test_binned_reads_align_on_step_numbers(tmp_path):
    path = str(tmp_path / "rank-0.history.sqlite")
    store = history.HistoryStore(path, {"rank": 0})
    store.add_steps(steps(1, 25))
    store.close()
    b = history.read_binned(path, 10)
    assert b["bin"] == [0, 1, 2] and b["steps"] == [10, 10, 5]
    assert b["step_seconds"] == [0.5, 0.5, 0.5] and b["exposed_comm_seconds"] == pytest.approx(
        [0.05] * 3
    )
    assert history.max_step(path) == 25


def test_schema_of_another_version_is_refused_with_the_fix(tmp_path):
    path = str(tmp_path / "rank-0.history.sqlite")
    history.HistoryStore(path, {"rank": 0}).close()
    with sqlite3.connect(path) as db:
        db.execute("UPDATE meta SET value='99' WHERE key='schema_version'")
    with pytest.raises(history.HistoryError, match="schema 99"):
        history.read(path)
    history.HistoryStore(path, {"rank": 0}).close()  # a new run starts a new file, of this version
    assert history.read(path)["meta"]["schema_version"] == str(history.SCHEMA_VERSION)


def test_a_file_that_is_not_a_database_is_named(tmp_path):
    path = tmp_path / "rank-0.history.sqlite"
    path.write_text("not sqlite")
    with pytest.raises(history.HistoryError, match="rank-0.history.sqlite"):
        history.read(str(path))


def test_recorder_history_since_has_phases_exposed_and_buckets():
    rec = Recorder(Identity(rank=0), world_size=2)
    rec.set_bucket_layout(0, 4096, "float32", ["w"])
    t = time.perf_counter()
    rec.forward_started(t)
    rec.forward_finished(t + 0.01)
    rec.backward_started(t + 0.01)
    rec.backward_done(t + 0.03)
    rec.close_step(t + 0.05)
    rec.add_step_timings(
        StepTimings([BucketTiming(0, 0.03, 1.0, 1.004)], exposed=0.015, measured=True)
    )
    rec.forward_started(t + 0.05)
    rec.close_step(t + 0.07)
    got = rec.history_since(0)
    assert [r.step for r in got] == [1, 2]
    first = got[0]
    assert first.step_seconds == pytest.approx(0.05) and first.forward_seconds == pytest.approx(
        0.01
    )
    assert first.backward_seconds == pytest.approx(
        0.02
    ) and first.exposed_comm_seconds == pytest.approx(0.015)
    assert first.buckets == [(0, pytest.approx(0.004), 4096)]
    assert first.history()["buckets"] == [
        {"index": 0, "seconds": pytest.approx(0.004), "bytes": 4096}
    ]
    assert first.end_unix - first.start_unix == pytest.approx(0.05)
    assert (
        got[1].exposed_comm_seconds is None
        and got[1].buckets is None
        and "buckets" not in got[1].history()
    )
    assert [r.step for r in rec.history_since(1)] == [2]


def test_events_from_a_state_body_name_notes_errors_and_hangs():
    snap = {
        "notes": {"find_unused_parameters": "needless"},
        "errors": {"comm_hook": "boom"},
        "hang": {
            "detected_unix": 5.0,
            "silent_seconds": 61.0,
            "step": 7,
            "stage": "allreduce",
            "in_flight": [{"op": "all_reduce", "seq": 12}],
        },
    }
    got = list(writers.events(snap))
    assert [k for k, _, _ in got] == ["note", "ddpmon_part_off", "hang"]
    assert (
        got[2][2]
        == "hang suspected: no progress for 61.0 s at step 7, stage allreduce, waiting in all_reduce #12"
    )
    assert list(writers.events({"notes": {}, "hang": None})) == []


def test_history_option_and_its_variable():
    from ddpmon.config import Config
    from ddpmon.errors import ConfigError

    assert Config.from_env({}).history is True
    assert Config.from_env({"DDPMON_HISTORY": "0"}).history is False
    assert Config.from_env({"DDPMON_HISTORY": "0"}, history=True).history is True
    with pytest.raises(ConfigError, match="history"):
        Config.from_env({}, history="sometimes")


def test_rank_0_waits_for_the_other_ranks_last_files_bounded(tmp_path):
    """Before it sums up the run, rank 0 waits for the files in its directory to say their
    rank ended; a rank that never does costs at most the bound."""
    import threading

    from ddpmon.state import files, schema

    def write(rank, stage):
        rec = Recorder(Identity(rank=rank, world_size=2), world_size=2)
        rec.stage = stage
        files.write_atomic(
            files.path_for(str(tmp_path), rank), dict(rec.snapshot(), format=schema.FORMAT)
        )

    write(0, "detached")
    write(1, "forward")
    started = time.monotonic()
    writers._wait_for_peers(str(tmp_path), timeout=0.5)
    assert 0.5 <= time.monotonic() - started < 1.5  # rank 1 never ended: the bound
    threading.Timer(0.2, write, (1, "detached")).start()
    started = time.monotonic()
    writers._wait_for_peers(str(tmp_path), timeout=5.0)
    assert time.monotonic() - started < 2.0  # its last file came


@as_root
def test_links_planted_by_a_group_member_are_never_followed(tmp_path, team_dir):
    """A team's state directory (group-writable, setgid): links owned by a member, at the
    history's name and its -wal and -shm, to files elsewhere that exist and that do not.
    The rank (root here) removes them and writes its own files; nothing outside changes."""
    shared = team_dir
    outside = tmp_path / "outside"
    outside.mkdir()
    kept = outside / "kept"
    kept.write_bytes(b"root only\n")
    kept.chmod(0o600)
    empty = outside / "empty"
    empty.touch(0o600)
    path = str(shared / "rank-0.history.sqlite")
    for suffix, target in (("", empty), ("-wal", kept), ("-shm", outside / "made-shm")):
        plant_link(Path(path + suffix), target)
    store = history.HistoryStore(path, {"rank": 0})
    store.add_steps(steps(1, 3))
    for suffix in ("", "-wal", "-shm"):
        info = os.lstat(path + suffix)
        assert (
            stat.S_ISREG(info.st_mode) and info.st_uid == 0 and stat.S_IMODE(info.st_mode) == 0o640
        )
    store.close()
    assert sorted(os.listdir(outside)) == ["empty", "kept"] and kept.read_bytes() == b"root only\n"
    assert empty.stat().st_size == 0
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    assert history.read(path)["rows"] == 3
