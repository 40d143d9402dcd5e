"""``ddpmon set --from`` on a real 2-rank gloo job (tests/distributed/capture_worker.py)
through a real node daemon (``--serve-state --allow-requests``, basic auth from a web config):
the hang timeout changed live on every rank and each rank's answer read back at /state; a
wrong password refused (401), a daemon without credentials or without --allow-requests
refused (403), nothing written either way; without TLS a request from another address than
loopback refused (403), with TLS taken; a state directory any user may write refused by the
daemon, and a request that another user (nobody) wrote there refused by the rank.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddpmon.state import settings
from tests.support import harness
from tests.support.commands import start_daemon, terminate
from tests.support.live_settings import request, training, wait_until, watchdog_timeout
from tests.support.roots import NOBODY
from tests.support.tls import bcrypt_hash, make_pki

pytestmark = pytest.mark.timeout(120)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def job() -> Iterator[Path]:
    """The job in a directory user nobody can reach (for the forged request), its state
    directory root's, 0700 as the rank makes it."""
    workdir = Path(tempfile.mkdtemp(prefix="ddpmon-set-daemons-"))
    workdir.chmod(0o755)
    try:
        with training(workdir, timeout=40):
            yield workdir
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("configs")
    return {
        "web": write(d / "web.yml", f"basic_auth_users:\n  ops: '{bcrypt_hash('s3cret')}'\n"),
        "client": write(d / "client.yml", "basic_auth:\n  username: ops\n  password: s3cret\n"),
        "wrong": write(d / "wrong.yml", "basic_auth:\n  username: ops\n  password: guess\n"),
    }


def daemon(job: Path, *args: str) -> tuple[subprocess.Popen, int]:
    return start_daemon("--state-dir", str(job / "state"), "--serve-state", "--no-gpu", *args)


def run_set(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ddpmon", "set", "--timeout", "15", *args],
        cwd=harness.ROOT,
        env=dict(os.environ, PYTHONPATH=str(harness.ROOT)),
        capture_output=True,
        text=True,
        timeout=40,
    )


def requests_in(job: Path) -> list[str]:
    """Request files (and their temporary names) in the state directory."""
    return sorted(
        p.name
        for p in (job / "state").iterdir()
        if p.name.endswith(".request") or p.name.startswith(".set-")
    )


def answers(job: Path) -> dict[int, object]:
    return {r: s.get("settings_answer") for r, s in harness.states(job).items()}


@pytest.fixture(scope="module")
def guarded(job: Path, configs: dict[str, Path]) -> Iterator[int]:
    proc, port = daemon(job, "--allow-requests", "--web-config-file", str(configs["web"]))
    try:
        yield port
    finally:
        terminate(proc)


def test_every_rank_applies_and_confirms(job: Path, configs: dict[str, Path], guarded: int) -> None:
    address = f"127.0.0.1:{guarded}"
    done = run_set("--from", address, "--http-config", str(configs["client"]), "hang_timeout=7.5")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = sorted(done.stdout.splitlines())
    assert lines[0].startswith(f"rank 0 ({address}): hang_timeout = 7.5 (applied at step ")
    assert lines[1].startswith(f"rank 1 ({address}): hang_timeout = 7.5 (applied at step ")
    assert len(lines) == 2
    wait_until(
        "both ranks' watchdogs to use 7.5 s",
        lambda: watchdog_timeout(job, 0) == watchdog_timeout(job, 1) == 7.5,
    )
    # one rank, as JSON; the other keeps its value
    done = run_set(
        "--from", address, "--http-config", str(configs["client"]), "--json", "--rank", "1",
        "hang_timeout=auto",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    out = json.loads(done.stdout)
    assert out["job"] == "capture" and out["no_answer"] == [] and out["daemons"] == {}
    assert list(out["ranks"]) == ["1"] and out["ranks"]["1"]["applied"] == {"hang_timeout": None}
    wait_until("rank 1 to learn again", lambda: watchdog_timeout(job, 1) != 7.5)
    assert watchdog_timeout(job, 0) == 7.5


def test_a_value_the_rank_refuses_is_never_placed(
    job: Path, configs: dict[str, Path], guarded: int
) -> None:
    before = answers(job)
    body = json.dumps({"changes": {"hang_timeout": "-1"}}).encode()
    status, text = post(guarded, body, configs)
    assert status == 400 and "hang_timeout='-1' is not valid: expected seconds >= 0" in text
    body = json.dumps({"changes": {"port": "9600"}}).encode()
    status, text = post(guarded, body, configs)
    assert status == 400 and "port is fixed at attach" in text
    status, text = post(guarded, b"x" * (settings.MAX_FILE_BYTES + 1), configs)
    assert status == 400 and "over 16384 bytes" in text
    assert requests_in(job) == [] and answers(job) == before


def post(
    port: int, body: bytes, configs: dict[str, Path], password: str = "s3cret"
) -> tuple[int, str]:
    import base64
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"http://127.0.0.1:{port}/set", data=body)
    token = base64.b64encode(f"ops:{password}".encode()).decode()
    req.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_a_wrong_password_is_refused(job: Path, configs: dict[str, Path], guarded: int) -> None:
    before = answers(job)
    done = run_set(
        "--from", f"127.0.0.1:{guarded}", "--http-config", str(configs["wrong"]), "hang_timeout=3"
    )
    assert done.returncode == 1
    assert f"daemon 127.0.0.1:{guarded}: HTTP 401" in done.stdout
    assert requests_in(job) == [] and answers(job) == before


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (("--allow-requests",), "this daemon's web config sets no credentials"),
        ((), "start it with --allow-requests"),
    ],
)
def test_a_daemon_that_may_not_act_answers_403(
    job: Path, configs: dict[str, Path], args: tuple[str, ...], reason: str
) -> None:
    before = answers(job)
    proc, port = daemon(job, *args)
    try:
        done = run_set("--from", f"127.0.0.1:{port}", "hang_timeout=3")
        assert done.returncode == 1
        assert done.stdout.startswith(f"daemon 127.0.0.1:{port}: HTTP 403: "), done.stdout
        assert reason in done.stdout
        time.sleep(1.5)  # a look by each rank
        assert requests_in(job) == [] and answers(job) == before
    finally:
        terminate(proc)


