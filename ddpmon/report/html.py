"""``ddpmon report``'s HTML: one self-contained file (no network fetch), plots drawn by uPlot.

uPlot (MIT, about 50 KB minified, ``vendor/``) and the data are inlined; the page needs
nothing but a browser. Every plot has axes with units, a legend with the values under the
cursor, and zoom (drag across it; double-click resets). Per-step series are averaged into
at most ``run.MAX_POINTS`` bins per rank, and at most ``MAX_LINES`` ranks are drawn one by
one (the slowest, by how much slower they are) next to the median and the maximum of all
ranks, so a report of 1,024 ranks stays small and fast (docs/report.md).
"""

from __future__ import annotations

import datetime
import html
import json
import statistics
from importlib import resources
from typing import Any

from .. import memory, steps
from ..doctor.report import attempt_line
from ..formats import format_bytes, format_seconds, format_time_left
from ..goodput import text as goodput_text
from ..steps import PART_LABELS, PART_TABLE, median_of_others
from .run import Run
from .summary import missing_text, pct, throughput_text

MAX_LINES = 16


def _vendor(name: str) -> str:
    return (resources.files(__package__) / "vendor" / name).read_text(encoding="utf-8")


def _r(v: Any, scale: float = 1.0) -> Any:
    """A number kept to 4 significant digits (the file stays small), None as null."""
    if not isinstance(v, (int, float)):
        return None
    return float(f"{v * scale:.4g}")


def _x_steps(run: Run, bins: list[int]) -> list[int]:
    return [(b + 1) * run.stride for b in bins]


def _aligned(run: Run) -> tuple[list[int], dict[int, dict[int, int]]]:
    """The union of bins over ranks, and for each rank where each bin sits in its columns."""
    all_bins = sorted({b for h in run.ranks.values() for b in h.binned.get("bin", [])})
    where = {
        rank: {b: i for i, b in enumerate(h.binned.get("bin", []))} for rank, h in run.ranks.items()
    }
    return all_bins, where


def _series(
    run: Run, bins: list[int], where: dict[int, dict[int, int]], column: str
) -> dict[int, list[Any]]:
    """One binned column per rank, aligned on ``bins`` (None where a rank has no steps)."""
    out = {}
    for rank, h in run.ranks.items():
        values = h.binned[column]
        if h.binned["bin"] == bins:  # the usual case: every rank has every bin
            out[rank] = list(values)
        else:
            pos = where[rank]
            out[rank] = [values[pos[b]] if b in pos else None for b in bins]
    return out


def _lines(per_rank: dict[int, list[Any]], chosen: list[int], scale: float) -> list[dict[str, Any]]:
    """One series per chosen rank, plus the median and maximum of all ranks when not all drawn."""
    series = [{"name": f"rank {r}", "values": [_r(v, scale) for v in per_rank[r]]} for r in chosen]
    if len(chosen) < len(per_rank):
        columns = list(zip(*per_rank.values()))
        med = [
            statistics.median(k) if (k := [v for v in col if v is not None]) else None
            for col in columns
        ]
        top = [max(k) if (k := [v for v in col if v is not None]) else None for col in columns]
        series.append(
            {
                "name": f"median of {len(per_rank)} ranks",
                "values": [_r(v, scale) for v in med],
                "dash": True,  # type: ignore[dict-item]
            }
        )
        series.append(
            {
                "name": f"max of {len(per_rank)} ranks",
                "values": [_r(v, scale) for v in top],
                "dash": True,  # type: ignore[dict-item]
            }
        )
    return series


def _slower(busy: dict[int, list[Any]]) -> dict[int, list[Any]]:
    """Per bin, how much slower each rank is than the median of the other ranks: the busy
    time (step less exposed communication) on the scale of ``steps.busy_ratio``."""
    ranks = list(busy)
    out: dict[int, list[Any]] = {r: [] for r in ranks}
    for column in zip(*(busy[r] for r in ranks)):
        values = sorted(v for v in column if v is not None)
        for r, v in zip(ranks, column):
            mid = median_of_others(values, v) if v is not None and len(values) > 1 else None
            out[r].append(steps.busy_ratio(v, mid) if mid else None)
    return out


