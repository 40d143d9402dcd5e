"""The in-memory record of one rank: hooks append, readers fold and publish.

Hooks run on the training thread, on autograd's and the communication library's threads;
the exporter, the state writer and the watchdog read from threads of their own. Hooks never
take a lock and do as little as they can: every hook runs on caches the model's own work has
emptied, where each line it runs costs (docs/performance.md). They append a mark (a kind and
a ``perf_counter`` reading) or an event to one log (``deque.append`` is atomic), and keep in
place only what the training thread decides on at once: the step count and what says where
the step in progress ends (``_Open``). Readers take the fold lock, which no hook ever takes,
replay the marks into the step's parts and the stage (``_Step``), fold the other events into
their aggregates (histograms, buckets, collectives in flight) and publish an immutable
``RankState`` (ddpmon/state/schema.py). A scrape or a snapshot therefore never holds up a
training step, and a reader of the stage or the last progress folds first (``fold()``). When
nobody reads for a long while the training thread folds, but only if the lock is free at
that moment (``acquire(blocking=False)``).

Nothing here imports torch, so readers stay cheap and the doctor can share the schema.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .. import steps
from ..state import records, schema
from ..state.schema import Stage
from ..steps import StepRow
from . import clock_offset, gpu_steps
from .books import (
    BUCKET_OP,
    BucketBook,
    BucketStats,
    BucketTiming,
    CollectiveBook,
    Histogram,
    StepBook,
    StepRecord,
    StepTimings,
)
from .gpu_steps import GpuStepClock

__all__ = ["Recorder", "BucketTiming", "StepTimings", "StepRecord", "BucketStats", "Histogram"]

_IDENTITY_FIELDS = tuple(f.name for f in dataclasses.fields(schema.Identity))
MAX_PENDING_EVENTS = 20000  # the training thread folds past this when no reader has


class _Open:
    """What the training thread knows of the step in progress: enough to decide where it
    ends (``boundary.py``), which bucket launched last, and when to mark a GPU's clock. Owned
    by the hooks' threads; the step's parts are the fold's (``_Step``)."""

    __slots__ = (
        "start",
        "forwarded",
        "forward_open",
        "backward_seen",
        "backward_open",
        "launched",
        "synced_at",
        "optimizer_open",
        "optimizer_end",
        "micro_steps",
        "samples",
        "tokens",
    )

    def __init__(self, start: float) -> None:
        self.reset(start)

    def reset(self, start: float) -> None:
        self.start = start
        self.forwarded = False
        self.forward_open = False
        self.backward_seen = False
        self.backward_open = False
        self.launched = 0  # buckets launched
        self.synced_at: float | None = None
        self.optimizer_open = False
        self.optimizer_end: float | None = None
        self.micro_steps = 0
        self.samples = 0
        self.tokens = 0


class _Step:
    """The step in progress as the fold replays its marks: its parts. Owned by readers,
    under the fold lock; reset, not rebuilt."""

    __slots__ = (
        "start",
        "first_forward",
        "forward_seconds",
        "forward_start",
        "backward_start",
        "backward_seconds",
        "backward_open",
        "last_grad_ready",
        "synced_at",
        "comm_wait",
        "optimizer_seconds",
        "optimizer_start",
        "optimizer_early",
        "optimizer_end",
        "closure",
        "eval_start",
        "forward_end",
        "backward_end",
        "after_forward",
        "between_micro_steps",
        "before_optimizer",
    )

    def __init__(self, start: float) -> None:
        self.reset(start)

    def reset(self, start: float) -> None:
        self.start = start
        self.first_forward: float | None = None
        self.forward_seconds = 0.0
        self.forward_start: float | None = None
        self.backward_start: float | None = None  # the first backward of the step
        self.backward_seconds = 0.0
        self.backward_open: float | None = None  # the backward in progress
        self.last_grad_ready: float | None = None
        self.synced_at: float | None = None
        self.comm_wait: float | None = None
        self.optimizer_seconds = 0.0
        self.optimizer_start: float | None = None
        self.optimizer_early = 0.0  # optimizer time before the first forward
        self.optimizer_end: float | None = None
        self.closure = False  # forward and backward ran inside the optimizer's step
        self.eval_start: float | None = None  # the first forward without grad before this step's
        # the gaps between hooks (``steps.GAP_TABLE``): the marks they start at, their seconds
        self.forward_end: float | None = None
        self.backward_end: float | None = None
        self.after_forward = 0.0
        self.between_micro_steps = 0.0
        self.before_optimizer = 0.0


# Event kinds in the log (first element of each tuple): first the marks of the step in
# progress, which the fold replays (``Recorder._replay``), then the rest.
(
    _FORWARD,
    _FORWARD_END,
    _BACKWARD,
    _GRAD,
    _BACKWARD_DONE,
    _SYNCED,
    _OPTIMIZER,
    _OPTIMIZER_END,
    _EVAL,
    _CLOSE,
    _TIMINGS,
    _LAYOUT,
    _DROP,
    _BEGAN,
    _ENDED,
    _BUCKET_DONE,
    _GPU_PARTS,
    _BUCKETS_BEGAN,
) = range(18)
_MARKS = _TIMINGS  # the kinds below are marks


