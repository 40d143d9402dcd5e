"""The daemon's ``/history``: its query, its bounded pages, the copy a reader makes of them,
and ``report --from`` / ``compare`` reading them, against a daemon served from threads of
this process. (A real daemon process: tests/processes/test_report_from.py; a real DDP job:
tests/distributed/test_report_job.py; two hosts: tests/hosts/test_two_hosts.py.)"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs

import pytest

from ddpmon.cli import daemon as daemon_cli
from ddpmon.cli import main
from ddpmon.daemon import Daemon
from ddpmon.doctor import busy as doctor_busy
from ddpmon.httpd import serve
from ddpmon.remote import daemons as remote
from ddpmon.report import compare, run, summary
from ddpmon.state import history
from tests.support import states
from tests.support.commands import get

pytestmark = pytest.mark.timeout(120)


def steps(first: int, last: int, buckets: int = 4) -> list[dict]:
    return [
        {
            "step": s,
            "start_unix": 1000.0 + s,
            "end_unix": 1000.5 + s,
            "step_seconds": 0.5 + s / 1e4,
            "forward_seconds": 0.1,
            "backward_seconds": 0.2,
            "exposed_comm_seconds": 0.05 if s % 2 else None,
            "buckets": [
                {"index": i, "seconds": 0.01 * (i + 1), "bytes": 1 << 20} for i in range(buckets)
            ],
        }
        for s in range(first, last + 1)
    ]


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


@pytest.mark.parametrize(
    "query, message",
    [
        ("rank=x", "rank='x' is not valid: expected a rank number (0, 1, ...)"),
        ("rank=-1", "rank='-1' is not valid"),
        (
            "rank=0&since=-5",
            "since='-5' is not valid: expected a step number (0 for the first page)",
        ),
        ("rank=0&since=%2B5", "since='+5' is not valid"),  # int() takes these three
        ("rank=0&since=1_0", "since='1_0' is not valid"),
        ("rank=0&limit=%205", "limit=' 5' is not valid"),
        (
            f"rank=0&since={2**63}",
            f"since='{2**63}' is not valid: expected a step number (0 for the first page), "
            f"at most {2**63 - 1}",
        ),  # past SQLite's integers
        (
            f"rank={10**30}",
            f"rank='{10**30}' is not valid: expected a rank number (0, 1, ...), at most {2**63 - 1}",
        ),
        (
            "rank=0&limit=0",
            f"limit='0' is not valid: expected 1 to {history.PAGE_ROWS} steps per answer",
        ),
        (f"rank=0&limit={history.PAGE_ROWS + 1}", "is not valid: expected 1 to"),
        (
            "rank=0&buckets=yes",
            "buckets='yes' is not valid: expected 1 (with each step's buckets) or 0",
        ),
        ("rank=0&rank=1", "rank is given 2 times: give it once"),
        (
            "step=3",
            "unknown parameter 'step': /history takes job, rank, since, limit, buckets, busy, "
            "at_least",
        ),
        (
            f"rank=0&busy={history.BUSY_SECONDS + 1}",
            f"is not valid: expected 1 to {history.BUSY_SECONDS} seconds",
        ),
        ("rank=0&busy=5&at_least=-1", "at_least='-1' is not valid: expected 0 to"),
        ("since=3", "since needs rank=R (without rank, /history lists this node's histories)"),
    ],
)
def test_a_bad_query_says_what_was_wrong_and_what_is_accepted(query: str, message: str) -> None:
    with pytest.raises(history.BadQuery) as err:
        ask(query)
    assert message in str(err.value)


@pytest.mark.parametrize(
    "body",
    [
        b"[]",
        b'{"busy": null}',
        b'{"busy": {"step": [1, 2], "end_unix": [1.0], "busy_seconds": [0.1, 0.2]}}',
        b'{"busy": {"step": [1], "end_unix": [NaN], "busy_seconds": [0.1]}}',
        b'{"busy": {"step": [true], "end_unix": [1.0], "busy_seconds": [0.1]}}',
        b'{"busy": {"step": "1", "end_unix": [1.0], "busy_seconds": [0.1]}}',
        b"not json",
    ],
)
def test_busy_times_from_a_daemon_that_are_not_so_are_refused(body: bytes) -> None:
    assert doctor_busy.parse(body) is None


# -- pages ----------------------------------------------------------------------------------------


def test_pages_hold_every_step_once_in_order_and_the_last_one_says_how_it_ended(
    tmp_path: Path,
) -> None:
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
    assert row["step_seconds"] == 0.5 + 25 / 1e4 and json.loads(row["buckets"])[3] == [
        3,
        0.04,
        1 << 20,
    ]
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
    assert (
        sum(counted[:-1]) < history.PAGE_BYTES <= sum(counted)
    )  # the row that reaches it ends the page
    assert text <= history.PAGE_BYTES
    assert p["next_since"] == p["rows"][-1][0]
    assert all(len(json.loads(r[p["columns"].index("buckets")])) == 256 for r in p["rows"])


def test_findings_on_the_last_page_are_the_newest_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = store(tmp_path, last=3)
    with sqlite3.connect(path) as db:
        db.executemany(
            "INSERT INTO findings VALUES (?, ?, ?, ?, ?)",
            [(3e9 + i, i, "note", f"k{i}", f"t{i}") for i in range(30)],
        )
    monkeypatch.setattr(history, "PAGE_FINDINGS", 5)
    assert [f["text"] for f in history.page(path, 0)["findings"]] == [
        "t25",
        "t26",
        "t27",
        "t28",
        "t29",
    ]


# -- the copy -------------------------------------------------------------------------------------


def copied(path: str, into: Path, limit: int = 7) -> str:
    copy = history.HistoryCopy(str(into / "rank-0.history.sqlite"), "node:1/rank-0.history.sqlite")
    since = 0
    while since is not None:
        p = history.page(path, since, limit)
        copy.add(json.loads(json.dumps(p)))  # as it travels
        since = p["next_since"]
    copy.close()
    return copy.path


def test_a_copy_of_the_pages_reads_exactly_as_the_file(tmp_path: Path) -> None:
    (tmp_path / "copy").mkdir()
    path = store(tmp_path, last=30)
    a, b = (
        history.read(path, bin_stride=4),
        history.read(copied(path, tmp_path / "copy"), bin_stride=4),
    )
    for key in ("meta", "identity", "rank", "rows", "steps", "findings", "exit", "binned"):
        assert a[key] == b[key], key


def test_a_copy_refuses_what_is_not_a_page_of_the_same_run(tmp_path: Path) -> None:
    path = store(tmp_path, last=10)
    first = json.loads(json.dumps(history.page(path, 0, limit=5)))
    where = "node:1/rank-0.history.sqlite"

    def fails(*pages: object) -> str:
        copy = history.HistoryCopy(str(tmp_path / f"c{time.monotonic_ns()}.sqlite"), where)
        with pytest.raises(history.HistoryError) as err:
            for p in pages:
                copy.add(p)
        copy.close()
        return str(err.value)

    again = json.loads(json.dumps(history.page(path, 5)))
    again["meta"]["created_unix"] = "1.0"
    assert "started anew while it was read" in fails(first, again)
    assert "not a page of ddpmon's /history" in fails({"rows": []})
    assert "not a page of ddpmon's /history" in fails(dict(first, rows=[["three"]]))
    assert "has history schema 9" in fails(
        dict(first, meta=dict(first["meta"], schema_version="9"))
    )
    bad = dict(first, rows=[list(r) for r in first["rows"]])
    bad["rows"][0][first["columns"].index("buckets")] = "[[0, 0.1"
    copy = history.HistoryCopy(str(tmp_path / "ok.sqlite"), where)
    copy.add(bad)  # a bucket text that is not JSON is left out, not kept for the reader to trip on
    copy.close()
    assert history.read(copy.path)["steps"]["buckets"][0] is None


# -- through a daemon -------------------------------------------------------------------------------


def served(directory: Path, ranks: int, job: str, world: int | None = None) -> None:
    """State files beside a synthetic run's histories, so that a daemon serves them."""
    for rank in range(ranks):
        states.write(directory, states.state(rank, world or ranks, job=job))


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[Daemon, str]]:
    daemon = Daemon(str(tmp_path / "node"), gpus=False, node_local=True)
    endpoint = serve(
        daemon,
        0,
        "127.0.0.1",
        {"/state": daemon.routes.state_route, "/history": daemon.routes.history_route},
    )
    yield daemon, f"127.0.0.1:{endpoint.port}"
    endpoint.close()


