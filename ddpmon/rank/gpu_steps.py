"""The parts of each step as the GPU ran them.

On a GPU the host only enqueues work: the host-side time of a forward is the time to launch
its kernels, and the host waits wherever something synchronises (``loss.item()``, a copy
back), so host times put the step's cost in the wrong part. This clock records a CUDA event
on the current stream at each boundary the step hooks see (forward start and end, backward
start, gradients ready, gradients synchronised, optimizer start and end, step end) and,
once the GPU has passed them, turns the gaps between consecutive events into the step's
parts, and the span from its first event to its last into the step's time. Events are
queried, never waited on: nothing here synchronises the GPU.

What an interval is, by the boundaries around it:

==================================  ==========================================================
up to the step's first forward      data wait: the GPU idle for the next batch, or running
                                    what was enqueued meanwhile (its host-to-device copies)
forward start to forward end        forward
backward start to gradients ready   backward compute
gradients ready to synchronised     exposed communication (the stream waits for all-reduce)
optimizer start to optimizer end    optimizer
anything else                       other (loss, logging, what the hooks do not see)
==================================  ==========================================================

A step the hooks did not see whole (no forward or backward marks: torch.compile, a forward
without backward; marks made during CUDA graph capture; more than ``MAX_MARKS``), a step
still pending when ``MAX_PENDING`` newer ones are, and every pending step when the clock
fails or the model is detached, resolve to None: its host-side parts stand.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

from .. import steps
from ..fuses import Fuse

FORWARD_START, FORWARD_END, BACKWARD_START = "forward_start", "forward_end", "backward_start"
GRAD_READY, SYNCED = "grad_ready", "synced"
OPTIMIZER_START, OPTIMIZER_END = "optimizer_start", "optimizer_end"
START, END = "start", "end"
PARTS = tuple(p for p in steps.PARTS if p != "h2d")  # the GPU sees copies as data wait
SEEN_WHOLE = frozenset({FORWARD_START, FORWARD_END, BACKWARD_START, GRAD_READY})
"""The marks a step needs for its GPU parts to replace the host's."""
MAX_PENDING = 16
"""Steps waiting for the GPU at most; older ones keep their host-side parts."""
MAX_MARKS = 64
"""Marks per step at most (forwards with grad and no backward would add them unbounded)."""


class _Step:
    __slots__ = ("marks", "usable")

    def __init__(self) -> None:
        self.marks: list[list[Any]] = []  # [name, event, owned]
        self.usable = True


