"""No per-bucket timing, but DDP's buckets still seen in flight.

On a backend that completes collectives on the CPU (gloo), a rank waiting for DDP's
all-reduce waits between the end of backward compute and the moment DDP has its buckets
back. With no comm hook to report each bucket, the buckets (sizes from DDP's logging data)
are marked in flight at the first of those moments and done at the second, so a hang report
and the doctor still name the bucket a rank waits in. Approximate by design: every bucket
stays listed until DDP has all of them back.

The marks themselves are the step's (the recorder's fold reads ``Recorder.untimed_sizes``
with the end of backward compute); this timeline keeps that list true: DDP's layout, read
until DDP has rebuilt its buckets, and none while a comm hook reports the buckets itself.
"""

from __future__ import annotations

from collections.abc import Callable

from ...fuses import Fuse
from ..recorder import Recorder
from .layout import BucketLayout


class UntimedBuckets:
    """A step timeline (see ddpmon/rank/hooks/step.py) that keeps ``Recorder.untimed_sizes``:
    DDP's layout while ``active()`` (False once a comm hook reports the buckets itself)."""

    IGNORES = frozenset({"forward_started", "backward_started", "sync_done"})
    """Step hook events it does nothing at (``hooks/step.py`` leaves them out)."""

    def __init__(
        self,
        layout: BucketLayout,
        recorder: Recorder,
        fuse: Fuse,
        active: Callable[[], bool] = lambda: True,
    ) -> None:
        self._layout = layout
        self._recorder = recorder
        self._fuse = fuse
        self._active = active
        self._marking: bool | None = None  # what ``untimed_sizes`` says: marked or not
        self._final = False  # DDP's layout will not change

    def forward_started(self) -> None:
        pass

    def backward_started(self, step_start: float) -> None:
        pass

    def backward_done(self, synced: bool) -> None:
        """Before the recorder's mark of the end of backward compute (which marks the
        buckets where it ``synced``): its list of buckets."""
        marking = self._active() and self._fuse.ok
        if self._final and marking is self._marking:
            return
        rec = self._recorder
        if marking and synced and not self._final:
            try:
                self._layout.refresh()
                self._final = self._layout.final
            except Exception as exc:
                self._fuse.blow(exc)
                marking = False
        self._marking = marking
        rec.untimed_sizes = self._layout.sizes if marking else None

    def sync_done(self, synced: bool) -> None:
        pass
