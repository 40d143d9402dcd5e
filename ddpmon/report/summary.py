"""The run's summary as data: what ``ddpmon report --json`` prints, what the HTML report
shows first, what ``ddpmon compare`` compares, and what rank 0 logs when training ends.

Times in seconds. Medians are over steps (a sample of up to 5,000 steps per rank, evenly
spaced), then over ranks. A rank's *busy* time is its step time minus its exposed
communication (``steps.busy_seconds``): in DDP every rank's step takes as long as the slowest rank's, so the
straggler is the rank that is busy longest, and the others wait for it in the all-reduce.
How much *slower* a rank is comes from the doctor's rule (``steps.scores``) over the whole
run: 0.37 = 37% slower. Throughput and FLOPs are each rank's own figures from its state file
(``schema.Throughput``: over its last steps' time); the job's are their sums, and its MFU is
the achieved FLOP/s over the ranks' summed peaks.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

from .. import goodput, memory, steps
from ..doctor import words
from ..doctor.report import attempt_line
from ..doctor.view import GONE
from ..formats import format_seconds
from ..state import captures, history, records, schema
from .run import RankHistory, Run, load

BUCKET_ROWS = 50_000  # steps whose buckets make the bucket summary, over all ranks


def part_medians(sample: dict[str, list[Any]]) -> dict[str, float | None]:
    """Median seconds per part of the step; ``other`` is the step time the known parts leave."""
    out: dict[str, float | None] = {}
    for p in steps.PARTS:
        values = [v for v in sample.get(f"{p}_seconds", []) if v is not None]
        out[p] = statistics.median(values) if values else None
    if out["other"] is None:
        measured = [sample[f"{p}_seconds"] for p in steps.PARTS[:-1] if out[p] is not None]
        others = [
            max(0.0, step - sum(v for v in known if v is not None))
            for step, *known in zip(sample.get("step_seconds", []), *measured)
        ]
        out["other"] = statistics.median(others) if others else None
    return out


def _median(values: Sequence[Any]) -> float | None:
    values = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(values) if values else None


def summarize(run: Run) -> dict[str, Any]:
    """Everything the report says in words and tables, as JSON-ready data."""
    diag = run.diagnosis
    views = {v.rank: v for v in diag.ranks} if diag is not None else {}
    ranks_out = []
    for rank in sorted(set(run.ranks) | set(views)):
        h = run.ranks.get(rank)
        v = views.get(rank)
        ident = dict(h.identity) if h else {}
        if v is not None:
            for key in ("host", "device", "job", "world_size", "backend", "pid"):
                ident.setdefault(key, getattr(v.state, key))
        parts = part_medians(h.sample) if h else {}
        step = h.median("step_seconds") if h else None
        if step is None and v is not None:
            summary = v.state.timings.step_seconds
            step = summary.median if summary is not None else None
        exposed = parts.get("exposed_comm")
        steps_done = h.last_step if h else None
        if v is not None:
            steps_done = max(steps_done or 0, v.state.step)
        ranks_out.append(
            {
                "rank": rank,
                "host": ident.get("host"),
                "device": ident.get("device"),
                "backend": ident.get("backend"),
                "steps": steps_done,
                "median_step_seconds": step,
                "median_busy_seconds": None if step is None else step - (exposed or 0.0),
                "parts": parts,
                "gpu_utilization_ratio": h.median("gpu_utilization_ratio") if h else None,
                "max_memory_bytes": _max_memory(h.sample) if h else None,
                "status": _status(h, v),
                "history_rows": h.rows if h else 0,
                "history": h.path if h else None,
                "missing_steps": missing_steps(h, v),
                **rank_throughput(v.state.throughput if v is not None else None),
                "memory": rank_memory(v.state.memory if v is not None else None),
            }
        )
    scores = run_scores(run)
    slowest = max(scores.values(), key=lambda sc: sc.score) if scores else None
    for r in ranks_out:
        score = scores.get(r["rank"])
        r["slower"] = round(score.score, 4) if score is not None else None
        r["slower_steps"] = score.steps if score is not None else None
    start, end = run_span(run, views)
    step_median = _median([r["median_step_seconds"] for r in ranks_out])
    parts = {p: _median([r["parts"].get(p) for r in ranks_out]) for p in steps.PARTS}
    exposed = parts.get("exposed_comm")
    first = next(iter(run.ranks.values()), None)
    world = (first.identity.get("world_size") if first else None) or (
        views[min(views)].state.world_size if views else None
    )
    out: dict[str, Any] = {
        "job": run.job,
        "sources": run.sources,
        "ranks": len(ranks_out),
        "world_size": world,
        "hosts": sorted({str(r["host"]) for r in ranks_out if r["host"]}),
        "devices": sorted({str(r["device"]) for r in ranks_out if r["device"]}),
        "backend": next((r["backend"] for r in ranks_out if r["backend"]), None),
        "steps": max((r["steps"] or 0 for r in ranks_out), default=0),
        "start_unix": start,
        "end_unix": end,
        "duration_seconds": (end - start) if start is not None and end is not None else None,
        "missing_steps": [
            {"rank": r["rank"], "first": a, "last": b}
            for r in ranks_out
            for a, b in r["missing_steps"]
        ],
        "median_step_seconds": step_median,
        "steps_per_second": (1.0 / step_median) if step_median else None,
        "parts": parts,
        "exposed_comm_share": (exposed / step_median)
        if exposed is not None and step_median
        else None,
        "throughput": job_throughput(ranks_out),
        "gpu_utilization_ratio": _median([r["gpu_utilization_ratio"] for r in ranks_out]),
        "slowest_rank": _slowest(slowest),
        "straggler": _straggler(slowest),
        "buckets": bucket_summary(run),
        "per_rank": ranks_out,
        "verdict": diag.verdict if diag is not None else None,
        "suspect_ranks": list(diag.suspect_ranks) if diag is not None else [],
        "findings": [f.as_dict() for f in diag.findings] if diag is not None else [],
        "attempts": list(diag.attempts) if diag is not None else [],
        "goodput": goodput.of_dirs(run.sources, run.job if run.job != "?" else None),
        "training": training(run),
        "recorded_findings": [dict(f, rank=h.rank) for h in run.ranks.values() for f in h.findings],
        "step_bin": run.stride,
        "captures": capture_list(run.sources),
        "problems": run.problems,
        "generated_unix": time.time(),
    }
    return out


def training(run: Run) -> dict[str, Any]:
    """What the run trained with, from its lowest rank's history (``history.training_of``):
    the global batch (samples per optimizer step, accumulation counted), the world size,
    the optimizer and its learning rate; empty from a ddpmon that did not record it."""
    first = run.ranks[min(run.ranks)] if run.ranks else None
    return history.training(first.meta) if first is not None else {}


def rank_throughput(t: schema.Throughput | None) -> dict[str, Any]:
    """A rank's samples, tokens and FLOPs per second and its MFU (null where unknown)."""
    count = t.flop_count if t is not None else None
    return {
        "samples_per_second": t.samples_per_second if t else None,
        "tokens_per_second": t.tokens_per_second if t else None,
        "flops_per_step": count.per_step if count else None,
        "flops_dtype": count.dtype if count else None,
        "achieved_flops_per_second": t.achieved_flops_per_second if t else None,
        "peak_flops_per_second": count.peak_flops_per_second if count else None,
        "mfu": t.mfu if t else None,
    }