def test_the_daemon_lists_and_pages_its_ranks_histories(
    tmp_path: Path, node: tuple[Daemon, str]
) -> None:
    _, address = node
    job = tmp_path / "node" / "j"
    for rank in (0, 1):
        store(job, rank, last=12)
    served(job, 2, "j")
    status, body = get(f"http://{address}/history")
    index = json.loads(body)
    assert (
        status == 200
        and index["page_rows"] == history.PAGE_ROWS
        and index["page_bytes"] == history.PAGE_BYTES
    )
    assert [(h["job"], h["rank"], h["rows"], h["last_step"]) for h in index["histories"]] == [
        ("j", 0, 12, 12),
        ("j", 1, 12, 12),
    ]
    page = json.loads(get(f"http://{address}/history?rank=1&since=4&limit=5")[1])
    assert (page["job"], page["rank"], [r[0] for r in page["rows"]], page["next_since"]) == (
        "j",
        1,
        [5, 6, 7, 8, 9],
        9,
    )
    assert get(f"http://{address}/history?rank=1&limit=0") == (
        400,
        f"limit='0' is not valid: expected 1 to {history.PAGE_ROWS} steps per answer\n".encode(),
    )
    assert get(f"http://{address}/history?rank=7") == (
        404,
        b"no history of rank 7 on this node: /history lists those there\n",
    )
    other = tmp_path / "node" / "k"
    store(other, 1, last=3, job="k")
    states.write(other, states.state(1, 2, job="k"))
    status, body = get(f"http://{address}/history?rank=1")
    assert (
        status == 400 and b"rank 1 has histories of jobs 'j', 'k' on this node: add job=JOB" in body
    )
    assert json.loads(get(f"http://{address}/history?rank=1&job=k")[1])["rows_total"] == 3
    # the straggler rule's sustain check (doctor --from): the steps that ended within 3 s of
    # the last, at least 6 of them, and nothing else
    answer = json.loads(get(f"http://{address}/history?rank=1&job=j&busy=3&at_least=6")[1])
    busy = answer["busy"]
    assert busy["step"] == [7, 8, 9, 10, 11, 12] and busy["end_unix"] == [
        1000.5 + s for s in busy["step"]
    ]
    assert busy["busy_seconds"] == pytest.approx(
        [0.5 + s / 1e4 - (0.05 if s % 2 else 0) for s in busy["step"]]
    )
    assert doctor_busy.parse(json.dumps(answer).encode()) == busy
    assert history.Ask.parse(parse_qs(history.Ask("j", 1, busy=3, at_least=6).query())).busy == 3


