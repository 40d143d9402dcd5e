"""``ddpmon run --debug-server`` refuses, before any rank starts, what cannot work: a bad port
or interval, and torch's debug server without the packages its frontend imports."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(tmp_path: Path, *flags: str, pythonpath: str = "") -> subprocess.CompletedProcess:
    """``ddpmon run FLAGS <this python> script.py``; the script leaves ``ran`` behind if it runs."""
    script = tmp_path / "script.py"
    script.write_text("open('ran', 'w').close()\n")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (pythonpath, str(ROOT)) if p),
        "DDPMON_STATE_DIR": str(tmp_path / "state"),
    }
    return subprocess.run(
        [sys.executable, "-m", "ddpmon", "run", *flags, sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_missing_package_stops_the_run_before_it_starts(tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed.debug", reason="this torch has no debug server")
    shadow = (
        tmp_path / "shadow" / "tabulate"
    )  # stands in front of the real one and fails as a missing one
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError(\"No module named 'tabulate'\")\n")
    out = run(tmp_path, "--debug-server", pythonpath=str(shadow.parent))
    assert out.returncode == 2, out.stderr
    assert (
        "--debug-server needs jinja2, aiohttp, tabulate in the ranks' Python; missing or broken here: "
        "tabulate (No module named 'tabulate')" in out.stderr
    ), out.stderr
    assert (
        "Fix: pip install 'ddpmon[debug-server]' (or pip install jinja2 aiohttp tabulate)"
        in out.stderr
    )
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize(
    "flags, says",
    [
        (("--debug-server=0",), "--debug-server=0: expected a port, 1 to 65535"),
        (
            ("--debug-server", "--debug-server-interval", "0"),
            "--debug-server-interval 0.0: expected seconds, more than 0",
        ),
    ],
)
def test_bad_values_are_refused(tmp_path: Path, flags: tuple[str, ...], says: str) -> None:
    out = run(tmp_path, *flags)
    assert out.returncode == 2 and f"ddpmon run: {says}" in out.stderr, out.stderr
    assert not (tmp_path / "ran").exists()
