"""The rank's own samples for the activity rule (``ddpmon/activity.py``): the main thread's
stack (``sys._current_frames``: cheap, no signal, no ptrace) and where it stands in its
loops (the bytecode's backward jumps), its CPU time, the time the process's threads ran and
waited for a CPU (Linux's per-thread ``schedstat``) and the bytes the process read and
wrote (``/proc/self/io``); and what the peers a waiting rank waits for are doing, from
their state files. Runs on the watchdog's thread, inside the training process."""

from __future__ import annotations

import bisect
import dis
import functools
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import psutil

from ..activity import Status, classify
from ..frames import is_library, short_path
from ..state import files, schema

SAMPLE_SECONDS = 1.0
"""Seconds between samples of the main thread."""

_FRAMES = 16
_CALLERS = 8
"""User frames kept beyond the innermost (``Activity.callers``)."""


class Sampler:
    """Samples the main thread's stack and CPU time, the time the process's threads ran and
    waited for a CPU, and the process's I/O; ``activity()`` classifies. Called from the
    watchdog thread; ``sample()`` is rate-limited.

    The shares are measured over the seconds the stack has been still (at least the last
    two samples): the evidence for stuck is the same stretch of time as the stillness, so
    the work before a stall does not hide it, and a thread that works with a stack that
    looks still (a loop inside one line) shows its work over the whole stretch."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        times: Callable[[], tuple[float, float, float]] | None = None,
        io: Callable[[], int] | None = None,
        runnable: Callable[[], bool] | None = None,
    ) -> None:
        """``times``, ``io`` and ``runnable`` replace the readings of (main thread's CPU
        seconds, the process's threads' seconds running, and waiting for a CPU), of the
        process's I/O bytes, and of whether the main thread is runnable now (tests; with
        ``times`` given and no ``runnable``, it never is)."""
        self._clock = clock
        self._read_times = times or self._times
        self._read_io = io or _io_bytes
        main = threading.main_thread()
        self._ident = main.ident
        self._main_tid = str(getattr(main, "native_id", "") or "")
        self._main_thread: psutil.Process | None = None
        self._read_runnable = runnable or ((lambda: False) if times else self._main_runnable)
        self._schedstat = os.path.isdir("/proc/self/task")
        try:
            self._cpu_clock: int | None = time.pthread_getcpuclockid(main.ident)  # type: ignore[arg-type]
        except Exception:
            self._cpu_clock = None
        self._threads: dict[
            str, tuple[int, int]
        ] = {}  # thread id -> (ns run, ns waited), last read
        self._ran = self._waited = (
            0  # ns, summed over the threads seen (threads that end keep theirs)
        )
        self._signature: tuple[Any, ...] | None = None
        self._changed = clock()
        self._where: str | None = None
        self._callers: list[str] = []
        self._loops: list[list[int]] = []
        self._samples: deque[tuple[float, float, float, float, int, bool]] = deque(maxlen=8)
        """(t, main thread's CPU, threads' run, threads' wait (seconds), I/O bytes, the main
        thread runnable)"""
        self._last = -1e18

    def sample(self) -> None:
        now = self._clock()
        if now - self._last < SAMPLE_SECONDS * 0.9:
            return
        self._last = now
        frame = sys._current_frames().get(self._ident)  # type: ignore[arg-type]
        signature = []
        user: list[str] = []
        loops = []
        depth = 0
        while frame is not None and depth < 256:
            code = frame.f_code
            if depth < _FRAMES:
                signature.append((code, frame.f_lineno))
            if len(user) <= _CALLERS and not (
                is_library(code.co_filename) or code.co_filename.startswith("<")
            ):
                user.append(f"{short_path(code.co_filename)}:{frame.f_lineno} in {code.co_name}")
                loops.append(loop_lines(code, frame.f_lasti))
            frame = frame.f_back
            depth += 1
        del frame
        sig = tuple(signature)
        if sig != self._signature:
            self._signature, self._changed = sig, now
        self._where = user[0] if user else None
        self._callers = user[1:]
        self._loops = loops
        main, ran, waited = self._read_times()
        self._samples.append((now, main, ran, waited, self._read_io(), self._read_runnable()))

    def _times(self) -> tuple[float, float, float]:
        """(seconds the main thread ran, seconds the process's threads ran, seconds they
        were ready to run and waited for a CPU), from Linux's per-thread schedstat; else
        the CPU clocks (no waiting known)."""
        if self._schedstat:
            try:
                tids = os.listdir("/proc/self/task")
            except OSError:
                tids = []
            now: dict[str, tuple[int, int]] = {}
            for tid in tids:
                try:
                    with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
                        ran, waited = f.read().split()[:2]
                    now[tid] = (int(ran), int(waited))
                except (OSError, ValueError):
                    continue
            if now:
                for tid, (ran_ns, waited_ns) in now.items():
                    before = self._threads.get(tid, (0, 0))
                    self._ran += max(0, ran_ns - before[0])
                    self._waited += max(0, waited_ns - before[1])
                self._threads = now
                main = now.get(self._main_tid)
                return (
                    (main[0] / 1e9 if main else self._main_cpu()),
                    self._ran / 1e9,
                    self._waited / 1e9,
                )
            self._schedstat = False
        return self._main_cpu(), time.process_time(), 0.0

    def _main_runnable(self) -> bool:
        """The main thread is running or waits for a CPU (state R in /proc), not asleep."""
        try:
            if self._main_thread is None:  # (Linux lists a thread as a process of its own)
                self._main_thread = psutil.Process(int(self._main_tid))
            return bool(self._main_thread.status() == psutil.STATUS_RUNNING)
        except (psutil.Error, ValueError):
            return False

    def _main_cpu(self) -> float:
        if self._cpu_clock is not None:
            try:
                return time.clock_gettime(self._cpu_clock)
            except OSError:
                self._cpu_clock = None
        return time.process_time()

    def shares(self) -> tuple[float, float, float, float]:
        """(main thread's CPU share, share of the time the process's threads ran or waited
        for a CPU (summed over them, at most 1), the share they waited, I/O bytes per
        second) since the stack took its present shape (at least over the last two
        samples)."""
        samples = list(self._samples)
        window = [s for s in samples if s[0] >= self._changed]
        if len(window) < 2:
            window = samples[-2:]
        if len(window) < 2 or window[-1][0] <= window[0][0]:
            return 0.0, 0.0, 0.0, 0.0
        (t0, m0, r0, w0, b0, _), (t1, m1, r1, w1, b1, _) = window[0], window[-1]
        span = t1 - t0
        cpu = min(1.0, max(0.0, (m1 - m0) / span))
        waited = max(0.0, (w1 - w0) / span)
        if all(s[5] for s in window):
            # Runnable at every sample, yet it hardly ran: it waits for a CPU. Linux adds a
            # wait to schedstat only once the thread runs again, so a thread starved for
            # the whole stretch shows no wait there at all.
            waited = max(waited, 1.0 - cpu)
        runnable = min(1.0, max(0.0, (r1 - r0) / span) + waited)
        return cpu, runnable, min(runnable, waited), max(0.0, (b1 - b0) / span)

    def activity(
        self,
        idle: float,
        in_flight: bool,
        timeout: float | None,
        now_unix: float,
        gpu_behind: float | None = None,
    ) -> schema.Activity:
        now = self._clock()
        cpu_share, runnable_share, wait_share, io_rate = self.shares()
        still_for = now - self._changed
        state = classify(
            idle, in_flight, still_for, cpu_share, io_rate, timeout, runnable_share, gpu_behind
        )
        return schema.Activity(
            state=state,
            sampled_unix=now_unix,
            still_seconds=round(still_for, 3),
            cpu_share=round(cpu_share, 3),
            runnable_share=round(runnable_share, 3),
            wait_share=round(wait_share, 3),
            io_bytes_per_second=round(io_rate),
            where=self._where,
            callers=list(self._callers),
            loops=list(self._loops),
            hang_timeout_seconds=timeout,
            gpu_behind_seconds=None if gpu_behind is None else round(gpu_behind, 3),
        )


def loop_lines(code: Any, offset: int) -> list[int]:
    """[first line, last line] of the innermost loop of ``code`` that the instruction at
    ``offset`` is in ([] when in none): where a rank stands relative to its training loop."""
    inside = [loop for loop in _loops(code) if loop[0] <= offset <= loop[1]]
    if not inside:
        return []
    first, last = min(inside, key=lambda loop: loop[1] - loop[0])[2:]
    return [first, last]


@functools.lru_cache(maxsize=1024)
def _loops(code: Any) -> tuple[tuple[int, int, int, int], ...]:
    """(first offset, last offset, first line, last line) of each loop in ``code``: the
    instructions from a backward jump's target to the jump (``for``, ``while``, and
    comprehensions compiled inline)."""
    try:
        starts = [(offset, line) for offset, line in dis.findlinestarts(code) if line is not None]
        instructions = list(dis.get_instructions(code))
    except Exception:
        return ()
    offsets = [offset for offset, _ in starts]

    def line_at(offset: int) -> int | None:
        i = bisect.bisect_right(offsets, offset) - 1
        return starts[i][1] if i >= 0 else None

    jumps = set(dis.hasjrel) | set(dis.hasjabs)
    out = []
    for ins in instructions:
        target = ins.argval
        if (
            ins.opcode in jumps
            and isinstance(target, int)
            and target < ins.offset
            and ins.opname != "JUMP_BACKWARD_NO_INTERRUPT"
        ):  # that one is await's, not a loop
            lines = [
                line
                for i in instructions
                if target <= i.offset <= ins.offset and (line := line_at(i.offset)) is not None
            ]
            if lines:
                out.append((target, ins.offset, min(lines), max(lines)))
    return tuple(out)


def _io_bytes() -> int:
    """Bytes the process has read and written (Linux ``/proc/self/io``; 0 elsewhere)."""
    try:
        with open("/proc/self/io", "rb") as f:
            total = 0
            for line in f:
                if line.startswith((b"rchar:", b"wchar:")):
                    total += int(line.split()[1])
            return total
    except (OSError, ValueError):
        return 0


MAX_PEER_FILES = 64
"""Beyond this many ranks the watchdog does not read its peers' files (the doctor does)."""


