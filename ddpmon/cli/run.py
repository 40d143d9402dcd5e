"""``ddpmon run [OPTIONS] TORCHRUN-ARGS... SCRIPT [ARGS...]``: monitor a job without changing it.

    ddpmon run --nproc-per-node=2 train.py --lr 0.1     # torchrun's own arguments
    ddpmon run python train.py                          # a script that starts its own ranks

Every rank runs the script through ``python -m ddpmon.launch``, which attaches ddpmon to each
DistributedDataParallel model the script builds (torchrun form: ``torchrun ARGS --no-python
PYTHON -u -mddpmon.launch SCRIPT ARGS``, so that torchrun names a failure after the script).
Where torchrun runs on this Python, it runs as ``python -m ddpmon.agent ARGS ...``: torchrun
itself, recording what its rendezvous tries (``ddpmon/agent.py``).
In the ``python`` form (another launcher program, and
torchrun's ``--no-python`` and ``--run-path``) ddpmon does not start the ranks, so the run
puts a ``sitecustomize`` of its own in a temporary directory on PYTHONPATH, for this run's
processes only: it calls ``ddpmon.launch.install()``, then the ``sitecustomize`` it stands in
front of, if any, and is removed when the run ends. Options are ``DDPMON_*`` variables, set here by the flags for the
children. The exit status is the command's (128 + N when a signal N ended it).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Any

from .. import goodput
from ..config import (
    DEBUG_SERVER_INTERVAL,
    DEBUG_SERVER_INTERVAL_VAR,
    DEBUG_SERVER_PACKAGES,
    DEBUG_SERVER_PORT_VAR,
    Config,
)
from ..errors import ConfigError
from ..state import attempts, launcher
from .exits import EXIT_OK, EXIT_USAGE

if TYPE_CHECKING:
    from ..agent import Record

HELP = "Run a training script under torchrun (or python) with ddpmon attached to every DDP model."

_OWN_FLAGS_WITH_VALUE = (
    "--job",
    "--state-dir",
    "--port",
    "--option",
    "-o",
    "--debug-server-interval",
)
_OWN_FLAGS_WITHOUT_VALUE = (
    "-h",
    "--help",
    "-v",
    "--verbose",
    "--debug-server",
    "--preflight",
)  # --debug-server=PORT too
DEBUG_SERVER_PORT = 25999  # torch's own default
_PYTHON = re.compile(r"python[0-9.]*(\.exe)?")

SITECUSTOMIZE = '''\
"""Written by `ddpmon run` for the processes of one run, and removed when it ends."""
import importlib.machinery as _machinery
import importlib.util as _util
import os as _os
import sys as _sys

_here = _os.path.dirname(_os.path.abspath(__file__))
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _here]
try:
    try:
        import ddpmon.launch
    except ImportError:  # this interpreter lacks ddpmon: take the launcher's, at the end
        _sys.path.append({ddpmon_parent!r})
        try:
            import ddpmon.launch
        finally:
            _sys.path.remove({ddpmon_parent!r})
    ddpmon.launch.install()
except Exception as _exc:
    _sys.stderr.write("ddpmon run: this process is not monitored: %r\\n" % (_exc,))
# the sitecustomize this one stands in front of, if there is one, runs as usual
_spec = _machinery.PathFinder.find_spec("sitecustomize", _sys.path)
if _spec is not None and _spec.loader is not None:
    _module = _util.module_from_spec(_spec)
    _sys.modules["sitecustomize"] = _module
    _spec.loader.exec_module(_module)
'''


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.usage = "ddpmon run [OPTIONS] [TORCHRUN-ARGS...] SCRIPT [ARGS...] | ddpmon run [OPTIONS] python SCRIPT [ARGS...]"
    parser.epilog = (
        "ddpmon's options come first; everything from the first other argument on is "
        "torchrun's (or the python command line). Any option can also be a DDPMON_* variable."
    )
    parser.add_argument(
        "--job",
        help="job name: the `job` label and the state directory's name "
        "(default: torchrun's --rdzv-id, else SCRIPT-YYYYMMDD-HHMMSS)",
    )
    parser.add_argument(
        "--state-dir", help="directory of the state files (default: <tmp>/ddpmon-<uid>/JOB)"
    )
    parser.add_argument(
        "--port",
        help="base metrics port: LOCAL_RANK k serves on PORT+k; 0 = ephemeral; "
        "negative = off (default 9500)",
    )
    parser.add_argument(
        "-o",
        "--option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="any other ddpmon option, as for attach() (repeatable): "
        "-o hang_timeout=120 -o bucket_timing=hook",
    )
    parser.add_argument(
        "--debug-server",
        nargs="?",
        const=DEBUG_SERVER_PORT,
        type=int,
        metavar="PORT",
        help="also start torch's debug server (torch.distributed.debug) in every rank: "
        f"rank 0 serves its pages on PORT (--debug-server=PORT; default {DEBUG_SERVER_PORT}) "
        "and dumps every rank's stacks into STATE_DIR/debug-server/. Experimental in "
        "torch, and not secure: it binds every interface without authentication (trusted "
        "networks only). Needs jinja2, aiohttp and tabulate: pip install 'ddpmon[debug-server]'",
    )
    parser.add_argument(
        "--debug-server-interval",
        type=float,
        metavar="SECONDS",
        help=f"seconds between the debug server's dumps (default {DEBUG_SERVER_INTERVAL:g})",
    )
    parser.add_argument(
        "--preflight",
        action="store_true",
        help="first run `ddpmon preflight` with the same torchrun options; stop (exit 1) "
        "when it names a slow or bad host or link",
    )
    parser.add_argument(
        "command", nargs=argparse.REMAINDER, metavar="TORCHRUN-ARGS... SCRIPT [ARGS...]"
    )
    _stop_at_command(parser)


def _stop_at_command(parser: argparse.ArgumentParser) -> None:
    """ddpmon's own flags are those before the command: the rest is torchrun's, unparsed
    (argparse would reject torchrun's flags as unknown)."""
    parse = parser.parse_known_args

    def parse_known_args(args: Any = None, namespace: Any = None) -> Any:
        args = list(sys.argv[1:] if args is None else args)
        i = 0
        while i < len(args):
            arg = args[i]
            if arg == "--":
                head, rest = args[:i], args[i + 1 :]
                break
            if (
                arg in _OWN_FLAGS_WITHOUT_VALUE
                or arg.startswith("--debug-server=")
                or (arg.startswith("-o") and len(arg) > 2 and not arg.startswith("--"))
            ):
                i += 1
            elif arg.split("=", 1)[0] in _OWN_FLAGS_WITH_VALUE:
                i += 1 if "=" in arg else 2
            else:
                head, rest = args[:i], args[i:]
                break
        else:
            head, rest = args, []
        ns, extra = parse(head, namespace)
        ns.command = rest
        return ns, extra

    parser.parse_known_args = parse_known_args  # type: ignore[method-assign]


@dataclasses.dataclass
class Plan:
    argv: list[str]
    sitecustomize: bool  # the processes are not started by ddpmon: reach them through site
    script: str
    rdzv_id: str | None = None


class UsageError(Exception):
    """The command line cannot be run as given; the message says why."""


def run(args: argparse.Namespace) -> int:
    """Start the command with ddpmon reaching its ranks; its exit status is ours."""
    early = None
    try:
        env = _child_env(args)
        early = _starting(args.command, env)
        plan = plan_command(args.command)
        if early is not None and not early.fits(plan):
            early.record.discard()  # the job is named from torch's own reading instead
            early = None
        env = early.env if early is not None else env
        job, state_dir = _job_and_state_dir(env, plan)
        if args.debug_server is not None:
            _check_debug_server(args, plan, env)
        if args.preflight and plan.sitecustomize:
            raise UsageError("--preflight needs torchrun's arguments (the nodes), not a command")
    except (UsageError, ConfigError) as exc:
        if early is not None:
            early.record.discard()
        print(f"ddpmon run: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"ddpmon run: job {job!r}, state files in {state_dir or '(off)'}", file=sys.stderr)
    if args.debug_server is not None:
        dumps = f"; dumps into {os.path.join(state_dir, 'debug-server')}" if state_dir else ""
        print(
            f"ddpmon run: torch's debug server: http://<rank 0's host>:{args.debug_server}/{dumps} "
            "(not secure: trusted networks only)",
            file=sys.stderr,
        )
    if args.preflight:
        from .preflight import before_run

        code = before_run(args.command)
        if code != EXIT_OK:
            return code
    sitedir = None
    try:
        if plan.sitecustomize:
            sitedir = tempfile.mkdtemp(prefix="ddpmon-run-")
            with open(os.path.join(sitedir, "sitecustomize.py"), "w") as f:
                f.write(SITECUSTOMIZE.format(ddpmon_parent=_ddpmon_parent()))
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (sitedir, env.get("PYTHONPATH", "")) if p
            )
        if early is not None:  # the agent goes on with it from its own start
            early.record.stop()
            handed, early.record.path = early.record.path, None  # written by the agent alone
            if handed is not None:
                env[launcher.HANDOFF_VARIABLE] = handed
        code = _run_child(plan.argv, env)
    finally:
        if early is not None:
            early.record.stop()
        if sitedir:
            shutil.rmtree(sitedir, ignore_errors=True)
    _print_summary(code, state_dir)
    return code


@dataclasses.dataclass
class Early:
    """The launcher's record that ``ddpmon run`` writes from its start, before torch loads
    (``ddpmon run`` reads torchrun's arguments with torch's parser), and hands to its agent."""

    record: Record
    script: str
    rdzv_id: str | None
    env: dict[str, str]
    """The children's environment, with the job and state directory the record is in."""

    def fits(self, plan: Plan) -> bool:
        """torch's reading of the command names the same job, and torchrun runs as the agent."""
        return (
            plan.argv[1:3] == ["-m", "ddpmon.agent"]
            and plan.script == self.script
            and plan.rdzv_id == self.rdzv_id
        )


def _starting(command: list[str], env: dict[str, str]) -> Early | None:
    """Where torchrun will run as ``ddpmon.agent``: the launcher's record in stage
    ``starting`` (the command and what its arguments expect), so that the doctor says the
    job is starting while torch loads, and the job and state directory fixed from a reading
    of the arguments without torch (``plan_command`` checks it against torch's). None
    otherwise, or when the record cannot be written (said once)."""
    torchrun = _torchrun(command)
    if torchrun is None or _ranks_python(torchrun) != sys.executable:
        return None
    rest = command[1:] if torchrun == command[:1] else list(command)
    reading = launcher.read_argv(rest)
    if not reading.command or not reading.starts_python:
        return None
    from .. import agent

    env = dict(env)
    try:
        _job_and_state_dir(env, Plan([], False, reading.command[0], reading.rdzv_id))
        state = launcher.starting(reading, socket.gethostname(), os.getpid(), time.time(), None)
        record = agent.open_record(state, environ=env)
    except Exception as exc:  # (bad options are said by plan_command and the checks after)
        if not isinstance(exc, (ConfigError, UsageError)):
            print(f"ddpmon run: the launcher's record is off: {exc!r}", file=sys.stderr)
        return None
    return None if record is None else Early(record, reading.command[0], reading.rdzv_id, env)


def _torchrun(command: list[str]) -> list[str] | None:
    """The torchrun that ``command`` (torchrun's arguments) would start; None for a python
    command line or a launcher of its own."""
    first = os.path.basename(command[0]) if command else ""
    if not command or _PYTHON.fullmatch(first) or command[0] == sys.executable:
        return None
    if first == "torchrun":
        return [command[0]]
    if (
        not command[0].startswith("-")
        and not command[0].endswith(".py")
        and shutil.which(command[0])
    ):
        return None
    return [sys.executable, "-m", "torch.distributed.run"]


def plan_command(command: list[str]) -> Plan:
    """How to start ``command`` (torchrun's arguments, or a python command line)."""
    if not command:
        raise UsageError(
            "name what to run: ddpmon run --nproc-per-node=2 train.py [ARGS...], "
            "or ddpmon run python train.py [ARGS...]"
        )
    launcher = _torchrun(command)
    if launcher is None:  # python, or a launcher of its own: accelerate launch, a shell script
        return Plan(list(command), True, _python_target(command[1:]))
    rest = command[1:] if launcher == command[:1] else list(command)
    try:
        from torch.distributed.run import get_args_parser
    except ImportError as exc:
        raise UsageError(
            f"torchrun's arguments need torch here ({exc}); with another "
            "interpreter's torch use: ddpmon run /path/to/python -m torch.distributed.run ..."
        ) from None

    parser = get_args_parser()
    parser.prog = "ddpmon run"
    try:
        targs = parser.parse_args(rest)
    except SystemExit:
        raise UsageError("torchrun could not read these arguments (see above)") from None
    cut = len(rest) - len(targs.training_script_args) - 1
    if cut < 0 or rest[cut] != targs.training_script:
        raise UsageError(
            f"cannot tell torchrun's arguments from the script's in {rest!r}: "
            "put ddpmon's options first, then torchrun's, then SCRIPT and its arguments"
        )
    opts, script, script_args = rest[:cut], rest[cut], rest[cut + 1 :]
    rdzv_id = targs.rdzv_id if targs.rdzv_id and targs.rdzv_id != "none" else None
    if targs.no_python or targs.run_path:  # torchrun does not start `python`: reach it through site
        return Plan(launcher + rest, True, script, rdzv_id)
    shim = ["-m", "ddpmon.launch"]
    python = _ranks_python(launcher)
    if python == sys.executable:  # torchrun's agent in a process that records what it tries
        launcher = [sys.executable, "-m", "ddpmon.agent"]
    if python is not None:
        # torchrun names a failure ("train.py FAILED") after the first argument of the rank's
        # python command line without a leading "-": -mddpmon.launch leaves that to the script
        shim = ["--no-python", python, "-u", "-mddpmon.launch"]
    if targs.module:
        opts = [o for o in opts if o not in ("-m", "--module")]
        shim += ["-m"]
    return Plan(launcher + opts + shim + [script] + script_args, False, script, rdzv_id)


def _ranks_python(launcher: list[str]) -> str | None:
    """The python torchrun would start the ranks with (``PYTHON_EXEC``, else its own
    interpreter: this one, or the one its script's ``#!`` line names), None when not known."""
    if os.environ.get("PYTHON_EXEC"):
        return os.environ["PYTHON_EXEC"]
    if launcher[0] == sys.executable:
        return sys.executable
    try:
        with open(shutil.which(launcher[0]) or launcher[0], "rb") as f:
            first = f.readline(512).decode("utf-8", "replace")
    except OSError:
        return None
    python = first[2:].split()[0] if first.startswith("#!") and first[2:].split() else ""
    return python if os.path.isabs(python) and _PYTHON.fullmatch(os.path.basename(python)) else None


def _check_debug_server(args: argparse.Namespace, plan: Plan, env: dict[str, str]) -> None:
    """``--debug-server``: its values, and (where the ranks run this Python) torch's debug
    server and the packages its frontend imports, before any rank starts."""
    if not 0 < args.debug_server < 65536:
        raise UsageError(f"--debug-server={args.debug_server}: expected a port, 1 to 65535")
    interval = (
        DEBUG_SERVER_INTERVAL if args.debug_server_interval is None else args.debug_server_interval
    )
    if not interval > 0:
        raise UsageError(f"--debug-server-interval {interval!r}: expected seconds, more than 0")
    env[DEBUG_SERVER_PORT_VAR] = str(args.debug_server)
    env[DEBUG_SERVER_INTERVAL_VAR] = repr(float(interval))
    if plan.sitecustomize and plan.argv[0] != sys.executable:
        return  # another interpreter: its ranks say so themselves, one warning each
    import importlib

    try:
        importlib.import_module("torch.distributed.debug")
    except ImportError as exc:
        import torch

        raise UsageError(
            f"--debug-server needs torch.distributed.debug, which torch {torch.__version__} "
            f"here cannot import ({exc}): use a torch that has it, or leave --debug-server "
            "out"
        ) from None
    broken = []
    for name in DEBUG_SERVER_PACKAGES:
        try:
            importlib.import_module(name)
        except Exception as exc:  # ImportError, or a package broken another way
            broken.append(f"{name} ({exc})")
    if broken:
        raise UsageError(
            f"--debug-server needs {', '.join(DEBUG_SERVER_PACKAGES)} in the ranks' Python; "
            f"missing or broken here: {'; '.join(broken)}. Fix: pip install "
            f"'ddpmon[debug-server]' (or pip install {' '.join(DEBUG_SERVER_PACKAGES)})"
        )


def _python_target(args: list[str]) -> str:
    """The script (or ``-m`` module) of a command line, for the job's name."""
    for arg in args:
        if arg.endswith(".py"):
            return arg
    for i, arg in enumerate(args):
        if arg == "-m" and i + 1 < len(args):
            return args[i + 1]
        if arg == "-c":
            return "python"
        if not arg.startswith("-"):
            return arg
    return "python"


def _child_env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    names = {f.name for f in dataclasses.fields(Config)} - {"comm_state"}
    given = [("job", args.job), ("state_dir", args.state_dir), ("port", args.port)]
    for item in args.option:
        name, sep, value = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in names:
            raise UsageError(
                f"-o {item!r}: expected NAME=VALUE with NAME one of {', '.join(sorted(names))}"
            )
        given.append((name, value))
    for name, value in given:
        if value is not None:
            env["DDPMON_" + name.upper()] = value
    return env


def _job_and_state_dir(env: dict[str, str], plan: Plan) -> tuple[str, str | None]:
    """Fix the job and state directory for every rank now, so the end can say where they are."""
    if not env.get("DDPMON_JOB"):
        stem = os.path.splitext(os.path.basename(plan.script.rstrip("/")))[0] or "job"
        # the launcher's pid: two runs of one script started in the same second differ
        env["DDPMON_JOB"] = plan.rdzv_id or f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    config = Config.from_env(env)  # bad values stop here, before any rank starts
    job = config.resolved_job(env)
    state_dir = config.resolved_state_dir(job)
    env["DDPMON_STATE_DIR"] = os.path.abspath(state_dir) if state_dir is not None else ""
    return job, env["DDPMON_STATE_DIR"] or None


def _ddpmon_parent() -> str:
    import ddpmon

    return os.path.dirname(os.path.dirname(os.path.abspath(ddpmon.__file__)))


def _run_child(argv: list[str], env: dict[str, str]) -> int:
    try:
        proc = subprocess.Popen(argv, env=env)
    except OSError as exc:
        print(f"ddpmon run: cannot start {argv[0]!r}: {exc}", file=sys.stderr)
        return 127 if isinstance(exc, FileNotFoundError) else 126

    def forward(signum: int, _frame: Any) -> None:
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            pass

    # TERM and HUP sent to the launcher are passed on; so is INT sent to it alone (`kill -INT
    # PID`), but not the terminal's Ctrl-C, which reaches the whole foreground process group,
    # the command included: passed on, it would reach the command twice.
    previous = {
        sig: signal.signal(sig, handler)
        for sig, handler in (
            (signal.SIGINT, lambda *_: None),
            (signal.SIGTERM, forward),
            (signal.SIGHUP, forward),
        )
    }
    try:
        code = _wait_passing_on_interrupts(proc, forward)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - code if code < 0 else code


SI_KERNEL = 0x80
"""``si_code`` of a signal the kernel sent: the terminal's Ctrl-C, to the foreground group."""


def _wait_passing_on_interrupts(proc: subprocess.Popen[Any], forward: Any) -> int:
    """Wait for ``proc``; a SIGINT that a process sent (``si_code`` not the kernel's) is
    passed on to it, as torchrun ends the job on one. Where ``sigtimedwait`` is missing
    (not Linux), SIGINT is left to the process group."""
    if not hasattr(signal, "sigtimedwait"):
        return proc.wait()
    signal.pthread_sigmask(
        signal.SIG_BLOCK, {signal.SIGINT}
    )  # (after the start: the child keeps it open)
    try:
        while proc.poll() is None:
            info = signal.sigtimedwait({signal.SIGINT}, 0.2)
            if info is not None and info.si_code != SI_KERNEL:
                forward(signal.SIGINT, None)
        return proc.wait()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _print_summary(code: int, state_dir: str | None) -> None:
    out = sys.stderr
    if state_dir is None:
        print(f"ddpmon run: exit status {code}; state files were off", file=out)
        return
    found = []  # (directory, number of rank files): the first model's, then model-k/
    for root, dirs, files in sorted(os.walk(state_dir)) if os.path.isdir(state_dir) else []:
        dirs[:] = [d for d in dirs if not attempts.is_attempt_dir(d)]  # earlier attempts: below
        ranks = [f for f in files if re.fullmatch(r"rank-\d+\.json", f)]
        if ranks:
            found.append((root, len(ranks)))
    if not found:
        print(
            f"ddpmon run: exit status {code}; no state file in {state_dir} (did the script "
            "build a torch.nn.parallel.DistributedDataParallel model?)",
            file=out,
        )
        return
    listed = ", ".join(
        f"{os.path.relpath(d, state_dir) + '/: ' if d != state_dir else ''}"
        f"{n} rank{'s' if n != 1 else ''}"
        for d, n in found
    )
    print(f"ddpmon run: exit status {code}; state files in {state_dir} ({listed})", file=out)
    for directory, _ in found:
        print(f"  ddpmon doctor {directory}\n  ddpmon report {directory}", file=out)
    spent = goodput.text(goodput.of_dirs([found[0][0]]))
    if spent:
        print(f"ddpmon run: {spent}", file=out)
    earlier = attempts.earlier(state_dir)
    if earlier:
        print(
            f"ddpmon run: {len(earlier) + 1} attempts; before the last, "
            + "; ".join(
                f"attempt {n} (files in {os.path.relpath(d, state_dir)}/)" for n, d in earlier
            ),
            file=out,
        )
