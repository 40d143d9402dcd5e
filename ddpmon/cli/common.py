"""What several subcommands share: the state-directory argument and its default, -v/--verbose,
a number of seconds, where the node daemons are and how to reach them (``--from``,
``--from-file``, ``--prometheus``, ``--http-config``), and what a subcommand whose module
cannot be imported does instead."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..config import default_state_root
from ..remote.discovery import DAEMON_JOBS
from .exits import EXIT_USAGE

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
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=argparse.SUPPRESS,
        help="log what ddpmon does",
    )
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # an alias is the same parser
                add_verbose_argument(sub)


def add_daemon_sources(parser: argparse.ArgumentParser, from_help: str) -> None:
    """Where the node daemons are (``--from``, ``--from-file``, ``--prometheus``) and how to
    connect to them and to Prometheus (``--http-config``, ``--prometheus-http-config``)."""
    parser.add_argument(
        "--from", dest="remote", action="append", default=[], metavar="HOST:PORT", help=from_help
    )
    parser.add_argument(
        "--from-file",
        action="append",
        default=[],
        metavar="FILE",
        help="the daemons' addresses in a file, one HOST:PORT a line (blank lines and # comments skipped); "
        "read as --from",
    )
    parser.add_argument(
        "--prometheus",
        metavar="URL",
        help="find the daemons among the targets of this Prometheus (http://HOST:9090), up or down, and read "
        f"them as --from: those of the scrape job {' or '.join(DAEMON_JOBS)} (also NAMESPACE/NAME, as the "
        "Prometheus Operator names a PodMonitor's), unless --prometheus-job names others",
    )
    parser.add_argument(
        "--prometheus-job",
        action="append",
        default=[],
        metavar="NAME",
        help="with --prometheus: the scrape job of the daemons (its job label, or its scrape pool as "
        "Prometheus' targets page shows it); repeat for several",
    )
    parser.add_argument(
        "--http-config",
        metavar="FILE",
        help="TLS and credentials for the daemons, in Prometheus' http_config format "
        "(basic_auth, authorization, tls_config: the same file as promtool's --http.config.file)",
    )
    parser.add_argument(
        "--prometheus-http-config",
        metavar="FILE",
        help="TLS and credentials for --prometheus, in the same format",
    )


@dataclass
class DaemonSources:
    """The node daemons a command was asked to read, and how to connect to them."""

    given: list[str]
    """``--from``, checked."""
    files: list[str]
    prometheus: str | None
    jobs: list[str]
    client: HttpConfig
    """The daemons' TLS and credentials (``--http-config``)."""
    prometheus_client: HttpConfig

    @property
    def asked(self) -> bool:
        return bool(self.given or self.files or self.prometheus)

    def addresses(self) -> list[str]:
        """Every daemon, each once: ``--from``'s, then each file's, then Prometheus' targets.
        Raises ``DiscoveryError`` (a file that is not a list of addresses; Prometheus that
        does not answer, or lists no daemon)."""
        from ..remote import discovery

        found = dict.fromkeys(self.given)
        for path in self.files:
            found.update(dict.fromkeys(discovery.read_address_file(path)))
        if self.prometheus:
            listed = discovery.prometheus_daemons(
                self.prometheus, self.jobs, self.prometheus_client
            )
            log.info(
                "ddpmon: Prometheus at %s lists %d daemons: %s",
                self.prometheus,
                len(listed),
                ", ".join(listed),
            )
            found.update(dict.fromkeys(listed))
        return list(found)


def daemon_sources(command: str, args: argparse.Namespace) -> DaemonSources | int:
    """What ``add_daemon_sources``' options ask for, after checking every ``--from`` address
    and loading the http_config files; or the exit status, with what is wrong said on
    stderr (never the address's password)."""
    from ..remote.daemons import address_problem, without_credentials
    from ..webconfig import WebConfigError, load_http_config

    for address in args.remote:
        problem = address_problem(address)
        if problem:
            print(
                f"ddpmon {command}: --from {without_credentials(address)!r} is not valid: {problem}",
                file=sys.stderr,
            )
            return EXIT_USAGE
    if (args.prometheus_job or args.prometheus_http_config) and not args.prometheus:
        print(
            f"ddpmon {command}: --prometheus-job and --prometheus-http-config need --prometheus URL",
            file=sys.stderr,
        )
        return EXIT_USAGE
    clients = []
    for option, path in (
        ("--http-config", args.http_config),
        ("--prometheus-http-config", args.prometheus_http_config),
    ):
        try:
            clients.append(load_http_config(path))
        except WebConfigError as exc:
            print(f"ddpmon {command}: {option} {exc}", file=sys.stderr)
            return EXIT_USAGE
    return DaemonSources(
        args.remote, args.from_file, args.prometheus, args.prometheus_job, *clients
    )


def missing_extra(exc: BaseException) -> tuple[str, str] | None:
    """(package, extra) when ``exc`` is an optional extra's package that is not installed."""
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        return EXTRAS.get(exc.name.split(".", 1)[0])
    return None


def add_unavailable(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    command: str,
    exc: BaseException,
) -> None:
    """The subcommand ``command`` whose module failed to import with ``exc``: listed, taking
    any arguments, and when run, a missing extra is named with how to install it (exit 2);
    any other error is raised again, so its traceback shows (exit 3). Never "invalid choice"."""
    extra = missing_extra(exc)
    if extra:
        package, name = extra
        help_line = f"(unavailable: needs {package}: pip install 'ddpmon[{name}]')"
        message = (
            f"ddpmon {command} needs the {package} package, which is not installed: "
            f"pip install 'ddpmon[{name}]'  (or: pip install {package})"
        )

        def run(args: argparse.Namespace) -> int:
            print(message, file=sys.stderr)
            return EXIT_USAGE
    else:
        help_line = f"(broken: {type(exc).__name__}: {exc}; run it to see the traceback)"

        def run(args: argparse.Namespace) -> int:
            raise exc

    parser = subparsers.add_parser(command, help=help_line, description=help_line)

    def parse_known_args(args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        namespace = argparse.Namespace() if namespace is None else namespace
        namespace.arguments, namespace._run, namespace._name = list(args or []), run, command
        return namespace, []

    parser.parse_known_args = parse_known_args  # type: ignore[method-assign, assignment]


def add_state_dir_argument(parser: argparse.ArgumentParser) -> None:
    """The optional positional STATE_DIR of the commands that read one job's state files."""
    parser.add_argument(
        "state_dir",
        nargs="?",
        metavar="STATE_DIR",
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
        print(
            f"ddpmon {command}: reading {chosen} (the job directory written last)", file=sys.stderr
        )
    else:
        log.info("ddpmon %s: reading %s (the only job directory under %s)", command, chosen, root)
    return chosen


def no_state_dir(command: str) -> str:
    """The usage error when no state directory was given and none was found."""
    return (
        f"ddpmon {command}: no state directory given, DDPMON_STATE_DIR is not set and "
        f"{default_state_root()} (your jobs' default root) holds no job: pass STATE_DIR "
        "(another user's job: its DDPMON_STATE_DIR, or <tmp>/ddpmon-<their uid>/<job>)"
    )


def seconds(text: str) -> float:
    """An argument of a positive number of seconds (argparse's ``type=``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number of seconds")
    return value
