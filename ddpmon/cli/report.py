"""``ddpmon report [STATE_DIR ...] [-o report.html] [--json]``: the run as one HTML file.

The file is self-contained (plots, data and script inlined; no network fetch) and opens in
any browser. Works on a finished, a killed and a live job, and on a job spread over nodes:
pass each node's state directory, or read the state files and the per-step histories
through the node daemons with ``--from`` (every daemon at once, within ``--deadline``; a
daemon that does not answer is named and the report goes on with the others).
Exit codes: 0 written, 2 bad usage or input (nothing to report), 3 ddpmon itself failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ..config import default_state_root
from ..errors import DiscoveryError, StateFileError
from ..remote.daemons import HISTORY_DEADLINE_SECONDS
from .common import add_daemon_sources, daemon_sources, seconds
from .exits import EXIT_OK, EXIT_USAGE

HELP = "Write a self-contained HTML report (plots, summary, findings) of a running or finished job."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "state_dirs",
        nargs="*",
        metavar="STATE_DIR",
        help="the job's state directory, once per node without a shared file system (default: "
        f"$DDPMON_STATE_DIR, else the job directory under {default_state_root()} written last)",
    )
    parser.add_argument(
        "-o",
        "--output",
        default="report.html",
        metavar="FILE",
        help="where to write the HTML report (default: report.html; - for stdout)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the run's summary as JSON instead"
    )
    parser.add_argument(
        "--job",
        help="the job to report when the directories or daemons hold several "
        "(with --from, default: the job written last on the daemons)",
    )
    add_daemon_sources(
        parser,
        "also read the state files and step histories from a node daemon started with "
        "--serve-state (repeat per node; no shared file system needed); HOST:PORT, or https://HOST:PORT",
    )
    parser.add_argument(
        "--deadline",
        type=seconds,
        default=HISTORY_DEADLINE_SECONDS,
        metavar="SECONDS",
        help="the longest to wait for the --from daemons' histories, all together; a history "
        "still coming then is cut where it got to (default: %(default)g)",
    )


def run(args: argparse.Namespace) -> int:
    from ..report import html, summary
    from ..report import run as run_mod
    from .common import default_state_dir

    daemons = daemon_sources("report", args)
    if isinstance(daemons, int):
        return daemons
    dirs = list(args.state_dirs)
    if not dirs and not daemons.asked:
        found = default_state_dir("report", args.job)
        if found is None:
            print(
                "ddpmon report: no state directory given and none found: pass STATE_DIR",
                file=sys.stderr,
            )
            return EXIT_USAGE
        dirs = [found]
    started = time.perf_counter()
    try:
        loaded = run_mod.load(
            dirs, daemons.addresses(), job=args.job, deadline=args.deadline, client=daemons.client
        )
    except (StateFileError, DiscoveryError) as exc:
        print(f"ddpmon report: {exc}", file=sys.stderr)
        return EXIT_USAGE
    for line in loaded.notes + loaded.problems:
        print(f"ddpmon report: {line}", file=sys.stderr)
    s = summary.summarize(loaded)
    if args.json:
        print(json.dumps(s, indent=2, default=str))
        return EXIT_OK
    page = html.render(loaded, s)
    if args.output == "-":
        sys.stdout.write(page)
        return EXIT_OK
    try:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(page)
    except OSError as exc:
        print(
            f"ddpmon report: cannot write {args.output} ({exc.strerror or exc}); pass -o FILE "
            "in a writable directory",
            file=sys.stderr,
        )
        return EXIT_USAGE
    print(
        f"wrote {args.output} ({os.path.getsize(args.output) / 1e6:.2f} MB, job {s['job']!r}, "
        f"{s['ranks']} ranks, {s['steps']} steps) in {time.perf_counter() - started:.1f} s",
        file=sys.stderr,
    )
    return EXIT_OK
