"""Progress watchdog: notices that this rank stopped making progress and says where it is.

A daemon thread compares the Recorder's last progress (heartbeats at forward, backward,
bucket launch and completion, every collective and step end) with a timeout: the configured
one, or one learned after warm-up as max(floor, 10 x the slowest recent step); during the
first steps, 5 x floor. Past it, the hang report (every Python thread's stack, main thread
first; the step and stage; the collectives in flight with their age; the last completed
one; torch's flight-recorder entries where available) goes into the Recorder, the state
file is rewritten at once and one warning is logged. Progress clears it.

The thread runs while the main thread waits in C++ (torch releases the GIL there). A rank
whose main thread holds the GIL stops this thread too: ``ddpmon doctor`` then reads the
rank's stack with py-spy. The loop cannot die: each pass is guarded, and ``stop()`` joins
with a bound. The watchdog also notes how the process ended (at interpreter exit), so the
doctor can tell the first rank to die from those that failed after it (``ending.py``).
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from .. import activity
from ..frames import is_library
from ..state import schema
from .ending import Ending
from .recorder import Recorder
from .sampler import Sampler, holdouts

log = logging.getLogger("ddpmon")

WARMUP_STEPS = 3
LEARN_FACTOR = 10.0
WARMUP_FACTOR = 5.0
REFRESH_SECONDS = 5.0
MAX_FRAMES = 40
MAX_THREADS = 32


class Watchdog:
    """One rank's progress watchdog. ``check()`` is one pass (the thread calls it every
    ``interval``; tests call it directly with an injected ``clock``)."""

    def __init__(
        self,
        recorder: Recorder,
        timeout: float | None,
        floor: float = 60.0,
        *,
        notify: Callable[[], Any] | None = None,
        flush: Callable[[], Any] | None = None,
        extras: Callable[[], dict[str, Any] | None] | None = None,
        interval: float | None = None,
        state_file: str | None = None,
        sampler: Sampler | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] | None = None,
        on_hang: Callable[[schema.Hang], Any] | None = None,
    ) -> None:
        self._recorder = recorder
        self._timeout = timeout
        self._floor = floor
        self._notify = notify
        self._flush = flush
        self._ending = Ending(recorder, flush, state_file)
        self._state_file = state_file
        # Activity sampling reads the real main thread: off under an injected clock (tests)
        # unless a sampler is given.
        self._sampler = sampler if sampler is not None or clock is not time.time else Sampler()
        self._extras = extras
        self._interval = interval
        self._clock = clock
        # Idle time is also counted on a monotonic clock from the moment this watchdog saw
        # the progress time change, so a wall-clock step (NTP) cannot fake a hang.
        self._mono = monotonic or (time.monotonic if clock is time.time else clock)
        self._seen: tuple[float, float, float] | None = None  # (progress, idle then, mono then)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reported_at = 0.0
        self._failed = False
        self.reports = 0
        self.on_hang = on_hang  # hang_action beyond the report (rank/hang_action.py)

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        if self._timeout != 0 and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ddpmon-watchdog", daemon=True)
            self._thread.start()
        self._ending.install()
        atexit.register(self._at_exit)

    def set_timeout(self, timeout: float | None) -> None:
        """A new hang timeout (``ddpmon set hang_timeout=...``): seconds, 0 = off, None =
        learned; the next pass, within a second, uses it. A watchdog started off starts its
        thread now."""
        self._timeout = timeout
        if timeout != 0 and self._thread is None and not self._stop.is_set():
            self._thread = threading.Thread(target=self._run, name="ddpmon-watchdog", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the thread, joined with a bound."""
        self._stop.set()
        atexit.unregister(self._at_exit)
        self._ending.remove()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.wait(self._pause()):
            try:
                self.check()
                if self._failed:
                    self._failed = False
                    log.warning("ddpmon: the progress watchdog works again")
            except Exception as exc:  # never let the loop die
                if not self._failed:
                    self._failed = True
                    log.warning(
                        "ddpmon: the progress watchdog failed a pass (%r); retrying",
                        exc,
                        exc_info=exc,
                    )

    def _pause(self) -> float:
        if self._interval is not None:
            return self._interval
        try:
            timeout, _ = self.timeout_now()
        except Exception:
            timeout = None
        return max(0.05, min(1.0, (timeout or 4.0) / 4))

    # -- the check ----------------------------------------------------------------------

    def timeout_now(self) -> tuple[float | None, str]:
        """(seconds without progress that count as a hang, where that number comes from)."""
        if self._timeout is not None:
            return (None, "off") if self._timeout == 0 else (float(self._timeout), "configured")
        slowest = self._recorder.slowest_recent_step()
        if self._recorder.steps < WARMUP_STEPS or slowest is None:
            return WARMUP_FACTOR * self._floor, "warm-up"
        return max(self._floor, LEARN_FACTOR * slowest), "learned"

    def _idle(self, now: float, last: float) -> float:
        """Seconds without progress: the wall clock's word, bounded by the monotonic clock's."""
        mono = self._mono()
        if self._seen is None or self._seen[0] != last:
            self._seen = (last, now - last, mono)
        return min(now - last, self._seen[1] + (mono - self._seen[2]))

    def check(self) -> schema.Hang | None:
        """One pass: report a hang, refresh the report while it lasts, clear it on progress.
        Returns the current hang report (None when there is none)."""
        rec = self._recorder
        now = self._clock()
        rec.fold()  # the hooks' marks: the last progress, the stage
        last = rec.last_progress_unix
        report = rec.hang
        if report is not None:
            if last > report.last_progress_unix:
                rec.set_hang(None)
                log.warning(
                    "ddpmon: rank %s makes progress again after %.1f s without",
                    rec.identity.rank,
                    last - report.last_progress_unix,
                )
                self._wake()
                return None
            if now - self._reported_at >= max(REFRESH_SECONDS, report.timeout_seconds / 2):
                fresh = self.build_report(now, last, report.timeout_seconds, report.timeout_source)
                fresh.detected_unix = report.detected_unix
                rec.set_hang(fresh)
                self._reported_at = now
                self._wake()
                return fresh
            return report
        timeout, source = self.timeout_now()
        idle = self._idle(now, last)
        seen = self.activity(idle, timeout, now)
        if timeout is None or idle < timeout:
            return None
        peers = None
        if seen.state == activity.Status.WAITING and self._state_file:
            waiting = rec.in_flight()
            if waiting:
                peers = holdouts(self._state_file, waiting[0], now)
        if not activity.is_hang(seen.state, idle, timeout, peers):
            return None
        report = self.build_report(now, last, timeout, source)
        rec.set_hang(report)
        self._reported_at = now
        self.reports += 1
        self._wake()
        log.warning("ddpmon: %s", describe(report, rec.identity.rank))
        if self.on_hang is not None:  # after the report is published: it is part of what ends
            self.on_hang(report)
        return report

    def activity(self, idle: float, timeout: float | None, now: float) -> schema.Activity:
        """Sample the main thread (at most about once a second) and publish what it does."""
        rec = self._recorder
        in_flight = rec.in_flight_count() > 0
        clock = rec.gpu_steps
        gpu_behind = (
            clock.behind()
            if clock is not None and idle >= activity.still_seconds(timeout)
            else None
        )
        if self._sampler is None:
            state = activity.classify(
                idle, in_flight, float("inf"), 0.0, 0.0, timeout, gpu_behind=gpu_behind
            )
            act = schema.Activity(state=state, sampled_unix=now, hang_timeout_seconds=timeout)
        else:
            self._sampler.sample()
            act = self._sampler.activity(idle, in_flight, timeout, now, gpu_behind)
        rec.activity = act  # the state writer publishes it with its next rewrite
        if act.state != activity.Status.STEPPING and rec.steps and rec.step_is_empty:
            seen = rec.pause_seen  # between steps, no progress: a pause began at the last
            if seen is None or seen[0] != rec.steps:
                rec.pause_seen = (rec.steps, rec.last_progress_unix)
        return act

    def build_report(self, now: float, last: float, timeout: float, source: str) -> schema.Hang:
        rec = self._recorder
        in_flight = rec.in_flight()
        for e in in_flight:
            e.age_seconds = round(now - e.issued_unix, 3)
        report = schema.Hang(
            detected_unix=now,
            last_progress_unix=last,
            silent_seconds=round(now - last, 3),
            timeout_seconds=timeout,
            timeout_source=source,
            step=rec.steps,
            stage=rec.stage,
            in_flight=in_flight,
            last_collective=rec.last_collective(),
            threads=thread_stacks(skip=_own_thread()),
        )
        if self._extras is not None:
            try:
                extras = self._extras() or {}
                report.flight_recorder = extras.get("flight_recorder")
                report.flight_recorder_error = extras.get("flight_recorder_error")
            except Exception as exc:
                report.extras_error = f"{type(exc).__name__}: {exc}"
        return report

    def _wake(self) -> None:
        if self._notify is not None:
            try:
                self._notify()
            except Exception:
                pass

    def _at_exit(self) -> None:
        """Note how this process ends, then write the state file one last time (bounded)."""
        try:
            self._ending.at_exit()
            if self._flush is not None:
                self._flush()
        except Exception:
            pass


