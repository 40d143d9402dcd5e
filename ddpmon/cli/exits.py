"""ddpmon's exit codes, one table for every subcommand and the launcher, so that a script
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

# ``python -m ddpmon.launch SCRIPT`` exits as ``python SCRIPT`` would, so that a launcher
# (torchrun, a scheduler) reads the training script's status unchanged:
EXIT_SCRIPT_FAILED = 1
"""The script raised, or its module does not exist (python's own status for both)."""
EXIT_INTERRUPTED = 130
"""The script was interrupted (KeyboardInterrupt, SIGINT: 128 + 2, as a shell reports it).
Bad usage, or a script that cannot be opened, is ``EXIT_USAGE`` (python's 2 as well)."""
