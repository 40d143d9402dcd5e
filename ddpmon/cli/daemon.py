"""``ddpmon daemon``: the per-node exporter (GPUs, XID errors, rank liveness) until SIGTERM."""

from __future__ import annotations

import argparse
import ipaddress
import os
import resource
import signal
import sys
import threading
from typing import Any

from ..config import default_state_root, web_config_file
from ..state.owners import MAX_RANKS_PER_USER
from .exits import EXIT_OK, EXIT_USAGE

HELP = "Export this node's GPUs and the liveness of its ranks to Prometheus (run one per node)."

DEFAULT_PORT = 9490


def every_users_root() -> str:
    """Every user's default root (ddpmon/state/root.py): a pattern, expanded at each pass."""
    return os.path.join(os.path.dirname(default_state_root()), "ddpmon-*")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--state-dir",
        default=every_users_root(),
        metavar="DIR",
        help="directory of the ranks' state files, read with its subdirectories (the ranks' "
        "DDPMON_STATE_DIR or its parent); it may appear later; a pattern reads every match "
        "(default: %(default)s, the users' default roots)",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help="metrics port; 0 = an ephemeral port (default: %(default)s)",
    )
    parser.add_argument("--bind", default="0.0.0.0", help="address to bind (default: %(default)s)")
    parser.add_argument(
        "--interval",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="seconds between samples; a dead rank shows within one (default: %(default)s)",
    )
    parser.add_argument(
        "--stale-after",
        type=float,
        default=15.0,
        metavar="SECONDS",
        help="a rank whose state file is older than this is down (default: %(default)s)",
    )
    parser.add_argument(
        "--max-ranks-per-user",
        type=int,
        default=MAX_RANKS_PER_USER,
        metavar="N",
        help="state files read per user (their owner) at each pass, those written last; "
        "bounds what one user's files cost the daemon and Prometheus (default: %(default)s)",
    )
    parser.add_argument(
        "--node-local",
        action="store_true",
        help="every state file in the directory is from a rank on this node, whatever "
        "host name it carries (a hostPath shared with containers)",
    )
    parser.add_argument("--no-gpu", action="store_true", help="do not use NVML (no GPU metrics)")
    parser.add_argument(
        "--serve-state",
        action="store_true",
        help="also serve this node's state files read-only at /state, the ranks' "
        "step histories at /history (JSON, at most 5,000 steps per answer) and the "
        "launchers' records at /launchers, for "
        "`ddpmon doctor --from HOST:PORT` and `ddpmon report --from HOST:PORT`; "
        "off by default: they hold stacks and paths. Without credentials a client "
        "on this host gets the files its user may read; on an address others can "
        "reach it needs --web-config-file with basic_auth_users or client certificates",
    )
    parser.add_argument(
        "--allow-requests",
        action="store_true",
        help="take `ddpmon set --from HOST:PORT` requests (POST /set) and place them for "
        "this node's ranks; needs --serve-state (the command reads the ranks' answers at "
        "/state) and credentials in --web-config-file, and without TLS takes them from this "
        "host only: anything else is answered 403 with the reason. Off by default",
    )
    parser.add_argument(
        "--web-config-file",
        metavar="FILE",
        help="TLS and basic auth, in exporter-toolkit's web config format (node_exporter's "
        "--web.config.file); default: $DDPMON_WEB_CONFIG_FILE",
    )


