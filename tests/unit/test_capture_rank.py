"""The rank's side of a capture (ddpmon/rank/capture.py) on a real Recorder, StepBoundary and
torch.profiler, in this process: requests taken or ignored, steps recorded, and every way a
capture fails (profiler busy, expired, detached, too large, disk full) said in its status."""

from __future__ import annotations

import errno
import json
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ddpmon.fuses import Fuse
from ddpmon.rank import capture as rank_capture
from ddpmon.rank.boundary import StepBoundary
from ddpmon.rank.capture import Capture
from ddpmon.rank.recorder import Recorder
from ddpmon.state import captures
from ddpmon.state.schema import Identity
from tests.support.roots import as_root, plant_link

PID = os.getpid()


class Rank:
    """A rank's boundary and capture part over ``directory``, without a model."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.rec = Recorder(Identity(rank=1, job="job", pid=PID), world_size=2)
        self.fuse = Fuse("capture")
        self.boundary = StepBoundary(self.rec, Fuse("step_hooks"), lambda: None)
        self.notified = 0
        self.part = Capture(str(directory), self.rec, self.boundary, self._notify, self.fuse, "cpu")
        self.a = torch.randn(64, 64)

    def _notify(self) -> None:
        self.notified += 1

    def ask(self, steps: int = 2, **fields: Any) -> captures.Request:
        now = time.time()
        base: dict[str, Any] = dict(
            nonce=os.urandom(8).hex(),
            rank=1,
            job="job",
            pid=PID,
            started_unix=self.rec.started_unix,
            steps=steps,
            at_step=None,
            requested_unix=now,
            expires_unix=now + 30,
        )
        base.update(fields)
        req = captures.Request(**base)
        captures.write_request(str(self.dir), req)
        self.part._next_look = 0.0  # (looks are at most once a second)
        self.part.poll()
        return req

    def steps(self, n: int) -> None:
        for _ in range(n):
            torch.mm(self.a, self.a)
            self.boundary.end(time.perf_counter())
        self.part.poll()  # the state writer's next pass writes what the training thread left

    def status(self, req: captures.Request, wait: float = 10.0) -> captures.Status | None:
        path = captures.status_path(str(self.dir), 1, req.nonce)
        deadline = time.monotonic() + wait
        while True:
            st = captures.read_status(path) if os.path.exists(path) else None
            if (st is not None and st.state in captures.DONE) or time.monotonic() > deadline:
                return st
            time.sleep(0.02)
            self.part.poll()


@pytest.fixture
def rank(tmp_path: Path) -> Iterator[Rank]:
    r = Rank(tmp_path)
    yield r
    r.part.detach()


def test_a_capture_records_the_steps_asked_for_after_a_warm_up(rank: Rank) -> None:
    rank.steps(3)
    req = rank.ask(steps=2)
    assert not os.path.exists(captures.request_path(str(rank.dir), 1))  # taken
    assert (
        captures.read_status(captures.status_path(str(rank.dir), 1, req.nonce)).state == "accepted"
    )
    assert rank.boundary.capture is rank.part  # armed
    rank.steps(4)  # start, warm-up, two recorded
    assert rank.boundary.capture is None  # disarmed once stopped: nothing more per step
    st = rank.status(req)
    assert st is not None and st.state == "ok", st
    assert (st.first_step, st.last_step, st.steps) == (6, 7, 2)  # started at the end of step 4
    trace = json.loads(
        (rank.dir / (st.trace or "")).read_text(errors="replace"), strict=False
    )  # (as profiles.read)
    events = trace["traceEvents"]
    assert sum(1 for e in events if str(e.get("name")).startswith("ProfilerStep#")) == 2
    assert (
        sum(1 for e in events if e.get("name") == "aten::mm") == 2
    )  # the warm-up's is not recorded
    assert trace["ddpmon"]["first_step"] == 6  # (add_metadata_json: a JSON value)
    assert st.trace_bytes == (rank.dir / (st.trace or "")).stat().st_size
    assert not [p for p in os.listdir(rank.dir) if p.endswith(".tmp")]


def test_a_request_for_another_process_or_expired_is_ignored_and_removed(rank: Rank) -> None:
    for fields in (
        {"pid": PID + 1},
        {"started_unix": 5.0},
        {"job": "old"},
        {"rank": 0},
        {"expires_unix": time.time() - 1},
    ):
        req = rank.ask(**fields)
        assert not os.path.exists(captures.request_path(str(rank.dir), 1)), fields
        assert not os.path.exists(captures.status_path(str(rank.dir), 1, req.nonce)), fields
        assert rank.boundary.capture is None, fields
    (rank.dir / "capture-1.request").write_text("not json")
    rank.part._next_look = 0.0
    rank.part.poll()
    assert not (rank.dir / "capture-1.request").exists() and rank.fuse.ok


def test_requests_are_looked_for_at_most_once_a_second(rank: Rank) -> None:
    rank.part.poll()
    captures.write_request(
        str(rank.dir),
        captures.Request(
            "ab12cd34", 1, "job", PID, rank.rec.started_unix, 1, None, time.time(), time.time() + 30
        ),
    )
    rank.part.poll()
    assert os.path.exists(captures.request_path(str(rank.dir), 1))
    rank.part._next_look = time.monotonic()  # a second later
    rank.part.poll()
    assert not os.path.exists(captures.request_path(str(rank.dir), 1))


def test_a_busy_profiler_is_left_alone(rank: Rank) -> None:
    req = rank.ask()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as user:
        rank.steps(1)
        assert torch.autograd._profiler_enabled()  # still the user's
        torch.mm(rank.a, rank.a)
    assert any(e.name == "aten::mm" for e in user.events())
    st = rank.status(req)
    assert (
        st is not None and st.state == "error" and (st.reason or "").startswith("profiler busy: ")
    )
    assert rank.boundary.capture is None and rank.part._plan is None and rank.fuse.ok


def test_without_torchs_profiler_flag_a_capture_says_so(
    rank: Rank, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A torch without ``torch.autograd._profiler_enabled`` (a private API): ddpmon cannot
    tell whether the program's own profiler runs, so the capture ends at once, its status and
    its one warning saying why; the steps go on."""
    from ddpmon.rank import torch_api

    monkeypatch.delattr(torch.autograd, "_profiler_enabled")
    req = rank.ask()
    rank.steps(2)
    st = rank.status(req)
    text = f"{torch_api.PROFILER} off: torch {torch.__version__} has no torch.autograd._profiler_enabled"
    assert st is not None and st.state == "error" and st.reason == text
    assert [r.getMessage() for r in caplog.records if "_profiler_enabled" in r.getMessage()] == [
        f"ddpmon: rank 1: capture failed (training goes on): {text}"
    ]
    assert rank.boundary.capture is None and rank.fuse.ok and rank.rec.steps == 2


