"""``python -m ddpmon.launch`` exits as ``python`` does (the codes in ``cli/exits.py``), so a
launcher reads the training script's status unchanged, and a script that runs never loads
the command line's modules."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ddpmon.cli import exits

ROOT = Path(__file__).resolve().parents[2]

SCRIPTS = {
    "raises": ("raise ValueError('x')", exits.EXIT_SCRIPT_FAILED),
    "interrupted": ("raise KeyboardInterrupt", exits.EXIT_INTERRUPTED),
    "exits_5": ("import sys; sys.exit(5)", 5),
    "runs": ("import sys; sys.exit(int('ddpmon.cli' in sys.modules))", exits.EXIT_OK),
}


def _run(*argv: str) -> int:
    """The status as a shell reports it (a death by signal N: 128 + N; python dies of SIGINT
    on an uncaught KeyboardInterrupt)."""
    code = subprocess.run(
        [sys.executable, *argv], cwd=ROOT, capture_output=True, timeout=120
    ).returncode
    return 128 - code if code < 0 else code


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_scripts_status_is_pythons(name: str, tmp_path: Path) -> None:
    source, code = SCRIPTS[name]
    script = tmp_path / f"{name}.py"
    script.write_text(source + "\n")
    assert _run(str(script)) == code  # python's own
    assert _run("-m", "ddpmon.launch", str(script)) == code


def test_bad_usage_and_missing_scripts_are_pythons_too(tmp_path: Path) -> None:
    assert _run("-m", "ddpmon.launch") == exits.EXIT_USAGE
    missing = str(tmp_path / "missing.py")
    assert _run(missing) == _run("-m", "ddpmon.launch", missing) == exits.EXIT_USAGE
    assert _run("-m", "no_such_module_here") == exits.EXIT_SCRIPT_FAILED
    assert _run("-m", "ddpmon.launch", "-m", "no_such_module_here") == exits.EXIT_SCRIPT_FAILED
