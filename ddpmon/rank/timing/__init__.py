"""Bucket timing for one DDP model: the source ``policy.plan`` picks, installed.

One module per source: ``c10d.py`` (NCCL's completion hook), ``flight.py`` (the same
timings read from torch's flight recorder), ``hook.py`` (a Python comm hook around the
all-reduce) and ``untimed.py`` (none: buckets only marked in flight);
``layout.py`` reads DDP's bucket layout. ``Timing`` wires the chosen one to the recorder,
gives the step hooks their timelines, folds resolved timings in at each step boundary and
undoes what it can at detach.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from ...errors import AttachError, ConfigError
from ...fuses import Fuse
from .. import model, torch_api
from ..recorder import Recorder
from . import c10d, flight
from .c10d import CompletionClock
from .flight import FlightRecorderFeed
from .hook import CudaEventClock, TimedCommHook, WallClock, allreduce_mean_hook
from .layout import BucketLayout
from .policy import COMPLETION_SOURCES, ERROR, plan
from .untimed import UntimedBuckets

log = logging.getLogger("ddpmon")

__all__ = ["Timing", "plan"]


class Timing:
    """Bucket timing of one model on this rank. ``mode`` is the source in use: ``c10d``,
    ``flight_recorder``, ``hook`` or ``off`` (it changes when a later comm hook starts
    timing, or when a completion source finds itself useless)."""

    def __init__(
        self,
        ddp: Any,
        option: str,
        user_hook: Callable[..., Any] | None,
        user_state: Any,
        recorder: Recorder,
        parameters: list[tuple[str, Any]],
        device: str,
        fuse: Fuse,
    ) -> None:
        self._ddp, self._recorder, self._fuse = ddp, recorder, fuse
        self._names = {id(p): name for name, p in parameters}
        self._closers: list[Callable[[], None]] = []
        self._untimed: UntimedBuckets | None = None
        self._layout: BucketLayout | None = None
        self.comm: TimedCommHook | None = getattr(ddp, "_ddpmon_comm_hook", None)
        reason = c10d.unavailable_reason(ddp.process_group, device)
        layout_missing = _layout_missing(ddp)
        if (
            reason is None and layout_missing is not None
        ):  # c10d's timings fit DDP's buckets by their layout
            reason = torch_api.off(layout_missing, recorder)
        chosen = plan(option, reason is None, user_hook is not None, self.comm is not None)
        if chosen.source == ERROR:
            raise ConfigError("bucket_timing", option, f"'hook' or 'auto' here: {reason}")
        self.clock: Any = None
        if chosen.source == "c10d":
            self.clock = self._listen(ddp, device, option)
            if self.clock is None:  # c10d refused its completion hook: time through a hook
                chosen = plan("hook", False, user_hook is not None, self.comm is not None)
        elif chosen.source == "flight_recorder":
            self.clock = self._read_flight_recorder(ddp, device)
        if self.clock is None:
            self.clock = CudaEventClock(device) if device.startswith("cuda") else WallClock()
        hook, state = (
            user_hook or allreduce_mean_hook,
            user_state if user_state is not None else ddp.process_group,
        )
        if chosen.comm_hook == "user":
            ddp.register_comm_hook(state, hook)
        elif chosen.comm_hook == "install":
            self._install(TimedCommHook(hook, state, recorder, self.clock, self._names, fuse))
        elif chosen.comm_hook == "rebind":
            assert self.comm is not None
            self.comm.rebind(recorder, self.clock, self._names, fuse)
            self.comm.timing = chosen.source == "hook"
            if user_hook is not None:
                self.comm.replace(hook, state)
        if chosen.time_later_hook:
            ddp.register_comm_hook = self._register_later  # type: ignore[method-assign]
        if chosen.read_layout and layout_missing is not None:
            torch_api.off(layout_missing, recorder)
        elif chosen.read_layout:
            self._layout = BucketLayout(ddp, [p for _, p in parameters], [n for n, _ in parameters])
        if chosen.mark_untimed and self._layout is not None:
            self._untimed = UntimedBuckets(
                self._layout, recorder, fuse, active=self._untimed_active
            )
        self.mode = chosen.source
        recorder.identity.bucket_timing = self.mode
        recorder.host_wait_exposed = isinstance(self.clock, WallClock)

    # -- for the step hooks ------------------------------------------------------------------

    @property
    def timelines(self) -> list[Any]:
        """What the step hooks tell of each backward: the clock when it measures exposed
        communication itself (c10d), and the untimed bucket marks."""
        out: list[Any] = []
        if isinstance(self.clock, CompletionClock):
            out.append(self.clock)
        if self._untimed is not None:
            out.append(self._untimed)
        return out

    def collect(self, step: int) -> None:
        """At a step boundary: fold every step the clock has resolved into the recorder.
        A failing clock switches bucket timing off, never the step hooks. A wall or event
        clock that no comm hook of ddpmon's feeds has nothing to fold (the default on gloo)."""
        fuse, rec, clock = self._fuse, self._recorder, self.clock
        if not fuse.ok or clock is None or (self.comm is None and self.mode == "off"):
            return
        try:
            completion = (
                self.mode in COMPLETION_SOURCES
            )  # matches collectives to DDP's bucket layout
            layout = self._layout if completion else None
            buckets = layout.refresh(rec) if layout else 0
            clock.new_step(step, buckets, layout.generation if layout else 0)
            for timings in clock.collect():
                rec.add_step_timings(timings)
            if completion:
                self._check_completion(clock)
        except Exception as exc:
            fuse.blow(exc)

    def _check_completion(self, clock: CompletionClock) -> None:
        """What the completion clock found of itself: steps it could not match, a warning
        while they keep failing, and whether the source times anything at all."""
        rec = self._recorder
        rec.unmatched_steps = clock.unmatched_steps
        if rec.notes.get("bucket_timing") != clock.warning:
            rec.note("bucket_timing", clock.warning)
        if clock.off_reason is not None:
            self._turn_off(clock.off_reason)

    def set_live(self, option: str) -> str | None:
        """``ddpmon set bucket_timing=off|hook`` on a running rank: ddpmon's comm hook stops
        or resumes timing (it stays DDP's hook, a pass-through while off). None once done;
        else why it cannot change here."""
        comm = self.comm
        hooked = comm is not None and isinstance(self.clock, (WallClock, CudaEventClock))
        if option == "hook" and not (hooked and self._fuse.ok):
            return (
                "no ddpmon comm hook can time buckets on this rank (DDP takes a comm hook once, "
                "before training): restart with DDPMON_BUCKET_TIMING=hook"
            )
        if option == "off" and not hooked and self.mode != "off":
            return (
                f"bucket timing comes from {self.mode} on this rank, chosen at attach: restart "
                "with DDPMON_BUCKET_TIMING=off"
            )
        if comm is not None and hooked:
            comm.timing = option == "hook"
        self.mode = self._recorder.identity.bucket_timing = option
        return None

    def remove(self) -> None:
        """Detach: DDP cannot unregister a comm hook, so ddpmon's becomes a pass-through."""
        if self.comm is not None:
            self.comm.timing = False
        if self._ddp.__dict__.get("register_comm_hook") == self._register_later:
            del self._ddp.register_comm_hook
        for close in self._closers:
            close()
        self._closers.clear()

    # -- wiring --------------------------------------------------------------------------------

    def _listen(self, ddp: Any, device: str, option: str) -> CompletionClock | None:
        """The c10d clock, or None (and a warning) when c10d refuses the completion hook."""
        clock = CompletionClock(device, _used_map_allreduce(ddp), self._fuse)
        try:
            self._closers.append(c10d.listen(ddp.process_group, clock.on_completion))
            return clock
        except Exception as exc:
            if option == "c10d":
                raise AttachError(
                    f"bucket_timing='c10d': c10d refused a completion hook: {exc}"
                ) from exc
            log.warning(
                "ddpmon: rank %s: c10d refused a completion hook (%s); timing buckets through "
                "a Python comm hook instead",
                self._recorder.identity.rank,
                exc,
            )
            return None

    def _read_flight_recorder(self, ddp: Any, device: str) -> CompletionClock:
        """The completion clock, fed from torch's flight recorder with the group's collective
        timing on (durations on NCCL)."""
        clock = CompletionClock(
            device,
            _used_map_allreduce(ddp),
            self._fuse,
            source="flight_recorder",
            max_windows=flight.MAX_WINDOWS,
        )
        group = ddp.process_group
        try:
            torch_api.enable_collectives_timing(group)
        except torch_api.Missing as missing:
            torch_api.off(missing, self._recorder)
        try:
            name: str | None = torch_api.process_group_name(group)
        except Exception:
            name = (
                None  # every group's all-reduces are read: the matching refuses what does not fit
            )
        feed = FlightRecorderFeed(clock, name, c10d.backend_name(group, device), self._fuse)
        feed.start()
        self._closers.append(feed.close)
        return clock

    def _install(self, comm: TimedCommHook) -> None:
        ddp = self._ddp
        ddp.register_comm_hook(None, comm)
        ddp._ddpmon_comm_hook = comm
        ddp.register_comm_hook = functools.partial(_register_user_hook, ddp, comm)  # type: ignore[method-assign]
        self.comm = comm

    def _register_later(self, state: object, hook: Any) -> None:
        """Stands in for ``ddp.register_comm_hook`` while no source times buckets: the
        user's hook runs in Python anyway, so ddpmon registers it inside its timing hook,
        and from then on every bucket is timed."""
        ddp = self._ddp
        del ddp.register_comm_hook  # DDP's own, to register ddpmon's
        comm = TimedCommHook(hook, state, self._recorder, self.clock, self._names, self._fuse)
        comm.user_registered = True
        try:
            model.check_comm_hook(ddp, hook, self._recorder)
            self._install(comm)
        except BaseException:  # refused: the user's next try is timed all the same
            ddp.register_comm_hook = self._register_later  # type: ignore[method-assign]
            raise
        self.mode = self._recorder.identity.bucket_timing = "hook"
        log.info(
            "ddpmon: rank %s: comm hook %s registered inside ddpmon's timing hook: buckets are "
            "timed from now on",
            self._recorder.identity.rank,
            getattr(hook, "__qualname__", hook),
        )

    def _untimed_active(self) -> bool:
        return self.comm is None or not self.comm.timing

    def _turn_off(self, reason: str) -> None:
        """A completion source checked itself and found nothing to time: say so once, in the
        log, the state file and ``ddpmon_rank_info``, and stop listening."""
        source = self.mode
        self.mode = self._recorder.identity.bucket_timing = "off"
        self.clock = None  # nothing left to collect
        text = f"per-bucket timing from {source} is off: {reason}; bucket_timing='hook' times buckets instead"
        self._recorder.note("bucket_timing", text)
        log.warning("ddpmon: rank %s: %s", self._recorder.identity.rank, text)
        for close in self._closers:
            close()
        self._closers.clear()


def _used_map_allreduce(ddp: Any) -> bool:
    """DDP all-reduces its used-parameter map after the last bucket (find_unused_parameters
    without static_graph): one all-reduce more per backward for a completion clock."""
    return bool(getattr(ddp, "find_unused_parameters", False)) and not getattr(
        ddp, "static_graph", False
    )


def _layout_missing(ddp: Any) -> torch_api.Missing | None:
    try:
        torch_api.check_ddp_logging_data(ddp)
    except torch_api.Missing as missing:
        return missing
    return None


def _register_user_hook(ddp: Any, comm: TimedCommHook, state: object, hook: Any) -> None:
    """Stands in for ``ddp.register_comm_hook`` once ddpmon's hook is registered: DDP accepts
    one hook, so the user's runs inside ddpmon's (and is timed)."""
    if comm.user_registered:
        raise RuntimeError(
            "register_comm_hook or register_builtin_comm_hook can only be called once."
        )
    model.check_comm_hook(ddp, hook, comm._recorder)
    comm.user_registered = True
    comm.replace(hook, state)
    log.info(
        "ddpmon: comm hook %s registered inside ddpmon's timing hook",
        getattr(hook, "__qualname__", hook),
    )
