"""What several subcommands share: the state-directory argument and its default."""

from __future__ import annotations

import argparse
import os
import sys

from ..config import default_state_root


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
        return env
    if job:
        from ..state.root import job_dir

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
    return chosen


def no_state_dir(command: str) -> str:
    """The usage error when no state directory was given and none was found."""
    return (f"ddpmon {command}: no state directory given, DDPMON_STATE_DIR is not set and "
            f"{default_state_root()} (your jobs' default root) holds no job: pass STATE_DIR "
            "(another user's job: its DDPMON_STATE_DIR, or <tmp>/ddpmon-<their uid>/<job>)")
