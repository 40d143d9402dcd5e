"""``ddpmon report --from`` against a real ``ddpmon daemon`` process serving synthetic histories
(no job): bounded pages, the same figures as from the directory, ``compare`` reading a run
through it, and a daemon started without ``--serve-state`` refusing. (A real DDP job: tests/distributed/test_report_job.py; the parsing
and the bounds alone: tests/unit/test_history_served.py.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ddpmon.state import history
from tests.support import states
from tests.support.commands import ROOT, env, get, start_daemon, terminate
from tools import synthetic

pytestmark = pytest.mark.timeout(180)

BIG, WIDE = 6_000, 600  # steps: 2 ranks of 4 buckets; 1 rank of 256 buckets


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """A node's root with two jobs, ``big`` and ``wide``, served by a real daemon."""
    root = tmp_path_factory.mktemp("node")
    synthetic.write_run(str(root / "big"), 2, BIG, job="big", slow_rank=1, gpu=False)
    synthetic.write_run(str(root / "wide"), 1, WIDE, job="wide", buckets=256, gpu=False)
    states.restart_clock()
    for job, ranks in (("big", 2), ("wide", 1)):
        for rank in range(ranks):
            states.write(root / job, states.state(rank, ranks, job=job))
    daemon, port = start_daemon(
        "--state-dir", str(root), "--serve-state", "--no-gpu", "--node-local"
    )
    yield root, f"127.0.0.1:{port}"
    terminate(daemon)


def ddpmon(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ddpmon", *args],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def pages(address: str, job: str, rank: int) -> list[tuple[int, dict[str, Any]]]:
    """Every page of a rank's history: (body bytes, page)."""
    out, since = [], 0
    while since is not None:
        status, body = get(f"http://{address}/history?job={job}&rank={rank}&since={since}")
        assert status == 200, body
        out.append((len(body), json.loads(body)))
        since = out[-1][1]["next_since"]
    return out


def test_pages_are_bounded_and_hold_the_files_values(node: tuple[Path, str]) -> None:
    root, address = node
    index = json.loads(get(f"http://{address}/history")[1])
    assert [(h["job"], h["rank"], h["rows"]) for h in index["histories"]] == [
        ("big", 0, BIG),
        ("big", 1, BIG),
        ("wide", 0, WIDE),
    ]
    for rank in (0, 1):
        got = pages(address, "big", rank)
        assert len(got) == 2 and all(len(p["rows"]) <= history.PAGE_ROWS for _, p in got)
        assert all(size <= history.PAGE_BYTES + 64 * 1024 for size, _ in got)
        assert got[0][1]["identity"]["rank"] == rank and got[0][1]["job"] == "big"
        rows = [r for _, p in got for r in p["rows"]]
        local = history.read(history.path_for(str(root / "big"), rank), decode_buckets=False)[
            "steps"
        ]
        for i, column in enumerate(got[0][1]["columns"]):
            assert [r[i] for r in rows] == local[column], column  # every value, to the last digit
    wide = pages(address, "wide", 0)
    assert len(wide) >= 2 and all(len(p["rows"]) < WIDE for _, p in wide)
    assert all(size <= history.PAGE_BYTES + 64 * 1024 for size, _ in wide), [s for s, _ in wide]
    assert sum(len(p["rows"]) for _, p in wide) == WIDE


def charts(page: str) -> Any:
    found = re.search(
        r'<script id="ddpmon-data" type="application/json">(.*?)</script>', page, re.DOTALL
    )
    assert found
    return json.loads(found.group(1))["charts"]


def test_report_from_the_daemon_is_the_report_of_the_directory(
    node: tuple[Path, str], tmp_path: Path
) -> None:
    root, address = node
    near = ddpmon("report", str(root / "big"), "--json")
    far = ddpmon("report", "--from", address, "--job", "big", "--json")
    assert near.returncode == 0 and far.returncode == 0, near.stderr + far.stderr
    a, b = json.loads(near.stdout), json.loads(far.stdout)
    assert b["ranks"] == 2 and b["steps"] == BIG and b["slowest_rank"]["rank"] == 1
    for key in (
        "median_step_seconds",
        "parts",
        "exposed_comm_share",
        "buckets",
        "slowest_rank",
        "straggler",
        "step_bin",
        "start_unix",
        "end_unix",
    ):
        assert a[key] == b[key], key
    # (the status is the doctor's, from the hand-made state files: it ages with the test)
    assert [
        {k: v for k, v in r.items() if k not in ("history", "status")} for r in a["per_rank"]
    ] == [{k: v for k, v in r.items() if k not in ("history", "status")} for r in b["per_rank"]]
    assert [r["history"] for r in b["per_rank"]] == [
        f"{address}/rank-{r}.history.sqlite" for r in (0, 1)
    ]
    assert ddpmon("report", str(root / "big"), "-o", str(tmp_path / "near.html")).returncode == 0
    done = ddpmon("report", "--from", address, "--job", "big", "-o", str(tmp_path / "far.html"))
    assert done.returncode == 0, done.stderr
    assert charts((tmp_path / "near.html").read_text()) == charts(
        (tmp_path / "far.html").read_text()
    )
    # without --job: the job written last, and the others named
    os.utime(history.path_for(str(root / "wide"), 0))
    latest = ddpmon("report", "--from", address, "--json")
    assert json.loads(latest.stdout)["job"] == "wide"
    assert (
        "reading job 'wide', the one written last on the daemons (they also hold 'big'"
        in latest.stderr
    )


def test_a_daemon_without_serve_state_refuses(tmp_path: Path, node: tuple[Path, str]) -> None:
    root, _ = node
    daemon, port = start_daemon("--state-dir", str(root), "--no-gpu", "--node-local")
    try:
        assert get(f"http://127.0.0.1:{port}/history") == (
            404,
            b"this daemon does not serve state files or histories: start it with --serve-state\n",
        )
        assert get(f"http://127.0.0.1:{port}/history?rank=0")[0] == 404
        done = ddpmon("report", "--from", f"127.0.0.1:{port}", "--json")
    finally:
        terminate(daemon)
    assert done.returncode == 2 and done.stdout == ""
    assert (
        f"127.0.0.1:{port}: http://127.0.0.1:{port}/history cannot be read (HTTP 404: this daemon does not "
        "serve state files or histories: start it with --serve-state)"
    ) in done.stderr


def test_compare_reads_a_run_through_the_daemon(node: tuple[Path, str]) -> None:
    root, address = node
    done = ddpmon("compare", f"big@{address}", str(root / "big"), "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["a"]["sources"] == [address] and result["a"]["steps"] == BIG
    assert result["explanation"][0].startswith("step time unchanged")  # the same run, read two ways
    assert all(r["change"] in (0.0, None) for r in result["rows"]), result["rows"]
