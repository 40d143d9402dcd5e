"""The shared liveness rule (ddpmon/activity.py) and the rank's samples for it
(ddpmon/rank/sampler.py): classification, the hang decision, a
waiting rank's view of its peers from their state files, the sampler's shares over the still
seconds (a rank that waits for a CPU works), and a reader's view of a rank's last activity."""

from __future__ import annotations

import dataclasses
import dis
import time
from pathlib import Path

import pytest

from ddpmon import activity as lv
from ddpmon.rank import sampler as rs
from ddpmon.state import files, schema


def test_classify() -> None:
    assert lv.classify(1.0, False, 10.0, 0.0, 0.0) == lv.Status.STEPPING
    assert lv.classify(9.0, True, 10.0, 0.0, 0.0) == lv.Status.WAITING
    assert lv.classify(9.0, False, 10.0, 0.0, 0.0) == lv.Status.STUCK
    assert lv.classify(9.0, False, 0.5, 0.0, 0.0) == lv.Status.BUSY  # the stack moves
    assert lv.classify(9.0, False, 10.0, 0.9, 0.0) == lv.Status.BUSY  # CPU
    assert lv.classify(9.0, False, 10.0, 0.0, 50e6) == lv.Status.BUSY  # I/O (a checkpoint)
    assert lv.classify(0.5, False, 10.0, 0.0, 0.0, timeout=0.2) == lv.Status.STUCK  # short timeouts
    # runnable but not scheduled (an oversubscribed machine): working, whatever CPU it got
    assert lv.classify(9.0, False, 10.0, 0.008, 0.0, runnable_share=0.96) == lv.Status.BUSY
    # a thread that sleeps in a polling loop waits for a CPU only after each wake: stuck
    assert lv.classify(9.0, False, 10.0, 0.002, 0.0, runnable_share=0.3) == lv.Status.STUCK


def test_is_hang_needs_evidence() -> None:
    assert not lv.is_hang(lv.Status.STUCK, 59.0, 60.0)
    assert lv.is_hang(lv.Status.STUCK, 61.0, 60.0)
    assert lv.is_hang(lv.Status.WAITING, 61.0, 60.0, peers_hold_out=lv.Status.STUCK)
    assert not lv.is_hang(lv.Status.BUSY, 200.0, 60.0)  # evaluation, checkpoint
    assert not lv.is_hang(lv.Status.WAITING, 200.0, 60.0, peers_hold_out=lv.Status.BUSY)
    # a rank that works is never hung, however long, nor are those that wait for it
    assert not lv.is_hang(lv.Status.BUSY, 1e6, 60.0)
    assert not lv.is_hang(lv.Status.WAITING, 1e6, 60.0, lv.Status.BUSY)
    assert lv.is_hang(lv.Status.WAITING, 61.0, 60.0)  # the peers unknown: the wait is the evidence


def _rank(directory: Path, rank: int, seq: int, state: str | None, exit: bool = False) -> str:
    s = schema.RankState(
        rank=rank, world_size=3, collective_seq={"0": seq}, state_interval=1.0, now_unix=time.time()
    )
    if state:
        s.activity = schema.Activity(state=state, sampled_unix=time.time())
    if exit:
        s.exit = schema.Exit(unix=time.time(), code=1)
    path = files.path_for(str(directory), rank)
    files.write_atomic(path, schema.to_json(s))
    return path


def test_holdouts_from_the_peers_files(tmp_path: Path) -> None:
    mine = _rank(tmp_path, 1, 9, lv.Status.WAITING)
    entry = schema.Collective(seq=9, op="barrier", group="0", group_size=3)
    _rank(tmp_path, 2, 9, lv.Status.WAITING)  # joined
    _rank(tmp_path, 0, 8, lv.Status.BUSY)  # not yet: busy saving
    assert rs.holdouts(mine, entry, time.time()) == lv.Status.BUSY
    _rank(tmp_path, 0, 8, lv.Status.STUCK)
    assert rs.holdouts(mine, entry, time.time()) == lv.Status.STUCK
    _rank(tmp_path, 0, 8, lv.Status.BUSY, exit=True)  # it ended
    assert rs.holdouts(mine, entry, time.time()) == lv.Status.STUCK
    _rank(tmp_path, 0, 9, lv.Status.WAITING)
    assert rs.holdouts(mine, entry, time.time()) is None  # everyone joined: unknown


def test_sampler_sees_the_main_thread(tmp_path: Path) -> None:
    sampler = rs.Sampler()
    sampler.sample()
    act = sampler.activity(0.0, False, 60.0, time.time())
    assert act.state == lv.Status.STEPPING and act.where and "test_activity.py" in act.where


