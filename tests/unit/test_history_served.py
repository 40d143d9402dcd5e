"""The daemon's ``/history``: its query and its bounded pages, against a daemon served from
threads of this process."""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs

import pytest

from ddpmon.daemon import Daemon
from ddpmon.metrics.exposition import serve
from ddpmon.state import history
from tests.support import states
from tests.support.commands import get

pytestmark = pytest.mark.timeout(120)


def steps(first: int, last: int, buckets: int = 4) -> list[dict]:
    return [{"step": s, "start_unix": 1000.0 + s, "end_unix": 1000.5 + s, "step_seconds": 0.5 + s / 1e4,
             "forward_seconds": 0.1, "backward_seconds": 0.2, "exposed_comm_seconds": 0.05 if s % 2 else None,
             "buckets": [{"index": i, "seconds": 0.01 * (i + 1), "bytes": 1 << 20} for i in range(buckets)]}
            for s in range(first, last + 1)]


def store(directory: Path, rank: int = 0, last: int = 100, buckets: int = 4, job: str = "j") -> str:
    path = history.path_for(str(directory), rank)
    s = history.HistoryStore(path, {"rank": rank, "job": job, "world_size": 2})
    s.add_steps(steps(1, last, buckets), {"process_resident_memory_bytes": 123})
    s.add_finding("note", "note:x", "x: something", 7)
    s.set_exit("exited", last, {"unix": 5.0, "exception": None})
    s.close()
    return path


def ask(query: str) -> history.Ask:
    return history.Ask.parse(parse_qs(query, keep_blank_values=True))


# -- the query --------------------------------------------------------------------------------


def test_the_query_and_what_it_asks() -> None:
    assert ask("") == history.Ask()
    assert ask("job=j") == history.Ask(job="j")
    assert ask("rank=3&since=40&limit=10&buckets=0&job=j") == history.Ask("j", 3, 40, 10, False)
    for a in (history.Ask(rank=0), history.Ask("a b&c", 7, 12, 99, False), history.Ask(job="x")):
        assert ask(a.query()) == a


@pytest.mark.parametrize("query, message", [
    ("rank=x", "rank='x' is not valid: expected a rank number (0, 1, ...)"),
    ("rank=-1", "rank='-1' is not valid"),
    ("rank=0&since=-5", "since='-5' is not valid: expected a step number (0 for the first page)"),
    ("rank=0&limit=0", f"limit='0' is not valid: expected 1 to {history.PAGE_ROWS} steps per answer"),
    (f"rank=0&limit={history.PAGE_ROWS + 1}", "is not valid: expected 1 to"),
    ("rank=0&buckets=yes", "buckets='yes' is not valid: expected 1 (with each step's buckets) or 0"),
    ("rank=0&rank=1", "rank is given 2 times: give it once"),
    ("step=3", "unknown parameter 'step': /history takes job, rank, since, limit, buckets"),
    ("since=3", "since needs rank=R (without rank, /history lists this node's histories)"),
])
def test_a_bad_query_says_what_was_wrong_and_what_is_accepted(query: str, message: str) -> None:
    with pytest.raises(history.BadQuery) as err:
        ask(query)
    assert message in str(err.value)


# -- pages ----------------------------------------------------------------------------------------


def test_pages_hold_every_step_once_in_order_and_the_last_one_says_how_it_ended(tmp_path: Path) -> None:
    path = store(tmp_path, last=25)
    seen, since, pages = [], 0, 0
    while since is not None:
        p = history.page(path, since, limit=10)
        pages += 1
        assert p["format"] == history.PAGE_FORMAT and p["rows_total"] == 25 and p["last_step"] == 25
        assert p["identity"] == {"rank": 0, "job": "j", "world_size": 2}
        assert len(p["rows"]) <= 10 and ("findings" in p) == (p["next_since"] is None)
        seen += [r[0] for r in p["rows"]]
        since = p["next_since"]
    assert (pages, seen) == (3, list(range(1, 26)))
    assert p["findings"][0]["text"] == "x: something" and p["exit"]["how"] == "exited"
    row = dict(zip(p["columns"], p["rows"][-1]))
    assert row["step_seconds"] == 0.5 + 25 / 1e4 and json.loads(row["buckets"])[3] == [3, 0.04, 1 << 20]
    assert row["process_resident_memory_bytes"] == 123 and row["data_wait_seconds"] is None
    assert "buckets" not in history.page(path, 0, buckets=False)["columns"]
    assert history.page(path, 99)["rows"] == [] and history.page(path, 99)["next_since"] is None


