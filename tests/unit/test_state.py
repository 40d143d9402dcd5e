"""The state schema and the state files: atomic writes, untrusted reads, versions."""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from pathlib import Path

import pytest

from ddpmon.errors import StateFileError
from ddpmon.rank import writers
from ddpmon.state import files, records, schema
from tools import state_schema


def test_atomic_rewrites_never_show_a_partial_file(tmp_path: Path) -> None:
    path = str(tmp_path / "rank-0.json")
    big = {"rank": 0, "notes": {"pad": "x" * 200_000}}
    files.write_atomic(path, big)
    stop = threading.Event()
    bad: list[str] = []
    reads = [0]

    def reader() -> None:
        while not stop.is_set():
            try:
                files.read(path)
                reads[0] += 1
            except StateFileError as exc:
                bad.append(str(exc))

    t = threading.Thread(target=reader)
    t.start()
    for i in range(200):
        files.write_atomic(path, {**big, "step": i})
    stop.set()
    t.join()
    assert bad == [] and reads[0] > 0
    assert files.read(path).step == 199
    assert [p.name for p in tmp_path.iterdir()] == ["rank-0.json"], "no temp files left behind"


@pytest.mark.parametrize(
    "content,reason",
    [
        (b"", "is empty"),
        (b'{"rank": 0, "st', "not valid JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b"\xff\xfe{", "not UTF-8"),
        (b"[" * 100_000 + b"]" * 100_000, "nests JSON too deeply"),
        (b'{"step": 3}', "no 'rank' key"),
        (b'{"rank": 1, "timings": 5}', "invalid timings 5"),
        (b'{"rank": 1, "step": "abc"}', "invalid step 'abc'"),
        (b'{"rank": 1, "buckets": {"x": 1}}', "invalid buckets"),
        (b'{"rank": 1, "in_flight": [3]}', "invalid in_flight[0] 3"),
        (
            b'{"rank": 1, "in_flight": [{"seq": "a", "op": "barrier"}]}',
            "invalid in_flight[0].seq 'a'",
        ),
        (
            b'{"rank": 1, "in_flight": [{"seq": 1, "op": "barrier"}, {"seq": 2, "op": "barrier"}, {"seq": 3, "op": 4}]}',
            "invalid in_flight[2].op 4",
        ),
        (b'{"rank": 99999999}', "invalid rank 99999999"),
        (b'{"rank": 1, "world_size": 4000000000}', "invalid world_size"),
        (b'{"rank": 1, "format": 7}', "written by a newer ddpmon"),
        (b'{"rank": 1, "hang": {"detected_unix": 1}}', "has no 'hang.last_progress_unix'"),
    ],
)
@pytest.mark.bad_state_files
def test_bad_files_are_reported_by_name_and_field(
    tmp_path: Path, content: bytes, reason: str
) -> None:
    path = tmp_path / "rank-3.json"
    path.write_bytes(content)
    with pytest.raises(StateFileError) as err:
        files.read(str(path))
    assert str(path) in str(err.value) and reason in str(err.value)


@pytest.mark.bad_state_files
def test_files_that_are_not_regular_files_are_never_followed_or_opened(tmp_path: Path) -> None:
    (tmp_path / "rank-0.json").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "rank-1.json")  # opening it for reading would block
    (tmp_path / "rank-2.json").mkdir()
    real = tmp_path / "real.json"
    real.write_text(json.dumps({"rank": 3}))
    (tmp_path / "rank-3.json").symlink_to(real)
    (tmp_path / "rank-4.json").write_bytes(b" " * (files.MAX_BYTES + 1))
    reasons = {}
    started = time.monotonic()
    for path in files.list_files(str(tmp_path)):
        with pytest.raises(StateFileError) as err:
            files.read(path)
        reasons[files.rank_of(path)] = err.value.reason
    assert time.monotonic() - started < 5, "a FIFO or device must never block a reader"
    assert "symbolic link" in reasons[0] and "symbolic link" in reasons[3]
    assert "not a regular file" in reasons[1] and "not a regular file" in reasons[2]
    assert "more than a state file holds" in reasons[4]


@pytest.mark.parametrize("version", [1, 2])
def test_the_previous_formats_are_read(version: int) -> None:
    state = schema.parse(
        {
            "format": version,
            "rank": 2,
            "step": 5,
            "in_flight": [
                {"seq": 3, "op": "all_reduce", "async" if version == 1 else "async_op": True}
            ],
            "timings": {
                "step_seconds": {"median": 0.1, "last": 0.2, "max": 0.3},
                "phases": {"steps": 20, "step_seconds": 0.1, "backward_seconds": 0.04},
            },
        }
    )
    assert state.rank == 2 and state.in_flight[0].async_op is True
    assert state.timings.step_seconds is not None and state.timings.step_seconds.max == 0.3
    # the step's parts, which formats 1 and 2 called phases
    assert state.timings.parts is not None and state.timings.parts.backward_seconds == 0.04
    assert "phases" not in schema.to_json(state)["timings"]


def test_records_round_trip_through_json() -> None:
    state = schema.RankState(
        rank=1,
        host="h",
        step=7,
        in_flight=[schema.Collective(seq=1, op="barrier", callers=["a.py:1 in f"])],
        hang=schema.Hang(
            detected_unix=2.0,
            last_progress_unix=1.0,
            silent_seconds=1.0,
            timeout_seconds=60.0,
            timeout_source="learned",
            threads=[
                schema.Thread(name="MainThread", main=True, frames=[schema.Frame("a.py", 1, "f")])
            ],
        ),
    )
    again = schema.parse(json.loads(json.dumps(schema.to_json(state))))
    assert again == state


def test_the_shipped_json_schema_is_the_generated_one() -> None:
    with open(schema.SCHEMA_FILE) as f:
        shipped = json.load(f)
    assert shipped == schema.generated_schema(), (
        "run `python -m tools.state_schema` to regenerate it"
    )
    assert shipped["properties"]["format"]["const"] == schema.FORMAT
    assert set(shipped["required"]) == {"rank"}
    assert "in_flight" in shipped["properties"] and "Collective" in shipped["$defs"]


def test_the_json_schema_accepts_what_the_records_write() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    state = schema.RankState(
        rank=0, buckets=[schema.Bucket(index=0, bytes=4)], exit=schema.Exit(unix=1.0)
    )
    jsonschema.validate(schema.to_json(state), schema.generated_schema())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"rank": "x"}, schema.generated_schema())


