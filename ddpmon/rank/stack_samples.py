"""Where a slow rank's time goes in its own code: the training thread's stack, sampled often
while this rank is suspected of being the slow one, and only then.

A rank cannot see its peers directly, but the advice watch reads up to eight of their state
files every two seconds (``rank/advice/watch.py``); it hands them here. When this rank's busy
time is the highest of them and at least ``steps.SCORE_WARN`` above their median in
``READINGS_IN_A_ROW`` readings in a row (a lower bar than the doctor's straggler rule, so that
the samples are there when the doctor names it), a thread of its own samples the main
thread's stack every ``INTERVAL_SECONDS`` for ``WINDOW_SECONDS``, then rests for
``REST_SECONDS`` before it may sample again. Each sample counts the innermost frame of the
user's code (``frames.is_library``) under the stage the thread is in (``schema.Stage``:
``after_forward`` is the gap between forward and backward), so the doctor can say "95% of
the samples between forward and backward in train.py:118 in get_batch". No suspicion, no
thread: nothing runs on a rank its peers keep up with.
"""

from __future__ import annotations

import logging
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence

from .. import steps
from ..frames import is_library, short_path
from ..fuses import Fuse
from ..state import schema
from .recorder import Recorder

log = logging.getLogger("ddpmon")

INTERVAL_SECONDS = 0.01
"""Between samples: each costs about 100 us of CPU with its wake-up (a 2-rank CPU job,
``benchmarks/threads.py``), about 1% of a core while a window lasts."""
READINGS_IN_A_ROW = 2
"""Readings of the peers' files (2 s apart) that must find this rank slowest before a window
starts: two ranks sharing two cores differ by 5% in one reading often enough that a single
one had started a window in 4 of 7 20-second counts of a healthy 2-rank job."""
WINDOW_SECONDS = 30.0
"""How long one suspicion is sampled."""
REST_SECONDS = 90.0
"""After a window, how long before a new one may start (the last window's samples stay)."""
PUBLISH_SECONDS = 0.5
"""How often the counts so far are handed to the recorder."""
MAX_FRAMES = 256
"""Distinct frames counted per window; further new ones are counted as ``(other frames)``."""
KEPT_FRAMES = 20
"""Frames published per stage, the most sampled first."""
_DEPTH = 128


def suspected(states: Sequence[schema.RankState], rank: int) -> bool:
    """Whether ``rank``'s typical busy time (``StepParts.busy_seconds``) is the highest of
    ``states`` (its own and peers') and at least ``steps.SCORE_WARN`` and
    ``steps.MIN_GAP_SECONDS`` above the others' median. A glance at the means, a few
    microseconds: the doctor's straggler rule, which tests the gap against its noise step by
    step, decides; this only makes sure the samples are there when it does."""
    busy = {
        s.rank: p.busy_seconds
        for s in states
        if (p := s.timings.parts) is not None and p.steps >= steps.MIN_STEPS
    }
    mine = busy.pop(rank, None)
    if mine is None or not busy:
        return False
    baseline = statistics.median(busy.values())
    return (
        mine >= max(busy.values())
        and steps.busy_ratio(mine, baseline) >= steps.SCORE_WARN
        and mine - baseline >= steps.MIN_GAP_SECONDS
    )


class StackSampler:
    """Samples the training thread's stack while this rank is suspected (``peers_seen``)."""

    def __init__(self, recorder: Recorder, fuse: Fuse) -> None:
        self._rec = recorder
        self._fuse = fuse
        self._ident = threading.main_thread().ident
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._rest_until = 0.0
        self._in_a_row = 0  # readings that found this rank slowest, in a row

    def peers_seen(self, states: Sequence[schema.RankState]) -> None:
        """The advice watch read its peers' files (``states``, this rank's first): start a
        window of samples if this rank is suspected and none ran lately."""
        if not self._fuse.ok or self._stop.is_set():
            return
        try:
            busy = self._thread is not None and self._thread.is_alive()
            if busy or time.monotonic() < self._rest_until:
                return
            if not suspected(states, int(self._rec.identity.rank)):
                self._in_a_row = 0
                return
            self._in_a_row += 1
            if self._in_a_row >= READINGS_IN_A_ROW:
                self._in_a_row = 0
                self.start()
        except Exception as exc:
            self._fuse.blow(exc)

    def start(self) -> None:
        """Sample one window now (tests call it directly)."""
        self._rest_until = time.monotonic() + WINDOW_SECONDS + REST_SECONDS
        self._thread = threading.Thread(
            target=self._window, name="ddpmon-stack-samples", daemon=True
        )
        self._thread.start()

    def _window(self) -> None:
        try:
            self._sample_window()
        except Exception as exc:
            self._fuse.blow(exc)

    def _sample_window(self) -> None:
        rec = self._rec
        counts: dict[str, Counter[str]] = {}
        frames: set[str] = set()
        started, started_unix = time.monotonic(), time.time()
        end = started + WINDOW_SECONDS
        published = started
        taken = 0
        log.info(
            "ddpmon: rank %s looks slower than its peers: sampling its stack for %.0f s",
            rec.identity.rank,
            WINDOW_SECONDS,
        )
        while True:
            stopped = self._stop.wait(INTERVAL_SECONDS)
            now = time.monotonic()
            where = None if stopped else self._innermost()
            if where is not None:
                if where not in frames:
                    if len(frames) >= MAX_FRAMES:
                        where = "(other frames)"
                    else:
                        frames.add(where)
                rec.fold()  # (the stage as the hooks' marks say)
                stage = str(rec.stage)
                counts.setdefault(stage, Counter())[where] += 1
            taken += not stopped
            if now - published >= PUBLISH_SECONDS or now >= end or stopped:
                published = now
                rec.stack_samples = schema.StackSamples(
                    started_unix=started_unix,
                    seconds=round(now - started, 3),
                    count=taken,
                    interval_seconds=INTERVAL_SECONDS,
                    by_stage={
                        stage: dict(counter.most_common(KEPT_FRAMES))
                        for stage, counter in counts.items()
                    },
                )
            if now >= end or stopped:
                return

    def _innermost(self) -> str | None:
        """The innermost frame of the user's code on the main thread: "train.py:118 in
        get_batch"; None when it runs none (inside the interpreter's start or end)."""
        frame = sys._current_frames().get(self._ident)  # type: ignore[arg-type]
        depth = 0
        while frame is not None and depth < _DEPTH:
            code = frame.f_code
            name = code.co_filename
            if not (is_library(name) or name.startswith("<")):
                return f"{short_path(name)}:{frame.f_lineno} in {code.co_name}"
            frame = frame.f_back
            depth += 1
        return None

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout)
