"""A private stand-in for the system temp directory, and another user, for the state root's
tests (in-process and with processes)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="simulating another user needs root")


@pytest.fixture
def tmp_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private stand-in for the system temp dir: sticky and world-writable like /tmp."""
    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    return shared


@pytest.fixture
def team_dir(tmp_path: Path) -> Path:
    """A team's state directory: group-writable and setgid (``chmod 2770``), its group user
    nobody's, so that nobody can plant files and links in it (needs root)."""
    shared = tmp_path / "team"
    shared.mkdir()
    os.chown(shared, 0, NOBODY)
    shared.chmod(0o2770)
    return shared


def plant_link(at: Path, target: Path) -> None:
    """A symbolic link at ``at`` to ``target``, owned by user nobody, as nobody makes it."""
    os.symlink(target, at)
    os.lchown(at, NOBODY, NOBODY)