def test_list_files_orders_by_rank(tmp_path: Path) -> None:
    for r in (10, 2, 1):
        (tmp_path / f"rank-{r}.json").write_text(json.dumps({"rank": r}))
    (tmp_path / "other.json").write_text("{}")
    assert [Path(p).name for p in files.list_files(str(tmp_path))] == [
        "rank-1.json",
        "rank-2.json",
        "rank-10.json",
    ]


def test_writer_rewrites_on_notify_and_survives_failures(tmp_path: Path) -> None:
    calls = {"n": 0}

    def snapshot() -> dict:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return {"rank": 0, "step": calls["n"]}

    (tmp_path / "s").mkdir()
    w = writers.StateWriter(str(tmp_path / "s" / "rank-0.json"), snapshot, interval=60)
    w.start()
    for wanted in (2, 3, 4):
        w.notify()
        deadline = time.monotonic() + 10
        while calls["n"] < wanted and time.monotonic() < deadline:
            time.sleep(0.01)
        assert calls["n"] >= wanted, (
            "notify() must cause a rewrite without waiting for the interval"
        )
    w.stop()
    state = files.read(str(tmp_path / "s" / "rank-0.json"))
    assert state.step >= 4 and state.format == schema.FORMAT


def test_a_final_write_that_hangs_is_not_waited_for(tmp_path: Path) -> None:
    release = threading.Event()

    def stuck_snapshot() -> dict:
        release.wait(30)
        return {"rank": 0}

    w = writers.StateWriter(str(tmp_path / "rank-0.json"), stuck_snapshot, interval=60)
    started = time.monotonic()
    assert w.write_final(timeout=0.3) is False
    assert time.monotonic() - started < 5
    release.set()


def test_schema_errors_name_the_nested_field() -> None:
    with pytest.raises(records.SchemaError) as err:
        records.load(
            schema.Hang,
            {
                "detected_unix": 1,
                "last_progress_unix": 1,
                "silent_seconds": 0,
                "timeout_seconds": 1,
                "timeout_source": "x",
                "threads": [{"frames": [{"line": "x"}]}],
            },
        )
    assert "threads[0].frames[0].line 'x'" in str(err.value)