class Times:
    """The readings of a rank's threads as the test's clock moves: the main thread's CPU
    seconds, the seconds its threads ran, and waited for a CPU."""

    def __init__(self) -> None:
        self.t = 100.0
        self.main = self.ran = self.waited = 0.0

    def clock(self) -> float:
        return self.t

    def __call__(self) -> tuple[float, float, float]:
        return self.main, self.ran, self.waited

    def advance(self, seconds: float, ran: float, waited: float, main: float | None = None) -> None:
        """``seconds`` pass; of each, the threads run ``ran`` (the main thread ``main``, by
        default all of it) and wait for a CPU ``waited``."""
        self.t += seconds
        self.main += seconds * (ran if main is None else main)
        self.ran += seconds * ran
        self.waited += seconds * waited


def _still(
    sampler: rs.Sampler,
    times: Times,
    ran: float,
    waited: float,
    seconds: int,
    main: float | None = None,
) -> list[schema.Activity]:
    """``seconds`` of work inside one line (its stack still), sampled each second as the
    watchdog does; the activity after each second (silent since the first)."""
    acts = []
    for i in range(seconds):
        times.advance(1.0, ran, waited, main)
        sampler.sample()  # one line: the main thread's stack is the same at every sample
        acts.append(sampler.activity(float(i + 1), False, 60.0, 2e9))
    return acts


def _moving(sampler: rs.Sampler, times: Times, ran: float, waited: float, seconds: int) -> None:
    for _ in range(seconds):
        times.advance(1.0, ran, waited)
        sampler.sample()  # another line: the stack has another shape than in _still


def _after_the_loop(
    sampler: rs.Sampler,
    times: Times,
    ran: float,
    waited: float,
    seconds: int,
    main: float | None = None,
) -> schema.Activity:
    """The activity ``seconds`` after the last step, spent working inside one line."""
    return _still(sampler, times, ran, waited, seconds, main)[-1]


def test_a_starved_rank_after_the_loop_is_busy_not_stuck() -> None:
    """The false hang: after the loop every rank works inside one line (its stack still)
    while the machine runs more threads than it has cores. Measured then: 0.1% to 2% of a
    core, the rest of the time waiting for one. CPU alone called it stuck; that its threads
    wait for a CPU says it works. So does a main thread that sleeps, waiting for the GIL
    held by one of the rank's threads that waits for a CPU (measured: the main thread
    waited for a CPU 28% of 2.2 s and ran 0.1%; it slept the rest)."""
    times = Times()
    sampler = rs.Sampler(clock=times.clock, times=times, io=lambda: 0)
    sampler.sample()
    act = _after_the_loop(sampler, times, ran=0.008, waited=0.95, seconds=6)
    assert act.still_seconds >= 3 and act.cpu_share < lv.CPU_BUSY
    assert act.wait_share == pytest.approx(0.95, abs=0.01) and act.runnable_share == pytest.approx(
        0.958, abs=0.01
    )
    assert act.state == lv.Status.BUSY
    times = Times()
    sampler = rs.Sampler(clock=times.clock, times=times, io=lambda: 0)
    sampler.sample()
    act = _after_the_loop(sampler, times, ran=0.01, waited=0.95, seconds=6, main=0.001)
    assert act.cpu_share == 0.001 and act.state == lv.Status.BUSY
    # the same stillness blocked (a lock, a socket) or sleeping in a polling loop: stuck
    for ran, waited in ((0.0, 0.0), (0.002, 0.3)):
        times = Times()
        sampler = rs.Sampler(clock=times.clock, times=times, io=lambda: 0)
        sampler.sample()
        assert _after_the_loop(sampler, times, ran, waited, seconds=6).state == lv.Status.STUCK


def test_a_rank_that_never_got_a_cpu_while_still_is_busy_not_stuck() -> None:
    """Linux adds a wait to a thread's schedstat only once it runs again: a main thread
    starved for the whole stillness (measured beside a hog at nice 19: 0.1% of a core, its
    threads' schedstat waits 26% of 3.9 s) shows no wait there. Runnable (state R) at every
    sample, it waits for a CPU: busy. Asleep at a sample, the same figures are stuck."""
    for runnable, state in (([True] * 8, lv.Status.BUSY), ([True, False] * 4, lv.Status.STUCK)):
        times = Times()
        seen = iter(runnable)
        sampler = rs.Sampler(clock=times.clock, times=times, io=lambda: 0, runnable=seen.__next__)
        sampler.sample()
        act = _after_the_loop(sampler, times, ran=0.002, waited=0.26, seconds=6, main=0.001)
        assert (act.cpu_share, act.state) == (0.001, state), act


def test_the_sampler_reads_whether_the_main_thread_is_runnable() -> None:
    sampler = rs.Sampler()
    assert sampler._main_runnable()  # this thread, running now
    assert not rs.Sampler(times=lambda: (0.0, 0.0, 0.0))._read_runnable()


