"""What the node daemon exports, as plain samples (``metrics/exposition.py`` makes them
families): each rank's liveness, every GPU of the node under the ranks' metric names (job
and rank labels from the rank whose process uses it), XID errors from NVML events, and the
attempts that ddpmon ended after a proven hang."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import psutil

from ..collectors import nvml
from ..errors import StateFileError
from ..metrics.catalog import DAEMON_ACTIVITIES
from ..metrics.exposition import Sample, state_set
from ..state import attempts, files, owners
from .discovery import StateFiles
from .ranks import NodeRank

log = logging.getLogger("ddpmon")


def rank_samples(ranks: list[NodeRank]) -> list[Sample]:
    """Each rank's liveness: up, last progress, a suspected hang, its activity, attempt."""
    out: list[Sample] = []
    for v in ranks:
        labels = {"job": v.job, "rank": str(v.rank)}
        out.append(("ddpmon_rank_up", labels, 1.0 if v.up else 0.0))
        out.append(("ddpmon_rank_last_progress_timestamp_seconds", labels, v.last_progress_unix))
        out.append(("ddpmon_rank_hang_suspected", labels, 1.0 if v.hang else 0.0))
        if v.activity is not None:
            out += state_set(
                "ddpmon_rank_activity", labels, "activity", DAEMON_ACTIVITIES, v.activity
            )
        if v.attempt is not None:
            out.append(("ddpmon_rank_attempt", labels, float(v.attempt)))
    return out


def node_samples(ranks: list[NodeRank]) -> list[Sample]:
    """Each job's figures over this node's ranks (``ddpmon_node_*``): a few series per node
    that tell, at thousands of ranks, which node holds the slowest rank and how many ranks
    are stuck, without reading every rank's series."""
    out: list[Sample] = []
    for job in sorted({v.job for v in ranks}):
        mine = [v for v in ranks if v.job == job]
        labels = {"job": job}
        out.append(("ddpmon_node_ranks_up", labels, float(sum(v.up for v in mine))))
        for activity in DAEMON_ACTIVITIES:
            count = sum(v.activity == activity for v in mine)
            out.append(("ddpmon_node_ranks", {**labels, "activity": activity}, float(count)))
        running = [v for v in mine if v.up]
        steps = sorted(v.step_seconds for v in running if v.step_seconds is not None)
        if steps:
            out.append(("ddpmon_node_step_seconds_max", labels, steps[-1]))
            out.append(("ddpmon_node_step_seconds_median", labels, _median(steps)))
        busy = sorted((v.busy_seconds, -v.rank) for v in running if v.busy_seconds is not None)
        if busy:
            out.append(("ddpmon_node_busy_seconds_max", labels, busy[-1][0]))
            out.append(("ddpmon_node_busy_seconds_median", labels, _median([b for b, _ in busy])))
            out.append(("ddpmon_node_slowest_rank", labels, float(-busy[-1][1])))
        resident = [b for v in running if (b := _resident_bytes(v)) is not None]
        if resident:
            out.append(("ddpmon_node_resident_memory_bytes", labels, float(sum(resident))))
    return out


def _median(values: list[float]) -> float:
    """The median of sorted ``values`` (the mean of the middle two for an even count)."""
    middle = len(values) // 2
    return values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2


def _resident_bytes(rank: NodeRank) -> int | None:
    """The rank process's resident memory, None when it cannot be read (gone, not ours)."""
    if rank.proc is None:
        return None
    try:
        return int(rank.proc.memory_info().rss)
    except psutil.Error:
        return None


class HangAborts:
    """Counts, from the state files and the kept attempts beside them, the attempts that
    ddpmon ended after a proven hang."""

    def __init__(self, files: StateFiles) -> None:
        self.files = files
        self._aborts: dict[
            str, tuple[float, str, int, bool]
        ] = {}  # path -> (mtime, job, rank, aborted)

    def samples(self) -> list[Sample]:
        """``ddpmon_hang_aborts_total``: per (job, rank), the kept attempts (current one
        included) that ddpmon ended after a proven hang; a file is read again only when it
        changed."""
        counts: dict[tuple[str, int], int] = {}
        dirs = {os.path.dirname(found.path) for found in self.files.read_all()}
        seen: set[str] = set()
        for d in dirs:
            for path in [*attempts.attempt_files(d), *files.list_files(d)]:
                seen.add(path)
                try:
                    info = os.lstat(path)
                    cached = self._aborts.get(path)
                    if cached is None or cached[0] != info.st_mtime:
                        state = files.read(path)
                        cached = (
                            info.st_mtime,
                            state.job or "",
                            state.rank,
                            attempts.ended_by_hang_abort(state),
                        )
                        self._aborts[path] = cached
                except (OSError, StateFileError):
                    continue
                key = (owners.name_of(cached[1], info.st_uid, self.files.shared), cached[2])
                counts[key] = counts.get(key, 0) + (1 if cached[3] else 0)
        for path in [p for p in self._aborts if p not in seen]:
            del self._aborts[path]
        return [
            ("ddpmon_hang_aborts_total", {"job": job, "rank": str(rank)}, float(n))
            for (job, rank), n in sorted(counts.items())
        ]


