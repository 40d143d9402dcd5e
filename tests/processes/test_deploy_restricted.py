"""The daemon as the shipped deployments run it: the systemd unit (``ProtectSystem=strict``
with the host's /tmp, only ``CAP_DAC_READ_SEARCH``, no new privileges) and the DaemonSet
(``readOnlyRootFilesystem``, the state directory mounted read-only, every capability dropped
but ``DAC_READ_SEARCH``), each rebuilt from the shipped file with a mount namespace whose
every file system is read-only and ``setpriv``. A rank of another user (nobody, a live
process, its 0600 file in its 0700 root) must show as up. Before it could, building the
command line's parser asked ``tempfile.gettempdir()`` for a writable temp dir and the daemon
died at start with ``FileNotFoundError: No usable temporary directory found``."""

from __future__ import annotations

import configparser
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from ddpmon.state import files as statefile
from tests.support.roots import NOBODY

ROOT = Path(__file__).resolve().parents[2]
HOST = os.uname().nodename

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="mount namespaces and setpriv need root"),
    pytest.mark.skipif(
        not (shutil.which("unshare") and shutil.which("setpriv")),
        reason="unshare and setpriv (util-linux) are not installed",
    ),
]


@pytest.fixture
def rank_of_nobody(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """A directory standing for the host's state root: user nobody's private root with one
    job, whose rank 0 is a live process of nobody's."""
    sleeper = subprocess.Popen(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "sleep", "120"]
    )
    try:
        src = tmp_path / "host"
        job = src / f"ddpmon-{NOBODY}" / "jobA"
        job.mkdir(parents=True)
        src.chmod(0o1777)
        now = time.time()
        path = statefile.path_for(str(job), 0)
        statefile.write_atomic(
            path,
            {
                "rank": 0,
                "local_rank": 0,
                "world_size": 1,
                "host": HOST,
                "pid": sleeper.pid,
                "job": "jobA",
                "step": 3,
                "phase": "forward",
                "started_unix": now,
                "last_progress_unix": now,
                "now_unix": now,
            },
        )
        for p in (job.parent, job, Path(path)):
            os.chown(p, NOBODY, NOBODY)
        job.parent.chmod(0o700)
        job.chmod(0o700)
        yield src, sleeper.pid
    finally:
        sleeper.kill()
        sleeper.wait()


def _unit() -> configparser.SectionProxy:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment]
    parser.read_string((ROOT / "deploy/systemd/ddpmon-daemon.service").read_text())
    return parser["Service"]


def _as_tmp(src: Path) -> str:
    """Shell that makes ``src`` this namespace's /tmp, keeping this checkout and its Python
    where they are when they live under /tmp (a fresh clone in ``mktemp -d``)."""
    lines = []
    for needed in sorted({ROOT, Path(sys.prefix).resolve()}):
        if needed.is_relative_to("/tmp"):
            inside = src / needed.relative_to("/tmp")
            inside.mkdir(parents=True, exist_ok=True)
            lines.append(f"mount --bind {shlex.quote(str(needed))} {shlex.quote(str(inside))}")
    return "\n".join([*lines, f"mount --rbind {shlex.quote(str(src))} /tmp"])


def _restricted(mounts: str, caps: list[str], argv: list[str]) -> subprocess.Popen[str]:
    """``argv`` (a ddpmon command line) in a mount namespace where ``mounts`` (shell) has
    run and every file system is then read-only, with only ``caps`` and no new privileges."""
    # (a mount that cannot be remounted, such as one another test is taking down, is left)
    remount = (
        'findmnt -rno TARGET | sort -u | while read m; do mount -o remount,bind,ro "$m" 2>/dev/null '
        "|| true; done"
    )
    bounding = ",".join(["-all", *(f"+{c}" for c in caps)])
    cmd = shlex.join(
        [
            "setpriv",
            f"--bounding-set={bounding}",
            "--inh-caps=-all",
            "--no-new-privs",
            sys.executable,
            "-m",
            "ddpmon",
            *argv,
        ]
    )
    return subprocess.Popen(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-ec",
            f"{mounts}\n{remount}\nexec {cmd}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd="/",
        env={"PATH": os.environ["PATH"], "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)},
    )


def _serving(proc: subprocess.Popen[str]) -> int:
    """The daemon's port, from its first line; fails with what it printed when it died."""
    line = proc.stdout.readline() if proc.stdout else ""
    m = re.search(r"serving http://[^:]+:(\d+)/metrics", line)
    if m is None:
        proc.kill()
        _, err = proc.communicate(timeout=10)
        pytest.fail(
            f"the daemon did not start under the deployment's restrictions (exit {proc.returncode}): "
            f"{line}{err[-3000:]}"
        )
    return int(m.group(1))


def _up_of(port: int, job: str, rank: int, deadline: float = 15.0) -> str:
    """The rank's ``ddpmon_rank_up`` line once the daemon exports it."""
    end = time.monotonic() + deadline
    want = f'ddpmon_rank_up{{job="{job}",rank="{rank}"}}'
    while True:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        found = [line for line in body.splitlines() if line.startswith(want)]
        if found or time.monotonic() > end:
            return found[0] if found else body[-2000:]
        time.sleep(0.3)


def _stop(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=15)
    assert proc.returncode == 0, err[-3000:]
    return err


def test_systemd_unit_restrictions(rank_of_nobody: tuple[Path, int]) -> None:
    src, _ = rank_of_nobody
    service = _unit()
    assert service["ProtectSystem"] == "strict" and service["PrivateTmp"] == "no"
    caps = [c.lower().removeprefix("cap_") for c in service["CapabilityBoundingSet"].split()]
    argv = shlex.split(service["ExecStart"])[1:] + ["--port", "0"]
    assert "/tmp/ddpmon-*" in " ".join(argv)
    # the host's /tmp (PrivateTmp=no), read-only like everything else (ProtectSystem=strict)
    proc = _restricted(_as_tmp(src), caps, argv)
    try:
        port = _serving(proc)
        assert _up_of(port, "jobA", 0).endswith(" 1.0")
        health = urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5)
        assert health.status == 200
    finally:
        if proc.poll() is None:
            _stop(proc)


def test_daemonset_restrictions(rank_of_nobody: tuple[Path, int]) -> None:
    src, _ = rank_of_nobody
    ds = next(
        d
        for d in yaml.safe_load_all((ROOT / "deploy/kubernetes/daemonset.yaml").read_text())
        if d["kind"] == "DaemonSet"
    )
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    security = container["securityContext"]
    assert (
        security["readOnlyRootFilesystem"] is True and security["allowPrivilegeEscalation"] is False
    )
    assert security["capabilities"]["drop"] == ["ALL"]
    caps = [c.lower() for c in security["capabilities"]["add"]]
    (mount,) = container["volumeMounts"]
    assert mount["readOnly"] is True
    # the hostPath volume holds the ranks' files directly (DDPMON_STATE_DIR=/run/ddpmon/<job>)
    job_dir = src / f"ddpmon-{NOBODY}"
    mounts = (
        f"mount -t tmpfs tmpfs /run && mkdir -p {mount['mountPath']} && "
        f"mount --bind {shlex.quote(str(job_dir))} {mount['mountPath']}"
    )
    proc = _restricted(mounts, caps, [*container["args"], "--port=0"])
    try:
        port = _serving(proc)
        assert _up_of(port, "jobA", 0).endswith(" 1.0")
    finally:
        if proc.poll() is None:
            _stop(proc)
