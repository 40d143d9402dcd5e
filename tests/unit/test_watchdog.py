"""The progress watchdog: timeouts (configured, learned, off), hang reports with every
thread's stack while the main thread waits in C, clearing on progress, a loop that cannot
die, exit records and the flight-recorder summary. Millisecond intervals, injected clock."""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any

import pytest

from ddpmon.rank import ending
from ddpmon.rank import watchdog as wd
from ddpmon.rank.recorder import Recorder
from ddpmon.rank.sampler import Sampler
from ddpmon.state.schema import Identity


def recorder(steps: list[float] | None = None) -> Recorder:
    rec = Recorder(Identity(rank=3, job="t"), world_size=4)
    t = time.perf_counter()
    for seconds in steps or []:
        rec.forward_started(t)
        t += seconds
        rec.close_step(t)
    return rec


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_configured_timeout_reports_once_then_clears_on_progress(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rec = recorder()
    rec.last_progress_unix = 1000.0
    clock = Clock(1001.0)
    wakes: list[int] = []
    dog = wd.Watchdog(rec, timeout=2.0, notify=lambda: wakes.append(1), clock=clock)
    caplog.set_level(logging.WARNING, "ddpmon")

    assert dog.check() is None and rec.hang is None
    entry = rec.collective_began("barrier", "0", 4, None, "train.py:88", "train_step")
    rec.last_progress_unix = 1000.0  # the collective was issued at the last progress
    entry["issued_unix"] = 999.5
    clock.now = 1002.5
    report = dog.check()
    assert report is rec.hang and report is not None
    assert report.silent_seconds == 2.5 and report.timeout_seconds == 2.0
    assert report.timeout_source == "configured" and report.stage == "first_step"
    assert report.in_flight[0].op == "barrier" and report.in_flight[0].age_seconds == 3.0
    assert report.threads and all(t.frames for t in report.threads)
    assert wakes == [1] and dog.reports == 1
    hang_logs = [r.getMessage() for r in caplog.records if "made no progress" in r.getMessage()]
    assert len(hang_logs) == 1
    assert "rank 3 made no progress for 2.5 s" in hang_logs[0]
    assert (
        "waiting 3.0 s in barrier #1 (group 0, issued at train.py:88 in train_step)" in hang_logs[0]
    )

    clock.now = 1003.0  # still hung: the report stays, no second log line
    assert dog.check() is report
    assert len([r for r in caplog.records if "made no progress" in r.getMessage()]) == 1

    clock.now = 1009.0  # past the refresh interval: fresh stacks, same detection time
    fresh = dog.check()
    assert fresh is not report and fresh.detected_unix == report.detected_unix
    assert fresh.silent_seconds == 9.0 and dog.reports == 1

    rec.collective_ended(entry)  # progress
    assert dog.check() is None and rec.hang is None
    assert any("makes progress again" in r.getMessage() for r in caplog.records)
    assert rec.snapshot()["hang"] is None


def test_a_wall_clock_step_fakes_no_hang() -> None:
    rec = recorder()
    rec.last_progress_unix = 1000.0
    wall, mono = Clock(1000.5), Clock(50.0)
    dog = wd.Watchdog(rec, timeout=2.0, clock=wall, monotonic=mono)
    assert dog.check() is None
    wall.now += 3600.0  # NTP steps the wall clock an hour ahead; 0.1 s really passed
    mono.now += 0.1
    assert dog.check() is None and rec.hang is None
    mono.now += 2.0  # now 2.6 s without progress, really
    assert dog.check() is not None and rec.hang is not None


class Starved:
    """The main thread after the loop, on a machine with more runnable threads than cores:
    (ran, waited) seconds of a clock the test moves."""

    def __init__(self, ran: float, waited: float) -> None:
        self.now, self.ran, self.waited = 1000.0, ran, waited
        self.ran_total = self.waited_total = 0.0

    def clock(self) -> float:
        return self.now

    def times(self) -> tuple[float, float, float]:
        return self.ran_total, self.ran_total, self.waited_total

    def tick(self) -> None:
        self.now += 1.0
        self.ran_total += self.ran
        self.waited_total += self.waited


def _passes(dog: wd.Watchdog, world: Starved, seconds: int) -> list[Any]:
    reports = []
    for _ in range(seconds):
        world.tick()
        reports.append(dog.check())  # one line: the main thread's stack is still
    return reports


def test_a_rank_starved_after_the_loop_is_busy_and_raises_no_hang() -> None:
    """Work after the loop while the rank gets 0.8% of a core and waits for one the rest of
    the time: busy, no hang report however long (here 15 x the timeout). Blocked the
    same way (neither running nor waiting to): stuck, reported past the timeout."""
    world = Starved(ran=0.008, waited=0.95)
    rec = recorder()
    rec.last_progress_unix = world.now
    sampler = Sampler(clock=world.clock, times=world.times, io=lambda: 0)
    dog = wd.Watchdog(rec, timeout=2.0, clock=world.clock, sampler=sampler)
    assert _passes(dog, world, 9) == [None] * 9
    assert (
        rec.activity is not None
        and rec.activity.state == "busy"
        and rec.activity.wait_share == 0.95
    )
    assert (
        _passes(dog, world, 21) == [None] * 21 and rec.hang is None
    )  # 30 s: a rank that works is never hung

    world = Starved(ran=0.0, waited=0.0)
    rec = recorder()
    rec.last_progress_unix = world.now
    sampler = Sampler(clock=world.clock, times=world.times, io=lambda: 0)
    dog = wd.Watchdog(rec, timeout=2.0, clock=world.clock, sampler=sampler)
    reports = _passes(dog, world, 4)
    assert reports[:2] == [None, None] and reports[2] is not None and rec.activity.state == "stuck"


def test_learned_timeout_after_warm_up() -> None:
    assert wd.Watchdog(recorder(), None, floor=60.0).timeout_now() == (300.0, "warm-up")
    assert wd.Watchdog(recorder([0.1, 0.2]), None, floor=60.0).timeout_now() == (300.0, "warm-up")
    slow = recorder([0.1, 0.5, 0.2, 0.1])
    assert wd.Watchdog(slow, None, floor=60.0).timeout_now() == (60.0, "learned")
    timeout, source = wd.Watchdog(slow, None, floor=1.0).timeout_now()
    assert source == "learned" and timeout == pytest.approx(5.0, rel=0.01)
    assert wd.Watchdog(slow, 0).timeout_now() == (None, "off")
    assert wd.Watchdog(slow, 7.5).timeout_now() == (7.5, "configured")


def test_off_starts_no_thread_and_never_reports() -> None:
    rec = recorder()
    rec.last_progress_unix = 0.0
    dog = wd.Watchdog(rec, timeout=0)
    dog.start()
    try:
        assert dog._thread is None
        assert dog.check() is None and rec.hang is None
    finally:
        dog.stop()


def test_thread_reports_while_main_thread_waits_in_c() -> None:
    """The main thread sleeps in C (GIL released); the watchdog thread takes its stack."""
    rec = recorder()
    rec.heartbeat()
    dog = wd.Watchdog(rec, timeout=0.2, interval=0.01)
    dog.start()
    try:
        time.sleep(0.6)  # a C-level wait, like torch's collective waits
    finally:
        dog.stop()
    report = rec.hang
    assert report is not None
    main = report.threads[0]
    assert main.main and main.name == "MainThread"
    assert main.frames[-1].function == "test_thread_reports_while_main_thread_waits_in_c"
    assert main.frames[-1].code.startswith("time.sleep(0.6)")
    assert all(t.name != "ddpmon-watchdog" for t in report.threads)  # not itself


def test_the_loop_survives_failures_and_stop_is_bounded(caplog: pytest.LogCaptureFixture) -> None:
    rec = recorder()
    rec.last_progress_unix = 0.0
    calls = {"n": 0}

    def broken() -> float:
        calls["n"] += 1
        if calls["n"] <= 3:
            raise OSError("clock broke")
        return time.time()

    caplog.set_level(logging.WARNING, "ddpmon")
    dog = wd.Watchdog(
        rec,
        timeout=1.0,
        interval=0.005,
        clock=broken,
        extras=lambda: (_ for _ in ()).throw(RuntimeError("no extras")),
    )
    dog.start()
    deadline = time.monotonic() + 5
    while rec.hang is None and time.monotonic() < deadline:
        time.sleep(0.01)
    started = time.monotonic()
    dog.stop(timeout=1.0)
    assert (
        time.monotonic() - started < 5 and not dog._thread.is_alive()
    )  # a hang bound, not a speed
    assert rec.hang is not None and rec.hang.extras_error == "RuntimeError: no extras"
    failures = [r for r in caplog.records if "failed a pass" in r.getMessage()]
    assert len(failures) == 1  # logged once, then quietly retried
    assert any("works again" in r.getMessage() for r in caplog.records)


def test_exit_record_names_the_uncaught_exception() -> None:
    def load() -> None:
        raise ValueError("sample 17 is corrupt")

    try:
        load()
    except ValueError as exc:
        record = ending.exception_record(exc, "exception", 1)
    assert record.exception == "ValueError: sample 17 is corrupt" and record.code == 1
    assert record.where.endswith(f"test_watchdog.py:{load.__code__.co_firstlineno + 1} in load")


def test_at_exit_writes_the_record_through_flush(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = recorder()
    flushed: list[dict[str, Any]] = []
    dog = wd.Watchdog(rec, timeout=0, flush=lambda: flushed.append(rec.snapshot()))
    monkeypatch.setattr(sys, "last_exc", KeyError("batch"), raising=False)
    monkeypatch.setattr(sys, "last_value", KeyError("batch"), raising=False)
    before = time.time()
    dog._at_exit()
    assert len(flushed) == 1, "the exit record is written once, through flush"
    assert flushed[0]["exit"]["exception"] == "KeyError: 'batch'"
    assert before <= flushed[0]["exit"]["unix"] <= time.time()


def test_flight_recorder_summary_and_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    from ddpmon.rank import flight_recorder as fr

    entries = [
        {
            "record_id": i,
            "collective_seq_id": i + 1,
            "profiling_name": "nccl:all_reduce",
            "state": "scheduled",
            "frames": ["dropped"],
        }
        for i in range(50)
    ]
    monkeypatch.setattr(
        fr,
        "_dump",
        lambda: {
            "version": "2.10",
            "pg_status": {"0": {"last_completed_collective": "49"}},
            "entries": entries,
        },
    )
    out = fr.read(limit=4)["flight_recorder"]
    assert out["total_entries"] == 50 and out["pg_status"]["0"]["last_completed_collective"] == "49"
    assert [e["record_id"] for e in out["entries"]] == [46, 47, 48, 49]
    assert "frames" not in out["entries"][0]

    monkeypatch.setattr(fr, "_dump", lambda: None)
    assert fr.read() is None

    def fails() -> None:
        raise RuntimeError("not built with NCCL")

    monkeypatch.setattr(fr, "_dump", fails)
    assert fr.read() == {"flight_recorder_error": "RuntimeError: not built with NCCL"}

    release = threading.Event()
    monkeypatch.setattr(fr, "_dump", lambda: release.wait(5))
    started = time.monotonic()
    assert "did not return" in fr.read(wait=0.1)["flight_recorder_error"]
    assert time.monotonic() - started < 4  # bounded by wait=0.1, not by the 5 s the dump hangs
    # while that dump hangs, later reports start no thread of their own
    threads = threading.active_count()
    assert "has not returned yet" in fr.read(wait=0.1)["flight_recorder_error"]
    assert threading.active_count() == threads
    release.set()


def test_ddp_facts_keeps_known_facts_only() -> None:
    from ddpmon.rank.timing.layout import ddp_facts

    class FakeDDP:
        def _get_ddp_logging_data(self) -> dict[str, Any]:
            return {
                "backend_name": "gloo",
                "bucket_cap_bytes": 26214400,
                "find_unused_parameters": 0,
                "master_addr": "N/A",
                "comm_hook": "",
                "iteration": 7,
                "module_name": "Net",
            }

    class Broken:
        def _get_ddp_logging_data(self) -> dict[str, Any]:
            raise RuntimeError("no reducer")

    assert ddp_facts(FakeDDP()) == {
        "backend_name": "gloo",
        "bucket_cap_bytes": 26214400,
        "find_unused_parameters": 0,
    }
    assert ddp_facts(Broken()) == {} and ddp_facts(object()) == {}


def test_collective_records_in_the_recorder() -> None:
    rec = recorder()
    a = rec.collective_began(
        "all_reduce", "0", 4, 1024, "train.py:10", "step", callers=["train.py:50 in main"]
    )
    b = rec.collective_began(
        "all_reduce", "0", 4, 4096, "train.py:30", "step", bucket=2, counted=False
    )
    c = rec.collective_began("send", "0", 4, 16, "train.py:40", "step", p2p=True)
    rec.fold()  # (numbered there, in the order issued)
    assert (a["seq"], b["seq"], c["seq"]) == (1, 2, 1)
    assert rec.state().collectives.issued == 2 and len(rec.in_flight()) == 3
    rec.collective_ended(b, counted=False)
    rec.collective_ended(a, error="RuntimeError: timed out")
    snap = rec.snapshot()
    assert [e["seq"] for e in snap["in_flight"]] == [1] and snap["in_flight"][0]["op"] == "send"
    assert snap["collectives"] == {"issued": 2, "completed": 1}
    assert snap["collective_seq"] == {"0": 2, "p2p:0": 1}
    assert snap["last_collective"]["error"] == "RuntimeError: timed out"
    assert snap["collective_sites"] == {
        "all_reduce train.py:10 < train.py:50 in main": 1,
        "all_reduce train.py:30 (DDP bucket)": 1,
        "send train.py:40": 1,
    }
    assert rec.collectives_by_op() == {"all_reduce": (1, 1), "send": (1, 0)}
    for i in range(300):  # bounded: in flight, call sites
        rec.collective_began("barrier", "0", 4, None, f"loop.py:{i}", "f")
    assert len(rec.in_flight()) == 256 and len(rec.state().collective_sites) == 64
