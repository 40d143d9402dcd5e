"""What several subcommands share: the state-directory argument and its default, -v/--verbose,
a number of seconds, the readers of node daemons (``--from``, ``--http-config``), and what a
subcommand whose module cannot be imported does instead."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..config import default_state_root

if TYPE_CHECKING:
    from ..webconfig import HttpConfig

log = logging.getLogger("ddpmon")

# the packages of ddpmon's optional extras (pyproject.toml), by the name they are imported as:
# (what pip calls it, the extra that installs it)
EXTRAS = {
    "grafana_client": ("grafana-client", "grafana"),
    "lightning": ("lightning", "lightning"),
    "transformers": ("transformers", "transformers"),
    "accelerate": ("accelerate", "accelerate"),
}


def add_verbose_argument(parser: argparse.ArgumentParser) -> None:
    """-v/--verbose on a subcommand and on its own subcommands, so that ``ddpmon doctor -v``
    means ``ddpmon -v doctor``. Left unset when not given: the top level's value stands."""
    parser.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="log what ddpmon does")
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # an alias is the same parser
                add_verbose_argument(sub)


def add_http_config(parser: argparse.ArgumentParser) -> None:
    """``--http-config FILE``: how the readers of node daemons (``--from``) connect."""
    parser.add_argument(
        "--http-config", metavar="FILE",
        help="TLS and credentials for the --from daemons, in Prometheus' http_config format "
             "(basic_auth, authorization, tls_config: the same file as promtool's --http.config.file)",
    )


def daemon_client(command: str, args: argparse.Namespace) -> HttpConfig | int:
    """The ``HttpConfig`` that ``--http-config`` names, after checking every ``--from``
    address; or the exit status, with what is wrong said on stderr (never the address's
    password)."""
    from ..state.remote import address_problem, without_credentials
    from ..webconfig import WebConfigError, load_http_config

    for address in getattr(args, "remote", ()):
        problem = address_problem(address)
        if problem:
            print(f"ddpmon {command}: --from {without_credentials(address)!r} is not valid: {problem}",
                  file=sys.stderr)
            return 2  # EXIT_USAGE
    try:
        return load_http_config(args.http_config)
    except WebConfigError as exc:
        print(f"ddpmon {command}: --http-config {exc}", file=sys.stderr)
        return 2  # EXIT_USAGE


def missing_extra(exc: BaseException) -> tuple[str, str] | None:
    """(package, extra) when ``exc`` is an optional extra's package that is not installed."""
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        return EXTRAS.get(exc.name.split(".", 1)[0])
    return None


def add_unavailable(subparsers: argparse._SubParsersAction, command: str, exc: BaseException) -> None:
    """The subcommand ``command`` whose module failed to import with ``exc``: listed, taking
    any arguments, and when run, a missing extra is named with how to install it (exit 2);
    any other error is raised again, so its traceback shows (exit 3). Never "invalid choice"."""
    extra = missing_extra(exc)
    if extra:
        package, name = extra
        help_line = f"(unavailable: needs {package}: pip install 'ddpmon[{name}]')"
        message = (f"ddpmon {command} needs the {package} package, which is not installed: "
                   f"pip install 'ddpmon[{name}]'  (or: pip install {package})")

        def run(args: argparse.Namespace) -> int:
            print(message, file=sys.stderr)
            return 2  # EXIT_USAGE
    else:
        help_line = f"(broken: {type(exc).__name__}: {exc}; run it to see the traceback)"

        def run(args: argparse.Namespace) -> int:
            raise exc

    parser = subparsers.add_parser(command, help=help_line, description=help_line)

    def parse_known_args(args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        namespace = argparse.Namespace() if namespace is None else namespace
        namespace.arguments, namespace._run, namespace._name = list(args or []), run, command
        return namespace, []

    parser.parse_known_args = parse_known_args  # type: ignore[method-assign]


def add_state_dir_argument(parser: argparse.ArgumentParser) -> None:
    """The optional positional STATE_DIR of the commands that read one job's state files."""
    parser.add_argument(
        "state_dir", nargs="?", metavar="STATE_DIR",
        help="directory of the ranks' state files (default: $DDPMON_STATE_DIR, else the job "
        f"directory under {default_state_root()} written last)",
    )


def default_state_dir(command: str, job: str | None = None) -> str | None:
    """$DDPMON_STATE_DIR, else JOB's default directory for ``--job JOB``, else the most
    recently written job directory under the default root; None when there is none. Says
    on stderr which one it chose among several."""
    env = os.environ.get("DDPMON_STATE_DIR", "")
    if env:
        log.info("ddpmon %s: reading %s ($DDPMON_STATE_DIR)", command, env)
        return env
    if job:
        from ..state.root import job_dir

        log.info("ddpmon %s: reading job %s's default directory", command, job)
        return job_dir(job)  # a missing one is named in the error
    root = default_state_root()
    try:
        candidates = [os.path.join(root, name) for name in os.listdir(root)]
    except OSError:
        return None
    candidates = [c for c in candidates if os.path.isdir(c)]
    if not candidates:
        return None
    chosen = max(candidates, key=os.path.getmtime)
    if len(candidates) > 1:
        print(f"ddpmon {command}: reading {chosen} (the job directory written last)", file=sys.stderr)
    else:
        log.info("ddpmon %s: reading %s (the only job directory under %s)", command, chosen, root)
    return chosen


def no_state_dir(command: str) -> str:
    """The usage error when no state directory was given and none was found."""
    return (f"ddpmon {command}: no state directory given, DDPMON_STATE_DIR is not set and "
            f"{default_state_root()} (your jobs' default root) holds no job: pass STATE_DIR "
            "(another user's job: its DDPMON_STATE_DIR, or <tmp>/ddpmon-<their uid>/<job>)")


def seconds(text: str) -> float:
    """An argument of a positive number of seconds (argparse's ``type=``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number of seconds")
    return value
