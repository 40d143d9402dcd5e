"""What the commands share: the default state directory (one root for the ranks, the daemon,
the doctor and top), -v/--verbose, and what a command that cannot load says."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ddpmon import __version__
from ddpmon.cli import EXIT_FAILED, EXIT_USAGE, SUBCOMMANDS, build_parser, common
from ddpmon.config import Config, default_state_root

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def tmp_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("DDPMON_STATE_DIR", raising=False)
    return tmp_path / f"ddpmon-{os.geteuid()}"


def test_every_reader_and_the_ranks_share_the_root(tmp_root: Path) -> None:
    assert default_state_root() == str(tmp_root)
    assert Config().resolved_state_dir("host:29500") == str(tmp_root / "host_29500")
    assert build_parser().parse_args(["daemon"]).state_dir == str(tmp_root.parent / "ddpmon-*")


def test_the_job_directory_written_last_is_chosen_and_named(tmp_root: Path, capsys: pytest.CaptureFixture) -> None:
    assert common.default_state_dir("top") is None  # no root yet
    for i, job in enumerate(("old", "new")):
        (tmp_root / job).mkdir(parents=True)
        os.utime(tmp_root / job, (1000 + i, 1000 + i))
    (tmp_root / "stray-file").write_text("")
    assert common.default_state_dir("top") == str(tmp_root / "new")
    assert f"ddpmon top: reading {tmp_root / 'new'}" in capsys.readouterr().err


def test_the_variable_wins(tmp_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_root / "job").mkdir(parents=True)
    monkeypatch.setenv("DDPMON_STATE_DIR", "/somewhere/else")
    assert common.default_state_dir("doctor") == "/somewhere/else"
    assert str(tmp_root) in common.no_state_dir("doctor")


# -v/--verbose: on ddpmon itself and on every subcommand, before or after the subcommand's own
# arguments
REQUIRED = {"compare": ["A", "B"], "dashboards": ["export"], "run": ["python", "train.py"]}


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_command_takes_verbose(command: str) -> None:
    parser = build_parser()
    rest = REQUIRED.get(command, [])
    assert parser.parse_args([command, *rest]).verbose is False
    assert parser.parse_args(["-v", command, *rest]).verbose is True
    for flag in ("-v", "--verbose"):
        assert parser.parse_args([command, flag, *rest]).verbose is True
    if command != "run":  # run's flags come before the command it runs
        assert parser.parse_args([command, *rest, "-v"]).verbose is True
    if command == "dashboards":
        assert parser.parse_args([command, "push", "--url", "http://g", "-v"]).verbose is True
    if command == "run":
        assert parser.parse_args([command, "-v", *rest]).command == rest


def _ddpmon(*args: str, env: dict[str, str] | None = None, before: str = "") -> subprocess.CompletedProcess:
    """``python -m ddpmon ARGS`` in a process of its own (``before``: Python run first)."""
    code = f"import runpy, sys\n{before}\nsys.argv = ['ddpmon', *{list(args)!r}]\nrunpy.run_module('ddpmon', run_name='__main__')"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def test_verbose_after_the_command_logs(tmp_path: Path) -> None:
    for argv in (["doctor", str(tmp_path), "-v"], ["-v", "doctor", str(tmp_path)], ["top", "--once", "--verbose"],
                 ["run", "-v", "--port", "x", "train.py"]):  # run's own `command` argument is not its name
        out = _ddpmon(*argv, env={"DDPMON_STATE_DIR": str(tmp_path)})
        assert "unrecognized arguments" not in out.stderr, argv
        assert f"INFO ddpmon {__version__}: {argv[argv[0] == '-v']}" in out.stderr, (argv, out.stderr)
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
    out = _ddpmon("doctor", "-v", before=BREAK.format(error="ImportError('cannot import name KINDS (broken here)')"))
    assert "invalid choice" not in out.stderr
    assert "cannot import name KINDS (broken here)" in out.stderr and "Traceback" in out.stderr
    assert out.returncode == EXIT_FAILED
    others = _ddpmon("dashboards", "export", "--help", before=BREAK.format(error="SyntaxError('broken')"))
    assert others.returncode == 0 and "DIR" in others.stdout  # the other commands still work
    listed = _ddpmon("--help", before=BREAK.format(error="SyntaxError('broken')"))
    assert "doctor" in listed.stdout and "broken" in listed.stdout


def test_a_missing_extra_is_named_with_how_to_install_it() -> None:
    error = "ModuleNotFoundError(\"No module named 'grafana_client'\", name='grafana_client')"
    out = _ddpmon("doctor", before=BREAK.format(error=error))
    assert "invalid choice" not in out.stderr and "Traceback" not in out.stderr
    assert "grafana-client" in out.stderr and "pip install 'ddpmon[grafana]'" in out.stderr
    assert out.returncode == EXIT_USAGE