def _own_thread() -> tuple[int, ...]:
    """The watchdog's own thread, left out of its reports (the main thread never is)."""
    me = threading.current_thread()
    return () if me is threading.main_thread() or me.ident is None else (me.ident,)


def describe(report: schema.Hang, rank: Any) -> str:
    """One log line for a hang report."""
    where = "not in any collective"
    if report.in_flight:
        oldest = min(report.in_flight, key=lambda e: e.issued_unix)
        where = f"waiting {oldest.age_seconds or 0.0:.1f} s in {oldest.describe()}"
    top = ""
    main = next((t for t in report.threads if t.main), None)
    if main and main.frames:
        user = [f for f in main.frames if not is_library(f.file or "")]
        f = (user or main.frames)[-1]
        top = f"; main thread at {f.file}:{f.line} in {f.function}"
    return (
        f"rank {rank} made no progress for {report.silent_seconds:.1f} s "
        f"(hang timeout {report.timeout_seconds:.0f} s, {report.timeout_source}): step "
        f"{report.step}, stage {report.stage}, {where}{top}. Run `ddpmon doctor` for "
        "the diagnosis across ranks."
    )


def thread_stacks(
    skip: tuple[int, ...] = (), max_frames: int = MAX_FRAMES, max_threads: int = MAX_THREADS
) -> list[schema.Thread]:
    """Every Python thread's stack (innermost frame last), the main thread first."""
    frames = sys._current_frames()
    threads = {t.ident: t for t in threading.enumerate()}
    main = threading.main_thread().ident
    order = sorted(
        (i for i in frames if i not in skip),
        key=lambda i: (i != main, getattr(threads.get(i), "name", "")),
    )
    out = []
    for ident in order[:max_threads]:
        thread = threads.get(ident)
        summary = traceback.extract_stack(frames[ident], limit=max_frames)
        out.append(
            schema.Thread(
                name=thread.name if thread else f"thread-{ident}",
                ident=ident,
                main=ident == main,
                daemon=thread.daemon if thread else None,
                frames=[schema.Frame(fs.filename, fs.lineno, fs.name, fs.line) for fs in summary],
            )
        )
    del frames
    return out
