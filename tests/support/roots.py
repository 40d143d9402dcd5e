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
