from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from ddpmon import statefile
from ddpmon.errors import StateFileError


def test_atomic_rewrites_never_show_a_partial_file(tmp_path: Path) -> None:
    path = str(tmp_path / "rank-0.json")
    big = {"rank": 0, "pad": "x" * 200_000}
    statefile.write_atomic(path, big)
    stop = threading.Event()
    bad: list[str] = []

    def reader() -> None:
        while not stop.is_set():
            try:
                statefile.read(path)
            except StateFileError as exc:
                bad.append(str(exc))

    t = threading.Thread(target=reader)
    t.start()
    for i in range(200):
        statefile.write_atomic(path, {**big, "step": i})
    stop.set()
    t.join()
    assert bad == []
    assert statefile.read(path)["step"] == 199
    assert [p.name for p in tmp_path.iterdir()] == ["rank-0.json"], "no temp files left behind"


@pytest.mark.parametrize("content,reason", [
    ("", "is empty"), ('{"rank": 0, "st', "not valid JSON"), ("[1, 2]", "not a ddpmon state file"),
    ('{"rank": 1, "timings": 5}', "invalid timings 5"), ('{"rank": 1, "step": "abc"}', "invalid step 'abc'"),
    ('{"rank": 1, "buckets": {"x": 1}}', "invalid buckets"), ('{"rank": 1, "in_flight": [3]}', "list of objects"),
])
def test_bad_files_are_reported_by_name(tmp_path: Path, content: str, reason: str) -> None:
    path = tmp_path / "rank-3.json"
    path.write_text(content)
    with pytest.raises(StateFileError) as err:
        statefile.read(str(path))
    assert str(path) in str(err.value) and reason in str(err.value)


def test_list_files_orders_by_rank(tmp_path: Path) -> None:
    for r in (10, 2, 1):
        (tmp_path / f"rank-{r}.json").write_text(json.dumps({"rank": r}))
    (tmp_path / "other.json").write_text("{}")
    assert [Path(p).name for p in statefile.list_files(str(tmp_path))] == ["rank-1.json", "rank-2.json", "rank-10.json"]


def test_writer_rewrites_on_notify_and_survives_failures(tmp_path: Path) -> None:
    calls = {"n": 0}

    def snapshot() -> dict:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return {"rank": 0, "n": calls["n"]}

    w = statefile.StateWriter(str(tmp_path / "s" / "rank-0.json"), snapshot, interval=60)
    w.start()
    for _ in range(3):
        w.notify()
        for _ in range(100):
            if calls["n"] >= _ + 2:
                break
            threading.Event().wait(0.01)
    w.stop()
    data = statefile.read(str(tmp_path / "s" / "rank-0.json"))
    assert data["n"] >= 3 and data["format"] == statefile.FORMAT_VERSION
