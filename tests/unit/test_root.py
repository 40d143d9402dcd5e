"""The state root: private per user, checked before writing, job names made safe. (Another
user reading a job, another live launch's file: tests/processes/test_root_other_processes.py.)"""

from __future__ import annotations

import logging
import os
import stat
import time
from pathlib import Path

import pytest

from ddpmon.state import files, root
from tests.support.roots import NOBODY, as_root


@pytest.mark.parametrize(
    "job,safe",
    [
        ("run-1", "run-1"),
        ("..", "_."),
        ("../../etc", "_._.._etc"),
        ("a/b", "a_b"),
        (".hidden", "_hidden"),
        ("", "_"),
    ],
)
def test_job_names_become_one_safe_directory_name(job: str, safe: str) -> None:
    assert root.sanitize_job(job) == safe
    assert os.path.dirname(root.job_dir(job)) == root.default_root()


def test_default_root_is_per_user_and_private(tmp_root: Path) -> None:
    state_dir = root.job_dir("j")
    assert root.claim(state_dir, 0, explicit=False) == state_dir
    base = Path(root.default_root())
    assert base == tmp_root / f"ddpmon-{os.geteuid()}"
    assert stat.S_IMODE(base.stat().st_mode) == 0o700
    assert stat.S_IMODE(Path(state_dir).stat().st_mode) == 0o700


@pytest.mark.parametrize(
    "mode,reason", [(0o777, "writable by every user"), (0o770, "writable by its group")]
)
def test_a_loose_default_root_is_refused_with_the_fix(
    tmp_root: Path, mode: int, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    base = Path(root.default_root())
    base.mkdir()
    base.chmod(mode)
    assert root.claim(root.job_dir("j"), 0, explicit=False) is None
    assert reason in caplog.text and str(base) in caplog.text and "chmod go-w" in caplog.text
    assert "training goes on" in caplog.text


@as_root
@pytest.mark.parametrize("planted", ["directory", "symlink"])
def test_a_root_planted_by_another_user_is_refused(
    tmp_root: Path, planted: str, caplog: pytest.LogCaptureFixture
) -> None:
    base = root.default_root()
    theirs = tmp_root / "theirs"
    # what another user leaves in the shared temp dir (made here as root, then handed over)
    if planted == "directory":
        os.mkdir(base)
        os.chmod(base, 0o777)
        os.chown(base, NOBODY, NOBODY)
        expected = f"owned by uid {NOBODY}"
    else:
        theirs.mkdir()
        os.chown(theirs, NOBODY, NOBODY)
        os.symlink(theirs, base)
        os.lchown(base, NOBODY, NOBODY)
        expected = "is a symbolic link"
    caplog.set_level(logging.WARNING, "ddpmon")
    assert root.claim(root.job_dir("j"), 0, explicit=False) is None
    assert expected in caplog.text and base in caplog.text and "DDPMON_STATE_DIR" in caplog.text
    assert not (theirs / "j").exists(), "nothing written through the planted symlink"


@as_root
def test_a_foreign_explicit_directory_is_refused_and_a_group_one_allowed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    os.chown(foreign, NOBODY, NOBODY)
    assert root.claim(str(foreign), 0, explicit=True) is None
    assert f"{foreign} is owned by uid {NOBODY}" in caplog.text
    shared = tmp_path / "nfs" / "job"  # a multi-node job's shared directory: group-writable is fine
    shared.mkdir(parents=True)
    shared.chmod(0o2770)
    assert root.claim(str(shared), 0, explicit=True) == str(shared)
    files.write_atomic(files.path_for(str(shared), 0), {"rank": 0})  # the group may read it
    assert stat.S_IMODE(os.stat(files.path_for(str(shared), 0)).st_mode) == 0o640


def test_state_files_are_private_in_a_private_directory(tmp_root: Path) -> None:
    state_dir = root.claim(root.job_dir("j"), 0, explicit=False)
    files.write_atomic(files.path_for(state_dir, 0), {"rank": 0})
    assert stat.S_IMODE(os.stat(files.path_for(state_dir, 0)).st_mode) == 0o600


def test_a_hung_file_system_does_not_stall_attach(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(root, "ATTACH_FS_SECONDS", 0.5)
    monkeypatch.setattr(root, "prepare", lambda *a, **k: time.sleep(30))
    started = time.monotonic()
    assert root.claim("/somewhere", 0, explicit=True) is None
    assert time.monotonic() - started < 5
    assert "did not answer within" in caplog.text


def test_directories_ddpmon_makes_are_private_however_they_were_given(
    tmp_root: Path, tmp_path: Path
) -> None:
    """``ddpmon run`` passes the default job directory as DDPMON_STATE_DIR: it is still a
    default one (its root checked too), and every directory ddpmon creates is 0700, the
    directories above an explicit one included, whatever the umask."""
    old = os.umask(0o022)
    try:
        given = root.job_dir("j")
        root.prepare(given, explicit=True)
        for path in (root.default_root(), given):
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o700, path
        explicit = tmp_path / "a" / "b" / "job"
        root.prepare(str(explicit), explicit=True)
        for path in (tmp_path / "a", tmp_path / "a" / "b", explicit):
            assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
        os.chmod(root.default_root(), 0o770)  # a default root is never group-writable, even given
        with pytest.raises(root.UnsafeStateDir, match="writable by its group"):
            root.prepare(given, explicit=True)
    finally:
        os.umask(old)
