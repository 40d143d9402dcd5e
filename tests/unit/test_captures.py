"""The capture protocol's files (ddpmon/state/captures.py) and ``ddpmon capture`` run in this
process against a thread that answers as a rank would: no torch, no process."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddpmon.cli import main
from ddpmon.errors import StateFileError
from ddpmon.state import captures
from tests.support import states
from tests.support.traces import rank_trace


def request(**fields: object) -> captures.Request:
    now = time.time()
    base: dict[str, object] = dict(
        nonce="ab12cd34ef56ab78",
        rank=1,
        job="job",
        pid=4001,
        started_unix=1000.5,
        steps=5,
        at_step=None,
        requested_unix=now,
        expires_unix=now + 60,
    )
    base.update(fields)
    return captures.Request(**base)  # type: ignore[arg-type]


def test_a_request_binds_to_one_process(tmp_path: Path) -> None:
    path = captures.write_request(str(tmp_path), request())
    assert os.path.basename(path) == "capture-1.request"
    r = captures.read_request(path)
    assert r == request(requested_unix=r.requested_unix, expires_unix=r.expires_unix)
    assert r.binds("job", 4001, 1000.5) is None
    assert r.binds("job", 4002, 1000.5) == "it is for pid 4001, not this process (4002)"
    assert "not at 2000.500" in (r.binds("job", 4001, 2000.5) or "")
    assert r.binds("other", 4001, 1000.5) == "it is for job 'job', not 'other'"


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"nonce": "../x"}, "has nonce='../x'; expected 8 to 32 hex digits"),
        ({"steps": 51}, "has steps=51; expected 1 to 50"),
        ({"steps": True}, "has steps=True; expected int"),
        ({"pid": "1"}, "has pid='1'; expected int"),
        ({"kind": "x"}, "is not a ddpmon capture file"),
    ],
)
def test_a_bad_request_is_named(tmp_path: Path, change: dict[str, object], reason: str) -> None:
    data = {**request().to_json(), **change}
    path = tmp_path / "capture-1.request"
    path.write_text(json.dumps(data))
    with pytest.raises(StateFileError) as err:
        captures.read_request(str(path))
    assert reason in str(err.value) and str(path) in str(err.value)


def test_a_status_names_its_trace_by_a_file_name_only(tmp_path: Path) -> None:
    st = captures.Status(
        "ab12cd34",
        1,
        "ok",
        5,
        step=20,
        first_step=18,
        last_step=22,
        trace=captures.trace_name(1, "ab12cd34"),
        trace_bytes=10,
        written_unix=5.0,
    )
    assert captures.read_status(captures.write_status(str(tmp_path), st)) == st
    bad = captures.Status("ab12cd34", 1, "ok", 5, trace="../../etc/passwd")
    with pytest.raises(StateFileError, match="names the trace '../../etc/passwd'"):
        captures.read_status(captures.write_status(str(tmp_path), bad))


def test_listing_and_pruning(tmp_path: Path) -> None:
    d = str(tmp_path)
    for i in range(6):
        nonce = f"{i:08x}"
        name = captures.trace_name(1, nonce)
        (tmp_path / name).write_text("{}")
        captures.write_status(
            d, captures.Status(nonce, 1, "ok", 5, trace=name, written_unix=100.0 + i)
        )
    captures.write_status(
        d, captures.Status("ffffffff", 0, "error", 5, reason="profiler busy", written_unix=50.0)
    )
    (tmp_path / "capture-0-eeeeeeee.status").write_text("nonsense")
    found = captures.listing(d)
    assert [(c.rank, c.nonce) for c in found] == [(0, "ffffffff"), (0, "eeeeeeee")] + [
        (1, f"{i:08x}") for i in range(6)
    ]
    broken = next(c for c in found if c.nonce == "eeeeeeee")
    assert (
        broken.status is None
        and broken.problem
        == "is not valid JSON (truncated or corrupt: Expecting value: line 1 column 1 (char 0))"
    )
    assert next(c for c in found if c.nonce == "ffffffff").trace_path is None
    removed = captures.prune(d, 1, keep=4)
    assert sorted(os.path.basename(p) for p in removed) == sorted(
        [f"capture-1-{i:08x}.status" for i in (0, 1)]
        + [captures.trace_name(1, f"{i:08x}") for i in (0, 1)]
    )
    assert [c.nonce for c in captures.listing(d) if c.rank == 1] == [
        f"{i:08x}" for i in (2, 3, 4, 5)
    ]


def test_the_command_for_a_rank_and_its_peer() -> None:
    assert (
        captures.command("/tmp/ddpmon-1000/job", 3)
        == "ddpmon capture /tmp/ddpmon-1000/job --rank 3"
    )
    assert (
        captures.command("/a b", 3, peer=0, steps=10)
        == "ddpmon capture '/a b' --rank 3 --steps 10 --compare 0"
    )


# -- the command, against a thread that answers as the ranks would ------------------------------


class FakeRanks:
    """Takes each request in ``directory`` and answers it: ``accepted``, then ``ok`` with a
    trace (rank 1 spends 4.12 ms more per step in aten::mm), or the ``answer`` given."""

    def __init__(self, directory: Path, answer: dict[int, str] | None = None) -> None:
        self.dir = directory
        self.answer = answer or {}
        self.taken: list[captures.Request] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> FakeRanks:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            for rank in (0, 1):
                path = captures.request_path(str(self.dir), rank)
                if not os.path.exists(path):
                    continue
                req = captures.read_request(path)
                os.unlink(path)
                self.taken.append(req)
                self._serve(req)

    def _serve(self, req: captures.Request) -> None:
        d = str(self.dir)
        start = req.at_step if req.at_step is not None else 21
        status = captures.Status(
            req.nonce,
            req.rank,
            "accepted",
            req.steps,
            step=20,
            job=req.job,
            written_unix=time.time(),
        )
        captures.write_status(d, status)
        answer = self.answer.get(req.rank, "ok")
        if answer == "hang":
            return
        first = {"first_step": start + 2, "last_step": start + 1 + req.steps}
        if answer != "ok":
            captures.write_status(
                d, captures.Status(req.nonce, req.rank, "error", req.steps, reason=answer, **first)
            )
            return
        name = captures.trace_name(req.rank, req.nonce)
        (self.dir / name).write_text(json.dumps(rank_trace(4120.0 if req.rank == 1 else 0.0)))
        captures.write_status(
            d,
            captures.Status(
                req.nonce,
                req.rank,
                "ok",
                req.steps,
                trace=name,
                trace_bytes=(self.dir / name).stat().st_size,
                **first,
            ),
        )


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Path]:
    d = tmp_path / "job"
    for rank in (0, 1):
        states.write(d, states.state(rank, steps=20, step_s=0.5))
    yield d


def command(*args: str) -> int:
    with pytest.raises(SystemExit) as done:
        main(["capture", *args])
    return int(done.value.code or 0)


def test_a_capture_waits_for_the_trace_and_copies_it(
    job: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "f.json"
    with FakeRanks(job) as ranks:
        assert command(str(job), "--rank", "1", "--steps", "3", "-o", str(out)) == 0
    (req,) = ranks.taken
    pid = states.PID_BASE + 1
    assert (req.rank, req.steps, req.at_step, req.pid, req.job) == (1, 3, None, pid, "job")
    assert json.loads(out.read_text())["traceEvents"]
    text = capsys.readouterr().out
    assert (
        f"rank 1: steps 23 to 25 recorded (3 steps): {job}/capture-1-{req.nonce}.pt.trace.json"
        in text
    )
    assert f"copied to {out}" in text


def test_compare_asks_both_ranks_for_the_same_steps_and_names_the_op(
    job: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "f.json"
    with FakeRanks(job) as ranks:
        assert command(str(job), "--rank", "1", "--compare", "0", "-o", str(out)) == 0
    assert {r.rank for r in ranks.taken} == {0, 1}
    assert {r.at_step for r in ranks.taken} == {20 + 6}  # 3 s ahead at 0.5 s a step
    assert (tmp_path / "f.rank0.json").exists()
    text = capsys.readouterr().out.splitlines()
    assert text[text.index("where rank 1 spends more than rank 0:") + 1] == (
        "  rank 1: +4.1 ms/step in aten::mm (4.2 vs 0.05 on rank 0), called from forward (model.py:40)"
    )


def test_json_output(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with FakeRanks(job):
        assert command(str(job), "--rank", "1", "--compare", "0", "--json") == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["outcome"] for r in data["ranks"]] == [0, 0]
    assert (
        data["comparison"][0]["name"] == "aten::mm"
        and data["comparison"][0]["site"] == "forward (model.py:40)"
    )


def test_a_failed_capture_says_why_and_exits_3(
    job: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with FakeRanks(job, {1: "profiler busy: torch's profiler is already running"}):
        assert command(str(job), "--rank", "1", "--compare", "0") == 3
    err = capsys.readouterr().err
    assert "ddpmon capture: rank 1: profiler busy: torch's profiler is already running" in err


def test_a_rank_that_never_reaches_a_step_boundary_may_be_hung(
    job: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with FakeRanks(job, {1: "hang"}):
        assert command(str(job), "--rank", "1", "--timeout", "0.5") == 1
    err = capsys.readouterr().err
    assert (
        "rank 1 did not reach a step boundary within 0 s: it may be hung; run ddpmon doctor" in err
        or "rank 1 did not reach a step boundary within 1 s" in err
    )
    assert not os.path.exists(captures.request_path(str(job), 1))


def test_a_request_not_taken_is_withdrawn_and_blames_a_frozen_rank(
    job: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("ddpmon.cli.capture.PICKUP_SECONDS", 0.3)
    assert command(str(job), "--rank", "1") == 1  # its state file was written before the request
    err = capsys.readouterr().err
    assert "rank 1 did not pick up the request within 0 s" in err and "the process is frozen" in err
    assert not os.path.exists(captures.request_path(str(job), 1))


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--rank", "7"],
            "rank 7 is not in this job: {job} holds the state files of ranks 0, 1 (world size 2)",
        ),
        (["--rank", "1", "--compare", "1"], "--compare 1 names rank 1 itself"),
        (
            ["--rank", "1", "-o", "/nonexistent/dir/f.json"],
            "-o /nonexistent/dir/f.json: /nonexistent/dir is not a directory",
        ),
        (["--rank", "-1"], "argument --rank: '-1' is not a rank"),
        (["--rank", "1", "--steps", "0"], "argument --steps: 0 steps: a capture records 1 to 50"),
    ],
)
def test_bad_input_exits_2_and_says_what(
    job: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert command(str(job), *args) == 2
    assert message.format(job=job) in capsys.readouterr().err


def test_a_rank_that_ended_is_not_alive(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    states.write(job, states.state(1, steps=40, stage="detached"))
    assert command(str(job), "--rank", "1") == 2
    assert "rank 1 is not alive: it detached from ddpmon at step 40" in capsys.readouterr().err
    states.write(
        job, states.state(1, steps=41, exit={"unix": states.NOW, "exception": "RuntimeError: boom"})
    )
    assert command(str(job), "--rank", "1") == 2
    assert (
        "rank 1 is not alive: it crashed (RuntimeError: boom) at step 41" in capsys.readouterr().err
    )


def test_another_capture_under_way_is_not_overwritten(
    job: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    captures.write_request(str(job), request())
    assert command(str(job), "--rank", "1") == 2
    assert (
        "a capture of rank 1 was asked for 0 s ago by another ddpmon capture"
        in capsys.readouterr().err
    )
    assert captures.read_request(captures.request_path(str(job), 1)).nonce == request().nonce


def test_a_rank_busy_with_an_earlier_capture_is_said_to_be(
    job: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("ddpmon.cli.capture.PICKUP_SECONDS", 0.5)
    captures.write_status(
        str(job),
        captures.Status("0123456789abcdef", 1, "recording", 50, step=20, written_unix=time.time()),
    )
    stop = threading.Event()

    def writer() -> None:  # the rank rewrites its state file, but takes no request
        while not stop.wait(0.05):
            os.utime(job / "rank-1.json")

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        assert command(str(job), "--rank", "1") == 3
    finally:
        stop.set()
        thread.join(5)
    assert (
        "it is still busy with an earlier capture (recording, 50 steps, asked for at its step 20)"
        in capsys.readouterr().err
    )
