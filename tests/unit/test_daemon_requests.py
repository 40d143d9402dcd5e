"""The node daemon's ``POST /set`` (ddpmon/daemon/requests.py) on its own: who may act, what
a body may hold, and where and as whom a request file is written (a planted link replaced,
never followed; a directory that is not the job owner's, or that any user may write,
refused; a file given to the job's user by a daemon running as root)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from ddpmon.daemon.requests import Refused, parse, permission, place
from ddpmon.httpd import BadRequest, Reader
from ddpmon.state import files, schema, settings
from ddpmon.webconfig import WebConfig
from tests.support.roots import NOBODY, as_root

pytestmark = pytest.mark.timeout(30)

CREDENTIALS = WebConfig("web.yml", users={"ops": b"$2b$10$" + b"x" * 53})


def job_dir(at: Path, uid: int = 0, mode: int = 0o700) -> tuple[Path, schema.RankState]:
    at.mkdir(mode=mode)
    at.chmod(mode)
    files.write_atomic(files.path_for(str(at), 0), {"rank": 0})
    os.chown(at, uid, uid)
    os.chown(files.path_for(str(at), 0), uid, uid)
    return at, schema.RankState(rank=0, job="train", pid=4242, started_unix=17.5)


def test_who_may_act() -> None:
    local = Reader(("127.0.0.1", 5000), ("127.0.0.1", 9490), True)
    assert "--allow-requests" in (permission(False, CREDENTIALS, local) or "")
    assert "sets no credentials" in (permission(True, None, local) or "")
    assert "sets no credentials" in (permission(True, WebConfig("web.yml"), local) or "")
    assert permission(True, CREDENTIALS, local) is None
    for peer in ("::1", "::ffff:127.0.0.1"):
        assert permission(True, CREDENTIALS, Reader((peer, 5000, 0, 0), (), True)) is None
    unproven = Reader(("127.0.0.1", 5000), (), False)
    assert "did not prove who sent it" in (permission(True, CREDENTIALS, unproven) or "")
    remote = Reader(("10.1.2.3", 5000), ("10.1.2.4", 9490), True)
    assert "without TLS this daemon takes requests from this host only" in (
        permission(True, CREDENTIALS, remote) or ""
    )
    over_tls = Reader(("10.1.2.3", 5000), ("10.1.2.4", 9490), True, encrypted=True)
    assert permission(True, CREDENTIALS, over_tls) is None


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (b"[1]", "not a JSON object"),
        (b"\xff", "not a JSON object"),
        (b'{"changes": {"hang_timeout": "5"}, "path": "/etc"}', "unknown field(s) path"),
        (b'{"changes": {}}', "changes must map 1 to 16 options"),
        (b'{"changes": {"hang_timeout": "soon"}}', "hang_timeout='soon' is not valid"),
        (b'{"changes": {"state_dir": "/etc"}}', "state_dir is fixed at attach"),
        (b'{"changes": {"hang_timeout": 5}}', "is not text"),
        (b'{"changes": {"hang_timeout": "5"}, "rank": -1}', "rank=-1 is not a rank"),
        (b'{"changes": {"hang_timeout": "5"}, "rank": true}', "rank=True is not a rank"),
        (b'{"changes": {"hang_timeout": "5"}, "timeout": 1e9}', "timeout=1000000000.0"),
        (b" " * (settings.MAX_FILE_BYTES + 1), "over 16384 bytes"),
    ],
)
def test_a_bad_body_is_refused_by_name(body: bytes, problem: str) -> None:
    with pytest.raises(BadRequest, match=None) as caught:
        parse(body)
    assert problem in str(caught.value)


def test_a_good_body() -> None:
    body = b'{"job": "train", "rank": 3, "changes": {"hang_timeout": "auto"}, "timeout": 8}'
    assert parse(body) == ("train", 3, {"hang_timeout": "auto"}, 8.0)


def test_a_planted_link_is_replaced_not_followed(tmp_path: Path) -> None:
    directory, state = job_dir(tmp_path / "job")
    target = tmp_path / "precious"
    target.write_text("untouched")
    link = Path(settings.request_path(str(directory), 0))
    os.symlink(target, link)
    nonce = place(str(directory), state, os.geteuid(), {"hang_timeout": "9"}, 10.0)
    assert target.read_text() == "untouched"
    assert stat.S_ISREG(link.lstat().st_mode)
    request = settings.read_request(str(link), owner=os.geteuid())
    assert (request.nonce, request.rank, request.pid, request.started_unix, request.job) == (
        nonce,
        0,
        4242,
        17.5,
        "train",
    )
    assert request.changes == {"hang_timeout": "9"}
    assert 9.0 < request.expires_unix - request.requested_unix <= 10.0 + 1e-6
    assert stat.S_IMODE(link.stat().st_mode) == 0o600
    assert sorted(p.name for p in directory.iterdir()) == ["rank-0.json", "set-0.request"]


def test_a_directory_given_as_a_link_is_not_followed(tmp_path: Path) -> None:
    directory, state = job_dir(tmp_path / "job")
    os.symlink(directory, tmp_path / "alias")
    with pytest.raises(Refused, match="cannot be opened"):
        place(str(tmp_path / "alias"), state, os.geteuid(), {"hang_timeout": "9"}, 10.0)
    assert not os.path.lexists(settings.request_path(str(directory), 0))


def test_a_directory_any_user_may_write_is_refused(tmp_path: Path) -> None:
    directory, state = job_dir(tmp_path / "job", os.geteuid(), 0o777)
    with pytest.raises(Refused, match="may be written by any user"):
        place(str(directory), state, os.geteuid(), {"hang_timeout": "9"}, 10.0)
    assert not os.path.lexists(settings.request_path(str(directory), 0))


@as_root
def test_root_writes_as_the_jobs_user(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    directory, state = job_dir(tmp_path / "job", NOBODY)
    place(str(directory), state, NOBODY, {"hang_timeout": "9"}, 10.0)
    path = settings.request_path(str(directory), 0)
    assert os.lstat(path).st_uid == NOBODY
    assert settings.read_request(path, owner=NOBODY).changes == {"hang_timeout": "9"}
    # a directory that is not the state file's owner's
    with pytest.raises(Refused, match=f"belongs to uid {NOBODY}, not to the job's user"):
        place(str(directory), state, 0, {"hang_timeout": "9"}, 10.0)