class Recorder:
    """The state of one rank. Times from ``time.perf_counter()`` unless named *_unix.

    Written by hooks without locks (see the module docstring); read through ``state()``,
    ``snapshot()``, ``histograms()``, ``bucket_stats()`` and the other readers below."""

    def __init__(self, identity: schema.Identity, world_size: int) -> None:
        self.identity = identity
        self.world_size = max(1, int(world_size))
        self.steps = 0
        self.micro_steps = 0  # backward passes of the steps done (no_sync ones included)
        self.startup: schema.Startup | None = None  # from the process's start (ddpmon run)
        self.stage = Stage.FIRST_STEP
        self.started_unix = time.time()
        self.last_progress_unix = self.started_unix
        self.unused_parameters: list[str] = []
        self.steps_without_unused = 0
        self.notes: dict[str, str] = {}
        self.errors: dict[str, str] = {}
        self.write_failures: dict[str, schema.WriteFailure] = {}
        """Set by the writers of the state file and the history (``rank/writers.py``), each
        record replaced whole."""
        self.hang: schema.Hang | None = None
        self.exit: schema.Exit | None = None
        self.activity: schema.Activity | None = None
        self.unmatched_steps = 0  # steps the c10d bucket clock could not match to buckets
        self.ddp_group: tuple[str, int] = ("0", self.world_size)  # DDP's process group (name, size)
        # ddpmon/advice/: findings appended; the other two replaced whole, never changed in place
        self.advice: list[schema.Advice] = []
        self.fingerprints = schema.Fingerprints()
        self.data_info = schema.DataInfo()
        self.untimed_sizes: Sequence[int] | None = None
        """DDP's buckets' bytes where no comm hook reports them (``timing/untimed.py``): the
        fold marks them in flight from the end of backward compute to DDP's wait for them."""
        self.gpu_steps: GpuStepClock | None = None
        """On a GPU: CUDA events at the step's boundaries, for its parts as the GPU ran them."""
        self.flop_count: schema.FlopCount | None = None
        """The model's FLOPs per step, once counted (``rank/throughput.py``); replaced whole."""
        self.memory = schema.Memory()
        """The memory trends of the rank and its workers (``rank/memory.py``); replaced whole."""
        self.first_step_unix: float | None = None
        """When the first step's first forward ran."""
        self.paused_seconds = 0.0
        """Seconds paused between steps (``schema.RankState.paused_seconds``)."""
        self.pause_seen: tuple[int, float] | None = None
        """(steps done, last progress unix) when the watchdog first saw this rank between
        steps without progress (busy, waiting or stuck): a pause began then."""
        # the model's optimizer (``learning_rate_seen``): plain values, no record per step
        self._optimizer_name: str | None = None
        self._lr: float | None = None
        self._lr_peak: float | None = None
        self._lr_peak_step: int | None = None
        self.stack_samples: schema.StackSamples | None = None
        """Where the training thread's time went while this rank looked slow
        (``rank/stack_samples.py``); replaced whole."""
        self.settings_answer: schema.SettingsAnswer | None = None
        """The answer to the last ``ddpmon set`` request (``rank/settings.py``); replaced whole."""
        self.slowed_step: int | None = None
        """The step the FLOP counter ran in: slower than the others, so left out of the rates."""
        now = time.perf_counter()
        self._open = _Open(now)
        self._latest: schema.RankState | None = None
        self._events: collections.deque[tuple[Any, ...]] = collections.deque()
        # -- owned by readers, under the fold lock ---------------------------------------
        self._fold_lock = threading.Lock()
        self._cur = _Step(now)
        self._folded_steps = 0  # the steps whose close the fold has replayed
        self._untimed_in_flight = 0  # buckets marked from ``untimed_sizes``, not yet back
        self._wall_offset = _wall_offset(None)  # the wall clock less perf_counter (a fold's)
        self._replay: dict[int, Callable[..., None]] = {
            _FORWARD: self._replay_forward,
            _FORWARD_END: self._replay_forward_end,
            _BACKWARD: self._replay_backward,
            _GRAD: self._replay_grad,
            _BACKWARD_DONE: self._replay_backward_done,
            _SYNCED: self._replay_synced,
            _OPTIMIZER: self._replay_optimizer,
            _OPTIMIZER_END: self._replay_optimizer_end,
            _EVAL: self._replay_eval,
            _CLOSE: self._replay_close,
        }
        self._steps_book = StepBook()
        self._buckets = BucketBook(self.world_size)
        self._collectives = CollectiveBook()

    @property
    def host_wait_exposed(self) -> bool:
        """The host's wait for the gradients is the step's exposed communication (CPU: set
        at attach by bucket timing, ``timing/hook.py``'s ``WallClock``)."""
        return self._steps_book.host_wait_exposed

    @host_wait_exposed.setter
    def host_wait_exposed(self, value: bool) -> None:
        self._steps_book.host_wait_exposed = value

    # -- the training thread: the step in progress ---------------------------------------

    def heartbeat(self) -> None:
        self.last_progress_unix = time.time()

    def evaluating(self, now: float) -> None:
        """A forward without grad (evaluation): alive, and between steps the start of a
        pause, which the next training forward ends."""
        self._events.append((_EVAL, now))

    def learning_rate_seen(self, name: str, lr: float | None) -> None:
        """The model's optimizer stepped at ``lr`` (None: not a plain number)."""
        self._optimizer_name = name
        self._lr = lr
        if lr is not None and (self._lr_peak is None or lr > self._lr_peak):
            self._lr_peak, self._lr_peak_step = lr, self.steps + 1

    @property
    def optimizer(self) -> schema.Optimizer | None:
        """The model's optimizer and its learning rates, None before its first step."""
        name = self._optimizer_name
        if name is None:
            return None
        return schema.Optimizer(name, self._lr, self._lr_peak, self._lr_peak_step)

    @property
    def step_start(self) -> float:
        return self._open.start

    def forward_started(self, now: float) -> None:
        o = self._open
        if not o.forwarded:
            o.forwarded = True
            if self.steps == 0:
                o.start = now  # the first step starts at the first forward, not at attach
                self.first_step_unix = time.time()
        o.forward_open = True
        if self.gpu_steps is not None:
            self.gpu_steps.mark(gpu_steps.FORWARD_START)
        self._events.append((_FORWARD, now))

    def forward_finished(self, now: float) -> None:
        o = self._open
        if o.forward_open:
            o.forward_open = False
            if self.gpu_steps is not None:
                self.gpu_steps.mark(gpu_steps.FORWARD_END)
        self._events.append((_FORWARD_END, now))

    def batch_seen(self, samples: int, tokens: int) -> None:
        """A training forward of the step in progress took ``samples`` samples (``tokens``
        tokens: 0 unless its input holds token ids)."""
        o = self._open
        o.samples += samples
        o.tokens += tokens

    def backward_started(self, now: float) -> None:
        o = self._open
        o.backward_seen = True
        if not o.backward_open:
            o.backward_open = True
            if self.gpu_steps is not None:
                self.gpu_steps.mark(gpu_steps.BACKWARD_START)
        self._events.append((_BACKWARD, now))

    def grad_ready(self, now: float) -> None:
        """A gradient (a parameter's, or a bucket's) is ready: backward runs. Called once per
        parameter under ``find_unused_parameters``: marked for the first of the step alone
        (the start of backward where no output's hook saw it; ``backward_done`` ends the
        pass)."""
        o = self._open
        if not o.backward_seen:
            o.backward_seen = True
            self._events.append((_GRAD, now))

    def backward_done(self, now: float, allreduce: bool = False) -> None:
        """Backward compute is done (one backward pass: a micro-step); ``allreduce``: DDP
        synchronises the gradients now (the stage, unless a comm hook has said so)."""
        o = self._open
        o.backward_seen = True
        o.backward_open = False
        o.micro_steps += 1
        if self.gpu_steps is not None:
            self.gpu_steps.mark(gpu_steps.GRAD_READY)
        untimed = self.untimed_sizes if allreduce else None
        self._events.append((_BACKWARD_DONE, now, allreduce, untimed, self.steps))

    def gradients_synced(self, now: float | None = None) -> None:
        """DDP has waited for every bucket of this step (on a GPU: the stream waits); the
        host's wait since backward compute ended is the step's exposed communication until
        a bucket clock says better."""
        if now is None:
            now = time.perf_counter()
        self._open.synced_at = now
        if self.gpu_steps is not None:
            self.gpu_steps.mark(gpu_steps.SYNCED)
        self._events.append((_SYNCED, now))

    def optimizer_started(self, now: float) -> None:
        self._open.optimizer_open = True
        if self.gpu_steps is not None:
            self.gpu_steps.mark(gpu_steps.OPTIMIZER_START)
        self._events.append((_OPTIMIZER, now))

    def optimizer_finished(self, now: float) -> None:
        o = self._open
        if o.optimizer_open:
            o.optimizer_open = False
            if self.gpu_steps is not None:
                self.gpu_steps.mark(gpu_steps.OPTIMIZER_END)
        o.optimizer_end = now
        self._events.append((_OPTIMIZER_END, now))

    @property
    def step_end_mark(self) -> float | None:
        """Where the step in progress ended, when it ended before now: its last optimizer
        step after the gradients synchronised, else the synchronisation (None: not yet)."""
        o = self._open
        if o.synced_at is None:
            return None
        if o.optimizer_end is not None and o.optimizer_end >= o.synced_at:
            return o.optimizer_end
        return o.synced_at

    @property
    def step_is_empty(self) -> bool:
        """Nothing happened since the last step ended: no forward, backward, optimizer step
        or bucket."""
        o = self._open
        return (
            not o.forwarded
            and not o.backward_seen
            and o.optimizer_end is None
            and o.launched == 0
            and o.synced_at is None
        )

    @property
    def launched_bucket(self) -> int:
        """Index of the bucket launched last in this step (DDP launches them in order)."""
        return max(0, self._open.launched - 1)

    @property
    def backward_seen(self) -> bool:
        """True once a backward started in the step in progress."""
        return self._open.backward_seen

    @property
    def backward_passes(self) -> int:
        """Backward passes so far, those of the step in progress included."""
        return self.micro_steps + self._open.micro_steps

    @property
    def step_has_synced(self) -> bool:
        """True once the step in progress has launched its gradient all-reduce."""
        return self._open.launched > 0 or self._open.synced_at is not None

    def close_step(self, now: float, end: float | None = None) -> None:
        """End the step in progress at ``end`` (default ``now``: the caller's moment) and
        start the next one there; the fold works out its parts (``_replay_close``)."""
        o = self._open
        end = now if end is None else min(end, now)
        self.steps += 1
        self.micro_steps += o.micro_steps
        clock = self.gpu_steps
        events = self._events
        events.append(
            (
                _CLOSE,
                now,
                end,
                self.steps,
                o.micro_steps,
                o.samples,
                o.tokens,
                clock is not None and clock.ok,
            )
        )
        if clock is not None:
            clock.close(self.steps, late=end < now)
        o.reset(end)
        if len(events) > MAX_PENDING_EVENTS and self._fold_lock.acquire(blocking=False):
            try:  # nobody has read for a long while; never waits for a reader
                self._fold()
            finally:
                self._fold_lock.release()

    # -- the fold: the step in progress, replayed from its marks ---------------------------

    def _progressed(self, now: float) -> None:
        """Progress at ``now`` (``time.perf_counter``)."""
        self._progressed_unix(now + self._wall_offset)

    def _progressed_unix(self, wall: float) -> None:
        if wall > self.last_progress_unix:
            self.last_progress_unix = wall

    def _replay_forward(self, now: float) -> None:
        self._untimed_done(now)  # (a backward that raised)
        cur = self._cur
        if cur.optimizer_start is not None:  # step(closure): Lightning's, LBFGS
            self._optimizer_paused(now)
        if cur.first_forward is None:
            if self._folded_steps == 0:
                cur.start = now  # the first step starts at the first forward, not at attach
            else:
                self._pause_ends(now)
            cur.first_forward = now
        elif cur.backward_end is not None:
            cur.between_micro_steps += now - cur.backward_end
        cur.backward_end = None
        cur.forward_start = now
        self.stage = Stage.FORWARD
        self._progressed(now)

    def _pause_ends(self, now: float) -> None:
        """The first training forward of a step ends a pause that began after the step
        before: at an evaluation's first forward, or where the watchdog saw it begin."""
        cur = self._cur
        starts = [cur.eval_start] if cur.eval_start is not None else []
        seen = self.pause_seen
        if seen is not None and seen[0] == self._folded_steps:
            starts.append(now - max(0.0, now + self._wall_offset - seen[1]))
        self.pause_seen = None
        if starts:
            self.paused_seconds += max(0.0, now - max(cur.start, min(starts)))

    def _replay_forward_end(self, now: float) -> None:
        cur = self._cur
        if cur.forward_start is not None:
            cur.forward_seconds += now - cur.forward_start
            cur.forward_start = None
            cur.forward_end = now
        self.stage = Stage.AFTER_FORWARD

    def _replay_backward(self, now: float) -> None:
        cur = self._cur
        if cur.backward_start is None:
            cur.backward_start = now
        if cur.forward_end is not None:
            cur.after_forward += max(0.0, now - cur.forward_end)
            cur.forward_end = None
        if cur.backward_open is None:
            cur.backward_open = now
        self.stage = Stage.BACKWARD
        self._progressed(now)

    def _replay_grad(self, now: float) -> None:
        cur = self._cur
        if cur.backward_start is None:
            cur.backward_start = now
            self.stage = Stage.BACKWARD
        cur.last_grad_ready = now

    def _replay_backward_done(
        self, now: float, allreduce: bool, untimed: Sequence[int] | None, steps: int
    ) -> None:
        cur = self._cur
        if cur.backward_start is None:
            cur.backward_start = now
            self.stage = Stage.BACKWARD
        if cur.backward_open is not None:
            cur.backward_seconds += max(0.0, now - cur.backward_open)
            cur.backward_open = None
        cur.last_grad_ready = cur.backward_end = now
        if allreduce and self.stage == Stage.BACKWARD:
            self.stage = Stage.ALLREDUCE  # (a comm hook has said so already)
        if untimed:
            self._untimed_done(now)
            self._buckets_began(self.ddp_group, now + self._wall_offset, 0, untimed, steps, True)
            self._untimed_in_flight = len(untimed)

    def _untimed_done(self, now: float) -> None:
        """DDP has its untimed buckets back at ``now``, or a backward that raised never
        reached its wait for them."""
        if self._untimed_in_flight:
            self._buckets_done(now + self._wall_offset, self._untimed_in_flight, True)
            self._untimed_in_flight = 0

    def _replay_synced(self, now: float) -> None:
        self._untimed_done(now)
        cur = self._cur
        cur.synced_at = now
        if cur.last_grad_ready is not None:
            cur.comm_wait = max(0.0, now - cur.last_grad_ready)
        self.stage = Stage.AFTER_BACKWARD

    def _replay_optimizer(self, now: float) -> None:
        cur = self._cur
        if cur.synced_at is not None:
            mark = cur.synced_at
            if cur.optimizer_end is not None and cur.optimizer_end > mark:
                mark = cur.optimizer_end  # a second optimizer's step
            cur.before_optimizer += max(0.0, now - mark)
        cur.optimizer_start = now
        self.stage = Stage.OPTIMIZER

    def _optimizer_paused(self, now: float) -> None:
        """An optimizer step calls its closure (forward and backward): its time so far is
        the optimizer's (before the step's first forward: not data wait); the closure's is
        forward's and backward's, and the optimizer's resumes once gradients are ready."""
        cur = self._cur
        seconds = max(0.0, now - cur.optimizer_start) if cur.optimizer_start is not None else 0.0
        cur.optimizer_seconds += seconds
        if cur.first_forward is None:
            cur.optimizer_early += seconds
        cur.optimizer_start = None
        cur.closure = True

    def _replay_optimizer_end(self, now: float) -> None:
        cur = self._cur
        if cur.optimizer_start is None and cur.closure:
            resumed = max(t for t in (cur.synced_at, cur.last_grad_ready, 0.0) if t is not None)
            cur.optimizer_start = resumed or None
            cur.closure = False
        if cur.optimizer_start is not None:
            seconds = max(0.0, now - cur.optimizer_start)
            cur.optimizer_seconds += seconds
            if cur.first_forward is None:
                cur.optimizer_early += seconds
            cur.optimizer_start = None
        cur.optimizer_end = now
        self.stage = Stage.AFTER_OPTIMIZER
        self._progressed(now)

    def _replay_eval(self, now: float) -> None:
        cur = self._cur
        if self._folded_steps and cur.first_forward is None and cur.eval_start is None:
            cur.eval_start = now
        self._progressed(now)

    def _replay_close(
        self,
        now: float,
        end: float,
        step: int,
        micro_steps: int,
        samples: int,
        tokens: int,
        gpu_parts_later: bool,
    ) -> None:
        """The step's parts: data wait (step start to its first forward, less any optimizer
        step in between), forward, backward compute (summed over micro-steps), the host's
        wait for the gradients (exposed communication), optimizer and the rest (see
        ``books.StepBook``)."""
        cur = self._cur
        backward = None
        if cur.backward_start is not None and cur.last_grad_ready is not None:
            backward = cur.backward_seconds
        after_optimizer = 0.0
        if cur.optimizer_end is not None and cur.synced_at is not None:
            after_optimizer = max(0.0, end - max(cur.optimizer_end, cur.synced_at))
        gaps = (cur.after_forward, cur.between_micro_steps, cur.before_optimizer, after_optimizer)
        data_wait = 0.0
        if cur.first_forward is not None:
            data_wait = max(0.0, cur.first_forward - cur.start - cur.optimizer_early)
        self._steps_book.add(
            StepRecord(
                step,
                cur.start + self._wall_offset,
                max(0.0, end - cur.start),
                cur.forward_seconds,
                backward,
                data_wait,
                cur.comm_wait,
                cur.optimizer_seconds,
                micro_steps,
                gpu_parts_later=gpu_parts_later,
                samples=samples,
                tokens=tokens,
                gaps=gaps,
            )
        )
        self._folded_steps = step
        cur.reset(end)
        self._progressed(now)

    def add_gpu_parts(self, step: int, parts: dict[str, float] | None) -> None:
        """Step ``step``'s parts as the GPU ran them (``gpu_steps.py``): they replace the
        host's; None: the host's stand."""
        self._events.append((_GPU_PARTS, step, parts))

    def set_unused_parameters(self, names: list[str]) -> bool:
        """Record this step's unused parameters; True when the set changed."""
        changed = names != self.unused_parameters
        self.unused_parameters = names
        self.steps_without_unused = 0 if names else self.steps_without_unused + 1
        return changed

    # -- any thread: events for the readers to fold ------------------------------------------

    def set_bucket_layout(self, index: int, nbytes: int, dtype: str, names: Iterable[str]) -> None:
        self._events.append((_LAYOUT, index, nbytes, dtype, tuple(names)))

    def drop_buckets_from(self, count: int) -> None:
        """Forget buckets with index >= count (after DDP rebuilt its buckets)."""
        self._events.append((_DROP, count))

    def add_bucket_timings(self, timings: Sequence[BucketTiming]) -> None:
        """Fold one step's bucket collectives in (the step that ended last)."""
        self.add_step_timings(StepTimings(list(timings)))

    def add_step_timings(self, step: StepTimings) -> None:
        """One step's bucket collectives, as a clock resolved them (see ``_fold_timings``)."""
        if step.buckets or step.exposed is not None:
            if step.step is None:
                step = StepTimings(step.buckets, step.exposed, step.measured, self.steps)
            self._events.append((_TIMINGS, step))

    def bucket_launched(
        self, is_last: bool, index: int | None = None, nbytes: int | None = None
    ) -> None:
        """DDP launched a bucket's collective: counted, and in flight until it completes
        (whatever the comm hook calls inside is attributed to the bucket). ``nbytes``
        when the bucket has no timings to hold its size."""
        o = self._open
        o.launched += 1
        if index is None:
            index = o.launched - 1
        # The entry itself is built, and numbered, by the reader that folds it in.
        self._events.append(
            (_BUCKETS_BEGAN, self.ddp_group, time.time(), index, (nbytes,), self.steps, is_last)
        )

    def bucket_completed(self, is_last: bool, count: int = 1) -> None:
        """The oldest ``count`` bucket collectives in flight are done: DDP's buckets complete
        in order, and the comm hook's completion callback says so without a callback of
        its own (without one, DDP's wait for them all says so for all at once)."""
        self._events.append((_BUCKET_DONE, time.time(), count, is_last))

    def collective_began(
        self,
        op: str,
        group: str,
        group_size: int,
        nbytes: int | None,
        site: str,
        function: str,
        *,
        bucket: int | None = None,
        p2p: bool = False,
        counted: bool = True,
        callers: Sequence[str] = (),
    ) -> dict[str, Any]:
        """A collective this rank issued: in flight until ``collective_ended``, numbered in
        its process group by the fold, in the order issued. ``counted=False`` for a
        bucket's collective, already counted by ``bucket_launched``; ``callers`` are the
        user frames that led to ``site``."""
        now = time.time()
        entry: dict[str, Any] = {
            "seq": None,  # numbered by the fold, in the order issued (``books``)
            "op": op,
            "group": group,
            "group_size": group_size,
            "bytes": nbytes,
            "call_site": site,
            "function": function,
            "issued_unix": now,
        }
        if callers:
            entry["callers"] = list(callers)
        if bucket is not None:
            entry["bucket"] = bucket
        if p2p:
            entry["p2p"] = True
        self._events.append((_BEGAN, entry, counted))
        self.last_progress_unix = now
        return entry

    def collective_ended(
        self, entry: dict[str, Any], error: str | None = None, counted: bool = True
    ) -> None:
        """The collective of ``entry`` (from ``collective_began``) completed or failed."""
        now = time.time()
        self._events.append((_ENDED, entry, error, counted, now))
        self.last_progress_unix = now

    def note(self, key: str, text: str | None) -> None:
        if text is None:
            self.notes.pop(key, None)
        else:
            self.notes[key] = text

    def record_error(self, part: str, message: str) -> None:
        self.errors[part] = message

    def set_hang(self, report: schema.Hang | None) -> None:
        """The watchdog's hang report, or None once progress resumed."""
        self.hang = report

    def set_exit(self, record: schema.Exit) -> None:
        """How this process ended (written at interpreter exit)."""
        self.exit = record

    # -- readers (their own threads) -----------------------------------------------------------

    def fold(self) -> None:
        """Fold the pending events in, for a reader of what they set in place (the stage,
        the last progress, the seconds paused). Never from a hook: it takes the fold lock."""
        with self._fold_lock:
            self._fold()

    def detached(self) -> None:
        """ddpmon's hooks are off: the stage says so from now on."""
        with self._fold_lock:
            self._fold()
            self.stage = Stage.DETACHED

    def _fold(self) -> None:
        """Replay the step's marks and hand the other events to the books; the caller holds
        the fold lock."""
        events, steps, buckets, collectives, replay = (
            self._events,
            self._steps_book,
            self._buckets,
            self._collectives,
            self._replay,
        )
        self._wall_offset = _wall_offset(self._wall_offset)
        while events:
            event = events.popleft()
            kind = event[0]
            if kind < _MARKS:
                replay[kind](*event[1:])
            elif kind == _BUCKETS_BEGAN:
                self._buckets_began(*event[1:])
            elif kind == _BEGAN:
                collectives.began(event[1], event[2], buckets)
            elif kind == _BUCKET_DONE:
                self._buckets_done(*event[1:])
            elif kind == _ENDED:
                collectives.ended(*event[1:])
            elif kind == _TIMINGS:
                if event[1].buckets:
                    steps.buckets(event[1].step, buckets.summary(event[1]))
                exposed = buckets.timings(event[1])
                if exposed is not None:
                    steps.exposed(event[1].step, exposed)
            elif kind == _GPU_PARTS:
                steps.gpu_parts(event[1], event[2])
            elif kind == _LAYOUT:
                buckets.layout(*event[1:])
            elif kind == _DROP:
                buckets.drop_from(event[1])

    def _buckets_began(
        self,
        group: tuple[str, int],
        now: float,
        first: int,
        sizes: Sequence[int | None],
        step: int,
        is_last: bool,
    ) -> None:
        """DDP launched buckets ``first``.. (their ``sizes`` in bytes, None: from their
        layout) at ``now`` (unix); the fold lock held."""
        collectives, buckets = self._collectives, self._buckets
        for index, nbytes in enumerate(sizes, first):
            collectives.began(_bucket_entry(group, now, index, nbytes, step), True, buckets)
        if is_last:
            self.stage = Stage.ALLREDUCE
        self._progressed_unix(now)

    def _buckets_done(self, now: float, count: int, is_last: bool) -> None:
        """The oldest ``count`` bucket collectives in flight are done at ``now`` (unix)."""
        for _ in range(count):
            self._collectives.bucket_done(now)
        if is_last:
            self.stage = Stage.AFTER_BACKWARD
        self._progressed_unix(now)

    def in_flight(self) -> list[schema.Collective]:
        """The collectives in flight now, oldest first."""
        with self._fold_lock:
            self._fold()
            return [_collective(e) for e in self._collectives.in_flight]

    def in_flight_count(self) -> int:
        with self._fold_lock:
            self._fold()
            return len(self._collectives.in_flight)

    def last_collective(self) -> schema.Collective | None:
        with self._fold_lock:
            self._fold()
            last = self._collectives.last
            return _collective(last) if last else None

    def slowest_recent_step(self) -> float | None:
        """The longest step in the recent window, None before the first step ends."""
        with self._fold_lock:
            self._fold()
            return max((r.step_seconds for r in self._steps_book.recent), default=None)

    def collectives_by_op(self) -> dict[str, tuple[int, int]]:
        """(issued, completed) per collective operation."""
        with self._fold_lock:
            self._fold()
            return {op: (c[0], c[1]) for op, c in self._collectives.ops.items()}

    def histograms(self) -> dict[str, Histogram]:
        """Copies of the step histograms: step, data_wait, forward, backward, exposed_comm,
        optimizer, other."""
        with self._fold_lock:
            self._fold()
            return {name: h.copy() for name, h in self._steps_book.hist.items()}

    def phase_totals(self) -> dict[str, float]:
        """Seconds of every step done, per part (``steps.PARTS``); they sum to the
        steps' wall time."""
        with self._fold_lock:
            self._fold()
            return dict(self._steps_book.phase_totals)

    def bucket_stats(self) -> list[BucketStats]:
        with self._fold_lock:
            self._fold()
            return [b.copy() for b in self._buckets.sorted()]

    def history_since(self, step: int) -> list[StepRow]:
        """Copies of the rows (``steps.StepRow``) of the steps after ``step``, oldest first
        (the last few thousand)."""
        with self._fold_lock:
            self._fold()
            return [copy.copy(row) for row in self._steps_book.history if row.step > step]

    def throughput(self) -> schema.Throughput:
        """Samples, tokens and FLOPs per second of step time, and MFU, over the recent steps."""
        with self._fold_lock:
            self._fold()
            return self._throughput()

    def _throughput(self) -> schema.Throughput:
        """``throughput()``; the caller holds the fold lock. The rows are the recent settled
        steps, less the one the FLOP counter slowed."""
        book, count = self._steps_book, self.flop_count
        rows = [r for r in book.recent if not r.gpu_pending and r.step != self.slowed_step]
        seconds = sum(r.step_seconds for r in rows)
        out = schema.Throughput(
            window_steps=len(rows),
            samples_total=book.samples_total,
            tokens_total=book.tokens_total,
            flop_count=count,
        )
        if seconds <= 0:
            return out
        out.step_seconds = seconds / len(rows)
        samples, tokens = sum(r.samples for r in rows), sum(r.tokens for r in rows)
        out.samples_per_second = samples / seconds if samples else None
        out.tokens_per_second = tokens / seconds if tokens else None
        if count is not None and count.per_step > 0:
            out.achieved_flops_per_second = count.per_step / out.step_seconds
            if count.peak_flops_per_second:
                out.mfu = out.achieved_flops_per_second / count.peak_flops_per_second
        return out

    def state(self) -> schema.RankState:
        """The latest view of this rank, a fresh record every call."""
        with self._fold_lock:
            self._fold()
            # summed up under the lock, from the rows themselves: only readers holding it
            # change a row (its GPU parts, its bucket timings), and copies cost the GIL
            timings = _summaries(list(self._steps_book.recent))
            throughput = self._throughput()
            c = self._collectives
            identity = {name: getattr(self.identity, name) for name in _IDENTITY_FIELDS}
            identity["ddp"] = dict(identity["ddp"])
            state = schema.RankState(
                **identity,
                step=self.steps,
                micro_steps=self.micro_steps,
                stage=self.stage,
                startup=self.startup,
                started_unix=self.started_unix,
                last_progress_unix=self.last_progress_unix,
                collectives=schema.Counts(c.issued, c.completed),
                in_flight=[_collective(e) for e in c.in_flight],
                last_collective=_collective(c.last) if c.last else None,
                collective_log=[_collective(e) for e in c.log],
                collective_seq=dict(c.last_seq),
                collective_sites=dict(c.sites),
                unused_parameters=list(self.unused_parameters),
                buckets=[b.record() for b in self._buckets.sorted()],
                notes=dict(self.notes),
                errors=dict(self.errors),
                write_failures=dict(self.write_failures),
                hang=self.hang,
                exit=self.exit,
                advice=list(self.advice),
                fingerprints=self.fingerprints,
                data=self.data_info,
                activity=self.activity,
                paused_seconds=self.paused_seconds,
                optimizer=self.optimizer,
                stack_samples=self.stack_samples,
                settings_answer=self.settings_answer,
                clock=clock_offset.measured(),
            )
        state.timings = timings
        state.throughput = throughput
        state.memory = self.memory
        state.now_unix = time.time()
        self._latest = state
        return state

    def recent_state(self, max_age: float) -> schema.RankState:
        """The view ``state()`` built last (for the state file, about once a second) when it
        is at most ``max_age`` seconds old, else a fresh one: a reader that needs no
        fresher view shares that work. Shared: read it, never change it."""
        latest = self._latest
        if latest is not None and time.time() - (latest.now_unix or 0.0) <= max_age:
            return latest
        return self.state()

    def snapshot(self) -> dict[str, Any]:
        """The latest per-rank view, as plain JSON-ready data (the state file's body)."""
        return schema.to_json(self.state())

    def noticed(self) -> dict[str, Any]:
        """What the history records, with the state file's keys: the step, notes, errors,
        write failures, hang report and exit record (its findings), and what the run trained
        with (``history.training_of``: the batch, the world size, the optimizer). A small
        part of ``snapshot()``, without its fold and per-step summaries (the history's thread
        reads it every second)."""
        return records.dump(
            {
                "step": self.steps,
                "data": self.data_info,
                "world_size": self.identity.world_size,
                "ddp_world_size": self.identity.ddp_world_size,
                "optimizer": self.optimizer,
                "notes": dict(self.notes),
                "errors": dict(self.errors),
                "write_failures": dict(self.write_failures),
                "hang": self.hang,
                "exit": self.exit,
            }
        )


