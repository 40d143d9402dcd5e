"""``ddpmon set``: change options of a running job without restarting it."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid

from ..config import LIVE_OPTIONS, LIVE_VALUES, live_value
from ..errors import ConfigError, DiscoveryError, StateFileError
from ..state import files, settings
from .capture import live_ranks
from .common import (
    DaemonSources,
    add_daemon_sources,
    add_state_dir_argument,
    daemon_sources,
    default_state_dir,
    no_state_dir,
    seconds,
)
from .exits import EXIT_OK, EXIT_PROBLEM, EXIT_USAGE

HELP = (
    "change options of a running job (hang_timeout, bucket_timing, metrics_detail) without "
    "restarting it"
)
DEFAULT_TIMEOUT = 10.0
EPILOG = (
    "options that change live:\n"
    + "".join(f"  {name}: {LIVE_VALUES[name]}\n" for name in LIVE_OPTIONS)
    + "\nThrough the node daemons of a job on many nodes (--from, --from-file, --prometheus;\n"
    "each daemon started with --serve-state --allow-requests and credentials, docs/daemon.md),\n"
    "each daemon places the request for the job's ranks it serves and the command reads their\n"
    "answers back at /state, one line per rank.\n"
    "\nEach rank checks the request (its own user's file, for its own process), applies what\n"
    "it can and answers what it applied and what it refused, with the reason. Exit 0: every\n"
    "rank applied everything; 1: a rank refused something or did not answer; 2: bad usage.\n\n"
    "examples:\n"
    "  ddpmon set /tmp/ddpmon-1000/myjob hang_timeout=600\n"
    "  ddpmon set /tmp/ddpmon-1000/myjob hang_timeout=auto --rank 3\n"
    "  ddpmon set --prometheus http://prometheus:9090 --http-config creds.yml "
    "--job myjob hang_timeout=600\n"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add_state_dir_argument(parser)
    parser.add_argument("changes", nargs="+", metavar="KEY=VALUE", help="the options to change")
    parser.add_argument(
        "--rank", type=int, metavar="R", help="only this rank (default: every rank)"
    )
    parser.add_argument(
        "--timeout",
        type=seconds,
        default=DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help=f"how long to wait for the ranks' answers (default {DEFAULT_TIMEOUT:.0f})",
    )
    parser.add_argument("--json", action="store_true", help="print each rank's answer as JSON")
    parser.add_argument(
        "--job",
        help="with the daemons: the job whose ranks to change (default: the one job whose "
        "ranks run on each node)",
    )
    add_daemon_sources(
        parser,
        "send the request through a node daemon started with --serve-state --allow-requests "
        "(repeat for every node of the job) instead of a directory; HOST:PORT, or "
        "https://HOST:PORT",
    )


def run(args: argparse.Namespace) -> int:
    state_dir = args.state_dir
    if state_dir and "=" in state_dir:  # no STATE_DIR given: the first change came first
        args.changes.insert(0, state_dir)
        state_dir = None
    daemons = daemon_sources("set", args)
    if isinstance(daemons, int):
        return daemons
    if daemons.asked and state_dir:
        print(
            "ddpmon set: give STATE_DIR or the daemons (--from, --from-file, --prometheus), not both",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if args.job and not daemons.asked:
        print(
            "ddpmon set: --job is for the daemons (--from ...): STATE_DIR is one job's",
            file=sys.stderr,
        )
        return EXIT_USAGE
    changes = _changes(args.changes)
    if changes is None:
        return EXIT_USAGE
    if daemons.asked:
        return _through_daemons(args, daemons, changes)
    state_dir = state_dir or default_state_dir("set")
    if not state_dir:
        print(no_state_dir("set"), file=sys.stderr)
        return EXIT_USAGE
    if not os.path.isdir(state_dir):
        print(f"ddpmon set: {state_dir!r} is not a directory", file=sys.stderr)
        return EXIT_USAGE
    if args.rank is None:
        ranks = sorted(r for r in map(files.rank_of, files.list_files(state_dir)) if r is not None)
        if not ranks:
            print(f"ddpmon set: {state_dir} holds no rank state files", file=sys.stderr)
            return EXIT_USAGE
    else:
        ranks = [args.rank]
    states, problem = live_ranks(state_dir, ranks)
    if problem:
        print(f"ddpmon set: {problem}", file=sys.stderr)
        return EXIT_USAGE
    now = time.time()
    requests = {
        rank: settings.Request(
            nonce=uuid.uuid4().hex[:16],
            rank=rank,
            job=state.job,
            pid=state.pid or 0,
            started_unix=state.started_unix or 0.0,
            changes=changes,
            requested_unix=now,
            expires_unix=now + args.timeout,
        )
        for rank, state in states.items()
    }
    answers: dict[int, settings.Status] = {}
    try:
        for request in requests.values():
            settings.write_request(state_dir, request)
        deadline = time.monotonic() + args.timeout
        while len(answers) < len(requests) and time.monotonic() < deadline:
            for rank, request in requests.items():
                path = settings.status_path(state_dir, rank, request.nonce)
                if rank not in answers and os.path.lexists(path):
                    try:
                        answers[rank] = settings.read_status(path)
                    except StateFileError:
                        pass  # written as we read: the next look
            time.sleep(0.1)
    finally:
        for request in requests.values():
            _withdraw(state_dir, request)
    return _report(args, requests, answers)


def _changes(items: list[str]) -> dict[str, str] | None:
    """The KEY=VALUE arguments, each checked as the ranks check it; None when one is bad
    (said on stderr)."""
    changes: dict[str, str] = {}
    for item in items:
        name, eq, text = item.partition("=")
        if not eq or not name:
            print(f"ddpmon set: {item!r} is not KEY=VALUE (e.g. hang_timeout=600)", file=sys.stderr)
            return None
        try:
            live_value(name, text)  # the ranks check it again: this says it at once
        except ConfigError as exc:
            print(f"ddpmon set: {exc}", file=sys.stderr)
            return None
        changes[name] = text
    return changes


def _withdraw(state_dir: str, request: settings.Request) -> None:
    """Remove our request if no rank took it (ours: the same nonce)."""
    path = settings.request_path(state_dir, request.rank)
    try:
        if settings.read_request(path).nonce == request.nonce:
            os.unlink(path)
    except (StateFileError, OSError):
        pass


def _report(
    args: argparse.Namespace,
    requests: dict[int, settings.Request],
    answers: dict[int, settings.Status],
) -> int:
    silent = sorted(set(requests) - set(answers))
    refused = sorted(r for r, a in answers.items() if a.refused)
    if args.json:
        print(
            json.dumps(
                {
                    "ranks": {
                        str(r): {"applied": a.applied, "refused": a.refused, "step": a.step}
                        for r, a in sorted(answers.items())
                    },
                    "no_answer": silent,
                },
                indent=2,
            )
        )
    else:
        for rank, answer in sorted(answers.items()):
            for name, value in answer.applied.items():
                shown = "auto (learned)" if value is None else value
                print(f"rank {rank}: {name} = {shown} (applied at step {answer.step})")
            for name, why in answer.refused.items():
                print(f"rank {rank}: {name} refused: {why}")
        if silent:
            print(
                f"no answer from rank(s) {', '.join(map(str, silent))} within {args.timeout:g} s: "
                "a rank looks for requests about once a second while its state writer runs; "
                "ddpmon doctor says whether it is alive"
            )
    return EXIT_PROBLEM if silent or refused else EXIT_OK


def _through_daemons(
    args: argparse.Namespace, daemons: DaemonSources, changes: dict[str, str]
) -> int:
    """``ddpmon set --from ...``: one line per rank (and per daemon that failed); exit 1
    unless every rank applied everything."""
    from ..remote import settings as remote

    if args.timeout > settings.MAX_TIMEOUT_SECONDS:
        print(
            f"ddpmon set: --timeout {args.timeout:g} is too long for the daemons: at most "
            f"{settings.MAX_TIMEOUT_SECONDS:g} s",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        addresses = daemons.addresses()
    except DiscoveryError as exc:
        print(f"ddpmon set: {exc}", file=sys.stderr)
        return EXIT_USAGE
    out = remote.ask(addresses, args.job, args.rank, changes, args.timeout, daemons.client)
    if args.json:
        print(
            json.dumps(
                {
                    "job": sorted(out.jobs)[0] if len(out.jobs) == 1 else args.job,
                    "ranks": {
                        str(r): {
                            "daemon": a.address,
                            "applied": a.applied,
                            "refused": a.refused,
                            "not_placed": a.not_placed,
                            "step": a.step,
                        }
                        for r, a in sorted(out.ranks.items())
                    },
                    "no_answer": sorted(
                        r for r, a in out.ranks.items() if a.nonce and a.applied is None
                    ),
                    "daemons": out.daemons,
                },
                indent=2,
            )
        )
    else:
        for rank, a in sorted(out.ranks.items()):
            where = f"rank {rank} ({a.address})"
            if a.not_placed:
                print(f"{where}: not asked: {a.not_placed}")
            elif a.applied is None:
                print(
                    f"{where}: no answer within {args.timeout:g} s (a rank looks for requests "
                    "about once a second while its state writer runs; ddpmon doctor says "
                    "whether it is alive)"
                )
            else:
                for name, value in a.applied.items():
                    shown = "auto (learned)" if value is None else value
                    print(f"{where}: {name} = {shown} (applied at step {a.step})")
                for name, why in a.refused.items():
                    print(f"{where}: {name} refused: {why}")
        for address, problem in sorted(out.daemons.items()):
            print(f"daemon {address}: {problem}")
        if len(out.jobs) > 1:
            print(
                f"the daemons chose different jobs ({', '.join(sorted(out.jobs))}): give --job JOB"
            )
        if not out.ranks and not out.daemons:
            of = f" of job {args.job!r}" if args.job else ""
            which = f"rank {args.rank}" if args.rank is not None else "no live rank"
            print(
                f"no daemon serves {which}{of}: ddpmon doctor --from ... lists the ranks they serve"
            )
    ok = (
        out.ranks
        and not out.daemons
        and len(out.jobs) <= 1
        and all(a.applied is not None and not a.refused for a in out.ranks.values())
    )
    return EXIT_OK if ok else EXIT_PROBLEM
