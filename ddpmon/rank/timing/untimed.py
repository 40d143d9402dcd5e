"""No per-bucket timing, but DDP's buckets still seen in flight.

On a backend that completes collectives on the CPU (gloo), a rank waiting for DDP's
all-reduce waits between the end of backward compute and the moment DDP has its buckets
back. With no comm hook to report each bucket, the buckets (sizes from DDP's logging data)
are marked in flight at the first of those moments and done at the second, so a hang report
and the doctor still name the bucket a rank waits in. Approximate by design: every bucket
stays listed until DDP has all of them back.
"""

from __future__ import annotations

from collections.abc import Callable

from ...fuses import Fuse
from ..recorder import Recorder
from .layout import BucketLayout


class UntimedBuckets:
    """A step timeline (see ddpmon/rank/hooks/step.py) that marks DDP's buckets in flight.
    ``active()`` turns False once a comm hook reports the buckets itself."""

    IGNORES = frozenset({"backward_started"})
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
        self._in_flight = 0

    def forward_started(self) -> None:
        self._close()  # a backward that raised never reached DDP's wait for its buckets

    def backward_started(self, step_start: float) -> None:
        pass

    def backward_done(self, synced: bool) -> None:
        if not synced or not self._fuse.ok or not self._active():
            return
        try:
            self._layout.refresh()
            sizes = self._layout.sizes
        except Exception as exc:
            self._fuse.blow(exc)
            return
        if sizes:
            self._recorder.buckets_launched(sizes)
        self._in_flight = len(sizes)

    def sync_done(self, synced: bool) -> None:
        if synced:
            self._close()

    def _close(self) -> None:
        if self._in_flight:
            self._recorder.bucket_completed(True, self._in_flight)
            self._in_flight = 0
