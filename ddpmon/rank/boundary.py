"""Where a training step ends: one owner for the rank.

Three kinds of callers find the end of a step and all ask here: the module hooks (a step
without an optimizer step ends where DDP synchronised its gradients, seen at the next
forward: ``hooks/step.py``), the optimizer hooks (a step ends at its optimizer step once its
gradients were synchronised: ``hooks/optimizer.py``), and the loop itself through
``Monitor.step()`` (from then on, steps end only there) and ``detach()``. The boundary
closes the step in the recorder, then tells every part that keeps per-step state, in one
order: a FLOP count that ran in the step ends (``throughput``), the bucket clocks and the
GPU step clock fold in what they resolved, the unused
parameter watch and the advice checks hear the step count, and a capture that
``ddpmon capture`` armed (``capture``: None while none is asked for) starts, steps or stops
its profiler. A failure blows the step hooks' fuse; training never sees it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..fuses import Fuse
from .recorder import Recorder


class StepBoundary:
    """The end of each step on this rank. ``manual`` turns on at the first ``Monitor.step()``;
    the parts it tells (``throughput``, ``timing``, ``unused``, ``advice``) are set once they exist, and
    ``capture`` only while a capture is armed or recording (``rank/capture.py``)."""

    def __init__(self, recorder: Recorder, fuse: Fuse, notify: Callable[[], None]) -> None:
        self.manual = False
        self.throughput: Any = None
        self.timing: Any = None
        self.unused: Any = None
        self.advice: Any = None
        self.capture: Any = None
        self._recorder = recorder
        self._fuse = fuse
        self._notify = notify

    def backward_seen(self) -> bool:
        """A backward ran in the step in progress (gradients or the output's grad hook)."""
        return bool(self.unused and self.unused.any_ready) or self._recorder.backward_seen

    def end(self, now: float, end: float | None = None) -> None:
        """The step in progress ended at ``end`` (None: ``now``); ``time.perf_counter``."""
        rec = self._recorder
        rec.close_step(now, end)
        if self.throughput:
            self.throughput.step_ended(rec.steps)
        if rec.steps == 1:  # the first step is news: a rank that dies early is then not
            self._notify()  # seen "at step 0, stage first_step"
        self.collect_resolved()
        if self.unused:
            self.unused.step_ended()
        if self.advice:
            self.advice.step_ended(rec.steps)
        if self.capture is not None:
            self.capture.step_ended(rec.steps)

    def step_called(self) -> None:
        """``Monitor.step()``: the loop marks its steps itself from now on."""
        if not self._fuse.ok:
            return
        try:
            first = not self.manual
            self.manual = True
            rec = self._recorder
            if first and rec.steps > 0 and rec.step_is_empty:
                # Its optimizer step has just ended this step: the same boundary. Fold in
                # what the clocks resolved since.
                self.collect_resolved()
                return
            self.end(time.perf_counter(), None)
        except Exception as exc:  # never into the training loop
            self._fuse.blow(exc)

    def detach(self) -> None:
        """At detach: a step in progress that synchronised its gradients ended there, so it
        counts; what the GPU has not passed keeps its host parts."""
        rec = self._recorder
        if self._fuse.ok and not self.manual and rec.step_has_synced:
            try:
                self.end(time.perf_counter(), rec.step_end_mark)
            except Exception as exc:
                self._fuse.blow(exc)
        self.collect_resolved(final=True)

    def collect_resolved(self, final: bool = False) -> None:
        """Fold in what the clocks resolved since (buckets; a step's GPU parts)."""
        rec = self._recorder
        if self.timing and not final:
            self.timing.collect(rec.steps)
        clock = rec.gpu_steps
        if clock is not None:
            for step, parts in clock.collect(final):
                rec.add_gpu_parts(step, parts)