def charts(run: Run, summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The plots, as data for the page's script."""
    bins, where = _aligned(run)
    x = _x_steps(run, bins)
    slower = {r["rank"]: r.get("slower") or 0.0 for r in summary["per_rank"]}
    chosen = sorted(run.ranks, key=lambda r: -slower.get(r, 0.0))[:MAX_LINES]
    chosen.sort()
    bin_note = (
        f"each point is the mean of {run.stride} steps" if run.stride > 1 else "one point per step"
    )
    step_x = {"label": "step", "values": x}
    out: list[dict[str, Any]] = []

    step = _series(run, bins, where, "step_seconds")
    out.append(
        {
            "id": "step_time",
            "title": "Step time per rank",
            "kind": "line",
            "x": step_x,
            "y_label": "step time",
            "unit": "ms",
            "series": _lines(step, chosen, 1e3),
            "note": bin_note,
        }
    )

    # The parts of the step: stacked medians per rank.
    rows = summary["per_rank"]
    shown = [p for p in PART_TABLE if any(r["parts"].get(p.name) for r in rows)]
    out.append(
        {
            "id": "parts",
            "title": "Parts of the step per rank (median step)",
            "kind": "stack",
            "x": {"label": "rank", "values": [r["rank"] for r in rows]},
            "y_label": "time per step",
            "unit": "ms",
            "series": [
                {
                    "name": p.label,
                    "colour": p.colour,
                    "values": [_r(r["parts"].get(p.name), 1e3) for r in rows],
                }
                for p in shown
            ],
            "note": "median over steps of each part; 'other' is what the measured parts leave of the step",
        }
    )

    exposed = _series(run, bins, where, "exposed_comm_seconds")
    if any(v is not None for vs in exposed.values() for v in vs):
        out.append(
            {
                "id": "exposed_comm",
                "title": "Exposed communication per rank",
                "kind": "line",
                "x": step_x,
                "y_label": "exposed communication",
                "unit": "ms",
                "series": _lines(exposed, chosen, 1e3),
                "note": "communication that backward compute did not hide; " + bin_note,
            }
        )

    buckets = summary["buckets"]
    if buckets:
        bx = {"label": "bucket", "values": [b["index"] for b in buckets]}
        out.append(
            {
                "id": "bucket_time",
                "title": "All-reduce time per bucket",
                "kind": "bars",
                "x": bx,
                "y_label": "all-reduce time",
                "unit": "ms",
                "series": [
                    {
                        "name": "median over steps and ranks",
                        "values": [_r(b["median_seconds"], 1e3) for b in buckets],
                    },
                    {
                        "name": "slowest rank's median",
                        "values": [_r(b["max_rank_median_seconds"], 1e3) for b in buckets],
                    },
                ],
                "note": "launch (bucket ready) to completion",
            }
        )
        out.append(
            {
                "id": "bucket_busbw",
                "title": "Bus bandwidth per bucket",
                "kind": "bars",
                "x": bx,
                "y_label": "bus bandwidth",
                "unit": "GB/s",
                "series": [
                    {
                        "name": "at the median all-reduce time",
                        "values": [_r(b["busbw_bytes_per_second"], 1e-9) for b in buckets],
                    },
                ],
                "note": "nccl-tests' bus bandwidth: bytes / time x 2(n-1)/n",
            }
        )

    busy = {
        r: [None if s is None else max(0.0, s - (e or 0.0)) for s, e in zip(step[r], exposed[r])]
        for r in step
    }
    out.append(
        {
            "id": "straggler",
            "title": "How much slower each rank is",
            "kind": "line",
            "x": step_x,
            "y_label": "slower than the others",
            "unit": "%",
            "series": _lines(_slower(busy), chosen, 100.0),
            "note": "the rank's busy time (step time minus exposed communication) against the median "
            "of the other ranks: 0 = typical, 25 = 25% slower; " + bin_note,
        }
    )

    util = _series(run, bins, where, "gpu_utilization_ratio")
    has_util = any(v is not None for vs in util.values() for v in vs)
    out.append(
        {
            "id": "gpu_util",
            "title": "GPU utilisation per rank",
            "kind": "line",
            "x": step_x,
            "y_label": "GPU utilisation",
            "unit": "%",
            "series": _lines(util, chosen, 100.0) if has_util else [],
            "note": bin_note if has_util else "not recorded: no GPU (or no NVML) on these ranks",
        }
    )
    out += _memory_charts(run, summary, bins, where, step_x, chosen, bin_note)
    return out


MEMORY_CHARTS = (
    ("memory", "process_resident_memory_bytes", "rss", "resident memory (RSS) of the process"),
    ("torch_memory", "torch_memory_allocated_bytes", "torch_allocated", "memory held by tensors"),
    ("gpu_memory", "gpu_memory_used_bytes", None, "GPU memory used (every process on it)"),
)
"""The memory plots: (id, history column, the trend shown beside it, what it is)."""


def _memory_charts(
    run: Run,
    summary: dict[str, Any],
    bins: list[int],
    where: dict[int, dict[int, int]],
    step_x: dict[str, Any],
    chosen: list[int],
    bin_note: str,
) -> list[dict[str, Any]]:
    """A rank's memory over the run, one plot per reading recorded (the host's RSS always,
    torch's allocated and the GPU's used memory on a GPU), each noting the ranks whose
    trend of it creeps."""
    out = []
    for chart_id, column, kind, label in MEMORY_CHARTS:
        mem = _series(run, bins, where, column)
        if not any(v is not None for vs in mem.values() for v in vs):
            continue
        creeping = [
            f"rank {r['rank']} grows {_rate(t)}"
            for r in summary["per_rank"]
            for t in r["memory"]["creeping"]
            if t["kind"] == kind and t["process"] == "rank"
        ]
        out.append(
            {
                "id": chart_id,
                "title": f"Memory per rank: {label}",
                "kind": "line",
                "x": step_x,
                "y_label": label,
                "unit": "MiB",
                "series": _lines(mem, chosen, 1 / 2**20),
                "note": "; ".join(
                    [f"{label}; the largest reading of each point's steps"] + creeping
                ),
            }
        )
    return out


def _rate(t: dict[str, Any]) -> str:
    """``4.0 MB a step (14.40 GB an hour)``."""
    text = f"{format_bytes(t['bytes_per_step'] or 0)} a step"
    if t.get("bytes_per_second"):
        text += f" ({format_bytes(t['bytes_per_second'] * 3600)} an hour)"
    return text


def render(run: Run, summary: dict[str, Any]) -> str:
    """The whole report page."""
    body = _BODY.format(
        summary=_summary_html(summary),
        ranks=_ranks_html(summary),
        findings=_findings_html(summary),
        memory=_memory_html(summary),
        goodput=_goodput_html(summary),
        attempts=_attempts_html(summary),
        captures=_captures_html(summary),
    )
    return page(f"ddpmon report: {summary['job']}", body, charts(run, summary))


def page(title: str, body: str, chart_specs: list[dict[str, Any]]) -> str:
    """A self-contained page: ``body`` (HTML with a ``<div id="charts">``) and the plots."""
    payload = json.dumps({"charts": chart_specs}, separators=(",", ":"), allow_nan=False).replace(
        "</", "<\\/"
    )
    return _PAGE.format(
        title=html.escape(title),
        css=_vendor("uPlot.min.css"),
        style=_STYLE,
        uplot=_vendor("uPlot.iife.min.js"),
        script=_SCRIPT,
        data=payload,
        body=body,
    )


def _t(unix: float | None) -> str:
    if unix is None:
        return "-"
    return datetime.datetime.fromtimestamp(unix, datetime.timezone.utc).strftime(
        "%Y-%m-%d %H:%M:%S UTC"
    )


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return str(datetime.timedelta(seconds=round(seconds)))


def _summary_html(s: dict[str, Any]) -> str:
    e = html.escape
    slow = s.get("slowest_rank") or {}
    slow_text = "-"
    if slow:
        slow_text = f"rank {slow['rank']}"
        if slow.get("score") is not None:
            slow_text += f", {steps.slower(slow['score'])} than the others"
            if slow.get("steps"):
                slow_text += f" {steps.over(slow['steps'], whole=True)}"
        if slow.get("part"):
            slow_text += f", most of it in {PART_LABELS[slow['part']]} (+{format_seconds(slow.get('excess_seconds'))})"
    verdict = s.get("verdict") or "-"
    run_slow = s.get("straggler")
    if run_slow and run_slow["named"] and verdict != "straggler":  # the doctor reads the last steps
        cause = f", most of it in {PART_LABELS[run_slow['cause']]}" if run_slow["cause"] else ""
        verdict += (
            f"; over the whole run rank {run_slow['rank']} was a straggler, "
            f"{steps.slower(run_slow['score'])} than the others{cause}"
        )
    rows = [
        ("job", s["job"]),
        ("verdict (ddpmon doctor)", verdict),
        ("ranks", f"{s['ranks']}" + (f" of {s['world_size']}" if s.get("world_size") else "")),
        ("hosts", ", ".join(s["hosts"]) or "-"),
        ("devices", ", ".join(s["devices"]) or "-"),
        ("backend", s.get("backend") or "-"),
        ("steps", str(s["steps"])),
        *(
            [("missing from the history", missing_text(s["missing_steps"]))]
            if s.get("missing_steps")
            else []
        ),
        ("start", _t(s.get("start_unix"))),
        ("duration", _duration(s.get("duration_seconds"))),
        ("median step time", format_seconds(s.get("median_step_seconds"))),
        (
            "throughput",
            ", ".join(
                filter(
                    None,
                    (
                        f"{s['steps_per_second']:.2f} steps/s"
                        if s.get("steps_per_second")
                        else None,
                        throughput_text(s["throughput"]),
                    ),
                )
            )
            or "-",
        ),
        ("exposed communication", pct(s.get("exposed_comm_share")) + " of the step"),
        ("GPU utilisation (median)", pct(s.get("gpu_utilization_ratio"))),
        ("slowest rank", slow_text),
    ]
    return "\n".join(
        f'<tr><th>{e(k)}</th><td data-key="{e(k)}">{e(str(v))}</td></tr>' for k, v in rows
    )


def _ranks_html(s: dict[str, Any]) -> str:
    e = html.escape
    out = []
    for r in s["per_rank"]:
        st = r["status"]
        how = st["status"] + (f": {st['exception']}" if st.get("exception") else "")
        score = "-" if r.get("slower") is None else steps.slower(r["slower"])
        out.append(
            f'<tr data-rank="{r["rank"]}"><td>{r["rank"]}</td><td>{e(str(r["host"] or "-"))}</td>'
            f"<td>{e(str(r['device'] or '-'))}</td><td>{r['steps'] if r['steps'] is not None else '-'}</td>"
            f"<td>{format_seconds(r['median_step_seconds'])}</td><td>{format_seconds(r['median_busy_seconds'])}</td>"
            f"<td>{format_seconds(r['parts'].get('exposed_comm'))}</td>"
            f"<td>{score}</td>"
            f"<td>{e(throughput_text(r) or '-')}</td>"
            f"<td>{e(how)}</td></tr>"
        )
    return "\n".join(out)


def _findings_html(s: dict[str, Any]) -> str:
    e = html.escape
    items = []
    for f in s["findings"]:
        ranks = ", ".join(str(r) for r in f.get("ranks") or []) or "-"
        evidence = "".join(f"<li>{e(str(x))}</li>" for x in f.get("evidence") or [])
        items.append(
            f'<div class="finding {e(f["severity"])}" data-kind="{e(f["kind"])}"><b>{e(f["severity"])}</b> '
            f"<code>{e(f['kind'])}</code> (ranks {e(ranks)}): {e(f['summary'])}"
            + (f"<ul>{evidence}</ul>" if evidence else "")
            + (f'<div class="fix">Fix: {e(f["fix"])}</div>' if f.get("fix") else "")
            + "</div>"
        )
    for f in s.get("recorded_findings") or []:
        items.append(
            f'<div class="finding recorded" data-kind="{e(f["kind"])}"><b>rank {f["rank"]}</b>, '
            f"step {f.get('step') or '-'}, {e(_t(f.get('unix')))}: {e(f['text'])}</div>"
        )
    for p in s.get("problems") or []:
        items.append(f'<div class="finding warning"><b>warning</b> {e(p)}</div>')
    return "\n".join(items) or "<p>No findings.</p>"


def _memory_html(s: dict[str, Any]) -> str:
    """Each rank's memory trends (``ddpmon/memory.py``) as the rank last fitted them: the
    series that creep first, with the doctor's ``memory_creep`` findings above them."""
    e = html.escape
    rows = [(r["rank"], t) for r in s["per_rank"] for t in r["memory"]["trends"]]
    if not rows:
        return ""
    rows.sort(key=lambda rt: (not rt[1]["creeping"], rt[0], rt[1]["process"], rt[1]["kind"]))
    cells = []
    for rank, t in rows:
        whose = f"rank {rank}" + (f" worker pid {t['pid']}" if t["process"] == "worker" else "")
        per_step = t["bytes_per_step"]
        left = t["seconds_left"]
        cells.append(
            f'<tr data-rank="{rank}" data-process="{e(t["process"])}" data-kind="{e(t["kind"])}" '
            f'data-creeping="{"yes" if t["creeping"] else "no"}">'
            f"<td>{e(whose)}</td><td>{e(memory.KINDS.get(t['kind'], t['kind']))}</td>"
            f'<td data-key="bytes">{format_bytes(t["bytes"])}</td>'
            f'<td data-key="per_step">{"-" if per_step is None else format_bytes(per_step)}</td>'
            f'<td data-key="per_hour">{format_bytes(t["bytes_per_second"] * 3600) if t["bytes_per_second"] is not None else "-"}</td>'
            f"<td>{t['steps']} steps, {t['samples']} samples</td>"
            f"<td>{'creeps' if t['creeping'] else '-'}</td>"
            f'<td data-key="left">{e(format_time_left(left)) if left is not None and t["creeping"] else "-"}'
            f"{e(' before ' + memory.LIMITS[t['limit']]) if left is not None and t['creeping'] and t['limit'] else ''}</td></tr>"
        )
    findings = "".join(
        f'<p class="finding warning" data-kind="memory_creep">{e(f["summary"])}</p>'
        for f in s["findings"]
        if f["kind"] == "memory_creep"
    )
    return (
        '<h2>Memory</h2><p class="note">Each series\' trend as its rank last fitted it: the '
        "median of the Theil-Sen slopes of each third of its last readings (noise and a rise "
        "that came once do not move it); it creeps from 1 MiB a step, in every third.</p>"
        + (findings or '<p class="memory-ok">No memory creeps.</p>')
        + '<table class="memory"><tr><th>whose</th><th>what</th><th>now</th><th>a step</th>'
        "<th>an hour</th><th>over</th><th>creeps</th><th>time left</th></tr>"
        + "".join(cells)
        + "</table>"
    )


def _goodput_html(s: dict[str, Any]) -> str:
    """The wall time cut into steps and lost time by cause (``report/goodput.py``)."""
    g = s.get("goodput")
    if not g or g.get("ratio") is None:
        return ""
    wall = g["wall_seconds"]
    rows = [("steps (productive)", g["productive_seconds"])] + [
        (cause.replace("_", " "), seconds) for cause, seconds in g["lost_seconds"].items()
    ]
    cells = "".join(
        f'<tr data-cause="{html.escape(name)}"><td>{html.escape(name)}</td>'
        f"<td>{html.escape(format_seconds(seconds))}</td><td>{pct(seconds / wall if wall else None)}</td></tr>"
        for name, seconds in rows
    )
    notes = "".join(f'<p class="note">{html.escape(n)}</p>' for n in g.get("notes") or [])
    return (
        f'<h2>Goodput</h2><p class="goodput">{html.escape(goodput_text(g) or "")}</p>'
        f'<p class="note">From the first process\'s start to the end, on the clock of '
        f"{html.escape(g['clock'])}; a failed attempt's steps since its last checkpoint are "
        f"not known to ddpmon and count as steps.</p>"
        f'<table class="goodput"><tr><th>where the time went</th><th>time</th><th>share</th></tr>'
        f"{cells}</table>{notes}"
    )


def _attempts_html(s: dict[str, Any]) -> str:
    """A restarted job's earlier attempts: how each ended, its culprit, the time lost."""
    if not s.get("attempts"):
        return ""
    items = "".join(
        f'<li data-attempt="{a["attempt"]}">{html.escape(attempt_line(a))}</li>'
        for a in s["attempts"]
    )
    return (
        f"<h2>Attempts</h2><p>This is attempt {len(s['attempts'])}; the launcher restarted the job "
        f'{len(s["attempts"])} time(s) before it:</p><ul class="attempts">{items}</ul>'
    )


def _captures_html(s: dict[str, Any]) -> str:
    e = html.escape
    items = []
    for c in s.get("captures") or []:
        steps = (
            f"steps {c['first_step']} to {c['last_step']}"
            if c.get("first_step")
            else f"{c.get('steps') or '?'} steps"
        )
        what = (
            f"<code>{e(c['trace'])}</code> (open it in ui.perfetto.dev or chrome://tracing)"
            if c.get("trace")
            else e(c.get("reason") or c["state"])
        )
        items.append(
            f'<li data-rank="{c["rank"]}">rank {c["rank"]}, {steps}, {e(_t(c.get("written_unix")))}, '
            f"{e(c['state'])}: {what}</li>"
        )
    if not items:
        return (
            "<p>None. <code>ddpmon capture STATE_DIR --rank R --compare R2</code> profiles a live rank "
            "beside a peer (docs/capture.md).</p>"
        )
    return '<ul class="captures">' + "".join(items) + "</ul>"


_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px auto;max-width:1200px;color:#222;padding:0 12px}
h1{font-size:22px;margin:0 0 8px} h2{font-size:17px;margin:28px 0 6px;border-bottom:1px solid #ddd}
table{border-collapse:collapse} th,td{padding:3px 10px;text-align:left;border-bottom:1px solid #eee}
.summary th{color:#555;font-weight:normal}
.chart{margin:18px 0} .chart h3{font-size:15px;margin:0} .note{color:#666;font-size:12px;margin:2px 0 6px}
.finding{margin:6px 0;padding:6px 10px;border-left:4px solid #999;background:#fafafa}
.finding.error{border-color:#d62728}.finding.warning{border-color:#ff7f0e}.finding.info{border-color:#1f77b4}
.fix{color:#333;margin-top:4px} pre{white-space:pre-wrap} .u-legend{font-size:12px} #errors{color:#d62728}
"""

_SCRIPT = r"""
(function(){
  const DATA = JSON.parse(document.getElementById('ddpmon-data').textContent);
  const palette = ['#1f77b4','#ff7f0e','#2ca02c','#d62728','#9467bd','#8c564b','#e377c2','#7f7f7f',
                   '#bcbd22','#17becf','#393b79','#637939','#8c6d31','#843c39','#7b4173','#3182bd','#000','#555'];
  const t0 = performance.now();
  const INTEGER_STEPS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1e3, 2e3, 5e3, 1e4, 2e4, 5e4, 1e5, 2e5, 5e5, 1e6, 2e6, 5e6];
  const fmt = (unit) => (u, v) => v == null ? '-' : (unit === '%' || unit === 'ms' || unit === 'MiB')
      ? v.toFixed(v < 10 ? 2 : 1) + ' ' + unit : unit === 'ratio' ? v.toFixed(3) : v + ' ' + unit;
  function width(el){ return Math.max(320, el.clientWidth || 900); }
  function render(c){
    const box = document.getElementById('chart-' + c.id);
    if (!c.series.length) { box.setAttribute('data-rendered', 'empty'); return; }
    const xs = c.x.values, stack = c.kind === 'stack', bars = c.kind === 'bars' || stack;
    const raw = c.series.map(s => s.values);
    let ys = raw;
    if (stack) {  // cumulative sums, drawn top layer first so each band shows
      let acc = xs.map(() => 0);
      ys = raw.map(vs => { acc = acc.map((a, i) => a + (vs[i] || 0)); return acc.slice(); });
    }
    const data = [xs].concat(stack ? ys.slice().reverse() : ys);
    const order = stack ? c.series.map((s, i) => c.series.length - 1 - i) : c.series.map((s, i) => i);
    const grouped = c.kind === 'bars' && c.series.length === 2;  // side by side: left, right
    const barPath = (k) => !bars ? undefined : grouped
        ? uPlot.paths.bars({size: [0.35, 40], align: k === 0 ? -1 : 1}) : uPlot.paths.bars({size: [0.7, 60]});
    const series = [{label: c.x.label}].concat(order.map((si, k) => {
      const s = c.series[si], col = s.colour || palette[si % palette.length];
      return {
        label: s.name, stroke: col, width: 1.5, dash: s.dash ? [6, 4] : undefined,
        fill: bars ? col + (stack ? 'ff' : '99') : undefined, paths: barPath(k),
        points: {show: false}, spanGaps: false,
        value: (u, v, sIdx, i) => fmt(c.unit)(u, i == null ? null : raw[si][i]),
      };
    }));
    const opts = {
      width: width(box), height: 300, series: series,
      scales: {x: {time: false, range: bars ? (u, lo, hi) => [lo - 0.5, hi + 0.5] : undefined},
               y: {range: bars ? (u, lo, hi) => [0, hi > 0 ? hi * 1.08 : 1] : undefined}},
      axes: [{label: c.x.label, labelSize: 20, incrs: INTEGER_STEPS,
              values: (u, vals) => vals.map(v => !Number.isInteger(v) ? ''
                  : c.x.labels ? (c.x.labels[v] || '') : v.toLocaleString('en'))},
             {label: c.y_label + ' (' + c.unit + ')', labelSize: 20, size: 70}],
      cursor: {drag: {x: true, y: false}},
      legend: {live: true},
    };
    const u = new uPlot(opts, data, box);
    let ymax = -Infinity, points = 0;
    raw.forEach(vs => vs.forEach(v => { if (v != null) { points++; if (v > ymax) ymax = v; } }));
    box.setAttribute('data-rendered', 'yes');
    box.setAttribute('data-series', String(c.series.length));
    box.setAttribute('data-points', String(points));
    box.setAttribute('data-y-max', String(ymax));
    box.setAttribute('data-x-max', String(Math.max.apply(null, xs)));
    box.setAttribute('data-series-names', c.series.map(s => s.name).join('|'));
    box._uplot = u;
  }
  try {
    DATA.charts.forEach(render);
  } catch (e) {
    document.getElementById('errors').textContent = 'error while drawing: ' + e;
    throw e;
  }
  document.body.setAttribute('data-render-ms', String(Math.round(performance.now() - t0)));
  document.body.setAttribute('data-charts', String(DATA.charts.length));
})();
"""

_BODY = """<h2>Summary</h2>
<table class="summary">
{summary}
</table>
<h2>Ranks</h2>
<table class="ranks"><tr><th>rank</th><th>host</th><th>device</th><th>steps</th><th>median step</th>
<th>busy</th><th>exposed comm</th><th>slower than the others</th><th>throughput</th><th>how it ended</th></tr>
{ranks}
</table>
<h2>Plots</h2>
<p class="note">Drag across a plot to zoom, double-click to reset; the legend shows the values under the cursor.</p>
<div id="charts"></div>
<h2>Findings</h2>
{findings}
{memory}
{goodput}
{attempts}
<h2>Captures</h2>
{captures}
"""

_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>{css}</style><style>{style}</style></head>
<body>
<h1>{title}</h1>
<div id="errors"></div>
{body}
<script id="ddpmon-data" type="application/json">{data}</script>
<script>{uplot}</script>
<script>
(function(){{
  const DATA = JSON.parse(document.getElementById('ddpmon-data').textContent);
  const root = document.getElementById('charts');
  DATA.charts.forEach(c => {{
    const d = document.createElement('div'); d.className = 'chart';
    d.innerHTML = '<h3></h3><div class="note"></div><div class="plot"></div>';
    d.querySelector('h3').textContent = c.title;
    d.querySelector('.note').textContent = c.note || '';
    d.querySelector('.plot').id = 'chart-' + c.id;
    root.appendChild(d);
  }});
}})();
</script>
<script>{script}</script>
</body></html>
"""
