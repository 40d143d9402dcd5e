"""The shipped alert and recording rules, and the overview board's queries, over a job of
1,000 or 10,000 ranks: series backfilled into a real Prometheus, each rule timed.

Each rank has the series a rank exports in summary detail (what ``metrics_detail="auto"``
gives past 256 ranks; the names of a real scrape, benchmarks/series.py) and its node
daemon's, 8 ranks a node, every 30 s over 15 minutes; Prometheus' own ``up`` per target;
and the recorded series the alerts read (deploy/prometheus/ddpmon-rules.yml), written as
Prometheus would have recorded them for this healthy job (the records of ranks that wait,
hang or went silent have no series), so that an alert that reads a record reads as many
series as on a live server. ``promtool tsdb
create-blocks-from openmetrics`` turns the file into blocks; Prometheus opens them; each
rule's expression runs as an instant query at the data's end (what one evaluation does;
inside ``count()``, so that the time is not spent writing series out as JSON), the fastest
of 7, the rule files given taken in turns; each overview panel's queries as range queries over the 15 minutes (every rank
selected, ``$__rate_interval`` = 1m, a 15 s step), the median of 3 runs each.

    python benchmarks/rules_scale.py --ranks 1000 10000 [--rules FILE ...] [--keep DIR]
    python benchmarks/rules_scale.py --reuse DIR/ddpmon-rules-10000-* [--rules FILE ...]
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ddpmon import dashboards  # noqa: E402
from ddpmon.metrics.catalog import DAEMON_ACTIVITIES, RANK_ACTIVITIES  # noqa: E402

STEP = 30  # seconds between samples
SPAN = 15 * 60  # seconds of data
RANKS_PER_NODE = 8
PHASES = ("data_wait", "h2d", "forward", "backward", "exposed_comm", "optimizer", "other")
SHARE = dict(zip(PHASES, (0.05, 0.0, 0.25, 0.45, 0.1, 0.1, 0.05)))
STEP_BOUNDS = ("0.1", "0.5", "1.0", "5.0", "30.0", "+Inf")
JOB = "big"


def lines_for(rank: int, t: float, step_s: float) -> list[str]:
    """One rank's samples at ``t`` (seconds since the start): its own and its daemon's."""
    node, local = divmod(rank, RANKS_PER_NODE)
    inst = f'instance="node{node}:{9500 + local}"'
    base = f'job="{JOB}",rank="{rank}"'
    lab = f"{base},{inst}"
    dlab = f'{base},instance="node{node}:9490"'
    steps = t / step_s
    ts = f" {T0 + t:.0f}"
    out = [
        f'ddpmon_rank_info{{{lab},host="node{node}",world_size="N",local_rank="{local}"}} 1',
        f"ddpmon_steps_total{{{lab}}} {steps:.0f}",
        f"ddpmon_samples_total{{{lab}}} {steps * 32:.0f}",
        f"ddpmon_unused_parameters{{{lab}}} 0",
        f"ddpmon_last_progress_timestamp_seconds{{{lab}}} {T0 + t:.0f}",
        f"ddpmon_hang_suspected{{{lab}}} 0",
        f"ddpmon_collectives_in_flight{{{lab}}} 0",
    ]
    out += [
        f'ddpmon_activity{{{lab},activity="{a}"}} {int(a == "stepping")}' for a in RANK_ACTIVITIES
    ]
    out += [
        f'ddpmon_step_phase_seconds_total{{{lab},phase="{p}"}} {t * SHARE[p]:.3f}' for p in PHASES
    ]
    out += [
        f'ddpmon_step_seconds_bucket{{{lab},le="{le}"}} {steps if float(le) >= step_s else 0:.0f}'
        for le in STEP_BOUNDS
    ]
    out += [
        f"ddpmon_step_seconds_count{{{lab}}} {steps:.0f}",
        f"ddpmon_step_seconds_sum{{{lab}}} {t:.3f}",
    ]
    for name, total in (("exposed_comm", t * 0.1), ("allreduce", t * 0.3)):
        extra = ',bucket="all"' if name == "allreduce" else ""
        out += [
            f'ddpmon_{name}_seconds_bucket{{{lab}{extra},le="+Inf"}} {steps:.0f}',
            f"ddpmon_{name}_seconds_count{{{lab}{extra}}} {steps:.0f}",
            f"ddpmon_{name}_seconds_sum{{{lab}{extra}}} {total:.3f}",
        ]
    out += [
        f'ddpmon_allreduce_bytes_total{{{lab},bucket="all"}} {steps * 1e9:.0f}',
        f'ddpmon_bucket_size_bytes{{{lab},bucket="all"}} 1000000000',
        f'ddpmon_bucket_ready_seconds{{{lab},bucket="all"}} {step_s * 0.7:.3f}',
        f'ddpmon_allreduce_bus_bandwidth_bytes_per_second{{{lab},bucket="all"}} 5e10',
        f"ddpmon_rank_up{{{dlab}}} 1",
        f"ddpmon_rank_last_progress_timestamp_seconds{{{dlab}}} {T0 + t:.0f}",
        f"ddpmon_rank_hang_suspected{{{dlab}}} 0",
        f"ddpmon_hang_aborts_total{{{dlab}}} 0",
    ]
    out += [
        f'ddpmon_rank_activity{{{dlab},activity="{a}"}} {int(a == "stepping")}'
        for a in DAEMON_ACTIVITIES
    ]
    busy = step_s * 0.9
    out += [
        f"job_rank:ddpmon_busy_seconds_per_step:rate5m{{{base}}} {busy:.4f}",
        f"job_rank:ddpmon_straggler_score:rate5m{{{base}}} {busy / 0.45 - 1:.4f}",
        f'up{{job="ddpmon-ranks",{inst}}} 1',
    ]
    if local == 0:
        out += [
            f'ddpmon_daemon_info{{instance="node{node}:9490",host="node{node}",version="x",gpus="8"}} 1',
            f'up{{job="ddpmon-daemons",instance="node{node}:9490"}} 1',
        ]
    return [line + ts for line in out]


def job_lines(t: float, ranks: int) -> list[str]:
    """The job's recorded series at ``t``, with the values a healthy job would give."""
    ts = f" {T0 + t:.0f}"
    j = f'job="{JOB}"'
    out = [
        f"job:ddpmon_steps_per_second:rate5m{{{j}}} 2",
        f"job:ddpmon_step_seconds:mean_rate5m{{{j}}} 0.5",
        f"job:ddpmon_exposed_comm_ratio:rate10m{{{j}}} 0.1",
        f"job:ddpmon_ranks_reporting:count{{{j}}} {ranks}",
        f"job:ddpmon_unused_parameters:max{{{j}}} 0",
        f'job_bucket:ddpmon_allreduce_seconds:mean_rate5m{{{j},bucket="all"}} 0.15',
    ]
    out += [
        f'job_phase:ddpmon_step_phase_seconds_per_step:rate5m{{{j},phase="{p}"}} {SHARE[p] / 2}'
        for p in PHASES
    ]
    return [line + ts for line in out]


