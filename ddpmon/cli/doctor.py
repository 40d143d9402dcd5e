"""``ddpmon doctor [STATE_DIR] [--json]``: which rank stopped the job, doing what, what to do.

Exit codes: 0 healthy (warnings too: they never change the verdict; --fail-on-advice makes advice exit 1), 1 a problem was found, 2 bad usage or input (a missing directory,
nothing to diagnose), 3 ddpmon itself failed.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..advice import KINDS as ADVICE_KINDS
from ..config import default_state_root
from ..errors import DiscoveryError, StateFileError
from ..state.files import cycle_collection_paused
from .common import (
    add_daemon_sources,
    add_state_dir_argument,
    daemon_sources,
    default_state_dir,
    no_state_dir,
    seconds,
)
from .exits import EXIT_OK, EXIT_PROBLEM, EXIT_USAGE

HELP = "Diagnose a hung, dying, out-of-step or slow DDP job from its ranks' state files."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_state_dir_argument(parser)
    parser.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    parser.add_argument(
        "--job",
        help=f"the job to diagnose: picks its directory {default_state_root()}/JOB when no "
        "STATE_DIR is given, and leaves every other job out of the report (--from included)",
    )
    parser.add_argument(
        "--stall",
        type=seconds,
        metavar="SECONDS",
        help="seconds without progress after which a rank counts as stalled (default: "
        "max(5, 5 x the rank's slowest recent step); a rank's own hang report always counts)",
    )
    parser.add_argument(
        "--no-stacks", action="store_true", help="do not read live stacks with py-spy"
    )
    parser.add_argument(
        "--fail-on-advice",
        action="store_true",
        help="exit 1 when a silent mistake was found (docs/advice.md), even if the job is healthy",
    )
    add_daemon_sources(
        parser,
        "read the state files from a node daemon started with --serve-state (repeat for "
        "every node of the job) instead of a directory; HOST:PORT, or https://HOST:PORT",
    )


def run(args: argparse.Namespace) -> int:
    # Its records live until it returns: a cycle collector walking a thousand ranks' records
    # again and again would cost a quarter of its time.
    with cycle_collection_paused():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from ..doctor import examine, report

    daemons = daemon_sources("doctor", args)
    if isinstance(daemons, int):
        return daemons
    if daemons.asked and args.state_dir:
        print(
            "ddpmon doctor: give STATE_DIR or the daemons (--from, --from-file, --prometheus), not both",
            file=sys.stderr,
        )
        return EXIT_USAGE
    state_dir = args.state_dir or ("" if daemons.asked else default_state_dir("doctor", args.job))
    if state_dir is None:
        print(no_state_dir("doctor"), file=sys.stderr)
        return EXIT_USAGE
    try:
        diagnosis = examine(
            state_dir,
            job=args.job,
            live_stacks=not args.no_stacks,
            stall=args.stall,
            remote=daemons.addresses(),
            client=daemons.client,
        )
    except (StateFileError, DiscoveryError) as exc:
        print(f"ddpmon doctor: {exc}", file=sys.stderr)
        if args.json:  # scripts reading --json get an answer too
            print(
                json.dumps(
                    {
                        "verdict": "no_data",
                        "suspect_ranks": [],
                        "findings": [],
                        "ranks": [],
                        "error": str(exc),
                    }
                )
            )
        return EXIT_USAGE
    if args.json:
        print(report.as_json(diagnosis))
    else:
        sys.stdout.write(report.render(diagnosis, colour=report.use_colour(sys.stdout)))
    if diagnosis.verdict == "healthy":
        if args.fail_on_advice and any(
            f.kind in ADVICE_KINDS and f.severity == "warning" for f in diagnosis.findings
        ):
            return EXIT_PROBLEM
        return EXIT_OK
    return EXIT_USAGE if diagnosis.verdict == "no_data" else EXIT_PROBLEM
