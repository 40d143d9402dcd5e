"""The ``ddpmon`` command's exit codes, one table for every subcommand, so that a script
reads the same status the same way whichever command it ran (docs/doctor.md lists them)."""

from __future__ import annotations

EXIT_OK = 0
"""Healthy, or the command did what was asked."""
EXIT_PROBLEM = 1
"""A problem was found (a hang, a slow host, a refused push, ...)."""
EXIT_USAGE = 2
"""Bad usage or input: an option, a missing directory, nothing to read."""
EXIT_FAILED = 3
"""ddpmon itself failed."""
