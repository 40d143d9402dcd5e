"""``ddpmon compare RUN_A RUN_B [--html FILE] [--json]``: two runs side by side.

Each run is a state directory, the JSON of ``ddpmon report --json``, or
``[JOB@]HOST:PORT[,HOST:PORT...]``, its histories read through the node daemons (started
with ``--serve-state``; no shared file system needed), or ``JOB@``, read through the daemons
of ``--from``, ``--from-file`` or ``--prometheus``. Prints step time,
every phase, exposed communication, bucket times and GPU utilisation of both, the change
in %, and the ranks and phases that explain it. Exit codes: 0 compared (a regression is not
an error), 2 bad usage or input, 3 ddpmon itself failed.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import DiscoveryError, StateFileError
from ..remote.daemons import HISTORY_DEADLINE_SECONDS
from .common import add_daemon_sources, daemon_sources, seconds
from .exits import EXIT_OK, EXIT_USAGE

HELP = "Compare two runs: step time, phases, exposed communication, buckets, and what explains the change."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run_a",
        metavar="RUN_A",
        help="the first run: its state directory, a report --json "
        "file, [JOB@]HOST:PORT[,HOST:PORT...] of the node daemons (--serve-state) that hold it, or "
        "JOB@ on the daemons of --from, --from-file or --prometheus",
    )
    parser.add_argument("run_b", metavar="RUN_B", help="the second run, as RUN_A")
    parser.add_argument(
        "--html", metavar="FILE", help="also write the comparison as a self-contained HTML file"
    )
    parser.add_argument("--json", action="store_true", help="print the comparison as JSON")
    parser.add_argument(
        "--deadline",
        type=seconds,
        default=HISTORY_DEADLINE_SECONDS,
        metavar="SECONDS",
        help="the longest to wait for a run's node daemons, all together (default: %(default)g)",
    )
    add_daemon_sources(
        parser,
        "a node daemon (--serve-state) of the runs given as JOB@ (repeat per node); "
        "HOST:PORT, or https://HOST:PORT",
    )


def run(args: argparse.Namespace) -> int:
    from ..report import compare

    daemons = daemon_sources("compare", args)
    if isinstance(daemons, int):
        return daemons
    sides = []
    try:
        found = daemons.addresses()
    except DiscoveryError as exc:
        print(f"ddpmon compare: {exc}", file=sys.stderr)
        return EXIT_USAGE
    for source in (args.run_a, args.run_b):
        try:
            sides.append(compare.load_side(source, args.deadline, daemons.client, found))
        except (StateFileError, ValueError) as exc:
            print(f"ddpmon compare: {exc}", file=sys.stderr)
            return EXIT_USAGE
        run = sides[-1][1]
        for line in (run.notes + run.problems) if run is not None else []:
            print(f"ddpmon compare: {source}: {line}", file=sys.stderr)
    result = compare.compare(sides[0][0], sides[1][0])
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        sys.stdout.write(compare.render_text(result))
    if args.html:
        try:
            with open(args.html, "w", encoding="utf-8") as f:
                f.write(compare.render_html(result, (sides[0][1], sides[1][1])))
        except OSError as exc:
            print(
                f"ddpmon compare: cannot write {args.html} ({exc.strerror or exc})", file=sys.stderr
            )
            return EXIT_USAGE
    return EXIT_OK
