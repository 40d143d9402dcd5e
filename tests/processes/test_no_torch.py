"""The command line works where torch cannot be imported, and attach says what is missing.

Each test runs ``python -m ddpmon ...`` in a subprocess whose every import of torch fails, as
on a node without torch; each attempt is also recorded, so code that catches the
ImportError and carries on (a subcommand quietly left out, say) is caught too. The same
paths run in a real torch-free virtualenv in tests/integration/test_torch_free.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from tests.fixtures import torch_free
from tests.support.commands import serving_port

ROOT = Path(__file__).resolve().parents[2]
ATTEMPTED = "ddpmon test: torch import attempted"

# Runs CODE (argv[1]) with the rest of argv, in an interpreter where importing torch fails.
NO_TORCH = f"""
import atexit, sys, traceback
assert "torch" not in sys.modules
attempts = []

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "torch":
            attempts.append("".join(traceback.format_stack(limit=15)))
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, NoTorch())
atexit.register(lambda: attempts and print({ATTEMPTED!r} + ":\\n" + attempts[0], file=sys.stderr))
code = sys.argv[1]
del sys.argv[1]
exec(compile(code, "<test>", "exec"))
"""
CLI = "import sys, runpy; sys.argv[0] = 'ddpmon'; runpy.run_module('ddpmon', run_name='__main__')"


def run(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", NO_TORCH, code, *args],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def no_torch(out: subprocess.CompletedProcess | str) -> None:
    stderr = out if isinstance(out, str) else out.stderr
    assert ATTEMPTED not in stderr, stderr


def test_the_guard_sees_an_import_of_torch() -> None:
    out = run("import torch")
    assert out.returncode == 1 and "No module named 'torch'" in out.stderr
    assert ATTEMPTED in out.stderr


def test_every_subcommand_is_there() -> None:
    """The CLI leaves out a subcommand whose module fails to import: all must be listed."""
    out = run(CLI, "--help")
    assert out.returncode == 0, out.stderr
    for name in ("doctor", "top", "daemon", "dashboards", "capture"):
        assert f"    {name} " in out.stdout, out.stdout
    no_torch(out)


def test_doctor_names_the_killed_rank(tmp_path: Path) -> None:
    state = torch_free.copy_state(tmp_path / "state")
    out = run(CLI, "doctor", "--json", str(state))
    no_torch(out)
    assert out.returncode == 1, out.stderr
    report = json.loads(out.stdout)
    assert report["verdict"] == "dead_rank" and report["suspect_ranks"] == [torch_free.KILLED_RANK]
    assert report["job"] == torch_free.JOB
    ranks = {r["rank"]: r for r in report["ranks"]}
    assert (
        ranks[0]["status"] == "crashed"
        and "Connection reset by peer" in ranks[0]["exit"]["exception"]
    )
    assert ranks[1]["status"] in ("dead", "silent")  # silent: recorded on another host


def test_capture_refuses_a_rank_that_is_not_alive(tmp_path: Path) -> None:
    state = torch_free.copy_state(tmp_path / "state")
    out = run(CLI, "capture", str(state), "--rank", "0", "--compare", str(torch_free.KILLED_RANK))
    no_torch(out)
    assert out.returncode == 2, out.stderr
    assert (
        "rank 0 is not alive: it crashed (RuntimeError: " in out.stderr
    )  # its exit record says so


def test_top_prints_every_rank(tmp_path: Path) -> None:
    state = torch_free.copy_state(tmp_path / "state")
    out = run(CLI, "top", "--once", "--json", str(state))
    no_torch(out)
    assert out.returncode == 0, out.stderr
    assert sorted(r["rank"] for r in json.loads(out.stdout)) == [0, 1]


def test_dashboards_export(tmp_path: Path) -> None:
    out = run(CLI, "dashboards", "export", str(tmp_path))
    no_torch(out)
    assert out.returncode == 0, out.stderr
    boards = sorted(tmp_path.glob("*.json"))
    assert boards and all(json.loads(p.read_text())["panels"] for p in boards)


def test_daemon_serves_the_recorded_ranks(tmp_path: Path) -> None:
    state = torch_free.copy_state(tmp_path / "state")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            NO_TORCH,
            CLI,
            "daemon",
            "--port",
            "0",
            "--bind",
            "127.0.0.1",
            "--state-dir",
            str(state),
            "--node-local",
            "--interval",
            "0.2",
        ],
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        port = serving_port(proc)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            metrics = r.read().decode()
        for rank in (0, 1):  # both processes are long gone
            assert f'ddpmon_rank_up{{job="killed",rank="{rank}"}} 0.0' in metrics, metrics
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
    assert proc.returncode == 0, err
    no_torch(err)


def test_attach_says_torch_is_needed_and_how_to_get_it() -> None:
    out = run(
        "import ddpmon\n"
        "try:\n"
        "    ddpmon.attach(object())\n"
        "except ddpmon.AttachError as exc:\n"
        "    print(exc)\n"
    )
    assert out.returncode == 0, out.stderr
    message = out.stdout
    assert "ddpmon.attach needs PyTorch" in message and "cannot import torch" in message
    assert "install ddpmon into the training environment that has torch" in message
    assert "pytorch.org" in message
    assert ATTEMPTED in out.stderr  # attach did try, and said so


def test_import_ddpmon_needs_no_torch() -> None:
    out = run(
        "import ddpmon, ddpmon.cli, ddpmon.doctor, ddpmon.daemon, ddpmon.dashboards; print(ddpmon.__version__)"
    )
    assert out.returncode == 0, out.stderr
    no_torch(out)