def test_a_boundary_after_the_command_gave_up_records_nothing(rank: Rank) -> None:
    req = rank.ask(expires_unix=time.time() + 0.05)
    time.sleep(0.1)
    rank.steps(1)
    st = rank.status(req)
    assert (
        st is not None
        and st.state == "error"
        and "only after the command had given up" in (st.reason or "")
    )


def test_at_step_waits_for_that_step(rank: Rank) -> None:
    req = rank.ask(steps=1, at_step=4)
    rank.steps(3)
    assert (
        captures.read_status(captures.status_path(str(rank.dir), 1, req.nonce)).state == "accepted"
    )
    rank.steps(3)  # boundary 4: start; 5: warm-up; 6: recorded
    st = rank.status(req)
    assert st is not None and (st.state, st.first_step, st.last_step) == ("ok", 6, 6)


def test_detach_ends_a_capture_under_way(rank: Rank) -> None:
    req = rank.ask(steps=5)
    rank.steps(3)
    rank.part.detach()
    st = rank.status(req)
    assert st is not None and st.state == "error"
    assert (
        st.reason
        == "the rank detached from ddpmon (its training ended) after 1 of 5 steps; nothing was written"
    )
    assert not torch.autograd._profiler_enabled()


def test_a_trace_over_the_cap_is_deleted(rank: Rank, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(captures, "MAX_TRACE_BYTES", 1000)
    req = rank.ask(steps=2)
    rank.steps(4)
    st = rank.status(req)
    assert st is not None and st.state == "error"
    assert "over the cap of 0.0 MiB: it was deleted; capture fewer steps (--steps 1)" in (
        st.reason or ""
    )
    assert not [p for p in os.listdir(rank.dir) if ".trace.json" in p]


@as_root
def test_links_planted_by_a_group_member_are_never_followed(tmp_path: Path, team_dir: Path) -> None:
    """A team's state directory (group-writable, setgid): a member asks for a capture with a
    nonce of its choosing and plants links, owned by it, where torch would write the trace
    (``<path>.tmp``) and where the trace goes, to a root-only file elsewhere. The rank
    (root here) writes under a name it draws itself: the file keeps its bytes and mode."""
    shared = team_dir
    secret = tmp_path / "secret"
    secret.write_text("root only\n")
    secret.chmod(0o600)
    r = Rank(shared)
    try:
        nonce = os.urandom(8).hex()
        name = captures.trace_name(1, nonce)
        for planted in (f".{name}.tmp.tmp", name):
            plant_link(shared / planted, secret)
        req = r.ask(steps=1, nonce=nonce)
        r.steps(3)
        st = r.status(req)
        assert st is not None and st.state == "ok", st
        assert secret.read_text() == "root only\n" and stat.S_IMODE(secret.stat().st_mode) == 0o600
        trace = shared / name
        assert not trace.is_symlink() and trace.stat().st_uid == 0
        assert (
            stat.S_IMODE(trace.stat().st_mode) == 0o640
        )  # the state files' mode in a group-readable directory
        assert "traceEvents" in trace.read_text(errors="replace")
    finally:
        r.part.detach()


def test_a_full_disk_fails_the_capture_not_the_rank(
    rank: Rank, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(path: str) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setattr(rank_capture.files, "own_private", full)
    req = rank.ask(steps=1)
    rank.steps(3)
    st = rank.status(req)
    assert st is not None and st.state == "error"
    assert st.reason == f"cannot write the trace into {rank.dir}: No space left on device"
    assert rank.fuse.ok  # the next capture may work
    monkeypatch.undo()
    req = rank.ask(steps=1)
    rank.steps(3)
    assert (rank.status(req) or captures.Status("", 0, "", 0)).state == "ok"


def test_the_boundary_calls_nothing_while_no_capture_is_asked(
    rank: Rank, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    monkeypatch.setattr(rank.part, "step_ended", calls.append)
    rank.steps(5)
    assert calls == []
    rank.boundary.capture = rank.part
    rank.steps(1)
    assert calls == [6]


def test_a_request_that_no_step_boundary_took_is_dropped_for_the_next(
    rank: Rank, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rank_capture, "EXPIRED_GRACE", 0.0)
    stuck = rank.ask(
        at_step=1000, expires_unix=time.time() + 0.05
    )  # the loop hangs before step 1000
    time.sleep(0.1)
    fresh = rank.ask(steps=1)  # the writer's next pass drops the first, then takes this one
    st = rank.status(stuck, wait=0)
    assert st is not None and st.state == "error" and "it may be hung" in (st.reason or "")
    assert rank.part._plan is not None and rank.part._plan.nonce == fresh.nonce
    rank.steps(3)
    assert (rank.status(fresh) or captures.Status("", 0, "", 0)).state == "ok"