class GpuStepClock:
    """CUDA events at a step's boundaries, resolved into its parts once the GPU passed them.

    ``event`` makes an event (default ``torch.cuda.Event(enable_timing=True)``), ``stream``
    returns the stream to record on (default the device's current stream) and
    ``capturing`` says whether that stream is being captured into a CUDA graph. A failure
    blows ``fuse``: the steps keep their host-side parts."""

    def __init__(
        self,
        device: str,
        fuse: Fuse,
        event: Callable[[], Any] | None = None,
        stream: Callable[[], Any] | None = None,
        capturing: Callable[[], bool] | None = None,
    ) -> None:
        if event is None or stream is None or capturing is None:
            import torch

            dev = torch.device(device)
            event = event or (lambda: torch.cuda.Event(enable_timing=True))
            stream = stream or (lambda: torch.cuda.current_stream(dev))
            capturing = capturing or torch.cuda.is_current_stream_capturing
        self._new_event, self._stream, self._capturing, self._fuse = event, stream, capturing, fuse
        self._free: list[Any] = []
        self._step = _Step()
        self._pending: collections.deque[tuple[int, _Step]] = collections.deque()
        self._dropped: list[int] = []
        self._last: tuple[float, Any] | None = None
        """(``time.monotonic()``, event) of the last mark recorded."""

    @property
    def ok(self) -> bool:
        return self._fuse.ok

    def mark(self, name: str) -> None:
        """A boundary of the step in progress, now (on the training thread)."""
        step = self._step
        if not self._fuse.ok or not step.usable:
            return
        try:
            if len(step.marks) >= MAX_MARKS or self._capturing():
                step.usable = False  # (a captured event would be replayed, not recorded now)
                return
            event = self._free.pop() if self._free else self._new_event()
            event.record(self._stream())
            step.marks.append([name, event, True])
            self._last = (time.monotonic(), event)
        except Exception as exc:
            self._fuse.blow(exc)

    def behind(self) -> float | None:
        """Seconds since the last mark was recorded while the GPU has not reached it (None
        once it has, or before any mark): a host that waits for a GPU which makes no
        progress (a kernel that never ends, a peer's NCCL collective that never starts)
        spins in ``.item()`` or a synchronize, which looks like work. For the watchdog's
        thread, while the rank makes no progress: one query of one event, never a wait."""
        last = self._last
        if last is None or not self._fuse.ok:
            return None
        try:
            return None if last[1].query() else max(0.0, time.monotonic() - last[0])
        except Exception as exc:
            self._fuse.blow(exc)
            return None

    def close(self, step: int, late: bool = False) -> None:
        """Step ``step`` ended now, or (``late``) at its last boundary: a step without an
        optimizer step is closed at the next forward, and the next one starts where it
        ended, sharing that event."""
        if not self._fuse.ok:
            return
        closed = self._step
        if not late:
            self.mark(END)
        self._pending.append((step, closed))
        while len(self._pending) > MAX_PENDING:
            number, old = self._pending.popleft()
            self._dropped.append(number)
            self._release(old)
        self._step = _Step()
        if not late:
            self.mark(START)
        elif closed.usable and closed.marks and closed.marks[-1][0] in (SYNCED, OPTIMIZER_END):
            closed.marks[-1][2] = False  # released with the next step, which starts there
            self._step.marks.append([START, closed.marks[-1][1], True])
        else:
            self._step.usable = False  # where the closed step ended is not marked

    def collect(self, final: bool = False) -> list[tuple[int, dict[str, float] | None]]:
        """(step, its GPU parts with ``step``, its span) for every step the GPU has passed,
        oldest first; None for a step whose host-side parts stand (see the module). With
        ``final`` (detach), every step still pending resolves too, to None if not passed."""
        out: list[tuple[int, dict[str, float] | None]] = [(s, None) for s in self._dropped]
        self._dropped = []
        try:
            # (a query while a CUDA graph is captured would invalidate the capture)
            while self._pending and self._fuse.ok and not self._capturing():
                number, step = self._pending[0]
                if not all(event.query() for _, event, _ in step.marks):
                    break
                names = {name for name, _, _ in step.marks}
                got = parts(step.marks) if step.usable and SEEN_WHOLE <= names else None
                self._pending.popleft()
                out.append((number, got))
                self._release(step)
        except Exception as exc:
            self._fuse.blow(exc)
        if final or not self._fuse.ok:
            out += [(number, None) for number, _ in self._pending]
            self._pending.clear()
        return out

    def _release(self, step: _Step) -> None:
        self._free.extend(event for _, event, owned in step.marks if owned)


def parts(marks: list[list[Any]]) -> dict[str, float]:
    """Seconds per part from one step's events, in the order they were recorded (see the
    module's table), with ``step``, the span from the first to the last: the parts sum to it.
    ``exposed_measured`` is 1.0 when the step synchronised its gradients (else 0.0, and
    exposed communication was not the GPU's to measure)."""
    out = dict.fromkeys(PARTS, 0.0)
    forwarded = False
    for (a, first, _), (b, second, _) in zip(marks, marks[1:]):
        seconds = max(0.0, first.elapsed_time(second) / 1000.0)
        if a == FORWARD_START:
            part = "forward"
        elif a == BACKWARD_START:
            part = "backward"
        elif a == GRAD_READY and b == SYNCED:
            part = "exposed_comm"
        elif a == OPTIMIZER_START:
            part = "optimizer"
        elif b == FORWARD_START and not forwarded:
            part = "data_wait"
        else:
            part = "other"
        forwarded = forwarded or b == FORWARD_START
        out[part] += seconds
    out["step"] = sum(out[p] for p in PARTS)
    out["exposed_measured"] = 1.0 if any(m[0] == SYNCED for m in marks) else 0.0
    return out
