"""The HTML report in a real browser: headless Chromium (Debian's ``chromium``, installed by
``make test``) renders the report of a real 2-rank job, and of 8 ranks x 20,000 steps.

The page marks each plot it drew (``data-rendered``, series names, point count, largest
value); the test reads the DOM after the scripts ran and the browser's console log."""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpmon.state import history
from tests.support import harness
from tools import synthetic

pytestmark = pytest.mark.timeout(240)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip(
        "needs Debian's chromium package (`make chromium` installs it as root; "
        "`apt-get install chromium`)",
        allow_module_level=True,
    )

STEPS = 25
CHARTS = (
    "step_time",
    "parts",
    "exposed_comm",
    "bucket_time",
    "bucket_busbw",
    "straggler",
    "memory",
)


def render(page: Path, tmp: Path) -> tuple[str, list[str]]:
    """The DOM after the page's scripts ran, and the console messages Chromium logged."""
    done = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--disable-extensions",
            f"--user-data-dir={tmp / 'chromium-profile'}",
            "--enable-logging=stderr",
            "--v=0",
            "--window-size=1280,1000",
            "--virtual-time-budget=10000",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    console = [line for line in done.stderr.splitlines() if ":CONSOLE" in line]
    return done.stdout, console


def chart(dom: str, chart_id: str) -> dict[str, str]:
    m = re.search(rf'<div class="plot" id="chart-{chart_id}"([^>]*)>', dom)
    assert m, f"no plot {chart_id}"
    return dict(re.findall(r'data-([a-z-]+)="([^"]*)"', m.group(1)))


def test_the_console_check_can_fail(tmp_path):
    page = tmp_path / "bad.html"
    page.write_text(
        "<html><body><script>console.error('boom'); undefined_name();</script></body></html>"
    )
    _, console = render(page, tmp_path)
    assert any("boom" in line for line in console) and any(
        "undefined_name" in line for line in console
    )