_COLLECTIVE_FIELDS = frozenset(f for f in schema.Collective.__dataclass_fields__)


def _bucket_entry(
    group: tuple[str, int], now: float, index: int, nbytes: int | None, step: int
) -> dict[str, Any]:
    """The collective entry of a bucket DDP launched (``bucket_launched``, or the end of
    backward compute with ``untimed_sizes``)."""
    return {
        "seq": None,  # (numbered by the book)
        "op": BUCKET_OP,
        "group": group[0],
        "group_size": group[1],
        "bytes": nbytes,
        "call_site": "DDP backward",
        "function": "backward",
        "issued_unix": now,
        "bucket": index,
        "step": step,
    }


def _collective(entry: dict[str, Any]) -> schema.Collective:
    fields = {k: v for k, v in entry.items() if k in _COLLECTIVE_FIELDS}
    if "callers" in fields:
        fields["callers"] = list(fields["callers"])
    return schema.Collective(**fields)


def _wall_offset(last: float | None) -> float:
    """``time.time()`` less ``time.perf_counter()``, from a wall-clock reading between two
    counter readings at most ``_TIGHT_SECONDS`` apart; ``last`` when they were further apart
    (a thread preempted between its reads would move the steps' wall times by as much: a
    step would no longer start where the one before it ended). Without a ``last``, the
    tightest of a few tries."""
    width, offset = float("inf"), 0.0
    for _ in range(1 if last is not None else 5):
        before = time.perf_counter()
        wall = time.time()
        after = time.perf_counter()
        if after - before < width:
            width, offset = after - before, wall - (before + after) / 2
        if width <= _TIGHT_SECONDS:
            return offset
    return offset if last is None else last