class Gpus:
    """The node's GPUs through NVML (none when it cannot be opened: said once), read at
    each sampling pass; XID errors arrive from NVML's event thread."""

    def __init__(self, slow_interval: float = nvml.SLOW_INTERVAL) -> None:
        self._slow_interval = slow_interval
        self._nv: Any = None
        self._readers: list[nvml.GpuReader] = []
        self._lost: set[int] = set()
        self._gpu_labels: dict[int, dict[str, str]] = {}
        self._xid: dict[tuple[int, int], list[float]] = {}  # (gpu, code) -> [count, last unix]
        self._xid_lock = threading.Lock()
        self._watcher: nvml.XidWatcher | None = None

    @property
    def gpus(self) -> list[nvml.Gpu]:
        return [r.gpu for r in self._readers]

    def open(self) -> None:
        nv = nvml.open_nvml("daemon")
        if nv is None:
            return
        try:
            gpus = nvml.list_gpus(nv)
        except Exception as exc:
            log.warning("ddpmon: daemon: GPU metrics are off: %s", nvml.explain(exc))
            nvml.close_nvml(nv)
            return
        if not gpus:
            log.warning("ddpmon: daemon: GPU metrics are off: NVML sees no GPU on this node")
            nvml.close_nvml(nv)
            return
        self._nv = nv
        self._readers = [nvml.GpuReader(nv, g, self._slow_interval) for g in gpus]
        watcher = nvml.XidWatcher(nv, gpus, self._on_xid)
        if watcher.start():
            self._watcher = watcher
        log.info(
            "ddpmon: daemon: watching %d GPU(s): %s",
            len(gpus),
            ", ".join(f"{g.index} {g.name} {g.uuid}" for g in gpus),
        )

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
        if self._nv is not None:
            nvml.close_nvml(self._nv)
            self._nv = None

    def samples(self, ranks: list[NodeRank]) -> list[Sample]:
        by_pid = {v.proc.pid: v for v in ranks if v.proc is not None}
        out: list[Sample] = []
        for reader in self._readers:
            gpu = reader.gpu
            if gpu.index in self._lost:
                continue
            try:
                if reader.slow_due():
                    reader.refresh_slow()
                pids = reader.processes()
                owners = sorted(
                    (by_pid[p] for p in pids if p in by_pid), key=lambda v: (v.job, v.rank)
                )
                owner = owners[0] if owners else None
                labels = {
                    "job": owner.job if owner else "",
                    "rank": str(owner.rank) if owner else "",
                    "gpu": str(gpu.index),
                    "gpu_uuid": gpu.uuid,
                }
                out.extend(reader.read(labels))
            except nvml.GpuLost as exc:
                self._lost.add(gpu.index)
                log.warning(
                    "ddpmon: daemon: GPU %d (%s): %s; its metrics are off until the daemon "
                    "restarts",
                    gpu.index,
                    gpu.uuid,
                    exc,
                )
                continue
            self._gpu_labels[gpu.index] = labels
            for pid in pids:
                v = by_pid.get(pid)
                out.append(
                    (
                        "ddpmon_gpu_process_info",
                        {
                            "gpu": str(gpu.index),
                            "gpu_uuid": gpu.uuid,
                            "pid": str(pid),
                            "job": v.job if v else "",
                            "rank": str(v.rank) if v else "",
                        },
                        1.0,
                    )
                )
        return out

    def _on_xid(self, gpu: nvml.Gpu, code: int, when: float) -> None:
        log.warning("ddpmon: daemon: GPU %d (%s): XID %d", gpu.index, gpu.uuid, code)
        with self._xid_lock:
            entry = self._xid.setdefault((gpu.index, code), [0.0, 0.0])
            entry[0] += 1
            entry[1] = when

    def xid_samples(self) -> list[Sample]:
        with self._xid_lock:
            xids = sorted((k, list(v)) for k, v in self._xid.items())
        uuids = {g.index: g.uuid for g in self.gpus}
        out: list[Sample] = []
        for (index, code), (count, last) in xids:
            base = self._gpu_labels.get(index) or {
                "job": "",
                "rank": "",
                "gpu": str(index),
                "gpu_uuid": uuids.get(index, ""),
            }
            labels = {**base, "xid": str(code)}
            out.append(("ddpmon_gpu_xid_errors_total", labels, count))
            out.append(("ddpmon_gpu_last_xid_timestamp_seconds", labels, last))
        return out