def test_report_of_a_real_2_rank_job_renders_its_numbers(tmp_path):
    procs = harness.start_ranks(
        "train",
        2,
        tmp_path,
        env={"DDPMON_TEST_JOB": "browser"},
        args=(str(STEPS), "1", "0.02", "detach"),
        module="tests.distributed.report_worker",
    )
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.05)
    finally:
        harness.stop(procs)
    assert [p.returncode for p in procs] == [0, 0], harness.describe(
        harness.collect(procs, tmp_path)
    )
    state, page = tmp_path / "state", tmp_path / "report.html"
    done = subprocess.run(
        [sys.executable, "-m", "ddpmon", "report", str(state), "-o", str(page)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=harness.ROOT,
        env=dict(os.environ, PYTHONPATH=str(harness.ROOT)),
    )
    assert done.returncode == 0, done.stderr
    dom, console = render(page, tmp_path)
    assert console == [], console
    assert 'id="errors"></div>' in dom
    for chart_id in CHARTS:
        c = chart(dom, chart_id)
        assert c.get("rendered") == "yes", (chart_id, c)
        assert f'id="chart-{chart_id}"' in dom and "<canvas" in dom
    assert chart(dom, "gpu_util").get("rendered") == "empty"  # a CPU job: said so, not drawn
    step = chart(dom, "step_time")
    assert step["series-names"] == "rank 0|rank 1" and step["x-max"] == str(STEPS)
    assert int(step["points"]) == 2 * STEPS
    slowest = 0.0
    for rank in (0, 1):
        with sqlite3.connect(history.path_for(str(state), rank)) as db:
            slowest = max(slowest, db.execute("SELECT max(step_seconds) FROM steps").fetchone()[0])
    assert float(step["y-max"]) == pytest.approx(slowest * 1e3, rel=1e-3)  # the run's own numbers
    phases = chart(dom, "parts")
    names = phases["series-names"].split("|")
    assert {"forward", "backward"} <= set(names) and names.index("forward") < names.index(
        "backward"
    )
    buckets = chart(dom, "bucket_time")
    assert (
        int(buckets["points"]) == 2 * 4
    )  # 4 buckets (bucket_cap_mb=0.01), median and slowest rank
    assert re.search(r'data-key="steps">25<', dom) and re.search(r'data-key="ranks">2 of 2<', dom)
    assert re.search(
        r"rank 1, \d+% slower than the others over the whole run \(\d+ steps\), most of it in forward",
        dom,
    ), dom
    assert 'class="finding' in dom  # the doctor's findings close the report


def test_8_ranks_by_20000_steps_small_and_fast(tmp_path):
    synthetic.write_run(str(tmp_path / "state"), 8, 20_000, slow_rank=5)
    page = tmp_path / "big.html"
    done = subprocess.run(
        [sys.executable, "-m", "ddpmon", "report", str(tmp_path / "state"), "-o", str(page)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=harness.ROOT,
        env=dict(os.environ, PYTHONPATH=str(harness.ROOT)),
    )
    assert done.returncode == 0, done.stderr
    assert page.stat().st_size < 5_000_000
    dom, console = render(page, tmp_path)
    assert console == []
    ms = int(re.search(r'data-render-ms="(\d+)"', dom).group(1))
    assert ms < 2000, f"drawing took {ms} ms"
    step = chart(dom, "step_time")
    assert step["x-max"] == "20000" and step["series"] == "8"


def test_report_of_a_leaking_job_shows_each_ranks_memory_and_its_trend(tmp_path):
    """The 3-rank job of tests/distributed/memory_worker.py (``host``: rank 1 keeps 4 MiB a
    step, rank 2 rose by 300 MB once): the page plots each rank's RSS and lists each trend
    with the numbers the rank published; rank 1's creeps, with the doctor's finding."""
    from tests.distributed.memory_worker import LEAK

    harness.run_ranks("host", 3, tmp_path, timeout=200, module="tests.distributed.memory_worker")
    state, page = tmp_path / "state", tmp_path / "report.html"
    done = subprocess.run(
        [sys.executable, "-m", "ddpmon", "report", str(state), "-o", str(page)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=harness.ROOT,
        env=dict(os.environ, PYTHONPATH=str(harness.ROOT)),
    )
    assert done.returncode == 0, done.stderr
    dom, console = render(page, tmp_path)
    assert console == [], console
    plot = chart(dom, "memory")
    assert plot["rendered"] == "yes" and plot["series-names"] == "rank 0|rank 1|rank 2"
    largest = 0
    for rank in (0, 1, 2):
        with sqlite3.connect(history.path_for(str(state), rank)) as db:
            (rss,) = db.execute("SELECT max(process_resident_memory_bytes) FROM steps").fetchone()
            largest = max(largest, rss)
    assert float(plot["y-max"]) == pytest.approx(largest / 2**20, rel=1e-3)
    assert re.search(r"rank 1 grows \d\.\d MB a step \([\d.]+ GB an hour\)", dom), dom

    def row(rank: int) -> str:
        found = re.search(
            rf'<tr data-rank="{rank}" data-process="rank" data-kind="rss" '
            rf'data-creeping="(yes|no)">(.*?)</tr>',
            dom,
        )
        assert found, f"no RSS row for rank {rank}"
        return found.group(1), found.group(2)

    creeps, cells = row(1)
    published = next(
        t
        for t in json.loads((state / "rank-1.json").read_text())["memory"]["trends"]
        if (t["process"], t["kind"]) == ("rank", "rss")
    )
    per_step = float(re.search(r'data-key="per_step">([\d.]+) MB<', cells).group(1))
    now = float(re.search(r'data-key="bytes">([\d.]+) MB<', cells).group(1))
    assert creeps == "yes" and per_step == pytest.approx(
        published["bytes_per_step"] / 1e6, abs=0.05
    )
    assert per_step == pytest.approx(LEAK / 1e6, rel=0.15)
    assert now == pytest.approx(published["bytes"] / 1e6, abs=0.05)
    assert re.search(r'data-key="left">[^<]+ before the (host|cgroup)', cells)
    assert row(0)[0] == "no" and row(2)[0] == "no"  # rank 2 rose once and stayed flat
    finding = re.search(r'<p class="finding warning" data-kind="memory_creep">([^<]*)<', dom)
    assert finding and finding.group(1).startswith("rank 1: resident memory grows ")
