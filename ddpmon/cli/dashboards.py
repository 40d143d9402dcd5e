"""``ddpmon dashboards``: write ddpmon's Grafana boards to files, or push them to a Grafana.

``export [DIR]`` needs nothing beyond ddpmon and writes only into DIR (default: the current
directory), never into the installed package. ``push`` talks to Grafana's HTTP API through
grafana-client, an optional dependency (``pip install 'ddpmon[grafana]'``), imported only here.
Exit codes: 0 done, 1 Grafana refused or could not be reached, 2 bad usage (no token, a bad
URL, grafana-client missing).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any
from urllib.parse import urlparse

from .. import __version__, dashboards
from .exits import EXIT_OK, EXIT_PROBLEM, EXIT_USAGE

HELP = "Export ddpmon's Grafana dashboards to files, or push them to a Grafana."

TOKEN_ENV = "GRAFANA_TOKEN"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    export = actions.add_parser(
        "export",
        help="write the dashboards' JSON into a directory",
        description="Write ddpmon's dashboards (Grafana JSON, for file provisioning or import) "
        f"into DIR. They target {dashboards.GRAFANA_VERSIONS}.",
    )
    export.add_argument(
        "directory",
        metavar="DIR",
        nargs="?",
        default=".",
        help="directory to write into, created if missing (default: the current directory)",
    )
    push = actions.add_parser(
        "push",
        help="create or update the dashboards in a Grafana",
        description="Create or update ddpmon's dashboards in a running Grafana through its HTTP "
        "API (needs grafana-client: pip install 'ddpmon[grafana]').",
    )
    push.add_argument(
        "--url",
        required=True,
        help="Grafana's address, e.g. https://grafana.example.com (user:password@ "
        "in it works when no token is given)",
    )
    push.add_argument(
        "--token",
        default=None,
        help=f"API token: a service account token with the Editor role (default: ${TOKEN_ENV})",
    )
    push.add_argument(
        "--folder",
        default="ddpmon",
        help="folder to put the dashboards in, created if missing; '' = General "
        "(default: %(default)s)",
    )
    push.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="seconds to wait for each request (default: %(default)s)",
    )


def run(args: argparse.Namespace) -> int:
    if args.action == "export":
        return _export(args.directory)
    if args.action == "push":
        return _push(args)
    _err(
        "choose what to do: `ddpmon dashboards export [DIR]` or `ddpmon dashboards push --url URL`"
    )
    return EXIT_USAGE


def _err(message: str) -> None:
    print(f"ddpmon dashboards: {message}", file=sys.stderr)


def _export(directory: str) -> int:
    if os.path.exists(directory) and not os.path.isdir(directory):
        _err(f"DIR={directory!r} is not valid: it is a file, expected a directory")
        return EXIT_USAGE
    if os.path.isdir(directory) and not os.access(directory, os.W_OK | os.X_OK):
        _err(
            f"DIR={directory!r} is not writable: pick a directory you can write to, or fix its "
            "permissions"
        )
        return EXIT_USAGE
    try:
        paths = dashboards.export(directory)
    except OSError as exc:  # a parent that is a file or not writable, a full or read-only disk
        where = f" ({exc.filename})" if exc.filename and str(exc.filename) != directory else ""
        _err(
            f"cannot write into DIR={directory!r}{where}: {exc.strerror or exc}; pick a directory "
            "you can write to"
        )
        return EXIT_USAGE
    for path in paths:
        print(path)
    return EXIT_OK


def _push(args: argparse.Namespace) -> int:
    url = args.url.rstrip("/")
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        _err(f"--url={args.url!r} is not valid: expected http(s)://HOST[:PORT][/PATH]")
        return EXIT_USAGE
    token = args.token or os.environ.get(TOKEN_ENV) or None
    if token is None and not (parsed.username and parsed.password):
        _err(
            f"no Grafana API token: pass --token TOKEN or set {TOKEN_ENV} (a service account "
            "token with the Editor role), or put user:password@ in --url"
        )
        return EXIT_USAGE
    if args.timeout <= 0:
        _err(f"--timeout={args.timeout} is not valid: expected a positive number of seconds")
        return EXIT_USAGE
    try:
        from grafana_client import GrafanaApi  # type: ignore[attr-defined]
        from grafana_client.client import GrafanaException
    except ImportError:
        _err(
            "`ddpmon dashboards push` needs the grafana-client package, which is not installed: "
            "pip install 'ddpmon[grafana]'  (or: pip install grafana-client)"
        )
        return EXIT_USAGE

    api = GrafanaApi.from_url(url, credential=token, timeout=args.timeout)
    where = _without_password(parsed)
    current = "the folder list"
    try:
        folder_uid = _folder_uid(api, args.folder) if args.folder else None
        for board in dashboards.build().values():
            current = f"dashboard {board['title']!r}"
            payload: dict[str, Any] = {
                "dashboard": {**board, "id": None},
                "overwrite": True,
                "message": f"ddpmon {__version__}",
            }
            if folder_uid:
                payload["folderUid"] = folder_uid
            result = api.dashboard.update_dashboard(payload) or {}
            print(f"{board['title']}: {where}{result.get('url', '/d/' + board['uid'])}")
    except GrafanaException as exc:
        _err(f"Grafana at {where} refused {current}: {_explain(exc)}")
        return EXIT_PROBLEM
    except OSError as exc:  # requests/niquests connection errors are OSErrors
        _err(
            f"cannot reach Grafana at {where} ({exc.__class__.__name__}: {exc}): check --url "
            "and that Grafana is running and reachable from here"
        )
        return EXIT_PROBLEM
    return EXIT_OK


def _folder_uid(api: Any, title: str) -> str:
    """The uid of the top-level folder called ``title``, created when missing."""
    for folder in api.folder.get_all_folders() or []:
        if folder.get("title") == title:
            return str(folder["uid"])
    return str(api.folder.create_folder(title)["uid"])


def _explain(exc: Any) -> str:
    status = getattr(exc, "status_code", 0)
    response = getattr(exc, "response", None)
    message = response.get("message") if isinstance(response, dict) else None
    detail = f"{status} {message or exc}".strip()
    if status == 401:
        return f"{detail}: the token or password was not accepted; check --token or ${TOKEN_ENV}"
    if status == 403:
        return (
            f"{detail}: the token may not write dashboards; use a service account with the "
            "Editor role (or Admin for a new folder)"
        )
    if status == 404:
        return f"{detail}: no Grafana API there; check --url (include the sub-path Grafana is served under)"
    if status == 412:
        return f"{detail}: a dashboard with the same title already exists in that folder under another uid"
    return detail


def _without_password(parsed: Any) -> str:
    netloc = parsed.hostname + (f":{parsed.port}" if parsed.port else "")
    return f"{parsed.scheme}://{netloc}{parsed.path.rstrip('/')}"
