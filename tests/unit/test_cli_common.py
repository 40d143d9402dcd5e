"""What the commands share: the default state directory (one root for the ranks, the daemon,
the doctor and top), -v/--verbose, and what a command that cannot load says."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

from ddpmon.cli import SUBCOMMANDS, build_parser, common
from ddpmon.cli.exits import EXIT_USAGE
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


def test_the_job_directory_written_last_is_chosen_and_named(
    tmp_root: Path, capsys: pytest.CaptureFixture
) -> None:
    assert common.default_state_dir("top") is None  # no root yet
    for i, job in enumerate(("old", "new")):
        (tmp_root / job).mkdir(parents=True)
        os.utime(tmp_root / job, (1000 + i, 1000 + i))
    (tmp_root / "stray-file").write_text("")
    assert common.default_state_dir("top") == str(tmp_root / "new")
    assert f"ddpmon top: reading {tmp_root / 'new'}" in capsys.readouterr().err


def test_report_without_a_directory_reads_the_latest_job(
    tmp_root: Path, capsys: pytest.CaptureFixture
) -> None:
    from ddpmon.cli import main
    from tools import synthetic

    synthetic.write_run(str(tmp_root / "latest"), 2, 20, job="latest")
    with pytest.raises(SystemExit) as done:
        main(["report", "--json"])
    assert done.value.code == 0 and json.loads(capsys.readouterr().out)["job"] == "latest"
    with pytest.raises(SystemExit) as done:  # --job: that job's default directory, not there
        main(["report", "--job", "elsewhere", "--json"])
    assert done.value.code == EXIT_USAGE and "elsewhere" in capsys.readouterr().err


def test_the_variable_wins(tmp_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_root / "job").mkdir(parents=True)
    monkeypatch.setenv("DDPMON_STATE_DIR", "/somewhere/else")
    assert common.default_state_dir("doctor") == "/somewhere/else"
    assert str(tmp_root) in common.no_state_dir("doctor")


# -v/--verbose: on ddpmon itself and on every subcommand, before or after the subcommand's own
# arguments
REQUIRED = {
    "compare": ["A", "B"],
    "dashboards": ["export"],
    "run": ["python", "train.py"],
    "capture": ["--rank", "0"],
    "set": ["hang_timeout=60"],
}


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
