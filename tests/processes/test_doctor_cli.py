"""``python -m ddpmon doctor`` as a user runs it, on crafted state files
(tests/support/states.py): each bad input, the exit codes and the JSON contract, the default
directory from the environment and --job, no torch import, and an unreachable daemon."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ddpmon.doctor import VERDICTS
from tests.support.commands import ROOT, run_doctor
from tests.support.states import hang_report, state, waiting_in, write


def test_missing_directory_exits_2_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir"
    out = run_doctor(str(missing))
    assert out.returncode == 2
    assert str(missing) in out.stderr and "no such directory" in out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""
    a_file = tmp_path / "file"
    a_file.write_text("x")
    out = run_doctor(str(a_file), "--json")
    assert out.returncode == 2 and "is not a directory" in out.stderr


def test_bad_usage_exits_2() -> None:
    out = run_doctor("/tmp", "--stall", "-3")
    assert out.returncode == 2 and "positive number of seconds" in out.stderr
    out = run_doctor("/tmp", "--no-such-option")
    assert out.returncode == 2


def test_empty_directory_is_no_data(tmp_path: Path) -> None:
    out = run_doctor(str(tmp_path), "--json")
    assert out.returncode == 2
    body = json.loads(out.stdout)
    assert body["verdict"] == "no_data" and body["suspect_ranks"] == [] and body["ranks"] == []
    assert body["findings"][0]["kind"] == "no_state_files"
    human = run_doctor(str(tmp_path))
    assert (
        human.returncode == 2
        and "NO DATA" in human.stdout
        and "ddpmon.attach(model)" in human.stdout
    )


@pytest.mark.bad_state_files
def test_corrupt_and_truncated_files_are_named(tmp_path: Path) -> None:
    write(tmp_path, state(0, world=4))
    write(tmp_path, state(1, world=4))
    good = json.dumps(state(2, world=4))
    (tmp_path / "rank-2.json").write_text(good[: len(good) // 2])  # truncated
    (tmp_path / "rank-3.json").write_text("\x00\x01 garbage")
    (tmp_path / "rank-4.json").write_text(json.dumps({"hello": "world"}))
    (tmp_path / "rank-5.json").write_text(json.dumps(dict(state(1, world=4), rank="five")))
    (tmp_path / "rank-6.json").write_text("")
    out = run_doctor(str(tmp_path), "--json")
    assert "Traceback" not in out.stderr
    body = json.loads(out.stdout)
    bad = {
        f["summary"].split(" ", 1)[0]: f["summary"]
        for f in body["findings"]
        if f["kind"] == "bad_state_file"
    }
    assert set(bad) == {str(tmp_path / f"rank-{r}.json") for r in (2, 3, 4, 5, 6)}
    assert "not valid JSON (truncated or corrupt" in bad[str(tmp_path / "rank-2.json")]
    assert "no 'rank' key" in bad[str(tmp_path / "rank-4.json")]
    assert "invalid rank 'five'" in bad[str(tmp_path / "rank-5.json")]
    assert "is empty" in bad[str(tmp_path / "rank-6.json")]
    assert [r["rank"] for r in body["ranks"]] == [0, 1]
    assert body["verdict"] == "healthy" and out.returncode == 0
    # ranks 2 and 3 have files, unreadable ones (named above): not "no state file"
    assert [f for f in body["findings"] if f["kind"] == "missing_ranks"] == []
    human = run_doctor(str(tmp_path))
    assert "rank-3.json is not valid JSON" in " ".join(human.stdout.split())


def test_json_contract_and_exit_code(tmp_path: Path) -> None:
    write(tmp_path, state(0, silent=30.0, hang=hang_report()))
    write(tmp_path, state(1, silent=30.0, in_flight=[waiting_in("all_reduce", 5, 30.0)]))
    out = run_doctor(str(tmp_path), "--json", "--no-stacks")
    assert out.returncode == 1, out.stderr
    body = json.loads(out.stdout)
    assert {"verdict", "suspect_ranks", "findings", "ranks"} <= set(body)
    assert body["verdict"] in VERDICTS
    for f in body["findings"]:
        assert set(f) == {"kind", "severity", "ranks", "summary", "evidence", "fix"}
        assert f["severity"] in ("error", "warning", "info")
    assert [r["rank"] for r in body["ranks"]] == [0, 1]
    assert body["ranks"][1]["waiting_in"]["op"] == "all_reduce"


def test_default_directory_from_the_environment(tmp_path: Path) -> None:
    write(tmp_path, state(0))
    write(tmp_path, state(1))
    out = run_doctor("--json", "--no-stacks", env={"DDPMON_STATE_DIR": str(tmp_path)})
    assert out.returncode == 0 and json.loads(out.stdout)["state_dir"] == str(tmp_path)


def test_never_imports_torch(tmp_path: Path) -> None:
    write(tmp_path, state(0, silent=30.0))
    write(tmp_path, state(1, silent=30.0, in_flight=[waiting_in("all_reduce", 5, 30.0)]))
    code = (
        "import sys\n"
        "from ddpmon.cli import main\n"
        "try:\n"
        f"    main(['doctor', {str(tmp_path)!r}, '--json'])\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 1, exc.code\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print('no torch')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        timeout=30,
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("no torch"), out.stderr


def test_from_an_unreachable_daemon_says_what_to_start(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run(
        [sys.executable, "-m", "ddpmon", "doctor", "--from", f"127.0.0.1:{port}", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    diagnosis = json.loads(done.stdout)
    assert diagnosis["verdict"] == "no_data"
    finding = next(f for f in diagnosis["findings"] if f["kind"] == "unreachable_daemon")
    assert f"127.0.0.1:{port}/state" in finding["summary"] and "--serve-state" in finding["fix"]


def test_job_picks_its_directory_and_leaves_other_jobs_out(tmp_path: Path) -> None:
    root = tmp_path / f"ddpmon-{os.geteuid()}"  # this user's default root
    write(root / "big", state(0, job="big"))
    write(root / "big", state(1, job="big"))
    write(root / "small", state(0, job="small"))
    write(root / "small", state(1, job="small"))
    out = run_doctor(
        "--job", "big", "--json", env={"TMPDIR": str(tmp_path), "DDPMON_STATE_DIR": ""}
    )
    assert out.returncode in (0, 1), out.stderr  # (the files age as the test runs)
    assert f'"state_dir": "{root / "big"}"' in out.stdout and '"small"' not in out.stdout
    out = run_doctor("--job", "nope", env={"TMPDIR": str(tmp_path), "DDPMON_STATE_DIR": ""})
    assert out.returncode == 2 and "nope" in out.stderr and "Traceback" not in out.stderr