def rank_memory(m: schema.Memory | None) -> dict[str, Any]:
    """A rank's memory trends (``ddpmon/memory.py``), each with whether it creeps and its
    seconds left before its limit; ``creeping``: those that creep, soonest at a limit first."""
    trends = []
    for t in m.trends if m is not None else []:
        row = records.dump(t)
        row["creeping"] = memory.creeping(t)
        row["seconds_left"] = memory.seconds_left(t)
        trends.append(row)
    creeping = [t for t in trends if t["creeping"]]
    creeping.sort(key=lambda t: t["seconds_left"] if t["seconds_left"] is not None else 1e300)
    return {"trends": trends, "creeping": creeping}


def job_throughput(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The job's rates, summed over its ranks; its MFU where every rank that counted its
    FLOPs knows its device's peak."""

    def total(key: str) -> float | None:
        values = [r[key] for r in ranks if r.get(key) is not None]
        return sum(values) if values else None

    achieved = [r for r in ranks if r.get("achieved_flops_per_second") is not None]
    peaks = [r["peak_flops_per_second"] for r in achieved if r.get("peak_flops_per_second")]
    mfu = None
    if achieved and len(peaks) == len(achieved):
        mfu = sum(r["achieved_flops_per_second"] for r in achieved) / sum(peaks)
    return {
        "samples_per_second": total("samples_per_second"),
        "tokens_per_second": total("tokens_per_second"),
        "achieved_flops_per_second": total("achieved_flops_per_second"),
        "mfu": mfu,
    }


def throughput_text(t: dict[str, Any]) -> str | None:
    """``1,234 samples/s, 56,789 tokens/s, 405.2 TFLOP/s, MFU 41%``: what is known of it."""
    parts = []
    if t.get("samples_per_second") is not None:
        parts.append(f"{t['samples_per_second']:,.0f} samples/s")
    if t.get("tokens_per_second") is not None:
        parts.append(f"{t['tokens_per_second']:,.0f} tokens/s")
    if t.get("achieved_flops_per_second") is not None:
        flops = t["achieved_flops_per_second"]
        parts.append(
            f"{flops / 1e12:,.1f} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:,.2f} GFLOP/s"
        )
        parts.append(
            f"MFU {pct(t['mfu'])}"
            if t.get("mfu") is not None
            else "MFU unknown (no peak for this device)"
        )
    return ", ".join(parts) or None


RANK_0_CLOCK = "\0rank 0's clock"
"""``run_span``'s key for the times put on rank 0's clock (no host is named so)."""


def run_span(run: Run, views: dict[int, Any]) -> tuple[float | None, float | None]:
    """When the run began and when it was last seen making progress, from all it knows: its
    first step's start (the rank's attach when its history lacks the first steps), and the
    latest of the last step in a history and the last progress a state file records (a
    history whose writes failed ends early; the state file may go on).

    A start and an end are only ever compared on one clock: rank 0's for the ranks that
    measured their clock against it (``schema.Clock``), else each host's own. Each clock's
    span is its ranks' earliest start to their latest end, and the run's is the longest of
    those, so a host whose clock is seconds ahead neither lengthens nor shortens the run."""
    starts: dict[str, list[float]] = {}
    ends: dict[str, list[float]] = {}
    for rank in set(run.ranks) | set(views):
        h, v = run.ranks.get(rank), views.get(rank)
        host = str((h.identity.get("host") if h else None) or (v.state.host if v else None) or "")
        clock = v.state.clock if v is not None else None
        on, shift = (RANK_0_CLOCK, clock.offset_seconds) if clock is not None else (host, 0.0)
        first, last = (h.first, h.last) if h else (None, None)
        if first is not None and first[0] == 1:
            starts.setdefault(on, []).append(first[1] - shift)
        elif v is not None and v.state.started_unix is not None:
            starts.setdefault(on, []).append(v.state.started_unix - shift)
        elif first is not None:
            starts.setdefault(on, []).append(first[1] - shift)
        if last is not None:
            ends.setdefault(on, []).append(last[2] - shift)
        if v is not None and v.state.step and v.state.last_progress_unix is not None:
            ends.setdefault(on, []).append(v.state.last_progress_unix - shift)
    spans = [(min(starts[h]), max(ends[h])) for h in starts if h in ends]
    if spans:
        return max(spans, key=lambda span: span[1] - span[0])
    every_start = [t for ts in starts.values() for t in ts]
    every_end = [t for ts in ends.values() for t in ts]
    return (min(every_start) if every_start else None), (max(every_end) if every_end else None)


def missing_steps(h: RankHistory | None, v: Any) -> list[tuple[int, int]]:
    """The steps (first, last) a rank finished that its history lacks: those it lost while
    its writes failed (``history.missing_steps``), and, once the rank has ended, those past
    the history's last row up to the last step its state file counted (its last writes
    failed). A live rank's newest steps are on their way, not missing."""
    if h is None:
        return []
    out = history.missing_steps(h.meta)
    ended = v is not None and (v.ending is not None or v.liveness.alive is False)
    if ended and v.state.step > h.last_step:
        out.append((h.last_step + 1, v.state.step))
    return out


def capture_list(sources: list[str]) -> list[dict[str, Any]]:
    """The profiles ``ddpmon capture`` took of the run's ranks (docs/capture.md), in the state
    directories read: done, failed or under way."""
    out = []
    for d in sources:
        if not os.path.isdir(d):
            continue
        for c in captures.listing(d):
            st = c.status
            out.append(
                {
                    "rank": c.rank,
                    "state": st.state if st else "unreadable",
                    "steps": st.steps if st else None,
                    "first_step": st.first_step if st else None,
                    "last_step": st.last_step if st else None,
                    "trace": c.trace_path,
                    "reason": (st.reason if st else c.problem),
                    "written_unix": c.written_unix or None,
                }
            )
    return out


def _status(h: Any, v: Any) -> dict[str, Any]:
    """How the rank ended: the doctor's status where a state file exists, else the history's."""
    ex = h.exit if h is not None else None
    own_exit = v.state.exit if v is not None else None
    record = (
        (ex or {}).get("record")
        or (schema.to_json(own_exit) if own_exit is not None else None)
        or {}
    )
    if v is not None:
        status = v.status
        if v.cannot_write is not None and v.liveness.alive is False:
            status = f"ended, not recorded ({v.cannot_write.reason})"  # its last writes failed
        elif v.liveness.alive is False and status not in GONE:
            status = (
                f"dead (was {status})"  # the doctor's view when it stopped: a hang, then killed
            )
    elif ex is not None:
        status = ex["how"]
    else:
        status = "killed or still running (no exit record)"
    return {
        "status": status,
        "exit_code": record.get("exit_code", record.get("code")),
        "exception": record.get("exception"),
        "unix": record.get("unix") or (ex or {}).get("unix"),
    }


def _max_memory(sample: dict[str, list[Any]]) -> float | None:
    """The largest memory reading of the first column the rank recorded (GPU, then torch's
    allocator, then the process)."""
    for column in history.BINNED_MAXES:
        values = [v for v in sample.get(column, []) if isinstance(v, (int, float))]
        if values:
            return max(values)
    return None


_SCORED = ("step_seconds", *(f"{p}_seconds" for p in steps.PARTS))


def run_scores(run: Run) -> dict[int, steps.Score]:
    """Who is slow over the whole run: ``steps.scores`` over each rank's sampled history,
    the same rule the doctor applies to the last steps of a running job."""
    parts = {}
    for rank, h in run.ranks.items():
        columns = {c: h.sample.get(c) or [] for c in _SCORED}
        numbers = h.sample.get("step") or []
        rows = [
            steps.StepRow(
                numbers[i] if i < len(numbers) else i,
                0.0,
                0.0,
                **{c: columns[c][i] if i < len(columns[c]) else None for c in _SCORED},  # type: ignore[arg-type]
            )
            for i, step in enumerate(columns["step_seconds"])
            if step is not None
        ]
        parts[rank] = steps.step_parts(rows, whole=True)
    return steps.scores(parts, whole=True)  # type: ignore[arg-type]


def _slowest(top: steps.Score | None) -> dict[str, Any] | None:
    """The slowest rank by busy time, how much slower (``score``: 0.37 = 37% slower), and the
    part of its step where it loses most against the other ranks' median (None when it
    loses in none)."""
    if top is None:
        return None
    losing = {p: e for p, e in top.excess.items() if e > 0}
    part = top.cause or (max(losing, key=lambda p: losing[p]) if losing else None)
    return {
        "rank": top.rank,
        "score": round(top.score, 4),
        "steps": top.steps,
        "part": part,
        "excess_seconds": top.excess[part] if part else None,
    }


def _straggler(top: steps.Score | None) -> dict[str, Any] | None:
    """The doctor's straggler rule over the whole run on the slowest rank: whether it is a
    straggler (out of its noise), and the part that explains it."""
    if top is None:
        return None
    return {
        "rank": top.rank,
        "score": round(top.score, 4),
        "steps": top.steps,
        "named": top.straggler,
        "cause": top.cause,
        "share": round(top.shares.get(top.cause, 0.0), 4) if top.cause else None,
        "busy_seconds": top.busy_seconds,
        "baseline_seconds": top.baseline_seconds,
    }


def bucket_summary(run: Run) -> list[dict[str, Any]]:
    """Per bucket: its size, the median all-reduce time over steps and ranks, and the bus
    bandwidth at that time (nccl-tests: bytes / time x 2(n-1)/n)."""
    seconds: dict[int, list[float]] = {}
    per_rank: dict[int, dict[int, list[float]]] = {}
    sizes: dict[int, int] = {}
    n = 1
    per_rank_rows = max(10, BUCKET_ROWS // max(1, len(run.ranks)))
    for h in run.ranks.values():
        n = max(n, int(h.identity.get("ddp_world_size") or h.identity.get("world_size") or 1))
        texts = [t for t in h.sample.get("buckets", []) if t]
        texts = texts[:: max(1, -(-len(texts) // per_rank_rows))]
        rows = (
            json.loads("[" + ",".join(texts) + "]")
            if texts and isinstance(texts[0], str)
            else texts
        )
        for row in rows:
            for index, secs, nbytes in row or ():
                if isinstance(secs, (int, float)):
                    seconds.setdefault(index, []).append(secs)
                    per_rank.setdefault(index, {}).setdefault(h.rank, []).append(secs)
                if isinstance(nbytes, int):
                    sizes[index] = nbytes
    factor = 2.0 * (n - 1) / n
    out = []
    for index in sorted(seconds):
        med = statistics.median(seconds[index])
        size = sizes.get(index)
        out.append(
            {
                "index": index,
                "bytes": size,
                "median_seconds": med,
                "max_rank_median_seconds": max(
                    statistics.median(v) for v in per_rank[index].values()
                ),
                "busbw_bytes_per_second": (size / med * factor) if size and med > 0 else None,
                "samples": len(seconds[index]),
            }
        )
    return out


# -- words --------------------------------------------------------------------------------


def pct(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio * 100:.0f}%"


def missing_text(missing: list[dict[str, Any]]) -> str:
    """``rank 0 steps 120-1340, rank 1 step 7``: the steps the histories lack."""
    return ", ".join(
        f"rank {m['rank']} "
        + (f"step {m['first']}" if m["first"] == m["last"] else f"steps {m['first']}-{m['last']}")
        for m in missing
    )


def end_of_run(state_dir: str) -> str:
    """The few lines rank 0 logs when training ends: steps, median step time, the slowest
    rank and its part, the exposed-communication share, findings, and the report command."""
    run = load([state_dir], max_points=200)
    s = summarize(run)
    lines = [
        f"ddpmon: run summary of job {s['job']!r}: {s['steps']} steps on {s['ranks']} ranks, "
        f"median step {format_seconds(s['median_step_seconds'])}, exposed communication "
        f"{pct(s['exposed_comm_share'])} of the step"
    ]
    rates = throughput_text(s["throughput"])
    if rates:
        lines.append(f"  throughput: {rates}")
    slow = s["straggler"]  # the doctor's rule, over the whole run
    if slow and slow["named"]:
        lines.append(
            f"  straggler: {words.straggler_summary(slow['rank'], slow['score'], slow['cause'], slow['share'] or 0.0, window=steps.over(slow['steps'], whole=True))}"
            f" ({format_seconds(slow['busy_seconds'])} against "
            f"{format_seconds(slow['baseline_seconds'])} of work per step)"
        )
    elif slow:
        lines.append(
            f"  no straggler: the slowest rank ({slow['rank']}) is {steps.slower(slow['score'])} "
            f"than the others {steps.over(slow['steps'], whole=True)}, within their "
            "step-to-step noise"
        )
    logged = {
        a.kind for v in (run.diagnosis.ranks if run.diagnosis else []) for a in v.state.advice
    }
    findings = [
        f
        for f in s[
            "findings"
        ]  # not what a rank logged as it found it, nor the straggler said above
        if f["kind"] not in logged and not (slow and f["kind"] == "straggler")
    ]
    shown = [f for f in findings if f["severity"] in ("error", "warning")] + [
        f for f in findings if f["severity"] == "info"
    ]
    for f in shown[:3]:  # a finding the doctor makes only now must reach a log, with what to do
        fix = f" Fix: {f['fix']}" if f["severity"] != "info" and f.get("fix") else ""
        lines.append(f"  {f['severity']}: {f['summary']} [{f['kind']}].{fix}")
    if s["missing_steps"]:  # what the history lacks (a full disk): the figures above leave them out
        lines.append(f"  missing from the history: {missing_text(s['missing_steps'])}")
    spent = goodput.text(s["goodput"])
    if spent:
        lines.append(f"  {spent}")
    if s["attempts"]:  # a restarted job: why each attempt before this one ended
        lines.append(f"  attempts: {len(s['attempts']) + 1}; before this one:")
        lines += [f"    {attempt_line(a)}" for a in s["attempts"]]
    lines.append(f"  report: ddpmon report {state_dir} -o report.html")
    return "\n".join(lines)
