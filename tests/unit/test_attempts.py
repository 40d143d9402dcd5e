"""Every attempt of a restarted job kept apart (state/attempts.py): a rank moves only its own
files of an earlier attempt into attempt-<N>/ and keeps the last KEEP attempts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ddpmon.state import attempts, files, schema
from tests.support.roots import NOBODY, as_root, plant_link


def write_rank(
    directory: Path, rank: int, job: str = "j", attempt: int | None = 0, pid: int = 1
) -> None:
    data = {"rank": rank, "job": job, "attempt": attempt, "pid": pid, "format": schema.FORMAT}
    files.write_atomic(str(directory / f"rank-{rank}.json"), data)
    (directory / f"rank-{rank}.history.sqlite").write_text("h")
    (directory / f"rank-{rank}.fault").write_text("")


def test_attempt_comes_from_torchelastic() -> None:
    assert attempts.attempt_of({"TORCHELASTIC_RESTART_COUNT": "2"}) == 2
    assert attempts.attempt_of({}) is None
    assert attempts.attempt_of({"TORCHELASTIC_RESTART_COUNT": "x"}) is None


def test_a_rank_moves_only_its_own_files_of_an_earlier_attempt(tmp_path: Path) -> None:
    write_rank(tmp_path, 0)
    write_rank(tmp_path, 1)
    assert attempts.keep_earlier(str(tmp_path), 1, "j", 1) == 0
    moved = sorted(p.name for p in (tmp_path / "attempt-0").iterdir())
    assert moved == ["rank-1.fault", "rank-1.history.sqlite", "rank-1.json"]
    assert (tmp_path / "rank-0.json").exists() and not (tmp_path / "rank-1.json").exists()
    assert json.loads((tmp_path / "attempt-0" / "rank-1.json").read_text())["attempt"] == 0
    assert attempts.earlier(str(tmp_path)) == [(0, str(tmp_path / "attempt-0"))]


def test_nothing_moves_without_an_earlier_attempt_of_this_job(tmp_path: Path) -> None:
    write_rank(tmp_path, 0, job="other")
    assert attempts.keep_earlier(str(tmp_path), 0, "j", 1) is None  # another job's file
    write_rank(tmp_path, 0, attempt=1)
    assert attempts.keep_earlier(str(tmp_path), 0, "j", 1) is None  # this attempt's own
    assert attempts.keep_earlier(str(tmp_path), 0, "j", 0) is None  # a first attempt overwrites
    assert attempts.keep_earlier(str(tmp_path), 0, "j", None) is None  # no launcher that restarts
    write_rank(tmp_path, 0, pid=os.getpid(), attempt=0)
    assert attempts.keep_earlier(str(tmp_path), 0, "j", 1) is None  # attached again in this process
    assert attempts.keep_earlier(str(tmp_path), 5, "j", 1) is None  # no file at all
    assert not list(tmp_path.glob("attempt-*"))


def test_a_file_without_attempt_counts_as_the_first(tmp_path: Path) -> None:
    write_rank(tmp_path, 0, attempt=None)
    assert attempts.keep_earlier(str(tmp_path), 0, "j", 1) == 0
    assert (tmp_path / "attempt-0" / "rank-0.json").exists()


def test_only_the_last_attempts_are_kept(tmp_path: Path) -> None:
    for attempt in range(5):
        write_rank(tmp_path, 0, attempt=attempt)
        write_rank(tmp_path, 1, attempt=attempt)
        attempts.keep_earlier(str(tmp_path), 0, "j", attempt + 1, keep=3)
    # rank 0 pruned its own files; attempt-0 and -1 still hold nothing of rank 1 (never moved)
    assert [n for n, _ in attempts.earlier(str(tmp_path))] == [2, 3, 4]
    attempts.keep_earlier(str(tmp_path), 1, "j", 5, keep=3)
    assert (tmp_path / "attempt-4" / "rank-1.json").exists()
    assert [n for n, _ in attempts.earlier(str(tmp_path))] == [2, 3, 4]


def test_a_directory_another_rank_still_uses_stays(tmp_path: Path) -> None:
    old = tmp_path / "attempt-0"
    old.mkdir()
    write_rank(old, 1)
    for attempt in (1, 2):
        write_rank(tmp_path, 0, attempt=attempt)
        attempts.keep_earlier(str(tmp_path), 0, "j", attempt + 1, keep=1)
    assert (old / "rank-1.json").exists()  # rank 1's files are rank 1's to drop
    assert attempts.is_attempt_dir(str(old)) and not attempts.is_attempt_dir("model-1")


@as_root
def test_a_planted_attempt_directory_gets_none_of_the_ranks_files(
    tmp_path: Path, team_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A team's state directory (group-writable): a member plants ``attempt-0`` as a link to a
    directory of its own, or as its own directory. The rank's files stay where they are."""
    shared = team_dir
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    write_rank(shared, 1)
    plant_link(shared / "attempt-0", theirs)
    assert attempts.keep_earlier(str(shared), 1, "j", 1) is None
    assert list(theirs.iterdir()) == [] and (shared / "rank-1.json").exists()
    assert (
        "the files of attempt 0 stay where they are" in caplog.text
        and "symbolic link" in caplog.text
    )
    (shared / "attempt-0").unlink()
    (shared / "attempt-0").mkdir()
    os.chown(shared / "attempt-0", NOBODY, NOBODY)
    assert attempts.keep_earlier(str(shared), 1, "j", 1) is None
    assert list((shared / "attempt-0").iterdir()) == [] and "owned by uid 65534" in caplog.text