def test_a_page_stops_at_its_byte_bound_with_a_whole_row(tmp_path: Path) -> None:
    path = store(tmp_path, last=600, buckets=256)  # about 4.5 KiB of buckets per row
    p = history.page(path, 0)
    text = len(json.dumps(p["rows"]))
    per_row = text / len(p["rows"])
    assert 300 < len(p["rows"]) < 600 and per_row > 4000, (len(p["rows"]), per_row)
    counted = [history.ROW_BYTES + len(r[p["columns"].index("buckets")]) for r in p["rows"]]
    assert sum(counted[:-1]) < history.PAGE_BYTES <= sum(counted)  # the row that reaches it ends the page
    assert text <= history.PAGE_BYTES
    assert p["next_since"] == p["rows"][-1][0]
    assert all(len(json.loads(r[p["columns"].index("buckets")])) == 256 for r in p["rows"])


def test_findings_on_the_last_page_are_the_newest_ones(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = store(tmp_path, last=3)
    with sqlite3.connect(path) as db:
        db.executemany("INSERT INTO findings VALUES (?, ?, ?, ?, ?)",
                       [(3e9 + i, i, "note", f"k{i}", f"t{i}") for i in range(30)])
    monkeypatch.setattr(history, "PAGE_FINDINGS", 5)
    assert [f["text"] for f in history.page(path, 0)["findings"]] == ["t25", "t26", "t27", "t28", "t29"]


# -- through a daemon -------------------------------------------------------------------------------


def served(directory: Path, ranks: int, job: str, world: int | None = None) -> None:
    """State files beside a synthetic run's histories, so that a daemon serves them."""
    for rank in range(ranks):
        states.write(directory, states.state(rank, world or ranks, job=job))


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[Daemon, str]]:
    daemon = Daemon(str(tmp_path / "node"), gpus=False, node_local=True)
    endpoint = serve(daemon, 0, "127.0.0.1", {"/state": daemon.state_route, "/history": daemon.history_route})
    yield daemon, f"127.0.0.1:{endpoint.port}"
    endpoint.close()


def test_the_daemon_lists_and_pages_its_ranks_histories(tmp_path: Path, node: tuple[Daemon, str]) -> None:
    _, address = node
    job = tmp_path / "node" / "j"
    for rank in (0, 1):
        store(job, rank, last=12)
    served(job, 2, "j")
    status, body = get(f"http://{address}/history")
    index = json.loads(body)
    assert status == 200 and index["page_rows"] == history.PAGE_ROWS and index["page_bytes"] == history.PAGE_BYTES
    assert [(h["job"], h["rank"], h["rows"], h["last_step"]) for h in index["histories"]] == [("j", 0, 12, 12),
                                                                                            ("j", 1, 12, 12)]
    page = json.loads(get(f"http://{address}/history?rank=1&since=4&limit=5")[1])
    assert (page["job"], page["rank"], [r[0] for r in page["rows"]], page["next_since"]) == ("j", 1, [5, 6, 7, 8, 9], 9)
    assert get(f"http://{address}/history?rank=1&limit=0") == (
        400, f"limit='0' is not valid: expected 1 to {history.PAGE_ROWS} steps per answer\n".encode())
    assert get(f"http://{address}/history?rank=7") == (
        404, b"no history of rank 7 on this node: /history lists those there\n")
    other = tmp_path / "node" / "k"
    store(other, 1, last=3, job="k")
    states.write(other, states.state(1, 2, job="k"))
    status, body = get(f"http://{address}/history?rank=1")
    assert status == 400 and b"rank 1 has histories of jobs 'j', 'k' on this node: add job=JOB" in body
    assert json.loads(get(f"http://{address}/history?rank=1&job=k")[1])["rows_total"] == 3


def test_a_history_that_is_a_link_or_someone_elses_is_not_served(tmp_path: Path, node: tuple[Daemon, str]) -> None:
    _, address = node
    job = tmp_path / "node" / "j"
    secret = store(tmp_path / "elsewhere", 0, last=5)
    job.mkdir(parents=True)
    os.symlink(secret, history.path_for(str(job), 0))
    served(job, 2, "j")
    store(job, 1, last=5)
    if os.geteuid() == 0:
        os.chown(history.path_for(str(job), 1), 4242, 4242)
    listed = [h["rank"] for h in json.loads(get(f"http://{address}/history")[1])["histories"]]
    assert listed == ([] if os.geteuid() == 0 else [1])
    assert get(f"http://{address}/history?rank=0")[0] == 404
