"""Report time and size against ranks x steps, from synthetic history stores.

    python benchmarks/report_scale.py                 # the grid of docs/report.md
    python benchmarks/report_scale.py --grid 8x20000 1024x2000

For each size: the time to write the synthetic stores (not part of the report), the bytes
per step of one rank's store, ``ddpmon report``'s time (load, summary, HTML; wall clock and
this process's CPU time, which a busy machine disturbs less) and the HTML
file's size. With chromium installed, also the page's drawing time in a headless browser
(``--browser``). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddpmon.report import html, run, summary  # noqa: E402
from ddpmon.state import history  # noqa: E402
from tools import synthetic  # noqa: E402

GRID = ("8x1000", "8x20000", "64x20000", "256x5000", "1024x2000")


def browser_ms(page: Path, tmp: Path) -> int | None:
    chromium = shutil.which("chromium")
    if not chromium:
        return None
    done = subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            f"--user-data-dir={tmp / 'profile'}",
            "--window-size=1280,1000",
            "--virtual-time-budget=20000",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    m = re.search(r'data-render-ms="(\d+)"', done.stdout)
    return int(m.group(1)) if m else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", nargs="*", default=list(GRID), metavar="RANKSxSTEPS")
    parser.add_argument(
        "--browser", action="store_true", help="also time the drawing in headless chromium"
    )
    args = parser.parse_args()
    print(
        "| ranks | steps | write stores | bytes/step (1 rank) | report (wall) | report (CPU) | HTML size | drawing (chromium) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for size in args.grid:
        ranks, steps = (int(x) for x in size.lower().split("x"))
        with tempfile.TemporaryDirectory() as tmp:
            tmp_path = Path(tmp)
            state = tmp_path / "state"
            t0 = time.perf_counter()
            synthetic.write_run(str(state), ranks, steps, slow_rank=ranks // 2, buckets=4)
            written = time.perf_counter() - t0
            per_step = history.bytes_per_step(history.path_for(str(state), 0))
            t0, c0 = time.perf_counter(), time.process_time()
            loaded = run.load([str(state)], findings=False)
            page_text = html.render(loaded, summary.summarize(loaded))
            page = tmp_path / "report.html"
            page.write_text(page_text)
            took, cpu = time.perf_counter() - t0, time.process_time() - c0
            draw = browser_ms(page, tmp_path) if args.browser else None
            print(
                f"| {ranks:,} | {steps:,} | {written:.1f} s | {per_step:.0f} | {took:.2f} s | {cpu:.2f} s | "
                f"{os.path.getsize(page) / 1e6:.2f} MB | {'-' if draw is None else f'{draw} ms'} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
