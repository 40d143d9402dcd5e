"""``ddpmon preflight [OPTIONS] TORCHRUN-OPTIONS...``: check the nodes a job is about to use.

    ddpmon preflight --nnodes=3 --node-rank=$NODE --master-addr=10.0.0.1 --master-port=29500

Run on every node with the options the job's torchrun gets (no script): torchrun starts
``python -m ddpmon.preflight.node`` there, the nodes check themselves and measure the links
between them (``ddpmon/preflight/``), and every node gets the same report and prints it.
Exit 1 when it names a slow or bad host or a slow link.
``ddpmon run --preflight`` runs it before the job (``before_run``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import threading
import time
from typing import Any, TextIO

import psutil

from ..preflight.verdict import table
from .exits import EXIT_OK, EXIT_PROBLEM, EXIT_USAGE

HELP = "Check the nodes a job is about to use (GPUs, disk, shm, clocks, the links between them)."

NODE_MODULE = "ddpmon.preflight.node"


@dataclasses.dataclass(frozen=True)
class Options:
    """What the nodes are asked to check, and how long they get."""

    checkpoint_dir: str = "."
    min_free_disk: int = 2**30
    message_bytes: int = 2**20
    min_bandwidth: float | None = None
    """Bytes per second below which a link is slow (the only judge of two nodes' one link)."""
    backend: str | None = None
    timeout: float = 300.0


GRACE_SECONDS = 10.0
"""The nodes' own timeouts (``--timeout``) come first; this long after, preflight gives up."""


class UsageError(Exception):
    """The options cannot be run as given; the message says why."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.usage = "ddpmon preflight [OPTIONS] TORCHRUN-OPTIONS..."
    parser.epilog = (
        "Every other option is torchrun's (--nnodes, --nproc-per-node, --node-rank, "
        "--master-addr, --master-port, --rdzv-*), as the job's torchrun gets them; run it on "
        "every node. Exit 0 healthy, 1 a slow or bad host or link is named."
    )
    parser.allow_abbrev = False  # --n... is torchrun's, never a prefix of ours
    defaults = Options()
    parser.add_argument("--json", action="store_true", help="the report as JSON on stdout")
    parser.add_argument(
        "--checkpoint-dir",
        default=defaults.checkpoint_dir,
        metavar="PATH",
        help="where the job writes checkpoints: its free space is checked (default: here)",
    )
    parser.add_argument(
        "--min-free-disk",
        type=float,
        default=defaults.min_free_disk / 2**30,
        metavar="GIB",
        help="less free space than this in --checkpoint-dir is a problem (default 1 GiB)",
    )
    parser.add_argument(
        "--message-bytes",
        type=int,
        default=defaults.message_bytes,
        metavar="BYTES",
        help="size of the messages that measure bandwidth (default 1 MiB)",
    )
    parser.add_argument(
        "--min-bandwidth",
        type=float,
        metavar="MB/S",
        help="a link slower than this is slow, whatever the others do (two nodes have one "
        "link and nothing else to compare it with)",
    )
    parser.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        help="the job's backend (default: nccl where there is a GPU, else gloo)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=defaults.timeout,
        metavar="SECONDS",
        help="give up (exit 1) when the nodes have not all reported by then (default 300)",
    )
    parse = parser.parse_known_args

    def parse_known_args(args: Any = None, namespace: Any = None) -> Any:
        ns, rest = parse(args, namespace)
        ns.torchrun = rest  # torchrun's options: checked by torchrun's own parser in `run`
        return ns, []

    parser.parse_known_args = parse_known_args  # type: ignore[method-assign]


def run(args: argparse.Namespace) -> int:
    try:
        options = Options(
            checkpoint_dir=args.checkpoint_dir,
            min_free_disk=int(args.min_free_disk * 2**30),
            message_bytes=args.message_bytes,
            min_bandwidth=args.min_bandwidth * 1e6 if args.min_bandwidth is not None else None,
            backend=args.backend,
            timeout=args.timeout,
        )
        _check_options(options)
    except UsageError as exc:
        print(f"ddpmon preflight: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return preflight(args.torchrun, options, as_json=args.json, out=sys.stdout)


def before_run(command: list[str]) -> int:
    """``ddpmon run --preflight``: the check, with the job's torchrun options, before the job;
    the report on stderr (stdout is the job's). A code other than 0 stops the run."""
    parser = _torchrun_parser()
    rest = command[1:] if command and os.path.basename(command[0]) == "torchrun" else command
    try:
        targs = parser.parse_args(rest)
    except SystemExit:
        return EXIT_USAGE
    cut = len(rest) - len(targs.training_script_args) - 1
    opts = [o for o in rest[: max(cut, 0)] if o not in ("-m", "--module")]
    return preflight(opts, Options(), as_json=False, out=sys.stderr)


def _torchrun_parser() -> argparse.ArgumentParser:
    try:
        from torch.distributed.run import get_args_parser
    except ImportError as exc:
        raise UsageError(f"preflight runs torchrun, which needs torch here ({exc})") from None
    parser = get_args_parser()
    parser.prog = "ddpmon preflight"
    return parser


def torchrun_args(torchrun_options: list[str], options: Options, result: str) -> argparse.Namespace:
    """torchrun's arguments: the job's options, starting ``ddpmon.preflight.node`` on each
    node, read by torchrun's own parser as in ``ddpmon run``."""
    for bad in ("--no-python", "--no_python", "--run-path", "--run_path", "-m", "--module"):
        if bad in torchrun_options:
            raise UsageError(f"{bad}: preflight starts its own program; leave it out")
    node_args = [
        "--result",
        result,
        "--checkpoint-dir",
        options.checkpoint_dir,
        "--min-free-disk",
        str(options.min_free_disk),
        "--message-bytes",
        str(options.message_bytes),
        "--timeout",
        repr(options.timeout),
    ]
    if options.min_bandwidth is not None:
        node_args += ["--min-bandwidth", repr(options.min_bandwidth)]
    if options.backend:
        node_args += ["--backend", options.backend]
    try:
        targs = _torchrun_parser().parse_args([*torchrun_options, "-m", NODE_MODULE, *node_args])
    except SystemExit:
        raise UsageError("torchrun could not read these options (see above)") from None
    if targs.training_script != NODE_MODULE or targs.training_script_args != node_args:
        raise UsageError(
            f"{targs.training_script!r}: preflight takes torchrun's options alone, without "
            "the script (ddpmon run --preflight ... SCRIPT checks, then runs it)"
        )
    return targs


def _check_options(options: Options) -> None:
    if not options.message_bytes >= 4:
        raise UsageError(f"--message-bytes {options.message_bytes}: expected 4 or more")
    if not options.timeout > 0:
        raise UsageError(f"--timeout {options.timeout!r}: expected seconds, more than 0")
    if options.min_free_disk < 0:
        raise UsageError("--min-free-disk: expected GiB, 0 or more")
    if options.min_bandwidth is not None and not options.min_bandwidth > 0:
        raise UsageError("--min-bandwidth: expected MB/s, more than 0")


def _give_up(timeout: float) -> None:
    """A node never arrived (torchrun waits in C++, deaf to signals): say so, end what this
    process started, exit 1."""
    print(
        f"ddpmon preflight: the nodes did not all report within {timeout:g} s (--timeout): a "
        "node did not start, has another --nnodes, or cannot reach the master address",
        file=sys.stderr,
        flush=True,
    )
    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.Error:
            pass
    os._exit(EXIT_PROBLEM)


def preflight(torchrun_options: list[str], options: Options, as_json: bool, out: TextIO) -> int:
    """Run torchrun's agent here, in this process (one start of torch less per node), over
    ``ddpmon.preflight.node``; print the report (the table, or JSON) and return its exit
    code, the same on every node."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ddpmon-preflight-") as tmp:
        result = os.path.join(tmp, "report.json")
        try:
            targs = torchrun_args(torchrun_options, options, result)
        except UsageError as exc:
            print(f"ddpmon preflight: {exc}", file=sys.stderr)
            return EXIT_USAGE
        from torch.distributed.run import run as torchrun

        timer = threading.Timer(options.timeout + GRACE_SECONDS, _give_up, (options.timeout,))
        timer.daemon = True
        timer.start()
        failure = None
        try:
            torchrun(targs)
        except BaseException as exc:  # ChildFailedError, SignalException, RendezvousError...
            if isinstance(exc, KeyboardInterrupt):
                raise
            failure = exc
        finally:
            timer.cancel()
        if not os.path.exists(result):
            print(
                f"ddpmon preflight: ended without a report ({type(failure).__name__}: "
                f"{failure}): a node did not arrive, cannot reach the master "
                "address, or failed (its error is above)",
                file=sys.stderr,
            )
            return EXIT_PROBLEM
        with open(result) as f:
            report = json.load(f)
    report["seconds"] = time.monotonic() - started
    if as_json:
        json.dump(report, out, indent=1)
        out.write("\n")
    else:
        print(table(report), file=out)
    return EXIT_OK if report["healthy"] else EXIT_PROBLEM
