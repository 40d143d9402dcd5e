"""The clock's offset from a reference through a real c10d store (``ddpmon/clocks.py``), and
the doctor's use of it (``doctor/load.align``)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

from ddpmon import clocks
from ddpmon.doctor.load import StateFile, align
from ddpmon.state import schema

dist = pytest.importorskip("torch.distributed")


def store() -> object:
    return dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10), wait_for_workers=False)


def client(server: object) -> object:
    port = server.port  # type: ignore[attr-defined]
    return dist.TCPStore("127.0.0.1", port, 1, False, timedelta(seconds=10))


@pytest.mark.timeout(30)
def test_askers_with_shifted_clocks_measure_their_offsets_within_half_the_delay() -> None:
    server = store()
    shifts = {1: 10.0, 2: -7.0, 3: 0.25}
    found: dict[int, clocks.Measured | None] = {}
    deadline = time.monotonic() + 20

    def ask(who: int) -> None:
        found[who] = clocks.measure(
            client(server), who, deadline, clock=lambda: time.time() + shifts[who]
        )

    askers = [threading.Thread(target=ask, args=(w,)) for w in shifts]
    for t in askers:
        t.start()
    served = clocks.serve(server, len(shifts), deadline)  # type: ignore[arg-type]
    for t in askers:
        t.join(10)
    assert served == 3
    for who, shift in shifts.items():
        m = found[who]
        assert m is not None
        assert abs(m.offset_seconds - shift) <= m.delay_seconds / 2 + 0.005, (who, m)
        assert m.delay_seconds < 0.1


@pytest.mark.timeout(30)
def test_a_reference_without_askers_and_an_asker_without_a_reference_give_up_in_time() -> None:
    server = store()
    started = time.monotonic()
    assert clocks.serve(server, 2, time.monotonic() + 0.5) == 0  # type: ignore[arg-type]
    assert clocks.measure(client(server), 1, time.monotonic() + 0.5) is None  # type: ignore[arg-type]
    assert time.monotonic() - started < 3


def state(rank: int, now: float, shift: float | None, ended: float) -> schema.RankState:
    clock = schema.Clock(shift, 0.001, 0.0) if shift is not None else None
    return schema.RankState(
        rank=rank,
        world_size=3,
        job="j",
        now_unix=now + (shift or 0.0),
        exit=schema.Exit(unix=ended + (shift or 0.0), exception="RuntimeError: x"),
        clock=clock,
    )


def test_copied_files_keep_the_order_their_measured_clocks_give() -> None:
    """Files copied at one moment all carry that moment as modification time; the measured
    offsets still put rank 2's end (t=100, its clock 7 s behind) before rank 1's (t=102,
    its clock 10 s ahead), on the file system's clock with one shift for the job."""
    copied = 5000.0
    files = [
        StateFile("rank-0.json", state(0, 103.0, 0.0, 103.0), copied),
        StateFile("rank-1.json", state(1, 102.0, 10.0, 102.0), copied),
        StateFile("rank-2.json", state(2, 100.0, -7.0, 100.0), copied),
    ]
    by_mtime = [f.state.exit.unix + f.offset for f in files]  # type: ignore[union-attr]
    assert max(by_mtime) - min(by_mtime) < 1e-9  # the estimate sees every end at the copy
    align(files)
    ends = [f.state.exit.unix + f.offset for f in files]  # type: ignore[union-attr]
    assert ends[2] < ends[1] < ends[0]
    assert ends[1] - ends[2] == pytest.approx(2.0) and ends[0] - ends[1] == pytest.approx(1.0)
    assert [f.written for f in files] == pytest.approx(ends)


def test_without_a_measurement_the_modification_time_is_the_estimate() -> None:
    f = StateFile("rank-1.json", state(1, 100.0, None, 100.0), 130.0)
    align([f])
    assert f.reference is None and f.offset == pytest.approx(30.0)