def test_the_shares_are_those_of_the_still_seconds() -> None:
    """A stall right after busy training is seen after the stillness (3 s), not once the
    busy seconds have left a longer window."""
    times = Times()
    sampler = rs.Sampler(clock=times.clock, times=times, io=lambda: 0)
    _moving(sampler, times, 1.0, 0.0, 5)  # training: a full core
    acts = _still(sampler, times, 0.0, 0.0, 4)  # blocked: the first still sample, then 3 s
    assert (acts[2].still_seconds, acts[2].state) == (2.0, lv.Status.BUSY)  # not still for 3 s yet
    assert (acts[3].still_seconds, acts[3].cpu_share, acts[3].state) == (3.0, 0.0, lv.Status.STUCK)


def test_the_sampler_reads_the_threads_times() -> None:
    sampler = rs.Sampler()
    main, ran, waited = sampler._times()
    end = time.thread_time() + 0.05
    while time.thread_time() < end:
        pass
    later = sampler._times()
    assert later[0] - main >= 0.04 and later[1] - ran >= 0.04 and later[2] >= waited >= 0.0


def test_working_since_a_readers_view_of_the_last_activity() -> None:
    """What the doctor makes of a rank's last activity once its silence passed the stall.
    The false hang's other half: a rank starved after the loop last wrote its file 2.5 s
    into its silence, its watchdog's sample then saying stepping; read 4 s later (silent
    6.5 s) it was taken for stuck. Its watchdog had not judged that silence: not stuck."""
    written = 2e9
    stepping = schema.Activity("stepping", sampled_unix=written - 0.01, hang_timeout_seconds=60.0)
    assert lv.working_since(stepping, 6.5, written)
    waiting = schema.Activity("waiting", sampled_unix=written - 1.0, hang_timeout_seconds=60.0)
    assert lv.working_since(waiting, 6.5, written)  # its collective completed since
    busy = schema.Activity("busy", sampled_unix=written - 0.3, hang_timeout_seconds=60.0)
    assert lv.working_since(busy, 200.0, written) and lv.working_since(
        busy, 1e6, written
    )  # however long
    assert not lv.working_since(schema.Activity("stuck", sampled_unix=written), 6.5, written)
    assert not lv.working_since(None, 6.5, written)  # no watchdog: silence is all there is
    # a watchdog that has not sampled for a while (its thread blocked): silence decides
    assert not lv.working_since(
        dataclasses.replace(stepping, sampled_unix=written - 6.0), 9.0, written
    )


LOOPS = """
def run(steps):
    x = 0
    for epoch in range(2):
        for step in range(steps):
            x += 1
            if x > 100:
                break
            x += 2
        x -= 1
    while x > 0:
        x -= 3
    return x
"""


def test_loop_lines_say_which_loop_a_line_is_in() -> None:
    """The innermost loop around a line (``for``, ``while``, nested), or none: whether a
    rank stands inside its training loop or past it."""
    namespace: dict[str, object] = {}
    exec(compile(LOOPS, "loops.py", "exec"), namespace)
    code = namespace["run"].__code__  # type: ignore[attr-defined]
    first = {line: offset for offset, line in reversed(list(dis.findlinestarts(code))) if line}
    assert [rs.loop_lines(code, first[line]) for line in (3, 6, 9, 10, 12, 13)] == [
        [],
        [5, 9],
        [5, 9],
        [4, 10],
        [11, 12],
        [],
    ]


def test_the_sampler_records_the_loops_around_the_main_thread() -> None:
    sampler = rs.Sampler()
    for _ in range(1):
        sampler.sample()  # inside this loop
        act = sampler.activity(0.0, False, 60.0, time.time())
    assert act.where and "test_activity.py" in act.where
    assert len(act.loops) == len(act.callers) + 1
    line = int(act.where.split(" in ")[0].rsplit(":", 1)[1])
    assert act.loops[0] == [line - 1, line + 1]  # the for line to the body's last


def test_a_host_spinning_for_a_gpu_that_makes_no_progress_is_stuck_not_busy() -> None:
    """``.item()`` waiting for a GPU whose work never ends uses a whole core: the CPU is
    the wait itself, not work (seen on an H100: a kernel that never ends, the host in
    loss.item() at 100% CPU, called busy)."""
    assert lv.classify(9.0, False, 10.0, 1.0, 0.0, gpu_behind=None) == lv.Status.BUSY
    assert lv.classify(9.0, False, 10.0, 1.0, 0.0, gpu_behind=1.0) == lv.Status.BUSY  # a step's lag
    assert lv.classify(9.0, False, 10.0, 1.0, 0.0, gpu_behind=9.0) == lv.Status.STUCK
    assert (
        lv.classify(9.0, True, 10.0, 1.0, 0.0, gpu_behind=9.0) == lv.Status.WAITING
    )  # in a collective
    assert lv.classify(1.0, False, 10.0, 1.0, 0.0, gpu_behind=9.0) == lv.Status.STEPPING
