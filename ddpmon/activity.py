"""What a rank does while it makes no progress: one rule for the watchdog and the doctor.

The step counter alone cannot tell a hang from an evaluation under ``no_grad``, a
checkpoint or work after the training loop: none of them touches the DDP model. So the
watchdog samples the main thread about once a second (``sys._current_frames``: cheap, no
signal, no ptrace) and its CPU time, the time the process's threads ran and the time they
were ready to run but waited for a CPU (Linux's per-thread ``schedstat``), and the bytes the
process reads and writes, and classifies the rank:

==========  =======================================================================
stepping    progress (a heartbeat) within the last ``STILL_SECONDS``
waiting     no progress, a collective in flight: waiting for its peers
busy        no progress, not in a collective, but working: its stack moves, or its
            main thread uses CPU, or its threads run or wait for a CPU most of the
            time (a machine with more runnable threads than cores), or the process
            reads or writes (evaluation, checkpoint, logging, post-loop work)
stuck       no progress, not in a collective, the stack unchanged for
            ``STILL_SECONDS`` and, over those seconds, neither CPU, nor waiting for
            one, nor I/O (a lock, a dead socket, a sleep); or its GPU has not
            finished the work enqueued at the rank's last step boundary for
            ``STILL_SECONDS`` (the host waits for a GPU that makes no progress,
            spinning in ``.item()`` or a synchronize: CPU that is no work)
==========  =======================================================================

A hang needs evidence of a stall (``is_hang``): a rank stuck past the hang timeout; a rank
waiting in a collective past it while a peer that has not joined is stuck, dead or gone. A
rank that works (busy) is never hung, however long it works: evaluation, a checkpoint or
work after the loop may last longer than any hang timeout, and while nobody waits for it
nothing is lost. Ranks that wait for a busy peer are reported as such (who waits, in what,
for how long, and when their process group's own timeout ends the job), not as a hang, so
``hang_action=abort`` never ends working ranks. The record (``schema.Activity``) is in the
state file, so the doctor applies the same rule to every rank. The rank's half, which
samples its own process, is ``rank/sampler.py``.
"""

from __future__ import annotations

from enum import Enum

from .state import schema


class Status(str, Enum):
    """What a rank is doing: one vocabulary for the watchdog, the state file (``activity``)
    and the doctor. The rank itself is stepping, busy, waiting or stuck (this module's
    rule); the doctor adds how a rank is stopped or gone, which only another process sees."""

    STEPPING = "stepping"
    """Progress (a heartbeat) within the last ``STILL_SECONDS``."""
    BUSY = "busy"
    WAITING = "waiting"
    STUCK = "stuck"
    FROZEN = "frozen"
    """The process is there and stopped (SIGSTOP, a debugger), or its file went stale."""
    SILENT = "silent"
    """On another host, its file is no longer rewritten: gone, as far as anyone can tell."""
    DEAD = "dead"
    CRASHED = "crashed"
    EXITED = "exited"
    UNKNOWN = "unknown"
    """Its file no longer rewritten because the file system refuses the writes (read-only,
    full), so what it does, or how it ended, is not known (the doctor)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


STILL_SECONDS = 3.0
"""No progress, stack unchanged, neither working nor waiting for a CPU, and no I/O for this
long: stuck."""
CPU_BUSY = 0.05
"""Share of one core the main thread uses that counts as working."""
RUNNABLE_BUSY = 0.5
"""Share of the time the rank's threads were running or ready to run (on a CPU's run queue),
summed over its threads, that counts as working. On an oversubscribed machine a busy rank
gets little CPU, yet it waits for a CPU, not for an event; and its main thread may sleep
while it waits for the GIL held by another of its threads, itself waiting for a CPU. A
blocked rank (a lock, a socket, a sleep) has its threads asleep most of the time."""
IO_BUSY = 1 << 20
"""Bytes per second read or written by the process that count as working (the state file
itself is a few kB a second)."""


def working(cpu_share: float, io_rate: float, runnable_share: float = 0.0) -> bool:
    """Does the rank work: its main thread uses CPU, or its threads run or wait for a CPU
    most of the time (the machine being oversubscribed), or the process moves data?"""
    return cpu_share >= CPU_BUSY or runnable_share >= RUNNABLE_BUSY or io_rate >= IO_BUSY


def classify(
    idle: float,
    in_flight: bool,
    still_for: float,
    cpu_share: float,
    io_rate: float,
    timeout: float | None = None,
    runnable_share: float = 0.0,
    gpu_behind: float | None = None,
) -> str:
    """The rank's activity from its samples (see the module's table); ``cpu_share``,
    ``runnable_share`` and ``io_rate`` are measured over the seconds the stack has been
    still; ``gpu_behind``: seconds the GPU has not reached the last step boundary's mark.
    A hang timeout shorter than ``STILL_SECONDS`` shortens the stillness needed too."""
    still = still_seconds(timeout)
    if idle < still:
        return Status.STEPPING
    if in_flight:
        return Status.WAITING
    if still_for >= still and (
        (gpu_behind or 0.0) >= still or not working(cpu_share, io_rate, runnable_share)
    ):
        return Status.STUCK  # (a host spinning for a stalled GPU uses CPU that is no work)
    return Status.BUSY


def still_seconds(timeout: float | None) -> float:
    """The stillness that counts (``STILL_SECONDS``, or a shorter hang timeout)."""
    return min(STILL_SECONDS, timeout) if timeout else STILL_SECONDS


def is_hang(activity: str, idle: float, timeout: float, peers_hold_out: str | None = None) -> bool:
    """The shared rule: does this rank's silence count as a hang (a proven stall)?

    ``peers_hold_out`` is what the peers that have not joined its collective are doing
    (``busy``, ``stuck``, ``dead``; None when unknown). A busy rank is never hung, nor a rank
    that waits only for busy peers: they work, and the process group's own timeout bounds
    the wait. Stuck (stack unchanged, not running) or waiting for a stuck or dead peer is."""
    if idle < timeout or activity == Status.BUSY:
        return False
    if activity == Status.WAITING:
        return peers_hold_out != Status.BUSY
    return activity == Status.STUCK


ACTIVITY_LAG = 5.0
"""Seconds a rank's watchdog may take to judge a silence (it samples about once a second):
until then its last word stands."""


def working_since(act: schema.Activity | None, silent: float, written_unix: float | None) -> bool:
    """Does a rank that has made no progress for ``silent`` seconds, and is in no
    collective, work (busy) rather than stand still (stuck)? For readers of its state file
    (the doctor), from its last ``activity`` (written at ``written_unix``, the file's own
    clock). It works while its watchdog says busy, however long; and while its
    watchdog has not judged this silence yet: its last sample said stepping, or waiting in a
    collective since completed, less than ``ACTIVITY_LAG`` seconds before the file was
    written (the reader's stall and the watchdog's stillness end at different moments, and
    a sample is a second apart). Stuck takes the watchdog's word, or silence alone where
    there is no watchdog (none ran, or an older ddpmon)."""
    if act is None:
        return False
    if act.state == Status.BUSY:
        return True
    if act.state == Status.STUCK:
        return False
    return written_unix is not None and written_unix - act.sampled_unix <= ACTIVITY_LAG
