"""A timing comm hook that wraps any DDP comm hook ``(state, bucket) -> Future[Tensor]``.

It reads like torch's own wrappers (``fp16_compress_wrapper``): it calls the hook it wraps,
returns that hook's result unchanged, and on the side notes when each bucket became ready
and when its collective completed. Where the times come from is a ``BucketClock``:
wall clock on CPU, pooled CUDA events on GPU (recorded in the hook and in the completion
callback, resolved later, never synchronizing).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ...fuses import Fuse
from ..recorder import BucketTiming, Recorder, StepTimings

CommHook = Callable[[Any, "dist.GradBucket"], "torch.futures.Future[torch.Tensor]"]


class BucketClock(Protocol):
    """Where a bucket's timing comes from. ``start`` runs in the comm hook, ``finish`` in
    the collective's completion callback, ``collect`` at a step boundary and returns the
    steps resolved so far (steps still pending on the device stay for a later call).
    ``timing/c10d.py`` has a clock that needs no comm hook and the same ``new_step`` and
    ``collect``."""

    def new_step(self, step: int, buckets: int = 0, generation: int = 0) -> None:
        """Step ``step`` (a count) ended; DDP's layout (its ``generation``) has ``buckets``,
        where a clock needs the layout (0 where it was not read)."""

    def start(self, index: int, ready: float) -> Any: ...

    def finish(self, token: Any) -> None: ...

    def collect(self) -> list[StepTimings]: ...


class WallClock:
    """CPU timing: the hook's call and the completion callback, on ``time.perf_counter``.

    Exposed communication is not the buckets' to say here: on CPU it is the host's wait
    from the end of backward compute to the moment DDP has its buckets back, which the
    recorder measures with or without a comm hook (``Recorder.host_wait_exposed``).
    """

    def __init__(self) -> None:
        self._done: collections.deque[BucketTiming] = collections.deque(maxlen=65536)

    def new_step(self, step: int, buckets: int = 0, generation: int = 0) -> None:
        pass

    def start(self, index: int, ready: float) -> Any:
        return (index, ready, time.perf_counter())

    def finish(self, token: Any) -> None:
        index, ready, start = token
        self._done.append(BucketTiming(index, ready, start, time.perf_counter()))

    def collect(self) -> list[StepTimings]:
        # On CPU DDP waits for every bucket before the step ends: all of them are one step.
        out = []
        while self._done:
            out.append(self._done.popleft())
        # measured, with no figure: the host's wait stands (see the class)
        return [StepTimings(out, None, measured=True)] if out else []


class CudaEventClock:
    """GPU timing with CUDA events taken from a pool and queried (never waited on) later.

    Events of one step are grouped so their times share the step's first event as origin.
    At most ``max_pending`` steps wait for the device; older ones are dropped.
    """

    def __init__(self, device: torch.device | str, max_pending: int = 8) -> None:
        self._device = torch.device(device)
        self._free: list[torch.cuda.Event] = []
        self._steps: collections.deque[list[list[Any]]] = collections.deque()
        self._max_pending = max_pending
        self._current: list[list[Any]] | None = None

    def _event(self) -> torch.cuda.Event:
        return self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)

    def new_step(self, step: int, buckets: int = 0, generation: int = 0) -> None:
        self._current = None

    def start(self, index: int, ready: float) -> Any:
        if self._current is None:
            self._current = []
            self._steps.append(self._current)
            while len(self._steps) > self._max_pending:
                self._release(self._steps.popleft())
        begin = self._event()
        begin.record(torch.cuda.current_stream(self._device))
        token = [index, ready, begin, None]
        self._current.append(token)
        return token

    def finish(self, token: Any) -> None:
        end = self._event()
        # The callback runs on streams that wait for the collective: this marks its end.
        end.record(torch.cuda.current_stream(self._device))
        token[3] = end

    def collect(self) -> list[StepTimings]:
        out: list[StepTimings] = []
        while self._steps and self._steps[0] is not self._current:
            tokens = self._steps[0]
            if any(t[3] is None or not t[3].query() for t in tokens):
                break
            self._steps.popleft()
            origin = tokens[0][2]
            out.append(
                StepTimings(
                    [
                        BucketTiming(
                            index,
                            ready,
                            origin.elapsed_time(begin) / 1000.0,
                            origin.elapsed_time(end) / 1000.0,
                        )
                        for index, ready, begin, end in tokens
                    ]
                )
            )
            self._release(tokens)
        return out

    def _release(self, tokens: list[list[Any]]) -> None:
        for t in tokens:
            self._free.append(t[2])
            if t[3] is not None:
                self._free.append(t[3])


class TimedCommHook:
    """The comm hook ddpmon registers: runs ``hook(state, bucket)`` and times it.

    ``hook`` and ``state`` can be replaced later (``replace``), which is how a user's
    ``ddp.register_comm_hook`` after ``attach`` still works and is still timed.
    ``timing = False`` makes it a pure pass-through.
    """

    def __init__(
        self,
        hook: CommHook,
        state: Any,
        recorder: Recorder,
        clock: BucketClock,
        names: Mapping[int, str],
        fuse: Fuse,
    ) -> None:
        self.hook = hook
        self.state = state
        self.timing = True
        self.user_registered = False
        self._recorder = recorder
        self._clock = clock
        self._names = names
        self._fuse = fuse
        self._layouts: dict[int, tuple[int, torch.dtype]] = {}
        self.__name__ = self.__qualname__ = f"ddpmon_timed_{getattr(hook, '__name__', 'hook')}"

    def replace(self, hook: CommHook, state: Any) -> None:
        self.hook, self.state = hook, state
        self.__name__ = self.__qualname__ = f"ddpmon_timed_{getattr(hook, '__name__', 'hook')}"

    def rebind(
        self, recorder: Recorder, clock: BucketClock, names: Mapping[int, str], fuse: Fuse
    ) -> None:
        """Serve a new monitor (attach after detach: DDP keeps the hook registered)."""
        self._recorder, self._clock, self._names, self._fuse = recorder, clock, names, fuse
        self._layouts = {}
        self.timing = True

    def __call__(self, state, bucket):  # type: ignore[no-untyped-def]
        # No annotations: DDP's _check_comm_hook compares them with the real types, and this
        # module's annotations are strings. ``state`` is the registered one (None): the
        # wrapped hook gets ``self.state``, which register_comm_hook after attach can change.
        token = None
        if self.timing and self._fuse.ok:
            try:
                token = self._start(bucket)
            except Exception as exc:
                self._fuse.blow(exc)
        fut = self.hook(self.state, bucket)
        if token is not None:
            return fut.then(_Completion(self, token, bucket.is_last()))
        return fut.then(_first) if self.hook is allreduce_mean_hook else fut

    def _start(self, bucket: dist.GradBucket) -> Any:
        now = time.perf_counter()
        index = bucket.index()
        buffer = bucket.buffer()
        layout = (buffer.numel(), buffer.dtype)
        if self._layouts.get(index) != layout:
            self._layouts[index] = layout
            names = [self._names.get(id(p), "?") for p in bucket.parameters()]
            nbytes = buffer.numel() * buffer.element_size()
            self._recorder.set_bucket_layout(
                index, nbytes, str(buffer.dtype).replace("torch.", ""), names
            )
        is_last = bucket.is_last()
        if is_last and len(self._layouts) > index + 1:
            # DDP rebuilt its buckets after iteration 0: fewer of them now.
            for stale in [i for i in self._layouts if i > index]:
                del self._layouts[stale]
            self._recorder.drop_buckets_from(index + 1)
        if is_last:  # every gradient is ready once the last bucket is
            self._recorder.grad_ready(now)
        self._recorder.bucket_launched(is_last, index)
        return self._clock.start(index, now - self._recorder.step_start)

    def _finished(self, token: Any, is_last: bool) -> None:
        if not self._fuse.ok:
            return
        try:
            self._clock.finish(token)
            self._recorder.bucket_completed(is_last)
        except Exception as exc:
            self._fuse.blow(exc)


class _Completion:
    """The ``then`` callback: record completion, hand the hook's value on unchanged."""

    __slots__ = ("_owner", "_token", "_is_last")

    def __init__(self, owner: TimedCommHook, token: Any, is_last: bool) -> None:
        self._owner, self._token, self._is_last = owner, token, is_last

    def __call__(self, fut: torch.futures.Future) -> Any:
        value = _first(fut)  # re-raises a failed collective's own error, as DDP expects
        self._owner._finished(self._token, self._is_last)
        return value


def allreduce_mean_hook(process_group: Any, bucket: dist.GradBucket) -> torch.futures.Future:
    """DDP's default as a Python hook: average the bucket by one all-reduce.

    Bit for bit what DDP does without a hook: it scales each gradient by ``1 / world size``
    (a multiplication, not torch ``allreduce_hook``'s division, which differs in the last bit
    for world sizes that are not powers of two), then sums. The process group is called
    directly and no ``then`` is chained here: the timing wrapper chains one anyway, and
    unwraps the ``[tensor]`` this future holds.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    assert group is not None  # DDP was built, so the default group exists
    tensor = bucket.buffer()
    size = group.size()
    if size > 1:
        tensor.mul_(1.0 / size)
    return group.allreduce([tensor]).get_future()


def _first(fut: torch.futures.Future) -> torch.Tensor:
    value = fut.value()
    return value[0] if isinstance(value, list) else value