T0 = 0.0


def write_openmetrics(path: Path, ranks: int) -> int:
    """The job's samples, grouped by series (each series' samples in time order)."""
    times = [i * STEP for i in range(SPAN // STEP + 1)]
    by_series: dict[str, list[str]] = {}
    for rank in range(ranks):
        step_s = 0.55 if rank == 7 else 0.5  # one straggler
        for t in times:
            for line in lines_for(rank, t, step_s):
                key, _, rest = line.rpartition("} ")
                by_series.setdefault(key, []).append(rest)
        if rank % 1000 == 999:
            _flush(path, by_series)
    for t in times:
        for line in job_lines(t, ranks):
            key, _, rest = line.rpartition("} ")
            by_series.setdefault(key, []).append(rest)
    return _flush(path, by_series, end=True)


_written = 0


def _flush(path: Path, by_series: dict[str, list[str]], end: bool = False) -> int:
    """Append the collected series to ``path`` and forget them (the file stays grouped by
    series; promtool asks no more)."""
    global _written
    with open(path, "a") as f:
        for key, values in by_series.items():
            f.write("".join(f"{key}}} {v}\n" for v in values))
            _written += 1
        if end:
            f.write("# EOF\n")
    by_series.clear()
    return _written


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, **params: str) -> dict:
    with urllib.request.urlopen(f"{url}?{urllib.parse.urlencode(params)}", timeout=300) as r:
        return json.loads(r.read())


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def timed(url: str, **params: str) -> tuple[float, int]:
    """Median seconds of 3 runs of one query, and the series it returned."""
    times, result = [], {}
    for _ in range(3):
        start = time.perf_counter()
        result = get(url, **params)
        times.append(time.perf_counter() - start)
        if result.get("status") != "success":
            raise SystemExit(f"{params}: {result}")
    return statistics.median(times), len(result["data"]["result"])


def evaluated(api: str, expr: str, at: str) -> tuple[float, int]:
    """One evaluation of a rule's expression: its seconds and the series it gives. Asked
    for as ``count(...)``: a rule appends its series to the database, where a query of
    10,000 would spend longer writing them out as JSON than computing them."""
    start = time.perf_counter()
    found = get(f"{api}/query", query=f"count({expr})", time=at)
    seconds = time.perf_counter() - start
    if found.get("status") != "success":
        raise SystemExit(f"{expr}: {found}")
    result = found["data"]["result"]
    return seconds, int(float(result[0]["value"][1])) if result else 0


def grafana(expr: str) -> str:
    return (
        expr.replace("$__rate_interval", "1m")
        .replace("$__range", "15m")
        .replace("$__interval", "15s")
        .replace('"$job"', f'"{JOB}"')
        .replace('"$rank"', '".*"')
    )


def backfill(ranks: int, keep: Path | None) -> tuple[Path, dict]:
    """A new work directory with the job's blocks in ``data/`` (and ``meta.json``: when the
    data starts, how much of it, what it took)."""
    global T0, _written
    _written = 0
    T0 = float(int(time.time()) - SPAN - 3600)
    work = Path(tempfile.mkdtemp(prefix=f"ddpmon-rules-{ranks}-", dir=keep))
    data, om = work / "data", work / "series.om"
    data.mkdir()
    start = time.perf_counter()
    series = write_openmetrics(om, ranks)
    generated = time.perf_counter() - start
    start = time.perf_counter()
    subprocess.run(
        ["promtool", "tsdb", "create-blocks-from", "openmetrics", str(om), str(data)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    backfilled = time.perf_counter() - start
    om.unlink()
    meta = {
        "t0": T0,
        "ranks": ranks,
        "series": series,
        "generate_s": generated,
        "backfill_s": backfilled,
    }
    (work / "meta.json").write_text(json.dumps(meta))
    return work, meta


def measure(
    ranks: int,
    rule_files: list[Path],
    keep: Path | None,
    board: bool = True,
    reuse: Path | None = None,
) -> dict:
    global T0
    if reuse is None:
        work, meta = backfill(ranks, keep)
    else:  # a kept work directory: its blocks as they are
        work, meta = reuse, json.loads((reuse / "meta.json").read_text())
        T0 = meta["t0"]
    data = work / "data"
    port = free_port()
    (work / "prometheus.yml").write_text("global: {scrape_interval: 15s}\n")
    prom = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={work / 'prometheus.yml'}",
            f"--storage.tsdb.path={data}",
            "--storage.tsdb.retention.time=10y",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(work / "prometheus.log", "w"),
    )
    api = f"http://127.0.0.1:{port}/api/v1"
    out: dict = {k: v for k, v in meta.items() if k != "t0"}
    try:
        deadline = time.monotonic() + 300
        while not ready(f"http://127.0.0.1:{port}/-/ready"):
            if time.monotonic() > deadline or prom.poll() is not None:
                log = (work / "prometheus.log").read_text()[-2000:]
                raise SystemExit(f"prometheus did not start: {log}")
            time.sleep(1)
        at = str(T0 + SPAN)
        found = get(f"{api}/query", query=f'count(ddpmon_rank_info{{job="{JOB}"}})', time=at)
        out["ranks_seen"] = found["data"]["result"][0]["value"][1]
        # every rule file's rules in turn, 7 times: what the others run on a shared machine
        # meanwhile weighs on each file alike, and the fastest of a rule's 7 runs stands
        files = {
            str(path): [
                (group["name"], rule.get("alert") or rule["record"], rule["expr"])
                for group in yaml.safe_load(path.read_text())["groups"]
                for rule in group["rules"]
            ]
            for path in rule_files
        }
        runs: dict[tuple[str, str], list[float]] = {}
        found: dict[tuple[str, str], int] = {}
        for _ in range(7):
            for path, rules in files.items():
                for _group, name, expr in rules:
                    seconds, found[path, name] = evaluated(api, expr, at)
                    runs.setdefault((path, name), []).append(seconds)
        for path, rules in files.items():
            per_rule = {name: (min(runs[path, name]), found[path, name]) for _, name, _ in rules}
            per_group: dict[str, float] = {}
            for group, name, _ in rules:
                per_group[group] = per_group.get(group, 0.0) + per_rule[name][0]
            out[path] = {
                "total_s": sum(s for s, _ in per_rule.values()),
                # Prometheus evaluates the groups side by side: one evaluation of every rule
                # takes the slowest group's time where there are cores for them all
                "per_group_s": per_group,
                "slowest": sorted(((s, n) for n, (s, _) in per_rule.items()), reverse=True)[:4],
                "per_rule": per_rule,
            }
        overview = dashboards.build()["ddp-job-overview.json"] if board else {"panels": []}
        panels = {}
        for panel in dashboards.panels(overview):
            total = 0.0
            for target in panel.get("targets", []):
                s, _ = timed(
                    f"{api}/query_range",
                    query=grafana(target["expr"]),
                    start=str(T0 + 60),
                    end=at,
                    step="15",
                )
                total += s
            panels[panel["title"]] = total
        out["board_total_s"] = sum(panels.values())
        out["board_slowest"] = sorted(((s, t) for t, s in panels.items()), reverse=True)[:4]
    finally:
        prom.terminate()
        prom.wait(60)
        if keep is None and reuse is None:
            shutil.rmtree(work, ignore_errors=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument(
        "--rules",
        type=Path,
        nargs="+",
        default=[ROOT / "deploy/prometheus/ddpmon-rules.yml"],
        help="rule files to time (another release's, to compare)",
    )
    parser.add_argument("--keep", type=Path, help="work in (and keep) this directory")
    parser.add_argument(
        "--reuse",
        type=Path,
        nargs="+",
        help="time the rules over the blocks of these kept work directories (--keep) "
        "instead of backfilling anew (--ranks is ignored)",
    )
    parser.add_argument(
        "--no-board", action="store_true", help="time the rules only (the board takes longest)"
    )
    args = parser.parse_args()
    if shutil.which("promtool") is None or shutil.which("prometheus") is None:
        raise SystemExit("needs prometheus and promtool on PATH (make prometheus)")
    for ranks, reuse in [(0, r) for r in args.reuse or []] or [(n, None) for n in args.ranks]:
        out = measure(ranks, args.rules, args.keep, not args.no_board, reuse)
        print(json.dumps(out, indent=1), flush=True)


if __name__ == "__main__":
    main()
