"""The parts of each step as the GPU ran them.

On a GPU the host only enqueues work: the host-side time of a forward is the time to launch
its kernels, and the host waits wherever something synchronises (``loss.item()``, a copy
back), so host times put the step's cost in the wrong part. This clock records a CUDA event
on the current stream at each boundary the step hooks see (forward start and end, backward
start, gradients ready, gradients synchronised, optimizer start and end, step end) and,
once the GPU has passed them, turns the gaps between consecutive events into the step's
parts. Events are queried, never waited on: nothing here synchronises the GPU.

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
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

from ._safety import Fuse

FORWARD_START, FORWARD_END, BACKWARD_START = "forward_start", "forward_end", "backward_start"
GRAD_READY, SYNCED = "grad_ready", "synced"
OPTIMIZER_START, OPTIMIZER_END = "optimizer_start", "optimizer_end"
START, END = "start", "end"
PARTS = ("data_wait", "forward", "backward", "exposed_comm", "optimizer", "other")
MAX_PENDING = 16
"""Steps waiting for the GPU at most; older ones keep their host-side parts."""


class GpuStepClock:
    """CUDA events at a step's boundaries, resolved into its parts once the GPU passed them.

    ``event`` makes an event (default ``torch.cuda.Event(enable_timing=True)``) and
    ``stream`` returns the stream to record on (default the device's current stream); a
    failure blows ``fuse`` and the steps keep their host-side parts."""

    def __init__(self, device: str, fuse: Fuse, event: Callable[[], Any] | None = None,
                 stream: Callable[[], Any] | None = None) -> None:
        if event is None or stream is None:
            import torch

            dev = torch.device(device)
            event = event or (lambda: torch.cuda.Event(enable_timing=True))
            stream = stream or (lambda: torch.cuda.current_stream(dev))
        self._new_event, self._stream, self._fuse = event, stream, fuse
        self._free: list[Any] = []
        self._marks: list[tuple[str, Any]] = []
        self._pending: collections.deque[tuple[int, list[tuple[str, Any]]]] = collections.deque()

    @property
    def ok(self) -> bool:
        return self._fuse.ok

    def mark(self, name: str) -> None:
        """A boundary of the step in progress, now (on the training thread)."""
        if not self._fuse.ok:
            return
        try:
            event = self._free.pop() if self._free else self._new_event()
            event.record(self._stream())
            self._marks.append((name, event))
        except Exception as exc:
            self._fuse.blow(exc)

    def close(self, step: int, late: bool = False) -> None:
        """Step ``step`` ended now, or (``late``) at its last boundary: a step without an
        optimizer step is closed at the next forward, and the GPU time between goes to
        neither step. The next one starts here."""
        if not self._fuse.ok:
            return
        if not late:
            self.mark(END)
        self._pending.append((step, self._marks))
        self._marks = []
        while len(self._pending) > MAX_PENDING:
            self._release(self._pending.popleft()[1])
        self.mark(START)

    def collect(self) -> list[tuple[int, dict[str, float]]]:
        """(step, seconds per part) of every step the GPU has passed, oldest first."""
        out: list[tuple[int, dict[str, float]]] = []
        if not self._fuse.ok:
            return out
        try:
            while self._pending:
                step, marks = self._pending[0]
                if not all(event.query() for _, event in marks):
                    break
                self._pending.popleft()
                out.append((step, parts(marks)))
                self._release(marks)
        except Exception as exc:
            self._fuse.blow(exc)
        return out

    def _release(self, marks: list[tuple[str, Any]]) -> None:
        self._free.extend(event for _, event in marks)


def parts(marks: list[tuple[str, Any]]) -> dict[str, float]:
    """Seconds per part from one step's events, in the order they were recorded (see the
    module's table); the parts sum to the time from its first event to its last."""
    out = dict.fromkeys(PARTS, 0.0)
    forwarded = False
    for (a, first), (b, second) in zip(marks, marks[1:]):
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
    return out
