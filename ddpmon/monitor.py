"""The composition root: wires hooks, recorder, exporter and state writer for one DDP model."""

from __future__ import annotations

import atexit
import functools
import logging
import os
import socket
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from . import __version__, statefile
from ._safety import Fuse
from .collectors import host, nvml, torch_memory
from .config import Config
from .errors import AttachError, ConfigError
from .hooks.autograd import GradReadyHooks, explain_reduction_error
from .hooks import completion
from .hooks.comm import CudaEventClock, TimedCommHook, WallClock, allreduce_mean_hook
from .hooks.completion import BucketLayout, CompletionClock
from .hooks.step import StepHooks
from .metrics.exporter import Endpoint, RankCollector, serve
from .recorder import Recorder

log = logging.getLogger("ddpmon")

_STATE_FILES_IN_USE: set[str] = set()  # by the monitors of this process

_HOW_TO_WRAP = (
    "wrap the model first:\n"
    "    model = torch.nn.parallel.DistributedDataParallel(model)\n"
    "    monitor = ddpmon.attach(model)"
)


class Monitor:
    """Watches one DDP model on this rank. Made by ``ddpmon.attach``; ``detach()`` undoes it."""

    def __init__(self, ddp: DistributedDataParallel, config: Config) -> None:
        _check_attachable(ddp)
        self.config = config
        self._ddp = ddp
        self._detached = False
        self._advised_unused = False

        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()  # the job's; DDP may run on a subgroup
        self.ddp_world_size = dist.get_world_size(ddp.process_group)
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        self.job = config.resolved_job()
        identity = self._identity()
        self.recorder = Recorder(identity, self.ddp_world_size)  # bus bandwidth: DDP's group
        self._fuses = {
            name: Fuse(name, self._part_failed) for name in ("comm_hook", "grad_hooks", "step_hooks")
        }
        if config.port > 0 and config.port + self.local_rank > 65535:
            raise ConfigError("port", config.port, f"a base port such that port + LOCAL_RANK "
                              f"({self.local_rank}) is at most 65535")
        if config.comm_hook is not None:
            try:
                ddp._check_comm_hook(config.comm_hook)
            except Exception as exc:
                raise ConfigError("comm_hook", config.comm_hook,
                                  f"a comm hook that torch accepts here; torch refused it: {exc}") from None
        state_dir = config.resolved_state_dir(self.job)
        if state_dir is not None and statefile.path_for(state_dir, self.rank) in _STATE_FILES_IN_USE:
            raise AttachError(
                f"another model of this process is monitored already, and both would write "
                f"{statefile.path_for(state_dir, self.rank)}: give this one a state directory of "
                "its own (ddpmon.attach(model, state_dir=...), or with the default directory a "
                "job=... of its own)"
            )
        # What detach() undoes; set before anything is installed, so a failure part-way
        # through attach can undo what was done.
        self._comm: TimedCommHook | None = None
        self._grads: GradReadyHooks | None = None
        self._steps: StepHooks | None = None
        self._endpoint: Endpoint | None = None
        self._writer: statefile.StateWriter | None = None
        self._closers: list[Any] = []  # what to release at detach (NVML, the c10d listener)
        self._collectives: Any = None
        self._watchdog: Any = None
        self._history: Any = None
        self.state_file: str | None = None
        try:
            self._install(ddp, config, identity)
        except BaseException:
            self.detach()
            raise
        log.info(
            "ddpmon: rank %d of %d attached (job %r): metrics %s, state file %s",
            self.rank, self.world_size, self.job, self.metrics_url or "off", self.state_file or "off",
        )

    def _install(self, ddp: DistributedDataParallel, config: Config, identity: dict[str, Any]) -> None:
        parameters = [
            (name, p)
            for name, p in ddp.module.named_parameters()
            if p.requires_grad and name not in getattr(ddp, "parameters_to_ignore", ())
        ]
        names = {id(p): name for name, p in parameters}
        device = identity["device"]
        hook, state = config.comm_hook or allreduce_mean_hook, config.comm_state
        if state is None:
            state = ddp.process_group
        comm = getattr(ddp, "_ddpmon_comm_hook", None)
        mode = self._timing_mode(ddp, config, hooked=comm is not None)
        clock: Any = self._completion_clock(ddp, device, config) if mode == "c10d" else None
        if clock is None:
            mode = "hook" if mode == "c10d" else mode  # c10d refused the completion hook
            clock = CudaEventClock(device) if device.startswith("cuda") else WallClock()
        self._clock = clock
        self._layout: BucketLayout | None = None
        self._names = names
        if comm is None and mode in ("c10d", "off"):
            if config.comm_hook:  # the user's hook, registered as is
                ddp.register_comm_hook(state, hook)
            if mode == "off" and config.bucket_timing == "auto":  # a hook registered later is timed
                ddp.register_comm_hook = self._time_hook_registered_later  # type: ignore[method-assign]
        elif comm is None:  # the Python comm hook times every bucket
            comm = TimedCommHook(hook, state, self.recorder, clock, names, self._fuses["comm_hook"])
            ddp.register_comm_hook(None, comm)
            ddp._ddpmon_comm_hook = comm  # type: ignore[attr-defined]
            ddp.register_comm_hook = functools.partial(_register_user_hook, ddp, comm)  # type: ignore[method-assign]
        else:  # attached before and detached: DDP still holds ddpmon's hook
            comm.rebind(self.recorder, clock, names, self._fuses["comm_hook"])
            comm.timing = config.bucket_timing != "off"
            if config.comm_hook:
                comm.replace(hook, state)
        self._comm = comm
        untimed = None
        if mode == "c10d" or (mode == "off" and completion.backend_name(ddp.process_group, device) != "nccl"):
            # c10d: the buckets' layout; gloo: DDP's buckets complete on the CPU, so a rank
            # waiting for them is seen between the two backward callbacks
            self._layout = BucketLayout(ddp, [p for _, p in parameters], [n for n, _ in parameters])
            untimed = self._untimed_bucket_sizes if mode == "off" else None
        self.recorder.identity["bucket_timing"] = mode

        # Parameters can go unused without an error only with find_unused_parameters or
        # static_graph; otherwise DDP stops at the next iteration and ddpmon names them in
        # that error, so the per-parameter hooks would only cost time.
        if getattr(ddp, "find_unused_parameters", False) or getattr(ddp, "static_graph", False):
            self._grads = GradReadyHooks(parameters, self.recorder, self._fuses["grad_hooks"])
        self._steps = StepHooks(
            ddp, self.recorder, self._on_boundary, self._backward_seen, self._fuses["step_hooks"],
            timeline=clock if isinstance(clock, (CompletionClock, WallClock)) else None,
            untimed_buckets=untimed,
        )
        self._wrap_forward([name for name, _ in parameters])

        self._endpoint = self._start_endpoint()
        self.recorder.identity["port"] = self.port
        self.state_file = self._start_state_writer()
        self._start_history()  # before the watchdog: its exit record is written first at exit
        self._start_hang_tracking()
        ddp._ddpmon_monitor = self  # type: ignore[attr-defined]

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
        """The latest view of this rank: step, phase, timings, buckets, unused parameters..."""
        return self.recorder.snapshot()

    def step(self) -> None:
        """Mark the end of a training step explicitly. Optional; once called, step
        boundaries come only from here (for loops the automatic detection misreads)."""
        fuse = self._fuses["step_hooks"]
        if self._detached or not fuse.ok:
            return
        try:
            self._steps.manual = True
            self._on_boundary(time.perf_counter())
        except Exception as exc:  # never into the training loop
            fuse.blow(exc)

    def detach(self) -> None:
        """Remove every hook and stop the endpoint and the state writer. The registered comm
        hook cannot be unregistered from DDP, so it becomes a pure pass-through."""
        if self._detached:
            return
        if self._steps and not self._steps.manual and self.recorder.step_has_synced:
            try:  # the step in progress synchronised its gradients: it is done, count it
                self._on_boundary(time.perf_counter())
            except Exception as exc:
                self._fuses["step_hooks"].blow(exc)
        self._detached = True
        if self._comm:
            self._comm.timing = False
        if self._grads:
            self._grads.remove()
        if self._steps:
            self._steps.remove()
        self._ddp.__dict__.pop("forward", None)
        if self._ddp.__dict__.get("register_comm_hook") == self._time_hook_registered_later:
            del self._ddp.register_comm_hook
        self._ddp._ddpmon_monitor = None  # type: ignore[attr-defined]
        self.recorder.phase = "detached"
        self._stop_hang_tracking()
        if self._endpoint:
            self._endpoint.close()
        for close in self._closers:
            close()
        self._stop_history()
        if self._writer:
            self._writer.stop()
            _STATE_FILES_IN_USE.discard(self._writer.path)

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    # -- wiring -------------------------------------------------------------------------------

    def _identity(self) -> dict[str, Any]:
        ddp = self._ddp
        params = list(ddp.module.parameters())
        device = str(params[0].device) if params else "cpu"
        level = dist.get_debug_level()
        return {
            "rank": self.rank,
            "local_rank": self.local_rank,
            "world_size": self.world_size,
            "ddp_world_size": self.ddp_world_size,
            "group_rank": int(os.environ.get("GROUP_RANK", "0") or 0),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "port": None,
            "job": self.job,
            "backend": str(dist.get_backend(ddp.process_group)),
            "device": device,
            "torch_version": torch.__version__,
            "debug_level": getattr(level, "name", str(level)),
            "version": __version__,
            "find_unused_parameters": bool(getattr(ddp, "find_unused_parameters", False)),
            "num_parameters": sum(1 for p in params if p.requires_grad),
        }

    def _part_failed(self, part: str, message: str) -> None:
        self.recorder.record_error(part, message)
        writer = getattr(self, "_writer", None)
        if writer:
            writer.notify()

    def _on_boundary(self, now: float) -> None:
        rec = self.recorder
        rec.close_step(now)
        if rec.steps == 1 and self._writer:  # the first step is news: a rank that dies
            self._writer.notify()            # early is then not seen "at step 0, phase init"
        self._collect_bucket_timings()
        unused = self._grads.take_unused() if self._grads else None
        if unused is not None and rec.set_unused_parameters(unused):
            if unused:
                shown = ", ".join(unused[:10]) + (f" (+{len(unused) - 10} more)" if len(unused) > 10 else "")
                log.warning(
                    "ddpmon: rank %d: %d parameter(s) received no gradient in step %d: %s",
                    self.rank, len(unused), rec.steps, shown,
                )
            else:
                log.warning("ddpmon: rank %d: every parameter receives a gradient again", self.rank)
            if self._writer:
                self._writer.notify()
        self._advise_find_unused(rec)

    def _collect_bucket_timings(self) -> None:
        clock, rec = self._clock, self.recorder
        if isinstance(clock, CompletionClock):
            fuse = self._fuses["comm_hook"]
            if not fuse.ok:
                return
            try:
                layout = self._layout
                buckets = layout.refresh(rec) if layout else 0
                clock.new_step(buckets, rec.steps, layout.generation if layout else 0)
                for step in clock.collect():
                    rec.add_step_timings(step)
                rec.unmatched_steps = clock.unmatched_steps
                if rec.notes.get("bucket_timing") != clock.warning:
                    rec.note("bucket_timing", clock.warning)
            except Exception as exc:
                fuse.blow(exc)
            return
        clock.new_step()
        for step in clock.collect():
            rec.add_step_timings(step)

    def _timing_mode(self, ddp: DistributedDataParallel, config: Config, hooked: bool) -> str:
        """``hook``, ``c10d`` or ``off``: what ``bucket_timing`` means for this model.

        ``auto`` never adds a Python comm hook of its own: any costs a few percent of step
        time (docs/performance.md). It takes c10d's timing where there is some (NCCL), and
        elsewhere times buckets only when a Python hook runs anyway: the user's, or
        ddpmon's still registered from an earlier attach."""
        mode = config.bucket_timing
        if mode in ("hook", "off"):
            return mode
        reason = completion.unavailable_reason(ddp.process_group, self.recorder.identity["device"])
        if mode == "c10d" and reason:
            raise ConfigError("bucket_timing", mode, f"'hook' or 'auto' here: {reason}")
        if hooked:  # DDP still holds ddpmon's hook from an earlier attach: it times
            return "hook"
        if not reason:
            return "c10d"
        return "hook" if config.comm_hook is not None else "off"

    def _untimed_bucket_sizes(self) -> list[int]:
        """DDP's bucket sizes while no comm hook reports its buckets (none once one does)."""
        fuse = self._fuses["comm_hook"]
        if (self._comm is not None and self._comm.timing) or self._layout is None or not fuse.ok:
            return []
        try:
            self._layout.refresh()
            return self._layout.sizes
        except Exception as exc:
            fuse.blow(exc)
            return []

    def _time_hook_registered_later(self, state: object, hook: Any) -> None:
        """Stands in for ``ddp.register_comm_hook`` while ``auto`` found no cheap timing
        source: the user's hook runs in Python anyway, so ddpmon registers it inside its
        timing hook, and from then on every bucket is timed."""
        ddp = self._ddp
        del ddp.register_comm_hook  # DDP's own, to register ddpmon's
        comm = TimedCommHook(hook, state, self.recorder, self._clock, self._names, self._fuses["comm_hook"])
        comm.user_registered = True
        try:
            ddp._check_comm_hook(hook)
            ddp.register_comm_hook(None, comm)
        except BaseException:  # refused: the user's next try is timed all the same
            ddp.register_comm_hook = self._time_hook_registered_later  # type: ignore[method-assign]
            raise
        ddp._ddpmon_comm_hook = comm  # type: ignore[attr-defined]
        ddp.register_comm_hook = functools.partial(_register_user_hook, ddp, comm)  # type: ignore[method-assign]
        self._comm = comm
        self.recorder.identity["bucket_timing"] = "hook"
        log.info("ddpmon: rank %d: comm hook %s registered inside ddpmon's timing hook: buckets are "
                 "timed from now on", self.rank, getattr(hook, "__qualname__", hook))

    def _completion_clock(self, ddp: DistributedDataParallel, device: str, config: Config) -> CompletionClock | None:
        """The c10d clock, or None (and a warning) when c10d refuses the completion hook."""
        used_map = bool(getattr(ddp, "find_unused_parameters", False)) and not getattr(ddp, "static_graph", False)
        clock = CompletionClock(device, used_map, self._fuses["comm_hook"])
        try:
            self._closers.append(completion.listen(ddp.process_group, clock.on_completion))
            return clock
        except Exception as exc:
            if config.bucket_timing == "c10d":
                raise AttachError(f"bucket_timing='c10d': c10d refused a completion hook: {exc}") from exc
            log.warning(
                "ddpmon: rank %d: c10d refused a completion hook (%s); timing buckets through a "
                "Python comm hook instead", self.rank, exc,
            )
            return None

    def _advise_find_unused(self, rec: Recorder) -> None:
        if self._advised_unused or not getattr(self._ddp, "find_unused_parameters", False):
            return
        if rec.steps_without_unused >= self.config.unused_parameters_advice_steps:
            self._advised_unused = True
            text = (
                f"find_unused_parameters=True, but no parameter has been unused on this rank for "
                f"{rec.steps_without_unused} steps; it costs a traversal of the autograd graph "
                "every step: if no rank has unused parameters (ddpmon doctor checks them all), "
                "pass find_unused_parameters=False (or static_graph=True)"
            )
            rec.note("find_unused_parameters", text)
            log.warning("ddpmon: rank %d: %s", self.rank, text)

    def _backward_seen(self) -> bool:
        """A backward ran in the step in progress (gradients or the output's grad hook)."""
        return bool(self._grads and self._grads.any_ready) or self.recorder.backward_seen

    def _wrap_forward(self, parameter_names: list[str]) -> None:
        original = self._ddp.forward
        recorder, rank = self.recorder, self.rank

        def forward(*args: Any, **kwargs: Any) -> Any:
            try:
                return original(*args, **kwargs)
            except RuntimeError as exc:
                try:
                    explain_reduction_error(exc, parameter_names, recorder.unused_parameters, rank)
                except Exception:
                    pass
                raise

        self._ddp.forward = forward  # type: ignore[method-assign]

    def _start_endpoint(self) -> Endpoint | None:
        cfg = self.config
        if cfg.port < 0:
            return None
        collector = RankCollector(self.recorder, cfg.bucket_metrics, sources=self._sample_sources())
        port = cfg.port + self.local_rank if cfg.port > 0 else 0
        try:
            return serve(collector, port, cfg.bind)
        except (OSError, OverflowError) as exc:
            if port == 0:
                log.warning("ddpmon: rank %d: no metrics endpoint: cannot bind %s (%s)", self.rank, cfg.bind, exc)
                return None
            log.warning(
                "ddpmon: rank %d: cannot serve metrics on %s:%d (%s); serving on an ephemeral port "
                "instead (see the state file's 'port'). Set DDPMON_PORT to a free base port.",
                self.rank, cfg.bind, port, getattr(exc, "strerror", None) or exc,
            )
            try:
                return serve(collector, 0, cfg.bind)
            except (OSError, OverflowError) as exc2:
                log.warning("ddpmon: rank %d: no metrics endpoint (%s)", self.rank, exc2)
                return None

    def _start_hang_tracking(self) -> None:
        """Collective tracking and the progress watchdog (see ddpmon/watchdog.py)."""
        from .hooks.collectives import CollectiveTracker, group_identity
        from .watchdog import Watchdog, ddp_facts, flight_recorder

        self.recorder.ddp_group = group_identity(self._ddp.process_group)
        self.recorder.identity["ddp"] = ddp_facts(self._ddp)
        self.recorder.identity["state_interval"] = self.config.state_interval
        self._collectives = CollectiveTracker(self.recorder, Fuse("collective_tracking", self._part_failed))
        if self.config.track_collectives:
            self._collectives.install()
        writer = self._writer
        self._watchdog = Watchdog(
            self.recorder, self.config.hang_timeout, self.config.hang_timeout_floor,
            notify=writer.notify if writer else None, flush=writer.write_now if writer else None,
            extras=flight_recorder,
        )
        self._watchdog.start()

    def _stop_hang_tracking(self) -> None:
        if self._collectives:
            self._collectives.remove()
        if self._watchdog:
            self._watchdog.stop()
        self.recorder.set_hang(None)

    def _sample_sources(self) -> list[Any]:
        """Host metrics (psutil) always; on a CUDA device also the GPU (NVML, when
        ``config.nvml``) and torch's allocator. A part that cannot start logs why and
        stays off."""
        base = {"job": self.job, "rank": str(self.rank)}
        sources: list[Any] = []
        try:
            sources.append(host.ProcessSampler(base).samples)
        except Exception as exc:
            log.warning("ddpmon: rank %d: host metrics are off: %r", self.rank, exc)
        device = torch.device(self.recorder.identity["device"])
        if device.type != "cuda":
            return sources
        try:
            index = device.index if device.index is not None else torch.cuda.current_device()
            uuid, pci_bus_id = torch_memory.device_identity(index)
            gpu = nvml.rank_gpu(self.job, self.rank, index, uuid, pci_bus_id) if self.config.nvml else None
            if gpu is not None:
                sources.append(gpu.samples)
                self._closers.append(gpu.close)
                labels = gpu.labels
            else:  # without NVML: torch's index and UUID
                labels = {**base, "gpu": str(index), "gpu_uuid": uuid or ""}
            sources.append(torch_memory.AllocatorStats(index, labels).samples)
        except Exception as exc:
            log.warning("ddpmon: rank %d: GPU metrics are off: %r", self.rank, exc)
        return sources

    def _start_state_writer(self) -> str | None:
        state_dir = self.config.resolved_state_dir(self.job)
        if state_dir is None:
            return None
        path = statefile.path_for(state_dir, self.rank)
        try:
            os.makedirs(state_dir, exist_ok=True)
            if not os.access(state_dir, os.W_OK):
                raise PermissionError(f"{state_dir} is not writable")
        except OSError as exc:
            log.warning(
                "ddpmon: rank %d: state files are off: cannot write to %s (%s). Set "
                "DDPMON_STATE_DIR (or state_dir=) to a writable directory.",
                self.rank, state_dir, exc,
            )
            return None
        self._writer = statefile.StateWriter(path, self.recorder.snapshot, self.config.state_interval)
        self._writer.start()
        _STATE_FILES_IN_USE.add(path)
        return path

    # -- step history (ddpmon/state/history.py) and the end-of-run summary ----------------------

    def _start_history(self) -> None:
        if not self.state_file or not self.config.history:
            return
        from .state import history

        sample = history.process_sample()
        if self.recorder.identity["device"].startswith("cuda"):
            sample = functools.partial(_gpu_sample, torch.device(self.recorder.identity["device"]), sample)
        self._history = history.HistoryWriter(
            history.path_for(os.path.dirname(self.state_file), self.rank), self.recorder.history_since,
            self.recorder.snapshot, self.recorder.identity, sample=sample,
        )
        self._history.start()
        atexit.register(self._stop_history)

    def _stop_history(self) -> None:
        """The last batch (bounded in time), then rank 0 logs the run's summary."""
        writer, self._history = self._history, None
        if writer is None:
            return
        atexit.unregister(self._stop_history)
        writer.stop()
        if self.rank == 0 and not writer.failed:
            try:
                from .report.summary import end_of_run

                log.warning("%s", end_of_run(os.path.dirname(writer.path)))
            except Exception as exc:
                log.info("ddpmon: no end-of-run summary: %r", exc)


