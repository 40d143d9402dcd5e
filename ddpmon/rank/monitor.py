"""The composition root: wires the parts that watch one DDP model on this rank.

Each part lives in a module of its own (ddpmon/rank/timing/, hooks/, watchdog.py, state/,
metrics/, collectors/); this module only builds them in order, hands each what it needs and
undoes them at detach. docs/ARCHITECTURE.md shows the data path.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from torch.nn.parallel import DistributedDataParallel

from ..config import Config
from ..fuses import Fuse, bounded
from ..httpd import Endpoint, start_endpoint
from ..state import attempts, files
from ..state import root as stateroot
from . import clock_offset, debug_server, model, startup, transparent, writers
from .advice.watch import Advice
from .boundary import StepBoundary
from .capture import Capture
from .exporter import RankCollector
from .gpu_steps import GpuStepClock
from .hang_action import HangAbort
from .hooks.autograd import UnusedParameterWatch
from .hooks.collectives import CollectiveTracker, group_identity
from .hooks.optimizer import OptimizerHooks
from .hooks.step import StepHooks
from .memory import MemoryWatch
from .recorder import Recorder
from .settings import LiveSettings
from .sources import rank_sources
from .stack_samples import StackSampler
from .throughput import Throughput
from .timing import Timing
from .timing.layout import ddp_facts
from .watchdog import Watchdog

log = logging.getLogger("ddpmon")


class Monitor:
    """Watches one DDP model on this rank. Made by ``ddpmon.attach``; ``detach()`` undoes it."""

    def __init__(self, ddp: DistributedDataParallel, config: Config) -> None:
        model.check_attachable(ddp)
        self.config = config
        self._ddp = ddp
        self._detached = False
        self.job = config.resolved_job()
        identity = model.identity(ddp, self.job)
        self.rank, self.world_size, self.local_rank = (
            identity.rank,
            identity.world_size,
            identity.local_rank,
        )
        self.recorder = Recorder(identity, identity.ddp_world_size)  # type: ignore[arg-type]  # bus bandwidth: DDP's group
        self._fuses = {
            name: Fuse(name, self._part_failed)
            for name in ("bucket_timing", "grad_hooks", "step_hooks")
        }
        self._boundary = StepBoundary(self.recorder, self._fuses["step_hooks"], self._notify)
        model.check_options(ddp, config, self.local_rank, self.recorder)  # type: ignore[arg-type]
        state_dir = config.resolved_state_dir(self.job)
        if state_dir is not None:
            writers.check_unclaimed(files.path_for(state_dir, self.rank))
        # What detach() undoes; set before anything is installed, so that a failure part-way
        # through attach undoes what was done.
        self._timing: Timing | None = None
        self._unused: UnusedParameterWatch | None = None
        self._steps: StepHooks | None = None
        self._optimizer: OptimizerHooks | None = None
        self._throughput: Throughput | None = None
        self._endpoint: Endpoint | None = None
        self._writer: writers.StateWriter | None = None
        self._collectives: CollectiveTracker | None = None
        self._watchdog: Watchdog | None = None
        self._history: Any = None
        self._advice: Advice | None = None
        self._capture: Capture | None = None
        self._settings: LiveSettings | None = None
        self._memory: MemoryWatch | None = None
        self._stacks: StackSampler | None = None
        self._closers: list[Any] = []
        self.state_file: str | None = None
        # the rank's file so far (``ddpmon run``, from its process's start) is this one's now
        self.recorder.startup = startup.hand_over()
        clock_offset.start()  # measured once per process (under ddpmon run, already at init)
        try:
            self._install(ddp, config, identity.device)  # type: ignore[arg-type]
        except BaseException:
            self.detach()
            raise
        log.info(
            "ddpmon: rank %d of %d attached (job %r): metrics %s, state file %s",
            self.rank,
            self.world_size,
            self.job,
            self.metrics_url or "off",
            self.state_file or "off",
        )

    def _install(self, ddp: DistributedDataParallel, config: Config, device: str) -> None:
        rec = self.recorder
        parameters = model.trainable_parameters(ddp)
        rec.ddp_group = group_identity(ddp.process_group)
        rec.identity.ddp, rec.identity.state_interval = ddp_facts(ddp, rec), config.state_interval
        transparent.install(ddp)
        self._timing = Timing(
            ddp,
            config.bucket_timing,
            config.comm_hook,
            config.comm_state,
            rec,
            parameters,
            device,
            self._fuses["bucket_timing"],
        )
        self._unused = UnusedParameterWatch(
            ddp,
            parameters,
            rec,
            self._fuses["grad_hooks"],
            config.unused_parameters_advice_steps,
            self._notify,
        )
        if device.startswith("cuda"):  # the step's parts as the GPU ran them
            rec.gpu_steps = GpuStepClock(device, Fuse("gpu_step_parts", self._part_failed))
        boundary = self._boundary
        boundary.timing, boundary.unused = self._timing, self._unused
        self._steps = StepHooks(
            ddp, rec, boundary, self._fuses["step_hooks"], timelines=self._timing.timelines
        )
        self._optimizer = OptimizerHooks(
            rec, boundary, self._fuses["step_hooks"], [p for _, p in parameters]
        )
        # the step hooks' forward pre-hook hands it each training forward's batch
        self._throughput = boundary.throughput = Throughput(
            rec,
            device,
            Fuse("throughput", self._part_failed),
            Fuse("flop_count", self._part_failed),
        )
        self._advice = boundary.advice = Advice(
            ddp,
            rec,
            parameters,
            config.resolved_state_dir(self.job),
            self._notify,
            Fuse("advice", self._part_failed),
        )
        self._stacks = StackSampler(rec, Fuse("stack_samples", self._part_failed))
        self._advice.on_peers = self._stacks.peers_seen
        sources, self._closers = rank_sources(self.job, self.rank, device, config.nvml, rec.note)
        self._collector = collector = RankCollector(
            rec,
            config.bucket_metrics,
            sources=sources,
            detail=config.metrics_detail,
            state_dir=config.resolved_state_dir(self.job),
        )
        self._endpoint = start_endpoint(
            collector,
            config.port,
            self.local_rank,  # type: ignore[arg-type]
            config.bind,
            self.rank,
            config.web_config_file,
        )
        rec.identity.port = self.port
        self.state_file = self._start_state_writer(config)
        if self._writer is not None:  # `ddpmon capture` asks through the state directory
            self._capture = Capture(
                os.path.dirname(self._writer.path),
                rec,
                boundary,
                self._notify,
                Fuse("capture", self._part_failed),
                device,
            )
        self._history = (
            writers.start_history(self.state_file, self.rank, rec, device)
            if config.history
            else None
        )
        self._memory = MemoryWatch(
            rec, device, config.state_interval, Fuse("memory_trend", self._part_failed)
        )
        self._collectives = CollectiveTracker(rec, Fuse("collective_tracking", self._part_failed))
        if config.track_collectives:
            self._collectives.install()
        self._watchdog = Watchdog(
            rec,
            config.hang_timeout,
            config.hang_timeout_floor,
            notify=self._notify,
            flush=self._writer.write_final if self._writer else None,
            extras=_flight_recorder,
            state_file=self.state_file,
        )
        if config.hang_action == "abort":  # a proven hang ends the rank (rank/hang_action.py)
            history = self._history
            self._watchdog.on_hang = HangAbort(
                rec,
                self.state_file,
                self._writer.write_final if self._writer else None,
                history=(lambda: history.stop(summary=False)) if history is not None else None,
            )
        self._watchdog.start()
        if self._writer is not None:  # `ddpmon set` asks through the state directory too
            watchdog, timing = self._watchdog, self._timing
            assert timing is not None
            self._settings = LiveSettings(
                os.path.dirname(self._writer.path),
                rec,
                {
                    "hang_timeout": watchdog.set_timeout,
                    "bucket_timing": timing.set_live,
                    "metrics_detail": self._set_metrics_detail,
                },
                self._notify,
                Fuse("live_settings", self._part_failed),
            )
            self._writer.on_pass = self._requests
        debug_server.stop_at_exit()  # before the exit hooks above: see debug_server.py
        ddp._ddpmon_monitor = self  # type: ignore[assignment, attr-defined]

    def _set_metrics_detail(self, mode: str) -> str | None:
        """``ddpmon set metrics_detail=...``: the endpoint's next scrape serves that detail."""
        if self._endpoint is None:
            return "this rank serves no metrics (port < 0 at attach): nothing to change"
        return self._collector.set_detail(mode)

    # -- public handle ----------------------------------------------------------------------

    @property
    def port(self) -> int | None:
        """The bound metrics port, or None when the endpoint is off."""
        return self._endpoint.port if self._endpoint else None

    @property
    def metrics_url(self) -> str | None:
        if not self._endpoint:
            return None
        host = "localhost" if self._endpoint.bind in ("0.0.0.0", "", "::") else self._endpoint.bind
        return f"http://{host}:{self._endpoint.port}/metrics"

    def snapshot(self) -> dict[str, Any]:
        """The latest view of this rank: step, stage, timings, buckets, unused parameters..."""
        return self.recorder.snapshot()

    def step(self) -> None:
        """Mark the end of a training step explicitly. Optional; once called, step
        boundaries come only from here (for loops the automatic detection misreads)."""
        if not self._detached and self._steps is not None:
            self._boundary.step_called()

    def detach(self) -> None:
        """Remove every hook and stop the endpoint and the state writer. The registered comm
        hook cannot be unregistered from DDP, so it becomes a pure pass-through."""
        if self._detached:
            return
        self._boundary.detach()  # the step in progress, if it synchronised, counts
        self._detached = True
        if self._writer:
            self._writer.on_pass = None
        if self._capture is not None:  # a capture under way ends, saying why
            self._capture.detach()
        for part in (
            self._timing,
            self._unused,
            self._steps,
            self._optimizer,
            self._throughput,
            self._collectives,
            self._advice,
        ):
            if part is not None:
                part.remove()
        self._ddp._ddpmon_monitor = None  # type: ignore[assignment, attr-defined]
        transparent.remove(self._ddp)
        self.recorder.detached()
        if self._watchdog:
            self._watchdog.stop()
        if self._stacks is not None:
            self._stacks.stop()
        self.recorder.set_hang(None)
        if self._memory:
            self._memory.stop()
        if self._endpoint:
            self._endpoint.close()
        for close in self._closers:
            close()
        if self._writer:  # its last write first: rank 0's end-of-run summary reads it
            self._writer.stop()
        if self._history:
            self._history.stop()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    # -- wiring -------------------------------------------------------------------------------

    def _part_failed(self, part: str, message: str) -> None:
        self.recorder.record_error(part, message)
        self._notify()

    def _requests(self) -> None:
        """After each state write: the requests of ``ddpmon capture`` and ``ddpmon set``."""
        if self._capture is not None:
            self._capture.poll()
        if self._settings is not None:
            self._settings.poll()

    def _notify(self) -> None:
        writer = getattr(self, "_writer", None)
        if writer:
            writer.notify()

    def _start_state_writer(self, config: Config) -> str | None:
        state_dir = config.resolved_state_dir(self.job)
        if state_dir is None:
            return None
        # private, owned, not another launch's; bounded in time (ddpmon/state/root.py)
        state_dir = stateroot.claim(state_dir, self.rank, explicit=config.state_dir is not None)
        if state_dir is None:
            return None
        # an earlier attempt's files of this rank go to attempt-<N>/ first (state/attempts.py)
        moved = bounded(
            lambda: attempts.keep_earlier(
                state_dir, self.rank, self.job, self.recorder.identity.attempt
            ),
            stateroot.ATTACH_FS_SECONDS,
            "keeping the earlier attempt's state files",
        )
        if moved is not None:
            log.info(
                "ddpmon: rank %d: the files of attempt %s are in %s",
                self.rank,
                moved,
                os.path.join(state_dir, f"attempt-{moved}"),
            )
        self._writer = writers.start_writer(
            state_dir,
            self.rank,
            self.recorder.snapshot,
            config.state_interval,
            self.recorder.write_failures,
        )
        return self._writer.path


def _flight_recorder() -> dict[str, Any] | None:
    from . import flight_recorder

    return flight_recorder.read()