def test_docs_state_md_holds_the_generated_field_tables() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "state.md").read_text()
    start = text.index("-->\n", text.index("<!-- generated by")) + len("-->\n")
    end = text.index("<!-- end of generated fields -->")
    assert text[start:end].strip() == state_schema.markdown().strip(), (
        "regenerate docs/state.md's tables: python -m tools.state_schema --markdown"
    )


def test_every_file_in_a_state_directory_is_as_private_as_the_state_file(tmp_path: Path) -> None:
    """The fault file and the history hold stacks and paths: never readable by others."""
    from ddpmon.state.history import HistoryStore

    for dir_mode, want in ((0o755, 0o640), (0o700, 0o600)):
        d = tmp_path / f"{dir_mode:o}"
        d.mkdir()
        d.chmod(dir_mode)
        fault = d / "rank-0.fault"
        fault.write_text("an earlier run's")
        fault.chmod(0o666)
        os.close(files.open_private(str(fault)))
        assert fault.read_text() == "" and stat.S_IMODE(fault.stat().st_mode) == want
        store = HistoryStore(str(d / "rank-0.history.sqlite"), {"rank": 0})
        store.close()
        for p in d.iterdir():
            assert stat.S_IMODE(p.stat().st_mode) & 0o007 == 0, p
        files.write_atomic(str(d / "rank-0.json"), {"rank": 0})
        assert stat.S_IMODE((d / "rank-0.json").stat().st_mode) == want


def test_a_file_stamped_in_the_future_was_written_when_its_inode_changed(tmp_path: Path) -> None:
    """The owner sets a file's modification time at will (``touch -d``), not its change time."""
    path = tmp_path / "rank-0.json"
    files.write_atomic(str(path), {"rank": 0})
    ahead = time.time() + 10 * 365 * 86400
    os.utime(path, (ahead, ahead))
    written = files.written_unix(os.stat(path))
    assert written <= time.time() and written == os.stat(path).st_ctime


def test_a_job_claimed_by_several_owners_is_one_job_per_owner() -> None:
    from ddpmon.state import owners

    def rank(r: int, job: str | None) -> schema.RankState:
        return schema.RankState(rank=r, job=job)

    found = [
        ("a/rank-0.json", rank(0, "j"), 1000),
        ("a/rank-1.json", rank(1, "j"), 1000),
        ("b/rank-1.json", rank(1, "j"), 1001),
        ("c/rank-0.json", rank(0, "k"), 1001),
        ("d/rank-0.json", rank(0, None), 1000),
        ("e/rank-0.json", rank(0, None), 1002),
    ]
    separated, shared = owners.separate(found)
    assert [(p, s.job) for p, s in separated] == [
        ("a/rank-0.json", "j@uid1000"),
        ("a/rank-1.json", "j@uid1000"),
        ("b/rank-1.json", "j@uid1001"),
        ("c/rank-0.json", "k"),
        ("d/rank-0.json", "@uid1000"),
        ("e/rank-0.json", "@uid1002"),
    ]
    assert shared == {"j": [1000, 1001], "": [1000, 1002]}
    assert [s.job for _, s, _ in found] == [
        "j",
        "j",
        "j",
        "k",
        None,
        None,
    ]  # the files' own word kept


def test_a_format_2_file_is_read_with_its_phase_as_the_stage() -> None:
    """Format 2 named the rank's stage ``phase`` (in the file and its hang report) and
    ``first_step`` ``init``; readers take those files as they are."""
    hang = {
        "detected_unix": 1.0,
        "last_progress_unix": 1.0,
        "silent_seconds": 1.0,
        "timeout_seconds": 1.0,
        "timeout_source": "configured",
        "phase": "allreduce",
    }
    old = schema.parse({"rank": 0, "format": 2, "phase": "init", "hang": hang})
    assert old.stage is schema.Stage.FIRST_STEP and old.hang.stage is schema.Stage.ALLREDUCE
    assert schema.parse({"rank": 0, "format": 2, "phase": "backward"}).stage == "backward"
    written = schema.to_json(old)
    assert written["stage"] == "first_step" and "phase" not in written
    with pytest.raises(records.SchemaError, match="stage 'warming'.*one of starting"):
        schema.parse({"rank": 0, "format": schema.FORMAT, "stage": "warming"})
