"""``ddpmon doctor [STATE_DIR] [--json]``: which rank stopped the job, doing what, what to do.

Exit codes: 0 healthy, 1 a problem was found, 2 bad usage or input (a missing directory,
nothing to diagnose), 3 ddpmon itself failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from ..errors import StateFileError

HELP = "Diagnose a hung, dying, out-of-step or slow DDP job from its ranks' state files."

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "state_dir", nargs="?", metavar="STATE_DIR",
        help="directory of the ranks' state files (default: $DDPMON_STATE_DIR, else the job "
        "directory under <tmp>/ddpmon written last)",
    )
    parser.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    parser.add_argument(
        "--job", help="the job to diagnose: picks its directory under <tmp>/ddpmon when no "
        "STATE_DIR is given, and leaves every other job out of the report (--from included)",
    )
    parser.add_argument(
        "--stall", type=_seconds, metavar="SECONDS",
        help="seconds without progress after which a rank counts as stalled (default: "
        "max(5, 5 x the rank's slowest recent step); a rank's own hang report always counts)",
    )
    parser.add_argument("--no-stacks", action="store_true", help="do not read live stacks with py-spy")
    parser.add_argument(
        "--from", dest="remote", action="append", default=[], metavar="HOST:PORT",
        help="read the state files from a node daemon started with --serve-state (repeat for "
        "every node of the job) instead of a directory",
    )


def run(args: argparse.Namespace) -> int:
    from ..doctor import examine, report

    if args.remote and args.state_dir:
        print("ddpmon doctor: give STATE_DIR or --from HOST:PORT, not both", file=sys.stderr)
        return EXIT_USAGE
    state_dir = args.state_dir or ("" if args.remote else default_state_dir(args.job))
    if state_dir is None:
        print(
            "ddpmon doctor: no state directory given, DDPMON_STATE_DIR is not set and "
            f"{os.path.join(tempfile.gettempdir(), 'ddpmon')} holds no job: pass STATE_DIR",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        diagnosis = examine(state_dir, job=args.job, live_stacks=not args.no_stacks, stall=args.stall,
                            remote=args.remote)
    except StateFileError as exc:
        print(f"ddpmon doctor: {exc}", file=sys.stderr)
        if args.json:  # scripts reading --json get an answer too
            print(json.dumps({"verdict": "no_data", "suspect_ranks": [], "findings": [], "ranks": [],
                              "error": str(exc)}))
        return EXIT_USAGE
    if args.json:
        print(report.as_json(diagnosis))
    else:
        sys.stdout.write(report.render(diagnosis, colour=report.use_colour(sys.stdout)))
    if diagnosis.verdict == "healthy":
        return EXIT_OK
    return EXIT_USAGE if diagnosis.verdict == "no_data" else EXIT_PROBLEM


def default_state_dir(job: str | None = None) -> str | None:
    """$DDPMON_STATE_DIR, else ``<tmp>/ddpmon/JOB`` for ``--job JOB`` (ddpmon's default
    directory of that job), else the most recently written job directory under <tmp>/ddpmon."""
    env = os.environ.get("DDPMON_STATE_DIR", "")
    if env:
        return env
    root = os.path.join(tempfile.gettempdir(), "ddpmon")
    if job:
        return os.path.join(root, job)  # a missing one is named in the error
    try:
        candidates = [os.path.join(root, name) for name in os.listdir(root)]
    except OSError:
        return None
    candidates = [c for c in candidates if os.path.isdir(c)]
    if not candidates:
        return None
    chosen = max(candidates, key=os.path.getmtime)
    if len(candidates) > 1:
        print(f"ddpmon doctor: reading {chosen} (the job directory written last)", file=sys.stderr)
    return chosen


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number of seconds")
    return value
