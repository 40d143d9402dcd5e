"""The memory trends of one rank: a thread that samples and fits, off the training thread.

Past the warm-up (``memory.WARMUP_STEPS``), every ``memory.SAMPLE_STEPS`` steps (or once a
state interval when steps are slower than that), the thread reads the resident set size of
the rank's process and of each DataLoader worker (/proc/<pid>/statm: microseconds), their
proportional set sizes as often as ``PSS_SHARE`` allows, and on a GPU torch's allocated and
reserved bytes (host-side counters of the caching allocator: no synchronisation). It looks
at the step count as often as the steps come (``period``), never more than every
``MIN_PERIOD`` seconds, and never touches the training thread. Each series keeps its last
``memory.WINDOW`` readings, thinned while they are closer than a state interval apart
(``memory.thinned``); once a state interval its trend (``memory.trend``) and the limit it
runs into go to the recorder, which publishes them in the state file (``memory``) and the
metrics. A worker that exits takes its series with it. A failure switches the thread off
through its fuse; training never sees any of it.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable

import psutil

from .. import memory
from ..collectors import host
from ..fuses import Fuse
from ..state import schema
from .recorder import Recorder

Key = tuple[str, int, str]
"""(process, pid, kind) of a series."""
Limit = Callable[[], tuple[str | None, int | None]]
"""What a series runs into: (name, headroom bytes)."""
PSS_SHARE = 0.001
"""At most this share of the time goes to reading PSS: Linux walks every page a process
maps to count it (13 ms of CPU for a CPU-only torch rank, about 0.1 s for 2 GiB), holding
the process's memory map lock for reading (the training thread's own mappings wait), so a
process's PSS is read as its own last reading took allows, seconds to minutes apart. At 1%
it was the largest of ddpmon's threads on a 2-rank CPU job (5.5 ms of CPU a second)."""
FIRST_PERIOD = 0.1
"""Seconds between looks at the step count until the thread has seen how long a step takes."""
MIN_PERIOD = 0.01
"""The thread looks at most this often: steps shorter than a few milliseconds are sampled
every few more of them."""


class MemoryWatch:
    """Samples this rank's memory on a thread of its own, as often as its steps come (at
    least once every ``interval`` seconds while they go on); ``stop()`` at detach."""

    def __init__(self, recorder: Recorder, device: str, interval: float, fuse: Fuse) -> None:
        self._rec = recorder
        self._fuse = fuse
        self._interval = max(0.05, interval)
        self._series: dict[Key, collections.deque[memory.Point]] = {}
        self._limits: dict[Key, Limit] = {}
        self._stride = memory.SAMPLE_STEPS
        self._last = (-1, 0.0)  # step and time of the last sample
        self._seen: tuple[int, float] | None = None  # the step count when it last changed
        self._step_seconds: float | None = None
        self._fitted = 0.0
        self._workers: list[int] = []
        self._workers_read = 0.0
        self._next_pss: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ddpmon-memory", daemon=True)
        try:
            self._process = host.ProcessSampler({})
            self._pid = os.getpid()
            self._gpu = GpuMemory(device) if device.startswith("cuda") else None
        except Exception as exc:
            fuse.blow(exc)
            return
        self._thread.start()

    def _run(self) -> None:
        wait = min(FIRST_PERIOD, self._interval)
        while self._fuse.ok and not self._stop.wait(wait):
            try:
                wait = self.sample()
            except Exception as exc:
                self._fuse.blow(exc)

    def sample(self) -> float:
        """One look: a sample of every series when one is due, their trends once a state
        interval; returns the seconds until the next look (``period``)."""
        now = time.time()
        step = self._rec.steps
        if self._seen is None or step < self._seen[0]:
            self._seen = (step, now)
        elif step > self._seen[0]:
            self._step_seconds = (now - self._seen[1]) / (step - self._seen[0])
            self._seen = (step, now)
        last_step, last_unix = self._last
        if step >= memory.WARMUP_STEPS and (
            step - last_step >= self._stride
            or (step > last_step and now - last_unix >= self._interval)
        ):
            self._take(step, now)
        if self._series and now - self._fitted >= self._interval:
            self._fit(now)
        return self.period()

    def period(self) -> float:
        """Seconds until the next look: half a stride's worth of steps, within
        [``MIN_PERIOD``, the state interval]."""
        if self._step_seconds is None:
            return min(FIRST_PERIOD, self._interval)
        return min(self._interval, max(MIN_PERIOD, self._step_seconds * self._stride / 2))

    def _take(self, step: int, now: float) -> None:
        """One reading of every series; a full window of readings closer than a state
        interval apart is thinned, and the stride doubles."""
        self._last = (step, now)
        if now - self._workers_read >= self._interval:
            self._workers, self._workers_read = self._process.child_pids(), now
        readings = [(k, n, _host_limit) for k, n in self._host_readings(now)]
        if self._gpu is not None:
            readings += [(k, n, self._gpu.limit) for k, n in self._gpu.readings()]
        pids = {key[1] for key, _, _ in readings}
        for key in [k for k in self._series if k[1] not in pids]:  # a worker that exited
            del self._series[key]
            del self._limits[key]
        for key, n, limit in readings:
            series = self._series.get(key)
            if series is None:
                series = self._series[key] = collections.deque(maxlen=memory.WINDOW)
                self._limits[key] = limit
            series.append(memory.Point(step, now, n))
        ref = self._series.get(("rank", self._pid, "rss"))
        if (
            ref is not None
            and len(ref) == memory.WINDOW
            and ref[-1].unix - ref[0].unix < (memory.WINDOW - 1) * self._interval
        ):
            self._stride *= 2
            for key, series in self._series.items():
                if key[2] != "pss":  # PSS comes as its share of the time allows
                    self._series[key] = collections.deque(memory.thinned(series), memory.WINDOW)

    def _fit(self, now: float) -> None:
        """Every series' trend, to the recorder."""
        self._fitted = now
        limits: dict[Limit, tuple[str | None, int | None]] = {}
        trends = []
        for key, series in self._series.items():
            limit = self._limits[key]
            if limit not in limits:
                limits[limit] = limit()
            name, headroom = limits[limit]
            process, pid, kind = key
            trends.append(memory.trend(list(series), process, kind, pid, name, headroom))
        self._rec.memory = schema.Memory(trends, now)

    def _host_readings(self, now: float) -> list[tuple[Key, int]]:
        """RSS of the rank and of each worker; PSS of each when its share of the time is due
        (``PSS_SHARE``, from what the last reading of that process took)."""
        out: list[tuple[Key, int]] = []
        pids = [("rank", self._pid)] + [("worker", p) for p in self._workers]
        for process, pid in pids:
            pss = now >= self._next_pss.get(pid, 0.0)
            began = time.perf_counter()
            try:
                if pss:
                    values = host.process_memory(pid, True)
                else:
                    values = [("rss", host.resident_bytes(pid))]
            except (psutil.Error, OSError):  # a worker that exited just now
                continue
            if pss:
                took = time.perf_counter() - began
                self._next_pss[pid] = now + max(self._interval, took / PSS_SHARE)
            out += [((process, pid, kind), n) for kind, n in values]
        for pid in set(self._next_pss) - {pid for _, pid in pids}:
            del self._next_pss[pid]
        return out

    def stop(self, timeout: float = 1.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)


def _host_limit() -> tuple[str | None, int | None]:
    """The nearer of the host's available memory and the cgroup's limit: (name, headroom)."""
    available = host.host_available()
    cgroup = host.cgroup_headroom()
    if cgroup is not None and cgroup < available:
        return "cgroup", cgroup
    return "host", available


class GpuMemory:
    """torch's allocated and reserved bytes on the rank's device, from the caching
    allocator's host-side counters (``torch.cuda.memory_stats_as_nested_dict``: no synchronisation, no
    CUDA initialisation); the limit is the device's memory less what torch reserved."""

    KEYS = (("torch_allocated", "allocated_bytes"), ("torch_reserved", "reserved_bytes"))

    def __init__(self, device: str) -> None:
        import torch

        dev = torch.device(device)
        self.index = dev.index if dev.index is not None else torch.cuda.current_device()
        self.total = int(torch.cuda.get_device_properties(self.index).total_memory)
        self.pid = os.getpid()
        self._reserved = 0

    def readings(self) -> list[tuple[Key, int]]:
        import torch

        # the allocator's counters as it keeps them (``memory_stats`` flattens them in Python)
        stats = torch.cuda.memory_stats_as_nested_dict(self.index)  # {} until CUDA starts
        if not stats:
            return []
        out = [
            (("rank", self.pid, kind), int(stats[key]["all"]["current"])) for kind, key in self.KEYS
        ]
        self._reserved = out[1][1]
        return out

    def limit(self) -> tuple[str | None, int | None]:
        return "device", max(0, self.total - self._reserved)