def _check(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments, or None."""
    if not 0 <= args.port <= 65535:
        return f"--port={args.port} is not valid: expected 0 (ephemeral) to 65535"
    for name in ("interval", "stale_after"):
        value = getattr(args, name)
        if not value > 0:
            return f"--{name.replace('_', '-')}={value} is not valid: expected a positive number of seconds"
    if args.max_ranks_per_user < 1:
        return f"--max-ranks-per-user={args.max_ranks_per_user} is not valid: expected a positive number"
    if args.stale_after <= args.interval:
        return (
            f"--stale-after={args.stale_after} is not valid: expected more than "
            f"--interval={args.interval}"
        )
    if args.allow_requests and not args.serve_state:
        return (
            "--allow-requests needs --serve-state: `ddpmon set --from` reads each rank's "
            "answer at /state"
        )
    if os.path.exists(args.state_dir) and not os.path.isdir(args.state_dir):
        return f"--state-dir={args.state_dir!r} is not valid: it is a file, expected a directory"
    return None


def run(args: argparse.Namespace) -> int:
    problem = _check(args)
    if problem:
        print(f"ddpmon daemon: {problem}", file=sys.stderr)
        return EXIT_USAGE

    from ..daemon import Daemon
    from ..httpd import serve
    from ..webconfig import WebConfigError, load_web_config

    web_file = args.web_config_file or web_config_file()
    try:
        web = load_web_config(web_file) if web_file else None
    except WebConfigError as exc:
        print(f"ddpmon daemon: --web-config-file {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.serve_state and not (web and web.guarded) and not _loopback(args.bind):
        print(
            f"ddpmon daemon: --serve-state on {args.bind} without credentials would serve every rank's state "
            "files and histories (stacks, paths, exception messages) to anyone who reaches the port. Bind "
            "127.0.0.1 (a client on this host then gets the files its user may read), or give "
            "--web-config-file with basic_auth_users or client_auth_type: RequireAndVerifyClientCert "
            "(docs/security.md)",
            file=sys.stderr,
        )
        return EXIT_USAGE

    _raise_fd_limit()
    daemon = Daemon(
        args.state_dir,
        interval=args.interval,
        stale_after=args.stale_after,
        gpus=not args.no_gpu,
        node_local=args.node_local,
        max_per_user=args.max_ranks_per_user,
    )
    daemon.start()
    routes = (
        {
            "/state": daemon.routes.state_route,
            "/history": daemon.routes.history_route,
            "/launchers": daemon.routes.launchers_route,
        }
        if args.serve_state
        else {"/state": _not_served, "/history": _not_served, "/launchers": _not_served}
    )
    try:  # /healthz reads two numbers: answered at once, even while a /state read is slow
        endpoint = serve(
            daemon,
            args.port,
            args.bind,
            routes,  # type: ignore[arg-type]
            quick_routes={"/healthz": daemon.health_route},
            web=web,
            post_routes={"/set": daemon.requests(args.allow_requests, web).set_route},
        )
    except OSError as exc:
        daemon.stop()
        print(
            f"ddpmon daemon: cannot serve on {args.bind}:{args.port} ({exc.strerror or exc}): "
            "choose another --port or --bind",
            file=sys.stderr,
        )
        return EXIT_USAGE

    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    gpus = len(daemon.gpus)
    scheme = "https" if web and web.ssl else "http"
    print(
        f"ddpmon daemon: serving {scheme}://{args.bind}:{endpoint.port}/metrics"
        f"{', /state and /history' if args.serve_state else ''}; state files from {args.state_dir}; "
        f"{gpus} GPU(s)",
        flush=True,
    )
    if args.serve_state:
        whose = (
            "every state file of this node, to a client with credentials"
            if web and web.guarded
            else "to a client on this host, the state files its own user may read"
        )
        print(f"ddpmon daemon: /state and /history serve {whose}", flush=True)
    if args.allow_requests:
        from ..daemon.requests import permission
        from ..httpd import Reader

        refusal = permission(True, web, Reader(("127.0.0.1",), (), True))
        print(
            "ddpmon daemon: POST /set "
            + (f"refuses every request: {refusal}" if refusal else "takes `ddpmon set --from`"),
            flush=True,
        )
    while not stop.wait(0.5):
        pass
    endpoint.close()
    daemon.stop()
    print("ddpmon daemon: stopped", flush=True)
    return EXIT_OK


def _raise_fd_limit() -> None:
    """Up to the hard limit, as Go's exporters do at start: the endpoint then holds up to
    4,096 connections (a quarter of the limit) before it drops the oldest idle one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 16384 if hard == resource.RLIM_INFINITY else min(hard, 16384)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (OSError, ValueError):
            pass  # a smaller cap, that is all


def _loopback(bind: str) -> bool:
    """Whether ``bind`` can be reached from this host only."""
    if bind == "localhost":
        return True
    try:
        return ipaddress.ip_address(bind).is_loopback
    except ValueError:
        return False


def _not_served(query: Any = None, reader: Any = None) -> tuple[str, bytes]:
    raise LookupError(
        "this daemon does not serve state files or histories: start it with --serve-state"
    )