_TIGHT_SECONDS = 50e-6


_SUMMED_PARTS = (
    "step_seconds",
    "forward_seconds",
    "backward_seconds",
    "data_wait_seconds",
    "optimizer_seconds",
    "other_seconds",
)


def _summaries(recent: list[StepRow]) -> schema.Timings:
    """Median, last and largest of each per-step time over the recent window, and where the
    time of the last steps went (``schema.StepParts``)."""

    def summary(values: list[float]) -> schema.Summary | None:
        return (
            schema.Summary(statistics.median(values), values[-1], max(values)) if values else None
        )

    step, forward, backward, data_wait, optimizer, other = steps.columns(recent, _SUMMED_PARTS)
    return schema.Timings(
        window_steps=len(recent),
        step_seconds=summary(step),
        forward_seconds=summary(forward),
        backward_seconds=summary(backward),
        compute_seconds=summary([f + b for f, b in zip(forward, backward)]),
        exposed_comm_seconds=summary(
            [r.exposed_comm_seconds for r in recent if r.exposed_comm_seconds is not None]
        ),
        data_wait_seconds=summary(data_wait),
        optimizer_seconds=summary(optimizer),
        other_seconds=summary(other),
        busy_seconds=summary([steps.busy_seconds(r) for r in recent]),
        parts=steps.step_parts(recent),
    )
