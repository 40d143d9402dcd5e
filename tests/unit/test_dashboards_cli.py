"""``ddpmon dashboards export|push``. Grafana cannot be installed here, so push talks, through
the real grafana-client over real HTTP, to a small server that answers the three Grafana API
calls push makes (folders, create folder, save dashboard) the way Grafana documents them."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from ddpmon import dashboards
from ddpmon.cli import main

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "glsa_test_token"


class GrafanaAPI:
    """Grafana's folder and dashboard endpoints, in memory, behind bearer-token auth."""

    def __init__(self, token: str = TOKEN, refuse_with: int | None = None) -> None:
        self.token = token
        self.refuse_with = refuse_with
        self.folders: list[dict[str, Any]] = [{"id": 1, "uid": "other", "title": "Other"}]
        self.saved: list[dict[str, Any]] = []
        self.requests: list[tuple[str, str]] = []

    def handle(self, method: str, path: str, auth: str, body: Any) -> tuple[int, Any]:
        self.requests.append((method, path))
        if auth != f"Bearer {self.token}":
            return 401, {"message": "Unauthorized"}
        if path == "/api/folders" and method == "GET":
            return 200, self.folders
        if path == "/api/folders" and method == "POST":
            folder = {
                "id": len(self.folders) + 1,
                "uid": f"f{len(self.folders) + 1}",
                "title": body["title"],
            }
            self.folders.append(folder)
            return 200, folder
        if path == "/api/dashboards/db" and method == "POST":
            if self.refuse_with:
                return self.refuse_with, {"message": "Access denied", "status": "error"}
            board = body["dashboard"]
            if not board.get("title") or not board.get("uid") or board.get("id") is not None:
                return 400, {"message": "Dashboard title cannot be empty"}
            self.saved.append(body)
            return 200, {
                "id": len(self.saved),
                "uid": board["uid"],
                "status": "success",
                "url": f"/d/{board['uid']}/{board['title'].lower().replace(' ', '-')}",
                "version": 1,
                "slug": board["title"].lower().replace(" ", "-"),
            }
        return 404, {"message": "Not found"}


@pytest.fixture
def grafana() -> Iterator[tuple[str, GrafanaAPI]]:
    api = GrafanaAPI()

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            status, payload = api.handle(
                self.command, self.path.split("?")[0], self.headers.get("Authorization", ""), body
            )
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _answer

        def log_message(self, *_args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    )
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", api
    finally:
        server.shutdown()
        server.server_close()


def run_cli(*argv: str) -> int:
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    return int(exit_info.value.code or 0)


# -- export ------------------------------------------------------------------------------------


def test_export_writes_every_board(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "boards"
    assert run_cli("dashboards", "export", str(out)) == 0
    written = sorted(p.name for p in out.iterdir())
    assert written == sorted(dashboards.BOARDS)
    for name in written:
        assert (out / name).read_text() == (ROOT / "dashboards" / name).read_text()
    assert capsys.readouterr().out.split() == [str(out / n) for n in dashboards.BOARDS]


def test_export_into_a_file_is_bad_usage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "a-file"
    target.write_text("x")
    assert run_cli("dashboards", "export", str(target)) == 2
    assert "is a file, expected a directory" in capsys.readouterr().err


def test_export_into_a_path_under_a_file_is_bad_usage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "a-file").write_text("x")
    target = tmp_path / "a-file" / "boards"
    assert run_cli("dashboards", "export", str(target)) == 2
    err = capsys.readouterr().err
    assert f"cannot write into DIR={str(target)!r}" in err and "Not a directory" in err
    assert (tmp_path / "a-file").read_text() == "x"


def test_no_action_is_bad_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli("dashboards") == 2
    assert "`ddpmon dashboards export [DIR]`" in capsys.readouterr().err


# -- push --------------------------------------------------------------------------------------


def test_push_creates_the_folder_and_saves_both_boards(
    grafana: tuple[str, GrafanaAPI], capsys: pytest.CaptureFixture[str]
) -> None:
    url, api = grafana
    assert run_cli("dashboards", "push", "--url", url, "--token", TOKEN) == 0
    assert [f["title"] for f in api.folders] == ["Other", "ddpmon"]
    assert [s["dashboard"]["title"] for s in api.saved] == ["DDP job overview", "DDP GPUs"]
    for s in api.saved:
        assert s["overwrite"] is True and s["folderUid"] == "f2"
        assert (
            s["dashboard"]["templating"]
            == dashboards.build()[
                "ddp-job-overview.json"
                if s["dashboard"]["uid"] == "ddpmon-ddp-overview"
                else "ddp-gpus.json"
            ]["templating"]
        )
    out = capsys.readouterr().out
    assert f"DDP job overview: {url}/d/ddpmon-ddp-overview/" in out


def test_push_reuses_an_existing_folder_and_reads_the_token_from_the_environment(
    grafana: tuple[str, GrafanaAPI], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, api = grafana
    api.folders.append({"id": 9, "uid": "ml", "title": "ML"})
    monkeypatch.setenv("GRAFANA_TOKEN", TOKEN)
    assert run_cli("dashboards", "push", "--url", url + "/", "--folder", "ML") == 0
    assert [f["title"] for f in api.folders] == ["Other", "ML"]
    assert {s["folderUid"] for s in api.saved} == {"ml"}


def test_push_to_the_general_folder(grafana: tuple[str, GrafanaAPI]) -> None:
    url, api = grafana
    assert run_cli("dashboards", "push", "--url", url, "--token", TOKEN, "--folder", "") == 0
    assert all("folderUid" not in s for s in api.saved) and len(api.saved) == 2
    assert ("GET", "/api/folders") not in api.requests


def test_push_with_a_wrong_token_says_grafana_refused(
    grafana: tuple[str, GrafanaAPI], capsys: pytest.CaptureFixture[str]
) -> None:
    url, api = grafana
    assert run_cli("dashboards", "push", "--url", url, "--token", "wrong") == 1
    err = capsys.readouterr().err
    assert f"Grafana at {url} refused the folder list: 401" in err
    assert "check --token or $GRAFANA_TOKEN" in err
    assert not api.saved


def test_push_refused_for_lack_of_permission(
    grafana: tuple[str, GrafanaAPI], capsys: pytest.CaptureFixture[str]
) -> None:
    url, api = grafana
    api.refuse_with = 403
    assert run_cli("dashboards", "push", "--url", url, "--token", TOKEN) == 1
    err = capsys.readouterr().err
    assert "refused dashboard 'DDP job overview': 403 Access denied" in err
    assert "Editor role" in err


def test_push_to_nothing_listening_says_unreachable(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert (
        run_cli(
            "dashboards",
            "push",
            "--url",
            f"http://127.0.0.1:{port}",
            "--token",
            TOKEN,
            "--timeout",
            "2",
        )
        == 1
    )
    assert f"cannot reach Grafana at http://127.0.0.1:{port}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--url", "http://127.0.0.1:3000"],
            "no Grafana API token: pass --token TOKEN or set GRAFANA_TOKEN",
        ),
        (["--url", "grafana:3000", "--token", TOKEN], "--url='grafana:3000' is not valid"),
        (
            ["--url", "http://127.0.0.1:3000", "--token", TOKEN, "--timeout", "0"],
            "--timeout=0.0 is not valid",
        ),
    ],
)
def test_push_bad_usage(
    argv: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.delenv("GRAFANA_TOKEN", raising=False)
    assert run_cli("dashboards", "push", *argv) == 2
    assert message in capsys.readouterr().err