def holdouts(state_file: str, entry: schema.Collective, now: float) -> str | None:
    """What the peers that have not joined ``entry`` (this rank's collective) are doing,
    from their state files beside ``state_file``: ``busy`` when every one of them is busy
    (a checkpoint, an evaluation) or stepping, else ``stuck`` (stuck, dead, gone), None
    when unknown."""
    state_dir = os.path.dirname(state_file)
    try:
        paths = files.list_files(state_dir)
    except OSError:
        return None
    if len(paths) > MAX_PEER_FILES:
        return None
    mine = os.path.abspath(state_file)
    seen = []
    for path in paths:
        if os.path.abspath(path) == mine:
            continue
        try:
            peer = files.read(path)
            age = now - os.stat(path).st_mtime
        except Exception:
            continue
        if entry.group_size and peer.world_size and peer.world_size < entry.group_size:
            continue
        if peer.has_issued(entry):
            continue  # it joined (or is past it)
        interval = peer.state_interval or 1.0
        act = peer.activity
        if peer.exit is not None or age > max(10.0, 5 * interval) or act is None:
            seen.append(Status.STUCK)
        else:
            # stepping: it made progress moments ago and has not joined yet (it is starting
            # its own pause, or runs on without joining: the doctor's not_joining tells)
            seen.append(
                Status.BUSY if act.state in (Status.BUSY, Status.STEPPING) else Status.STUCK
            )
    if not seen:
        return None
    return Status.BUSY if all(s == Status.BUSY for s in seen) else Status.STUCK
