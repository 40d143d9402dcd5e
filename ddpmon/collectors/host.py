"""Host metrics of a rank's process from psutil, and the one rule for "is this rank's
process alive".

``ProcessSampler`` reads one process (CPU, memory, threads), the host's memory and the
process's children (the data-loader workers) in one pass per sample. ``locate_process``
finds the process a state file names, also when the rank runs in a container and the pid
it wrote is the pid inside the container (Linux lists a process's pid in every namespace in
/proc/<pid>/status, line NSpid); ``judge`` says whether it lives, and why not. The doctor
(``check``) and the node daemon both decide with these two, so they judge a rank alike.
Nothing here imports torch.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

import psutil

from ..fuses import Fuse

Sample = tuple[str, dict[str, str], float]

CREATE_TIME_SLACK = 2.0
"""Seconds by which a process's creation may seem to follow the moment it started ddpmon
(psutil derives creation times from clock ticks since boot)."""


class ProcessSampler:
    """Samples one process (default: this one), its direct children and the host memory.

    Children come and go (data-loader workers restart every epoch unless persistent), so
    their CPU time is kept as a true counter: a child's last reading is carried over when
    it exits instead of dropping out of the sum. On Linux the children are read from
    /proc/<pid>/task/*/children (microseconds); psutil's own ``children()`` scans every
    process of the host (a millisecond or more) and is only the fallback.
    """

    def __init__(self, labels: dict[str, str], pid: int | None = None) -> None:
        self._labels = dict(labels)
        self._proc = psutil.Process(pid)
        self._tasks = f"/proc/{self._proc.pid}/task"
        self._proc_children = os.path.exists(f"{self._tasks}/{self._proc.pid}/children")
        self._children: dict[int, tuple[psutil.Process, float]] = {}
        self._exited_children_cpu = 0.0
        self._fuse = Fuse("host metrics")

    def samples(self) -> list[Sample]:
        if not self._fuse.ok:
            return []
        try:
            return self._read()
        except Exception as exc:
            self._fuse.blow(exc)
            return []

    def _read(self) -> list[Sample]:
        labels = self._labels
        with self._proc.oneshot():
            cpu = self._proc.cpu_times()
            rss = self._proc.memory_info().rss
            threads = self._proc.num_threads()
        memory = psutil.virtual_memory()
        workers, workers_cpu = self._children_cpu(self.child_pids())
        return [
            ("ddpmon_process_cpu_seconds_total", labels, cpu.user + cpu.system),
            ("ddpmon_process_resident_memory_bytes", labels, float(rss)),
            ("ddpmon_process_threads", labels, float(threads)),
            ("ddpmon_host_memory_used_bytes", labels, float(memory.total - memory.available)),
            ("ddpmon_host_memory_total_bytes", labels, float(memory.total)),
            ("ddpmon_dataloader_workers", labels, float(workers)),
            ("ddpmon_dataloader_workers_cpu_seconds_total", labels, workers_cpu),
        ]

    def child_pids(self) -> list[int]:
        """The pids of the process's children (its DataLoader workers)."""
        if not self._proc_children:
            return [c.pid for c in self._proc.children()]
        pids: list[int] = []
        for task in os.listdir(self._tasks):  # a child belongs to the thread that forked it
            try:
                with open(f"{self._tasks}/{task}/children") as f:
                    pids.extend(int(x) for x in f.read().split())
            except FileNotFoundError:  # the thread ended meanwhile
                continue
        return pids

    def _children_cpu(self, pids: list[int]) -> tuple[int, float]:
        """(number of live children, CPU seconds of all children ever seen)."""
        current: dict[int, tuple[psutil.Process, float]] = {}
        for pid in pids:
            known = self._children.get(pid)
            try:
                proc = known[0] if known and known[0].is_running() else psutil.Process(pid)
                times = proc.cpu_times()
                current[pid] = (proc, times.user + times.system)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue  # exited just now: counted below with its last reading
        for pid, (proc, last) in self._children.items():
            if pid not in current or current[pid][0] is not proc:
                self._exited_children_cpu += last
        self._children = current
        return len(current), self._exited_children_cpu + sum(last for _, last in current.values())


def process_memory(pid: int, pss: bool) -> list[tuple[str, int]]:
    """(kind, bytes) of process ``pid``: ``rss`` and, with ``pss`` and where Linux gives it
    (/proc/<pid>/smaps_rollup: one pass over every page the process maps), ``pss``, which
    shares a page among the processes that map it, so that a forked worker's copied pages
    show and its inherited ones do not. Raises psutil.Error when the process is gone."""
    proc = psutil.Process(pid)
    if pss and _HAS_PSS:
        full = proc.memory_full_info()
        return [("rss", int(full.rss)), ("pss", int(full.pss))]
    return [("rss", int(proc.memory_info().rss))]


def resident_bytes(pid: int) -> int:
    """The resident set size of process ``pid``: one read of /proc/<pid>/statm (a few
    microseconds, no lock a process's threads take), psutil elsewhere. Raises OSError or
    psutil.Error when the process is gone."""
    if _HAS_STATM:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    return int(psutil.Process(pid).memory_info().rss)


_HAS_STATM = os.path.exists("/proc/self/statm")
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

_HAS_PSS = os.path.exists("/proc/self/smaps_rollup")
"""psutil reads PSS from smaps_rollup where the kernel has it (Linux 4.14); elsewhere it
would walk every mapping in /proc/<pid>/smaps, too slow to do each second."""


def host_available() -> int:
    """Bytes the host can still give processes without swapping (psutil's ``available``)."""
    return int(psutil.virtual_memory().available)


CGROUP_ROOT = "/sys/fs/cgroup"


def cgroup_headroom(membership: str | None = None, root: str = CGROUP_ROOT) -> int | None:
    """Bytes before the memory limit of this process's cgroup or of a cgroup above it,
    whichever is nearest; None without a limit or where it cannot be read. ``membership``:
    the text of /proc/self/cgroup (read when None). cgroup v2 (``memory.max`` and
    ``memory.current`` along the path of the ``0::`` line), else v1's memory controller
    (``memory.limit_in_bytes``, ``memory.usage_in_bytes``)."""
    if membership is None:
        try:
            with open("/proc/self/cgroup") as f:
                membership = f.read()
        except OSError:
            return None
    for fields in (line.split(":", 2) for line in membership.splitlines()):
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "" and os.path.exists(os.path.join(root, "cgroup.controllers")):
            return _nearest_limit(root, path, "memory.max", "memory.current")
        if "memory" in controllers.split(","):
            return _nearest_limit(
                os.path.join(root, "memory"), path, "memory.limit_in_bytes", "memory.usage_in_bytes"
            )
    return None


def _nearest_limit(root: str, path: str, limit_file: str, usage_file: str) -> int | None:
    """The least headroom of the cgroups from ``path`` up to ``root`` that have a limit."""
    best: int | None = None
    parts = [p for p in path.split("/") if p and p != ".."]
    for depth in range(len(parts), -1, -1):
        directory = os.path.join(root, *parts[:depth])
        try:
            with open(os.path.join(directory, limit_file)) as f:
                limit = f.read().strip()
            with open(os.path.join(directory, usage_file)) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if not limit.isdigit() or int(limit) >= 1 << 62:  # "max", or v1's "no limit"
            continue
        headroom = max(0, int(limit) - usage)
        best = headroom if best is None else min(best, headroom)
    return best


def process_started_unix(pid: int | None = None) -> float | None:
    """When a process (default: this one) was created, by this host's clock, within a clock
    tick; None when it cannot be told. On Linux its start in clock ticks since boot
    (/proc/<pid>/stat) plus the boot time as the clock puts it now: psutil adds the boot
    time in whole seconds (/proc/stat's btime), up to a second early, which a job's start-up
    and restarts (``goodput.py``) would carry."""
    try:
        with open(f"/proc/{pid or 'self'}/stat", "rb") as f:
            ticks = int(f.read().rsplit(b")", 1)[1].split()[19])  # field 22, starttime
        booted = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
        return booted + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        pass  # not Linux
    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.Error, OSError, ValueError):
        return None


def is_alive(proc: psutil.Process) -> bool:
    """True while ``proc`` runs (the same process, not a reused pid, not a zombie)."""
    try:
        return bool(proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def uid_of(proc: psutil.Process) -> int | None:
    """The real uid ``proc`` runs as; None when it is gone."""
    try:
        return int(proc.uids().real)
    except psutil.Error:
        return None


def is_stopped(proc: psutil.Process) -> bool:
    """True while ``proc`` is stopped (SIGSTOP, a debugger): it cannot make progress."""
    try:
        return proc.status() in (
            psutil.STATUS_STOPPED,
            getattr(psutil, "STATUS_TRACING_STOP", "tracing-stop"),
        )
    except psutil.Error:
        return False


def namespace_pids(pid: int) -> list[int] | None:
    """The pids of ``pid`` from this namespace inward (NSpid); None where Linux does not say."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return [int(x) for x in line.split()[1:]]
    except (OSError, ValueError):
        return None
    return None


def locate_process(
    pid: int, started_unix: float | None, same_host: bool, rank: int | None = None
) -> psutil.Process | None:
    """The live process that wrote a state file naming ``pid``, or None.

    ``started_unix`` (when ddpmon started in that process) rules out pids reused by later
    processes. When the rank shares this host name, a process with that very pid in our
    own namespace wins; otherwise processes in nested pid namespaces (containers) whose
    innermost pid is ``pid`` are preferred, the most recently started first.
    """
    direct = _candidate(pid, started_unix, rank)
    if direct is not None and same_host:
        return direct
    nested = _nested_candidates(pid, started_unix, rank)
    if nested:
        return max(nested, key=_create_time)
    return direct


@dataclass(frozen=True)
class Liveness:
    """Whether a rank's process lives: ``alive`` is None when it cannot be checked from here
    (another host, no valid pid); ``detail`` says what was seen, for a reader."""

    alive: bool | None
    detail: str
    stopped: bool = False
    """It is there and stopped (SIGSTOP, a debugger): it cannot make progress."""


def judge(proc: psutil.Process | None, pid: int, started_unix: float | None) -> Liveness:
    """The verdict on the process ``locate_process`` found for ``pid`` (None: none could be
    the rank), with what ``pid`` itself is when none could."""
    if proc is not None and is_alive(proc):
        try:
            status = proc.status()
        except psutil.Error:
            status = "?"
        where = "" if proc.pid == pid else f" (pid {proc.pid} on this host: in a container)"
        if is_stopped(proc):
            return Liveness(True, f"pid {pid}{where} is stopped (SIGSTOP or a debugger)", True)
        return Liveness(True, f"pid {pid}{where} is running ({status})")
    try:
        direct = psutil.Process(pid)
        status = direct.status()
        created = direct.create_time()
    except psutil.NoSuchProcess:
        return Liveness(False, f"pid {pid} does not exist")
    except psutil.AccessDenied:
        return Liveness(None, f"pid {pid} exists, but its details are not permitted here")
    except Exception as exc:  # psutil can fail in odd ways on odd systems
        return Liveness(None, f"pid {pid}: cannot be checked ({exc})")
    if status == psutil.STATUS_ZOMBIE:
        return Liveness(False, f"pid {pid} has exited (a zombie, not yet reaped by its parent)")
    if status == psutil.STATUS_DEAD:
        return Liveness(False, f"pid {pid} is dead")
    if started_unix is not None and created > started_unix + CREATE_TIME_SLACK:
        return Liveness(False, f"pid {pid} is a later process (the rank's process is gone)")
    return Liveness(False, f"pid {pid} is another process (not a rank: the rank's is gone)")


def check(
    host: str | None,
    pid: object,
    started_unix: float | None,
    local_host: str,
    rank: int | None = None,
) -> Liveness:
    """Liveness of the rank whose state file names ``pid`` on ``host``; ``started_unix``
    (this host's clock) is when the rank attached. Only a rank of this host is checked."""
    if not host or host != local_host:
        return Liveness(None, f"on host {host or '?'}, not checked from {local_host}")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return Liveness(None, f"no valid pid in the state file ({pid!r})")
    return judge(locate_process(pid, started_unix, True, rank), pid, started_unix)


def _nested_candidates(
    pid: int, started_unix: float | None, rank: int | None
) -> list[psutil.Process]:
    if not sys.platform.startswith("linux"):
        return []
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        ns = namespace_pids(int(entry))
        if ns and len(ns) > 1 and ns[-1] == pid:
            proc = _candidate(int(entry), started_unix, rank, nested=True)
            if proc is not None:
                found.append(proc)
    return found


def _candidate(
    pid: int, started_unix: float | None, rank: int | None, nested: bool = False
) -> psutil.Process | None:
    """``pid`` as a psutil.Process when it could be the rank: alive, started before ddpmon
    did, a user process, in our namespace (unless ``nested``), and, where its environment
    is readable, not another rank's."""
    try:
        proc = psutil.Process(pid)
        if not is_alive(proc):
            return None
        if started_unix is not None and proc.create_time() > started_unix + CREATE_TIME_SLACK:
            return None
        if not nested:
            ns = namespace_pids(pid)
            if ns is not None and len(ns) > 1:
                return None
        if not proc.cmdline():  # kernel threads have none
            return None
        if rank is not None and _environ_rank(proc) not in (None, str(rank)):
            return None
        return proc
    except psutil.Error:
        return None


def _environ_rank(proc: psutil.Process) -> str | None:
    try:
        rank: str | None = proc.environ().get("RANK")
        return rank
    except (psutil.Error, OSError):
        return None


def _create_time(proc: psutil.Process) -> float:
    try:
        return float(proc.create_time())
    except psutil.Error:
        return 0.0


def peer_uid(local: tuple[Any, ...], peer: tuple[Any, ...]) -> int | None:
    """The uid that owns the other end of a TCP connection between two sockets of this host
    (a loopback client of the daemon), as the kernel's socket tables say: the socket whose
    own address is ``peer`` and whose remote one is ``local``. None when it is not there
    (the client is on another host, or not on Linux)."""
    want = (_normal(peer[0]), peer[1], _normal(local[0]), local[1])
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f, None)
                for line in f:
                    fields = line.split()
                    if len(fields) > 7 and (*_endpoint(fields[1]), *_endpoint(fields[2])) == want:
                        return int(fields[7])
        except (OSError, ValueError):
            continue
    return None


def _endpoint(text: str) -> tuple[str, int]:
    """``0100007F:1F90`` (the kernel's byte order, 32-bit words) as ("127.0.0.1", 8080)."""
    address, port = text.split(":")
    raw = bytes.fromhex(address)
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return _normal(socket.inet_ntop(family, raw)), int(port, 16)


def _normal(ip: str) -> str:
    """An IPv4 address seen through an IPv6 socket (``::ffff:127.0.0.1``) as itself."""
    return ip[7:] if ip.startswith("::ffff:") and "." in ip else ip


def port_holder(port: int) -> str | None:
    """The process that listens on TCP ``port`` on this host (``pid 123: python -m
    http.server 8000``), where this user may see it; None when none is seen."""
    try:
        conns = psutil.net_connections("tcp")
    except (psutil.Error, OSError):
        return None
    for c in conns:
        if c.status != psutil.CONN_LISTEN or not c.laddr or c.laddr.port != port:
            continue
        if c.pid is None:
            return "a process this user cannot see (another user's)"
        try:
            command = " ".join(psutil.Process(c.pid).cmdline())[:200]
        except psutil.Error:
            command = "?"
        return f"pid {c.pid}: {command}"
    return None