def _gpu_sample(device: torch.device, base: Any) -> dict[str, Any]:
    """The history's GPU columns, once per batch (each read that fails is left out)."""
    out = dict(base())
    for key, read, scale in (
        ("torch_memory_allocated_bytes", torch.cuda.memory_allocated, 1),
        ("gpu_utilization_ratio", torch.cuda.utilization, 0.01),  # NVML's percent
        ("gpu_memory_used_bytes", getattr(torch.cuda, "device_memory_used", None), 1),
    ):
        try:
            out[key] = read(device) * scale  # type: ignore[misc]
        except Exception:
            pass
    return out


def _register_user_hook(ddp: DistributedDataParallel, comm: TimedCommHook, state: object, hook: Any) -> None:
    """Stands in for ``ddp.register_comm_hook`` once ddpmon is attached: DDP accepts one
    hook and ddpmon's is registered, so the user's hook runs inside it (and is timed)."""
    if comm.user_registered:
        raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
    ddp._check_comm_hook(hook)
    comm.user_registered = True
    comm.replace(hook, state)
    log.info("ddpmon: comm hook %s registered inside ddpmon's timing hook", getattr(hook, "__qualname__", hook))


def _check_attachable(ddp: Any) -> None:
    if not isinstance(ddp, DistributedDataParallel):
        raise AttachError(
            f"ddpmon.attach() needs a torch.nn.parallel.DistributedDataParallel model, got "
            f"{type(ddp).__module__}.{type(ddp).__qualname__}; {_HOW_TO_WRAP}"
        )
    if not dist.is_available() or not dist.is_initialized():
        raise AttachError(
            "torch.distributed is not initialized: call "
            "torch.distributed.init_process_group(...) before wrapping the model and attaching"
        )
    if getattr(ddp, "_ddpmon_monitor", None) is not None:
        raise AttachError(
            "ddpmon is already attached to this model; use the Monitor that attach() returned "
            "(or call its detach() first)"
        )
    if getattr(ddp, "_ddpmon_comm_hook", None) is None and (
        getattr(ddp, "_comm_hooks", None) or _builtin_hook_name(ddp)
    ):
        raise AttachError(
            "this model already has a comm hook, and DDP accepts only one; pass yours to "
            "ddpmon.attach(model, comm_hook=hook, comm_state=state) instead of registering it, "
            "or register it after attach()"
        )


def _builtin_hook_name(ddp: DistributedDataParallel) -> str:
    try:
        return str(ddp._get_ddp_logging_data().get("comm_hook", "") or "")
    except Exception:
        return ""