def test_a_step_past_sqlites_integers_is_answered_400_and_nothing_is_logged(
    tmp_path: Path, node: tuple[Daemon, str], caplog: pytest.LogCaptureFixture
) -> None:
    _, address = node
    job = tmp_path / "node" / "j"
    store(job, 0, last=3)
    served(job, 1, "j")
    with caplog.at_level("WARNING", logger="ddpmon"):
        for since in (2**63, 2**64):
            assert get(f"http://{address}/history?rank=0&since={since}") == (
                400,
                (
                    f"since='{since}' is not valid: expected a step number (0 for the first page), "
                    f"at most {2**63 - 1}\n"
                ).encode(),
            )
        last = json.loads(get(f"http://{address}/history?rank=0&since={2**63 - 1}")[1])
    assert (last["rows"], last["next_since"]) == ([], None)
    assert caplog.records == []


def test_a_history_that_is_a_link_or_someone_elses_is_not_served(
    tmp_path: Path, node: tuple[Daemon, str]
) -> None:
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


def test_report_from_a_daemon_gives_the_figures_of_the_directory(
    slow_run: str, tmp_path: Path, node: tuple[Daemon, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, address = node
    job = tmp_path / "node" / "slow"
    shutil.copytree(slow_run, job)
    served(job, 4, "slow")
    monkeypatch.setattr(history, "PAGE_ROWS", 40)  # 300 steps: 8 pages per rank
    here, there = run.load([str(job)], findings=False), run.load((), [address], findings=False)
    assert there.problems == [] and list(there.ranks) == [0, 1, 2, 3]
    for rank, h in here.ranks.items():
        far = there.ranks[rank]
        assert (far.rows, far.last_step, far.sample, far.binned, far.findings, far.exit) == (
            h.rows,
            h.last_step,
            h.sample,
            h.binned,
            h.findings,
            h.exit,
        )
        assert far.path == f"{address}/rank-{rank}.history.sqlite"
    a, b = summary.summarize(here), summary.summarize(there)
    for key in (
        "median_step_seconds",
        "parts",
        "buckets",
        "slowest_rank",
        "straggler",
        "steps",
        "ranks",
    ):
        assert a[key] == b[key], key
    assert [{k: v for k, v in r.items() if k != "history"} for r in a["per_rank"]] == [
        {k: v for k, v in r.items() if k != "history"} for r in b["per_rank"]
    ]


def test_unreachable_daemons_are_named_and_the_report_goes_on(
    slow_run: str, tmp_path: Path, node: tuple[Daemon, str]
) -> None:
    _, address = node
    job = tmp_path / "node" / "slow"
    shutil.copytree(slow_run, job)
    served(job, 4, "slow")
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)  # connects, never answers
    refused = socket.socket()
    refused.bind(("127.0.0.1", 0))  # bound, not listening: refused
    quiet, closed = (f"127.0.0.1:{s.getsockname()[1]}" for s in (silent, refused))
    try:
        started = time.monotonic()
        r = run.load((), [quiet, address, closed], findings=False)
        took = time.monotonic() - started
    finally:
        silent.close()
        refused.close()
    assert took < 8 and list(r.ranks) == [0, 1, 2, 3]
    assert len(r.problems) == 2, r.problems
    assert r.problems[0].startswith(
        f"{quiet}: http://{quiet}/history cannot be read (no answer within 3 s); "
        "its ranks are not in the report"
    )
    assert r.problems[1].startswith(f"{closed}: http://{closed}/history cannot be read (")
    assert "Connection refused" in r.problems[1] and "--serve-state" in r.problems[1]


def test_a_daemon_without_serve_state_or_from_before_history(tmp_path: Path) -> None:
    daemon = Daemon(str(tmp_path), gpus=False)
    refusing = serve(
        daemon,
        0,
        "127.0.0.1",
        {"/state": daemon_cli._not_served, "/history": daemon_cli._not_served},
    )
    older = serve(
        daemon, 0, "127.0.0.1", {"/state": daemon.routes.state_route}
    )  # /history: metrics, as any path
    try:
        assert get(f"http://127.0.0.1:{refusing.port}/history") == (
            404,
            b"this daemon does not serve state files or histories: start it with --serve-state\n",
        )
        out = remote.fetch_histories(
            [f"127.0.0.1:{refusing.port}", f"127.0.0.1:{older.port}"], str(tmp_path)
        )
    finally:
        refusing.close()
        older.close()
    assert (
        "HTTP 404: this daemon does not serve state files or histories: start it with --serve-state"
        in out.problems[0]
    )
    assert out.problems[1] == (
        f"http://127.0.0.1:{older.port}/history: not ddpmon's /history (a daemon of a ddpmon "
        "before histories were served? it answers with metrics): upgrade ddpmon there"
    )
    assert out.copies == {}


def test_the_deadline_cuts_a_history_where_it_got_to(
    slow_run: str, tmp_path: Path, node: tuple[Daemon, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, address = node
    job = tmp_path / "node" / "slow"
    shutil.copytree(slow_run, job)
    served(job, 4, "slow")
    # 15 pages of 20 steps a rank, 0.3 s each: the daemon cannot serve rank 0 whole (ranks
    # are read one after the other) within the deadline, however fast the machine, so the
    # cut falls inside rank 0 (with 50 steps a page it fell between two ranks on a busy one)
    monkeypatch.setattr(history, "PAGE_ROWS", 20)
    real = history.page

    def slow_page(*args, **kwargs):  # the daemon's worker takes 0.3 s a page
        time.sleep(0.3)
        return real(*args, **kwargs)

    monkeypatch.setattr(history, "page", slow_page)
    started = time.monotonic()
    r = run.load((), [address], findings=False, deadline=2.5)
    assert time.monotonic() - started < 5
    cut = [p for p in r.problems if "steps read within 2.5 s" in p]
    assert cut and all(
        "its plots stop at step" in p and "(--deadline waits longer)" in p for p in cut
    ), r.problems
    assert 0 < min(h.last_step for h in r.ranks.values()) < 300, (
        r.problems,
        [(h.path, h.last_step) for h in r.ranks.values()],
    )


def test_the_job_written_last_unless_one_is_asked_for(
    slow_run: str, even_run: str, tmp_path: Path, node: tuple[Daemon, str]
) -> None:
    _, address = node
    for age, name, source in ((60, "even", even_run), (0, "slow", slow_run)):
        shutil.copytree(source, tmp_path / "node" / name)
        served(tmp_path / "node" / name, 4, name)
        for path in history.list_files(str(tmp_path / "node" / name)):
            os.utime(path, (time.time() - age, time.time() - age))
    latest = run.load((), [address], findings=False)
    assert latest.job == "slow" and latest.notes == [
        "reading job 'slow', the one written last on the daemons (they also hold 'even'; --job picks another)"
    ]
    assert run.load((), [address], job="even", findings=False).job == "even"
    missing = remote.fetch_histories([address], str(tmp_path / "scratch"), job="nope")
    assert missing.problems == ["no daemon holds a history of job 'nope'; jobs there: even, slow"]
    # compare reads each run through the daemons: JOB@HOST:PORT
    a, _ = compare.load_side(f"even@{address}")
    b, _ = compare.load_side(f"slow@{address}")
    assert "rank 2 explains it" in "\n".join(compare.compare(a, b)["explanation"])


def _cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(args)
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["report", "--from", "node1"],
            (
                "ddpmon report: --from 'node1' is not valid: expected HOST:PORT of a node "
                "daemon (for example node1:9490)"
            ),
        ),
        (
            ["report", "--from", "node1:http"],
            "ddpmon report: --from 'node1:http' is not valid: Port could not be cast",
        ),
        (
            ["report", "--from", "node1:9490/state"],
            "is not valid: expected HOST:PORT alone, without a path (/state)",
        ),
        (
            ["report", "--from", "ftp://node1:9490"],
            "is not valid: the scheme is 'ftp'; a node daemon answers http or https",
        ),
        (
            ["report", "--from", "node1:9490", "--deadline", "0"],
            "argument --deadline: '0' must be a positive number",
        ),
        (
            ["compare", "no-such-run", "other"],
            (
                "ddpmon compare: no-such-run: no such directory or file; a run is a "
                "state directory, the JSON of `ddpmon report --json`, or [JOB@]HOST:PORT"
            ),
        ),
    ],
)
def test_bad_input_says_what_was_wrong_and_how_to_fix_it(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _cli(args, capsys)
    assert code == 2 and message in err, err


def test_report_from_the_command_line_names_an_unreachable_daemon(
    slow_run: str, tmp_path: Path, node: tuple[Daemon, str], capsys: pytest.CaptureFixture[str]
) -> None:
    _, address = node
    shutil.copytree(slow_run, tmp_path / "node" / "slow")
    served(tmp_path / "node" / "slow", 4, "slow")
    refused = socket.socket()
    refused.bind(("127.0.0.1", 0))
    closed = f"127.0.0.1:{refused.getsockname()[1]}"
    try:
        code, out, err = _cli(["report", "--from", address, "--from", closed, "--json"], capsys)
    finally:
        refused.close()
    assert code == 0, err
    assert f"ddpmon report: {closed}: http://{closed}/history cannot be read (" in err
    s = json.loads(out)
    assert s["ranks"] == 4 and s["steps"] == 300 and s["slowest_rank"]["rank"] == 2
    assert any(p.startswith(f"{closed}: ") for p in s["problems"])
