"""The CLI as a user runs it, ``python -m ddpmon ...`` in a process of its own: ``-v`` on
every command, and a command whose module cannot be imported shows its real error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ddpmon import __version__
from ddpmon.cli.exits import EXIT_FAILED, EXIT_USAGE

ROOT = Path(__file__).resolve().parents[2]


def _ddpmon(
    *args: str, env: dict[str, str] | None = None, before: str = ""
) -> subprocess.CompletedProcess:
    """``python -m ddpmon ARGS`` in a process of its own (``before``: Python run first)."""
    code = f"import runpy, sys\n{before}\nsys.argv = ['ddpmon', *{list(args)!r}]\nrunpy.run_module('ddpmon', run_name='__main__')"
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )


def test_verbose_after_the_command_logs(tmp_path: Path) -> None:
    for argv in (
        ["doctor", str(tmp_path), "-v"],
        ["-v", "doctor", str(tmp_path)],
        ["top", "--once", "--verbose"],
        ["run", "-v", "--port", "x", "train.py"],
    ):  # run's own `command` argument is not its name
        out = _ddpmon(*argv, env={"DDPMON_STATE_DIR": str(tmp_path)})
        assert "unrecognized arguments" not in out.stderr, argv
        assert f"INFO ddpmon {__version__}: {argv[argv[0] == '-v']}" in out.stderr, (
            argv,
            out.stderr,
        )
    quiet = _ddpmon("doctor", str(tmp_path))
    assert "INFO" not in quiet.stderr and quiet.returncode == EXIT_USAGE


# a subcommand whose module cannot be imported is never an "invalid choice": its real error shows
BREAK = """
class _Broken:
    def find_spec(self, name, path=None, target=None):
        if name == "ddpmon.advice":  # imported by the doctor's module, at its top
            raise {error}
sys.meta_path.insert(0, _Broken())
"""


def test_a_broken_command_shows_its_real_error() -> None:
    out = _ddpmon(
        "doctor",
        "-v",
        before=BREAK.format(error="ImportError('cannot import name KINDS (broken here)')"),
    )
    assert "invalid choice" not in out.stderr
    assert "cannot import name KINDS (broken here)" in out.stderr and "Traceback" in out.stderr
    assert out.returncode == EXIT_FAILED
    others = _ddpmon(
        "dashboards", "export", "--help", before=BREAK.format(error="SyntaxError('broken')")
    )
    assert others.returncode == 0 and "DIR" in others.stdout  # the other commands still work
    listed = _ddpmon("--help", before=BREAK.format(error="SyntaxError('broken')"))
    assert "doctor" in listed.stdout and "broken" in listed.stdout


def test_a_missing_extra_is_named_with_how_to_install_it() -> None:
    error = "ModuleNotFoundError(\"No module named 'grafana_client'\", name='grafana_client')"
    out = _ddpmon("doctor", before=BREAK.format(error=error))
    assert "invalid choice" not in out.stderr and "Traceback" not in out.stderr
    assert "grafana-client" in out.stderr and "pip install 'ddpmon[grafana]'" in out.stderr
    assert out.returncode == EXIT_USAGE
