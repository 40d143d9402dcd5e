"""``ddpmon capture [STATE_DIR] --rank R [--steps N] [-o FILE] [--compare R2]``: a live rank
records its next steps with torch.profiler, and the command waits for the trace.

The request goes through the job's state directory (``state/captures.py``; docs/capture.md):
no port, and no torch here; ``--compare`` reads the two traces with ``profiles.py``.

Exit codes: 0 the trace is written; 1 the rank did not answer in time (it may be hung, or
frozen); 2 bad usage or input: a rank the job does not have, or one that is not alive; 3 the
capture failed (the rank says why: torch's profiler busy, a trace over the size cap, a full
disk) or ddpmon itself failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import sys
import time
import uuid
from dataclasses import asdict, dataclass

from .. import profiles
from ..errors import StateFileError
from ..state import captures, files, schema
from .common import add_state_dir_argument, default_state_dir, no_state_dir, seconds
from .exits import EXIT_FAILED, EXIT_OK, EXIT_PROBLEM, EXIT_USAGE

HELP = (
    "Profile a live rank's next steps with torch.profiler (a Chrome/Perfetto trace), and with "
    "--compare say which operators it spends more time in than a healthy peer."
)

DEFAULT_TIMEOUT = 60.0
LEAD_SECONDS = 3.0
"""With --compare, both ranks start this far ahead of where their state files say they are:
time for both to pick up the request (at most a second each, plus a state file's age)."""
POLL_SECONDS = 0.1
PICKUP_SECONDS = 5.0
"""A rank looks for a request once a second, after it rewrites its state file: one that has
not taken it within this many of its state-file intervals (at least this many seconds) is
not listening."""


EPILOG = f"""\
The rank is asked through a file in STATE_DIR: whoever can write that directory can ask, and
no port is opened. It starts the profiler at its next step's end, runs one warm-up step, then
records N steps (CPU operators with Python stacks; CUDA kernels on a GPU); the job trains on.
Each trace stays in STATE_DIR (the last {captures.KEEP} per rank, at most \
{captures.MAX_TRACE_BYTES // 2**20} MiB each).

exit status: 0 the trace is written; 1 the rank did not reach a step's end in time (it may be
hung: run ddpmon doctor) or is frozen; 2 bad usage, a rank the job does not have, or one that
is not alive; 3 the capture failed (the rank says why: the program's own torch.profiler
running, a full disk, a trace over the cap) or ddpmon did. More: docs/capture.md"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add_state_dir_argument(parser)
    parser.add_argument(
        "--rank", type=_rank, required=True, metavar="R", help="the rank to profile"
    )
    parser.add_argument(
        "--steps",
        type=_steps,
        default=captures.DEFAULT_STEPS,
        metavar="N",
        help=f"steps to record, after one warm-up step (1 to {captures.MAX_STEPS}; "
        f"default {captures.DEFAULT_STEPS})",
    )
    parser.add_argument(
        "-o",
        "--output",
        metavar="FILE",
        help="copy the trace to FILE (it stays in STATE_DIR too; with --compare, the "
        "peer's goes to FILE with .rank<R2> before its extension)",
    )
    parser.add_argument(
        "--compare",
        type=_rank,
        metavar="R2",
        help="also profile rank R2, a healthy peer, over the same steps, and list the "
        "operators whose self time per step differs most, with their call sites",
    )
    parser.add_argument(
        "--timeout",
        type=seconds,
        default=DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help=f"how long to wait for the rank to reach a step boundary (default "
        f"{DEFAULT_TIMEOUT:.0f}); recording its steps gets more time",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the outcome (and the comparison) as JSON"
    )


@dataclass
class Target:
    """One rank being captured, as the command follows it."""

    rank: int
    state: schema.RankState
    request: captures.Request
    status: captures.Status | None = None
    recording_seen: float | None = None
    outcome: int | None = None
    message: str | None = None
    trace: str | None = None
    copied_to: str | None = None


def run(args: argparse.Namespace) -> int:
    state_dir = args.state_dir or default_state_dir("capture")
    if not state_dir:
        print(no_state_dir("capture"), file=sys.stderr)
        return EXIT_USAGE
    if not os.path.isdir(state_dir):
        print(f"ddpmon capture: {state_dir!r} is not a directory", file=sys.stderr)
        return EXIT_USAGE
    ranks = [args.rank] if args.compare is None else [args.rank, args.compare]
    if args.compare == args.rank:
        print(
            f"ddpmon capture: --compare {args.compare} names rank {args.rank} itself: compare it "
            "with another rank, a healthy one",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if args.output:
        where = os.path.dirname(os.path.abspath(args.output))
        if not os.path.isdir(where) or not os.access(where, os.W_OK):
            print(
                f"ddpmon capture: -o {args.output}: {where} is not a directory you can write to",
                file=sys.stderr,
            )
            return EXIT_USAGE
    states, problem = live_ranks(state_dir, ranks)
    if problem:
        print(f"ddpmon capture: {problem}", file=sys.stderr)
        return EXIT_USAGE
    for rank in ranks:
        busy = _request_under_way(state_dir, rank)
        if busy:
            print(f"ddpmon capture: {busy}", file=sys.stderr)
            return EXIT_USAGE
    now = time.time()
    at_step = _common_start(states) if len(ranks) == 2 else None
    targets = []
    for rank in ranks:
        state = states[rank]
        request = captures.Request(
            nonce=uuid.uuid4().hex[:16],
            rank=rank,
            job=state.job,
            pid=state.pid or 0,
            started_unix=state.started_unix or 0.0,
            steps=args.steps,
            at_step=at_step,
            requested_unix=now,
            expires_unix=now + args.timeout,
        )
        targets.append(Target(rank, state, request))
    try:
        for t in targets:
            captures.write_request(state_dir, t.request)
        _wait(state_dir, targets, args.timeout)
    finally:
        for t in targets:
            _withdraw(state_dir, t.request)
    for t in targets:
        if t.outcome == EXIT_OK and args.output:
            copy = args.output if t is targets[0] else _peer_output(args.output, t.rank)
            try:
                shutil.copyfile(t.trace or "", copy)
                t.copied_to = copy
            except OSError as exc:
                t.outcome = EXIT_FAILED
                t.message = (
                    f"cannot copy the trace to {copy} ({exc.strerror or exc}); it is at {t.trace}"
                )
    return _report(args, state_dir, targets)


# -- before asking --------------------------------------------------------------------------


def live_ranks(state_dir: str, ranks: list[int]) -> tuple[dict[int, schema.RankState], str | None]:
    """The state of each rank asked for, or what is wrong: a rank the job does not have, a
    file that cannot be read, a rank that is not alive."""
    paths = {files.rank_of(p): p for p in files.list_files(state_dir)}
    known = sorted(r for r in paths if r is not None)
    states: dict[int, schema.RankState] = {}
    for rank in ranks:
        if rank not in paths:
            has = f"the state files of ranks {_ranks(known)}" if known else "no rank state files"
            size = ""
            for p in paths.values():
                try:
                    size = f" (world size {files.read(p).world_size})"
                    break
                except StateFileError:
                    pass
            return states, (
                f"rank {rank} is not in this job: {state_dir} holds {has}{size}. Give a rank "
                "listed there (on several nodes without a shared directory, run this on "
                "the rank's node)"
            )
        try:
            state = files.read(paths[rank])
        except StateFileError as exc:
            return states, f"rank {rank}: {exc}"
        dead = _not_alive(state)
        if dead:
            return states, (
                f"rank {rank} is not alive: {dead}; there is nothing to ask "
                f"(ddpmon doctor {state_dir} says what happened)"
            )
        if not state.pid or state.started_unix is None:
            return states, (
                f"rank {rank}: its state file names no process (pid, started_unix): it was not "
                "written by a live rank"
            )
        states[rank] = state
    return states, None


def _not_alive(state: schema.RankState) -> str | None:
    """Why the rank of ``state`` is not alive, or None (alive, or on another host: unknown)."""
    if state.exit is not None:
        what = f"crashed ({state.exit.exception})" if state.exit.exception else "exited"
        return f"it {what} at step {state.step}"
    if state.stage == schema.Stage.DETACHED:
        return f"it detached from ddpmon at step {state.step} (its training ended)"
    from ..collectors import host

    liveness = host.check(
        state.host, state.pid, state.started_unix, socket.gethostname(), state.rank
    )
    if liveness.alive is False:
        return f"its process is gone ({liveness.detail}) since step {state.step}"
    return None


def _request_under_way(state_dir: str, rank: int) -> str | None:
    """Another ``ddpmon capture`` of ``rank`` waits for an answer: what to say."""
    path = captures.request_path(state_dir, rank)
    if not os.path.lexists(path):
        return None
    try:
        other = captures.read_request(path)
    except StateFileError:
        return None  # not a request the rank would take: ours replaces it
    now = time.time()
    if other.expires_unix <= now:
        return None
    return (
        f"a capture of rank {rank} was asked for {now - other.requested_unix:.0f} s ago by another "
        f"ddpmon capture, which waits {other.expires_unix - now:.0f} s more: wait for it (or remove {path})"
    )


def _common_start(states: dict[int, schema.RankState]) -> int:
    """The step count at whose boundary both ranks start: ahead of both by LEAD_SECONDS."""
    medians = [
        s.timings.step_seconds.median
        for s in states.values()
        if s.timings.step_seconds is not None and s.timings.step_seconds.median > 0
    ]
    step_seconds = max(medians) if medians else 1.0
    lead = max(2, math.ceil(LEAD_SECONDS / step_seconds))
    return max(s.step for s in states.values()) + lead


# -- waiting --------------------------------------------------------------------------------


def _wait(state_dir: str, targets: list[Target], timeout: float) -> None:
    """Follow each rank's status until it is done, fails, or stops answering."""
    started = time.monotonic()
    last_check = started
    # until every rank is done; with --compare, one rank's failure ends the wait for both
    while any(t.outcome is None for t in targets) and not any(
        t.outcome not in (None, EXIT_OK) for t in targets
    ):
        now = time.monotonic()
        for t in targets:
            if t.outcome is None:
                _follow(state_dir, t, now - started, timeout)
        if now - last_check >= 1.0:  # a rank that dies meanwhile
            last_check = now
            for t in targets:
                if t.outcome is None:
                    _check_alive(state_dir, t)
        if any(t.outcome is None for t in targets):
            time.sleep(POLL_SECONDS)


def _follow(state_dir: str, t: Target, waited: float, timeout: float) -> None:
    path = captures.status_path(state_dir, t.rank, t.request.nonce)
    if os.path.exists(path):
        try:
            t.status = captures.read_status(path)
        except StateFileError:
            pass  # (a file being replaced: read again next time)
    st = t.status
    if st is not None and st.state == "ok":
        t.trace = os.path.join(state_dir, st.trace or "")
        t.outcome = EXIT_OK if os.path.isfile(t.trace) else EXIT_FAILED
        if t.outcome != EXIT_OK:
            t.message = f"the rank wrote {st.trace}, which is no longer in {state_dir}"
        return
    if st is not None and st.state == "error":
        t.outcome, t.message = EXIT_FAILED, st.reason or "the capture failed (no reason given)"
        return
    if st is None:
        pickup = PICKUP_SECONDS * max(1.0, t.state.state_interval or 1.0)
        if waited > pickup:
            t.outcome, t.message = _not_picked_up(state_dir, t, waited)
        return
    if st.state == "accepted":
        if waited > timeout:
            if t.request.at_step is not None:
                where = f"step {t.request.at_step} (it was at step {st.step})"
            else:
                where = "a step boundary"
            t.outcome = EXIT_PROBLEM
            t.message = (
                f"rank {t.rank} did not reach {where} within {timeout:.0f} s: it may be hung; "
                f"run ddpmon doctor {state_dir}"
            )
        return
    # recording or writing: the steps asked for, each given room
    if t.recording_seen is None:
        t.recording_seen = waited
    median = t.state.timings.step_seconds.median if t.state.timings.step_seconds else 1.0
    room = timeout + (t.request.steps + captures.WARMUP_STEPS) * max(3 * median, 1.0)
    if waited - t.recording_seen > room:
        t.outcome = EXIT_PROBLEM
        t.message = (
            f"rank {t.rank} started recording at step {st.first_step} but did not finish its "
            f"{t.request.steps} steps within {room:.0f} s: it may be hung (run ddpmon doctor "
            f"{state_dir}); if it finishes, the trace appears in {state_dir}"
        )


def _not_picked_up(state_dir: str, t: Target, waited: float) -> tuple[int, str]:
    """The rank's ddpmon thread did not take the request: why, as far as its state file tells."""
    path = files.path_for(state_dir, t.rank)
    try:
        written = os.stat(path).st_mtime
    except OSError:
        written = None
    if written is not None and written < t.request.requested_unix:
        return EXIT_PROBLEM, (
            f"rank {t.rank} did not pick up the request within {waited:.0f} s, and its state "
            f"file has not been rewritten since ({time.time() - written:.0f} s ago): the "
            "process is frozen (stopped, or stuck holding Python's lock); run ddpmon "
            f"doctor {state_dir}"
        )
    busy = [
        c
        for c in captures.listing(state_dir)
        if c.rank == t.rank
        and c.status is not None
        and c.status.state not in captures.DONE
        and c.nonce != t.request.nonce
        and c.status.written_unix >= (t.state.started_unix or 0.0)
    ]  # (this run's)
    if busy:
        st = busy[-1].status
        assert st is not None
        return EXIT_FAILED, (
            f"rank {t.rank} did not pick up the request within {waited:.0f} s: it is still "
            f"busy with an earlier capture ({st.state}, {st.steps} steps, asked for at its step "
            f"{st.step}); wait for it and ask again"
        )
    return EXIT_FAILED, (
        f"rank {t.rank} did not pick up the request within {waited:.0f} s although it "
        f"rewrites its state file: its ddpmon ({t.state.version or 'an unknown version'}) "
        "may predate captures, or its captures switched off after a failure (see "
        f"'errors' in {path})"
    )


def _check_alive(state_dir: str, t: Target) -> None:
    try:
        state = files.read(files.path_for(state_dir, t.rank))
    except StateFileError:
        state = t.state
    dead = _not_alive(state)
    if dead:
        t.outcome = EXIT_USAGE
        t.message = f"rank {t.rank} is not alive: {dead}, before its capture was done"


def _withdraw(state_dir: str, request: captures.Request) -> None:
    """Remove our request if the rank has not taken it (a timeout, ^C, a failure)."""
    path = captures.request_path(state_dir, request.rank)
    try:
        if captures.read_request(path).nonce == request.nonce:
            os.unlink(path)
    except (StateFileError, OSError):
        pass


# -- after ----------------------------------------------------------------------------------


def _report(args: argparse.Namespace, state_dir: str, targets: list[Target]) -> int:
    failed = [t for t in targets if t.outcome not in (None, EXIT_OK)]
    for t in failed:
        print(f"ddpmon capture: rank {t.rank}: {t.message}", file=sys.stderr)
    for t in targets:
        if t.outcome is None:
            t.message = f"not waited for, since the capture of rank {failed[0].rank} failed"
            print(f"ddpmon capture: rank {t.rank}: {t.message}", file=sys.stderr)
    comparison = None
    lines = []
    if not failed:
        for t in targets:
            st = t.status
            assert st is not None and t.trace is not None
            lines.append(
                f"rank {t.rank}: steps {st.first_step} to {st.last_step} recorded ({st.steps} steps): "
                f"{t.trace} ({(st.trace_bytes or 0) / 2**20:.1f} MiB)"
                + (f", copied to {t.copied_to}" if t.copied_to else "")
            )
        lines.append("open a trace in https://ui.perfetto.dev or chrome://tracing")
        if len(targets) == 2:
            slow, peer = targets
            a, b = profiles.read(slow.trace or ""), profiles.read(peer.trace or "")
            comparison = profiles.as_json(a, b)
            if slow.status and peer.status and slow.status.first_step != peer.status.first_step:
                lines.append(
                    f"note: the ranks recorded different steps (rank {slow.rank} from step "
                    f"{slow.status.first_step}, rank {peer.rank} from step {peer.status.first_step})"
                )
            lines += profiles.summary(slow.rank, a, peer.rank, b)
    if args.json:
        print(
            json.dumps(
                {
                    "ranks": [
                        {
                            "rank": t.rank,
                            "outcome": t.outcome,
                            "message": t.message,
                            "trace": t.trace,
                            "copied_to": t.copied_to,
                            "status": asdict(t.status) if t.status else None,
                        }
                        for t in targets
                    ],
                    "comparison": comparison,
                },
                indent=1,
            )
        )
    else:
        for text in lines:
            print(text)
    codes = [t.outcome for t in failed]
    if EXIT_USAGE in codes:
        return EXIT_USAGE
    return max(codes, default=EXIT_OK)  # type: ignore[return-value, type-var]


def _peer_output(output: str, rank: int) -> str:
    stem, ext = os.path.splitext(output)
    return f"{stem}.rank{rank}{ext}"


def _ranks(ranks: list[int]) -> str:
    if len(ranks) > 8:
        return f"{ranks[0]} to {ranks[-1]} ({len(ranks)} files)"
    return ", ".join(map(str, ranks))


# -- argument types ---------------------------------------------------------------------------


def _integer(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None


def _rank(text: str) -> int:
    value = _integer(text, "a rank (a whole number from 0)")
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a rank (a whole number from 0)")
    return value


def _steps(text: str) -> int:
    value = _integer(text, "a number of steps")
    if not 1 <= value <= captures.MAX_STEPS:
        raise argparse.ArgumentTypeError(
            f"{value} steps: a capture records 1 to {captures.MAX_STEPS} (the profiler holds every "
            "event in memory until the end)"
        )
    return value
