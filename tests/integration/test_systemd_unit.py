"""systemd-analyze verifies the shipped unit (deploy/systemd/ddpmon-daemon.service)."""

from __future__ import annotations

import configparser
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "deploy/systemd/ddpmon-daemon.service"


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed"
)
def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment]
    parser.read_string(UNIT.read_text())
    binary = shlex.split(parser["Service"]["ExecStart"])[0]
    checked = tmp_path / "ddpmon-daemon.service"  # the real binary may not be installed here
    checked.write_text(UNIT.read_text().replace(binary, shutil.which("true") or "/bin/true", 1))
    r = subprocess.run(
        ["systemd-analyze", "verify", str(checked)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr
