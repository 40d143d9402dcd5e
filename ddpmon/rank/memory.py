"""The memory trends of one rank: a thread that samples and fits, off the training thread.

Once a state interval, when at least one step has passed since its last sample (and past
the warm-up, ``memory.WARMUP_STEPS``), the thread reads the resident and proportional set
sizes of the rank's process and of each DataLoader worker (``collectors/host.py``; PSS as
often as ``PSS_SHARE`` allows) and, on
a GPU, torch's allocated and reserved bytes (host-side counters of the caching allocator:
no synchronisation). Each series keeps its last ``memory.WINDOW`` readings; its trend
(``memory.trend``) and the limit it runs into go to the recorder, which publishes them in
the state file (``memory``) and the metrics. A worker that exits takes its series with it.
A failure switches the thread off through its fuse; training never sees any of it.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from typing import Any

import psutil

from .. import memory
from ..collectors import host
from ..fuses import Fuse
from ..state import schema
from .recorder import Recorder

Key = tuple[str, int, str]
"""(process, pid, kind) of a series."""
PSS_SHARE = 0.01
"""At most this share of the time goes to reading PSS: Linux walks every page a process
maps to count it (about 0.1 s for 2 GiB), holding the process's memory map lock for
reading, so a large process's PSS is read less often than once a state interval (each
process's as its own last reading took)."""


class MemoryWatch:
    """Samples this rank's memory every ``interval`` seconds on a thread of its own;
    ``stop()`` at detach."""

    def __init__(self, recorder: Recorder, device: str, interval: float, fuse: Fuse) -> None:
        self._rec = recorder
        self._fuse = fuse
        self._interval = max(0.05, interval)
        self._series: dict[Key, collections.deque[memory.Point]] = {}
        self._trends: dict[Key, schema.MemoryTrend] = {}
        self._last_step = -1
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
        while self._fuse.ok and not self._stop.wait(self._interval):
            try:
                self.sample()
            except Exception as exc:
                self._fuse.blow(exc)

    def sample(self) -> None:
        """One sample of every series and their trends, when a step has passed since the
        last one; PSS only when its share of the time is due (``PSS_SHARE``)."""
        step = self._rec.steps
        if step < memory.WARMUP_STEPS or step == self._last_step:
            return
        self._last_step = step
        now = time.time()
        readings = [(k, n, _host_limit) for k, n in self._host_readings(now)]
        if self._gpu is not None:
            readings += [(k, n, self._gpu.limit) for k, n in self._gpu.readings()]
        pids = {key[1] for key, _, _ in readings}
        for key in [k for k in self._series if k[1] not in pids]:  # a worker that exited
            del self._series[key]
            self._trends.pop(key, None)
        limits: dict[Any, tuple[str | None, int | None]] = {}
        for key, n, limit_of in readings:
            series = self._series.get(key)
            if series is None:
                series = self._series[key] = collections.deque(maxlen=memory.WINDOW)
            series.append(memory.Point(step, now, n))
            if limit_of not in limits:
                limits[limit_of] = limit_of()
            name, headroom = limits[limit_of]
            process, pid, kind = key
            self._trends[key] = memory.trend(list(series), process, kind, pid, name, headroom)
        self._rec.memory = schema.Memory(list(self._trends.values()), now)

    def _host_readings(self, now: float) -> list[tuple[Key, int]]:
        """RSS of the rank and of each worker; PSS of each when its share of the time is due
        (``PSS_SHARE``, from what the last reading of that process took)."""
        out: list[tuple[Key, int]] = []
        pids = [("rank", self._pid)] + [("worker", p) for p in self._process.child_pids()]
        for process, pid in pids:
            pss = now >= self._next_pss.get(pid, 0.0)
            began = time.perf_counter()
            try:
                values = host.process_memory(pid, pss)
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
    allocator's host-side counters (``torch.cuda.memory_stats``: no synchronisation, no
    CUDA initialisation); the limit is the device's memory less what torch reserved."""

    KEYS = (
        ("torch_allocated", "allocated_bytes.all.current"),
        ("torch_reserved", "reserved_bytes.all.current"),
    )

    def __init__(self, device: str) -> None:
        import torch

        dev = torch.device(device)
        self.index = dev.index if dev.index is not None else torch.cuda.current_device()
        self.total = int(torch.cuda.get_device_properties(self.index).total_memory)
        self.pid = os.getpid()
        self._reserved = 0

    def readings(self) -> list[tuple[Key, int]]:
        import torch

        stats = torch.cuda.memory_stats(self.index)  # {} until CUDA is initialised
        if not stats:
            return []
        self._reserved = int(stats.get("reserved_bytes.all.current", 0))
        return [(("rank", self.pid, kind), int(stats.get(key, 0))) for kind, key in self.KEYS]

    def limit(self) -> tuple[str | None, int | None]:
        return "device", max(0, self.total - self._reserved)
