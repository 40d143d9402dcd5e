"""A capture of this rank's next steps with torch.profiler, asked for by ``ddpmon capture``.

The request is a file in the rank's state directory (``state/captures.py`` has the protocol;
docs/capture.md the whole story). Three threads take part, and the training thread does no
file I/O:

- the state writer's thread calls ``poll()`` after each write: at most once a second it
  looks for ``capture-<R>.request`` (one ``stat``: the whole cost while idle), takes a
  request bound to this process, answers ``accepted`` and arms the step boundary
  (``StepBoundary.capture = self``); it also writes the statuses the training thread left;
- the training thread, at each step's end while armed (``step_ended``), starts the profiler
  (a warm-up step, then the steps asked for), steps it and stops it, then disarms the
  boundary: nothing else is added to a step, and nothing at all while no capture is asked;
- a short-lived thread writes the trace (bounded in size), then ``ok`` or ``error``.

A capture that cannot be done (torch's profiler already in use, a full disk, a trace over
the size cap, a rank that detaches meanwhile) is logged, its status says why, and training
goes on; an unexpected failure blows the ``capture`` fuse, which switches captures off.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

from ..fuses import Fuse, bounded
from ..state import captures, files
from . import torch_api
from .recorder import Recorder

log = logging.getLogger("ddpmon")

LOOK_INTERVAL = 1.0
"""Seconds between two looks for a request file."""
WARMUP_STEPS = captures.WARMUP_STEPS
EXPIRED_GRACE = 5.0
"""Seconds past a request's expiry before the state writer's thread drops it unstarted."""


def profiler_busy() -> bool:
    """torch's profiler is already on in this process (the program's own torch.profiler or
    torch.autograd.profiler): a second one would cut the first one's trace short. Raises
    ``torch_api.Missing`` where torch cannot tell."""
    return torch_api.profiler_running()


class Capture:
    """Captures of one rank whose state files go to ``state_dir``; ``boundary`` is the rank's
    ``StepBoundary``, ``notify`` wakes the state writer's thread."""

    def __init__(
        self,
        state_dir: str,
        recorder: Recorder,
        boundary: Any,
        notify: Callable[[], None],
        fuse: Fuse,
        device: str,
    ) -> None:
        self._dir = state_dir
        self._rec = recorder
        self._rank = recorder.identity.rank
        self._request = captures.request_path(state_dir, self._rank)
        self._boundary = boundary
        self._notify = notify
        self._fuse = fuse
        self._device = device
        self._next_look = 0.0
        self._plan: captures.Request | None = None  # the request being served
        self._prof: Any = None  # training thread only
        self._ended = 0  # step boundaries since the profiler started
        self._first = self._last = 0
        self._pending: collections.deque[captures.Status] = collections.deque()
        self._writing = threading.Lock()  # status files: the writer's thread, export, detach
        self._written = ("", -1)  # the capture and the state last written
        # starting the profiler (training thread) and dropping an expired request (the state
        # writer's thread) exclude each other; the training thread never waits for it
        self._arming = threading.Lock()

    # -- the state writer's thread ----------------------------------------------------------

    def poll(self) -> None:
        """Write the statuses left by the training thread; at most once a second, look for
        a request."""
        if not self._fuse.ok:
            return
        try:
            self._write_pending()
            self._drop_expired()
            now = time.monotonic()
            if now < self._next_look or self._plan is not None:
                return  # one capture at a time: a new request waits for this one to end
            self._next_look = now + LOOK_INTERVAL
            if os.path.lexists(self._request):
                self._take()
        except Exception as exc:
            self._fuse.blow(exc)

    def _take(self) -> None:
        request, why = captures.take(self._request, captures.read_request)
        rec = self._rec
        if request is not None:
            why = captures.refusal(
                request, self._rank, rec.identity.job, os.getpid(), rec.started_unix, time.time()
            )
        if why is not None:
            log.info(
                "ddpmon: rank %d: ignored the capture request %s: %s",
                self._rank,
                self._request,
                why,
            )
            return
        assert request is not None
        captures.prune(self._dir, self._rank, captures.KEEP - 1)
        self._plan = request
        self._ended = 0
        self._write(self._status("accepted"))
        log.info(
            "ddpmon: rank %d: capturing %d steps (%s)",
            self._rank,
            request.steps,
            f"from step {request.at_step}" if request.at_step is not None else "from the next step",
        )
        self._boundary.capture = self  # armed: the boundary tells us its next ends

    def _drop_expired(self) -> None:
        """A request still waiting for a step boundary after the command gave up (a hung
        training loop): dropped, so that the next request is taken."""
        plan = self._plan
        if (
            plan is None
            or self._prof is not None
            or time.time() < plan.expires_unix + EXPIRED_GRACE
        ):
            return
        with self._arming:
            if self._plan is not plan or self._prof is not None:
                return
            self._boundary.capture = None
            status = self._status(
                "error",
                reason=(
                    f"no step boundary came before the command gave up (the rank stayed at step "
                    f"{self._rec.steps}): it may be hung; run ddpmon doctor"
                ),
            )
            self._plan = None
        log.warning("ddpmon: rank %d: capture dropped: %s", self._rank, status.reason)
        self._write(status)

    def _status(self, state: str, **fields: Any) -> captures.Status:
        plan = self._plan
        assert plan is not None
        first = {"first_step": self._first, "last_step": self._last} if self._first else {}
        return captures.Status(
            nonce=plan.nonce,
            rank=self._rank,
            state=state,
            steps=plan.steps,
            step=self._rec.steps,
            job=self._rec.identity.job,
            written_unix=time.time(),
            **{**first, **fields},
        )

    def _write(self, status: captures.Status) -> None:
        """Write ``status`` unless a later one of the same capture was written already (the
        export thread may end a capture before the state writer's thread writes its
        ``recording``)."""
        with self._writing:
            order = captures.STATES.index(status.state)
            if self._written[0] == status.nonce and self._written[1] >= order:
                return
            self._written = (status.nonce, order)
            try:
                captures.write_status(self._dir, status)
            except OSError as exc:
                log.warning(
                    "ddpmon: rank %d: cannot write the capture status into %s (%s)",
                    self._rank,
                    self._dir,
                    exc.strerror or exc,
                )

    def _write_pending(self) -> None:
        while self._pending:
            self._write(self._pending.popleft())

    # -- the training thread, at a step's end while armed -------------------------------------

    def step_ended(self, steps: int) -> None:
        """The step ``steps`` ended (the step boundary, training thread). Never raises."""
        try:
            if self._prof is None:
                if not self._arming.acquire(blocking=False):
                    return  # the request is being dropped right now
                try:
                    self._start(steps)
                finally:
                    self._arming.release()
            else:
                self._advance()
        except Exception as exc:
            self._give_up(f"ddpmon failed: {type(exc).__name__}: {exc}")
            self._fuse.blow(exc)

    def _start(self, steps: int) -> None:
        plan = self._plan
        if plan is None:
            self._boundary.capture = None
            return
        if plan.at_step is not None and steps < plan.at_step:
            return
        if time.time() > plan.expires_unix:
            self._give_up(
                f"the rank reached a step boundary (step {steps}) only after the command had "
                "given up; ask again"
            )
            return
        try:
            busy = profiler_busy()
        except torch_api.Missing as missing:  # said by the capture's own warning and status
            self._give_up(missing.line)
            return
        if busy:
            self._give_up(
                "profiler busy: torch's profiler is already running in this process (the "
                "program's own torch.profiler): capture once it has stopped, or read that "
                "profiler's trace"
            )
            return
        from torch import profiler

        activities = [profiler.ProfilerActivity.CPU]
        if self._device.startswith("cuda"):
            activities.append(profiler.ProfilerActivity.CUDA)
        prof = profiler.profile(
            activities=activities,
            with_stack=True,
            schedule=profiler.schedule(wait=0, warmup=WARMUP_STEPS, active=plan.steps, repeat=1),
        )
        prof.start()
        self._prof = prof
        self._first = steps + WARMUP_STEPS + 1
        self._last = steps + WARMUP_STEPS + plan.steps
        self._pending.append(self._status("recording"))
        self._notify()

    def _advance(self) -> None:
        plan, prof = self._plan, self._prof
        assert plan is not None
        self._ended += 1
        prof.step()
        if self._ended == WARMUP_STEPS:  # recording from here on: say what it is
            prof.add_metadata_json(
                "ddpmon",
                json.dumps(
                    {
                        "rank": self._rank,
                        "job": self._rec.identity.job,
                        "steps": plan.steps,
                        "first_step": self._first,
                        "last_step": self._last,
                        "nonce": plan.nonce,
                    }
                ),
            )
        if self._ended < WARMUP_STEPS + plan.steps:
            return
        prof.stop()
        self._prof = None
        self._boundary.capture = None
        threading.Thread(
            target=self._export, args=(prof, plan), name="ddpmon-capture", daemon=True
        ).start()

    def _give_up(self, reason: str) -> None:
        """End the capture under way with ``reason`` (training thread: the status is written
        by the state writer's thread)."""
        self._boundary.capture = None
        prof, self._prof = self._prof, None
        if prof is not None:
            try:
                prof.stop()
            except Exception:
                pass
        if self._plan is not None:
            log.warning(
                "ddpmon: rank %d: capture failed (training goes on): %s", self._rank, reason
            )
            self._pending.append(self._status("error", reason=reason))
            self._plan = None
            self._first = 0
            self._notify()

    # -- the export thread ----------------------------------------------------------------

    def _export(self, prof: Any, plan: captures.Request) -> None:
        self._write(self._status("writing"))
        name = captures.trace_name(self._rank, plan.nonce)
        final = os.path.join(self._dir, name)
        # torch writes the trace to "<path>.tmp", following any link there, then renames it:
        # a name nobody else can know before torch creates it, not the requester's nonce alone
        tmp = os.path.join(self._dir, f".{name}.{secrets.token_hex(16)}")
        try:
            prof.export_chrome_trace(tmp)
            size = files.own_private(
                tmp
            )  # the state files' mode, set on the file itself, never a link
            if size > captures.MAX_TRACE_BYTES:
                os.unlink(tmp)
                fewer = max(1, plan.steps * captures.MAX_TRACE_BYTES // size)
                status = self._status(
                    "error",
                    reason=(
                        f"the trace of {plan.steps} steps is {_mib(size)}, over the cap of "
                        f"{_mib(captures.MAX_TRACE_BYTES)}: it was deleted; capture fewer steps (--steps {fewer})"
                    ),
                )
            else:
                os.replace(tmp, final)
                status = self._status("ok", trace=name, trace_bytes=size)
        except Exception as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            why = (
                exc.strerror
                if isinstance(exc, OSError) and exc.strerror
                else f"{type(exc).__name__}: {exc}"
            )
            status = self._status("error", reason=f"cannot write the trace into {self._dir}: {why}")
        if status.state == "error":
            log.warning(
                "ddpmon: rank %d: capture failed (training goes on): %s", self._rank, status.reason
            )
        else:
            log.info(
                "ddpmon: rank %d: steps %d to %d captured in %s",
                self._rank,
                self._first,
                self._last,
                final,
            )
        self._write(status)
        self._first = 0
        self._plan = None  # ready for the next request

    # -- detach ---------------------------------------------------------------------------

    def detach(self) -> None:
        """The rank detaches: a capture under way ends with an error status (bounded)."""
        if self._plan is not None and self._prof is not None:
            done = max(0, self._ended - WARMUP_STEPS)
            self._give_up(
                f"the rank detached from ddpmon (its training ended) after {done} of "
                f"{self._plan.steps} steps; nothing was written"
            )
        elif self._plan is not None and self._boundary.capture is self:
            self._give_up(
                "the rank detached from ddpmon (its training ended) before its next step boundary"
            )
        bounded(self._write_pending, files.FINAL_WRITE_SECONDS, "the last capture status")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
