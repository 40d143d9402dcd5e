"""The ``ddpmon`` command. One module per subcommand; ``main()`` owns ``sys.exit``.

Each subcommand module has ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int``, an exit code from ``exits``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import platform
import sys
from collections.abc import Sequence

from .. import __version__
from . import common
from .exits import EXIT_FAILED, EXIT_OK, EXIT_USAGE

SUBCOMMANDS = (
    "doctor",
    "top",
    "daemon",
    "dashboards",
    "report",
    "compare",
    "run",
    "capture",
    "preflight",
    "set",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddpmon", description="Observe and debug PyTorch DistributedDataParallel jobs."
    )
    parser.add_argument("--version", action="version", version=f"ddpmon {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what ddpmon does")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"{__name__}.{name}")
        except Exception as exc:  # said when the command runs: never an "invalid choice"
            common.add_unavailable(sub, name, exc)
            continue
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        common.add_verbose_argument(p)
        p.set_defaults(_run=module.run, _name=name)  # `run` has a `command` argument of its own
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on bad usage, 0 on --help
        sys.exit(exc.code if exc.code in (0, None) else EXIT_USAGE)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(message)s",
    )
    if not getattr(args, "_run", None):
        parser.print_help(sys.stderr)
        sys.exit(EXIT_USAGE)
    logging.getLogger("ddpmon").info(
        "ddpmon %s: %s (Python %s, from %s)",
        __version__,
        args._name,
        platform.python_version(),
        os.path.dirname(os.path.dirname(__file__)),
    )
    try:
        code = args._run(args)
    except KeyboardInterrupt:
        code = EXIT_OK
    except BrokenPipeError:  # `ddpmon top | head`: the reader left; nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = EXIT_OK
    except Exception as exc:  # ddpmon's own failure: say so, exit 3
        logging.getLogger("ddpmon").exception("ddpmon %s failed: %s", args._name, exc)
        code = EXIT_FAILED
    sys.exit(code)