@pytest.mark.skipif(os.geteuid() != 0, reason="another user's request needs root")
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv is not installed")
def test_a_directory_any_user_may_write(job: Path, configs: dict[str, Path], guarded: int) -> None:
    """The daemon places nothing there; what user nobody writes there, the rank refuses."""
    state_dir = job / "state"
    mode = state_dir.stat().st_mode & 0o7777
    before = answers(job)
    state_dir.chmod(0o1777)
    try:
        done = run_set(
            "--from", f"127.0.0.1:{guarded}", "--http-config", str(configs["client"]),
            "--rank", "0", "hang_timeout=3",
        )  # fmt: skip
        assert done.returncode == 1
        assert "rank 0 (127.0.0.1:" in done.stdout
        assert "not asked: its directory" in done.stdout
        assert "may be written by any user (mode 1777)" in done.stdout
        # a request forged by another user, bound to rank 1's very process
        forged = request(job, 1, hang_timeout="3")
        path = settings.request_path(str(state_dir), 1)
        subprocess.run(
            ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "sh", "-c",
             f"cat > {path}"],
            input=json.dumps(forged.to_json()), text=True, check=True, timeout=10,
        )  # fmt: skip
        assert os.stat(path).st_uid == NOBODY
        wait_until("rank 1 to take the forged request away", lambda: not os.path.lexists(path))
        time.sleep(1.5)
        assert not os.path.exists(settings.status_path(str(state_dir), 1, forged.nonce))
        assert answers(job) == before and watchdog_timeout(job, 1) != 3.0
    finally:
        state_dir.chmod(mode)


def this_hosts_address() -> str | None:
    """An address of this host that is not loopback (None when it has none)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # a route only: nothing is sent
            address = str(s.getsockname()[0])
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_without_tls_only_this_hosts_loopback(job: Path, configs: dict[str, Path]) -> None:
    address = this_hosts_address()
    if address is None:
        pytest.skip("this host has no address but loopback")
    before = answers(job)
    proc, port = daemon(
        job, "--allow-requests", "--web-config-file", str(configs["web"]), "--bind", "0.0.0.0"
    )
    try:
        done = run_set(
            "--from", f"{address}:{port}", "--http-config", str(configs["client"]), "hang_timeout=3"
        )
        assert done.returncode == 1
        assert done.stdout.startswith(f"daemon {address}:{port}: HTTP 403: "), done.stdout
        assert "without TLS this daemon takes requests from this host only" in done.stdout
        assert "add tls_server_config to --web-config-file" in done.stdout
        time.sleep(1.5)
        assert requests_in(job) == [] and answers(job) == before
    finally:
        terminate(proc)


def test_bad_usage_is_said(tmp_path: Path) -> None:
    done = run_set(str(tmp_path), "hang_timeout=3", "--from", "node1:9490")
    assert done.returncode == 2 and "give STATE_DIR or the daemons" in done.stderr
    done = run_set(str(tmp_path), "hang_timeout=3", "--job", "train")
    assert done.returncode == 2 and "--job is for the daemons" in done.stderr
    done = run_set("--from", "node1:9490", "--timeout", "500", "hang_timeout=3")
    assert done.returncode == 2 and "at most 120 s" in done.stderr
    done = run_set("--from", "node1:9490", "port=1")
    assert done.returncode == 2 and "port is fixed at attach" in done.stderr


def test_over_tls_from_another_address(job: Path, tmp_path: Path) -> None:
    """With TLS, a request is taken from an address other than loopback."""
    address = this_hosts_address()
    if address is None or shutil.which("openssl") is None:
        pytest.skip("needs an address but loopback, and openssl for the certificates")
    pki = make_pki(tmp_path)
    web = write(
        tmp_path / "web.yml",
        f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n"
        f"basic_auth_users:\n  ops: '{bcrypt_hash('s3cret')}'\n",
    )
    client = write(
        tmp_path / "client.yml",
        "basic_auth:\n  username: ops\n  password: s3cret\n"
        f"tls_config:\n  ca_file: {pki.ca}\n  server_name: ddpmon-node\n",
    )
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "ddpmon", "daemon", "--port", "0", "--bind", "0.0.0.0",
            "--state-dir", str(job / "state"), "--serve-state", "--no-gpu", "--allow-requests",
            "--web-config-file", str(web),
        ],
        cwd=harness.ROOT, env=dict(os.environ, PYTHONPATH=str(harness.ROOT)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "serving https://0.0.0.0:" in line, line + (
            proc.stderr.read() if proc.stderr else ""
        )
        port = int(line.split("serving https://0.0.0.0:")[1].split("/")[0])
        done = run_set(
            "--from", f"https://{address}:{port}", "--http-config", str(client),
            "--rank", "0", "hang_timeout=11",
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.startswith(f"rank 0 (https://{address}:{port}): hang_timeout = 11.0")
        wait_until("rank 0's watchdog to use 11 s", lambda: watchdog_timeout(job, 0) == 11.0)
    finally:
        terminate(proc)
