"""``ddpmon compare``: two runs side by side, the change in %, and what explains it.

Each run is a state directory (its history databases), the JSON of ``ddpmon report --json``,
or ``[JOB@]HOST:PORT[,HOST:PORT...]``: the histories of JOB (default: the job written last)
read through those node daemons (``ddpmon daemon --serve-state``); ``JOB@`` alone reads
them through the daemons the command found (``--from``, ``--from-file``, ``--prometheus``).
The step time's change is split over the parts of the step (their medians add up to the
median step), and over the ranks (whose busy time grew most, and in which part), so the
answer to "why is B slower than A" reads as: "+12 ms per step, 11 ms of it in backward,
on rank 1".
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Sequence
from typing import Any

from .. import steps
from ..formats import format_seconds
from ..remote.daemons import HISTORY_DEADLINE_SECONDS, address_problem
from ..steps import PART_LABELS, PARTS
from ..webconfig import HttpConfig
from . import html as html_page
from .run import Run, load
from .summary import pct, summarize

NOISE = 0.02  # changes under 2% are shown but not called out


def load_side(
    source: str,
    deadline: float = HISTORY_DEADLINE_SECONDS,
    client: HttpConfig | None = None,
    found: Sequence[str] = (),
) -> tuple[dict[str, Any], Run | None]:
    """A run's summary (and the Run when read from a directory or daemons, these asked with
    ``client``'s TLS and credentials; ``found``: the daemons of a run given as ``JOB@``)."""
    daemons = _daemons(source, found) if not os.path.exists(source) else None
    if daemons is not None:
        job, addresses = daemons
        run = load((), addresses, job=job, findings=False, deadline=deadline, client=client)
        return summarize(run), run
    if not os.path.exists(source):
        raise ValueError(
            f"{source}: no such directory or file; a run is a state directory, the JSON of "
            "`ddpmon report --json`, or [JOB@]HOST:PORT[,HOST:PORT...] of node daemons "
            "started with --serve-state"
        )
    if os.path.isfile(source):
        try:
            with open(source) as f:
                data = json.load(f)
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"{source}: not a readable summary of `ddpmon report --json` ({exc})"
            ) from None
        if not isinstance(data, dict) or "per_rank" not in data:
            raise ValueError(f"{source}: not the JSON of `ddpmon report --json` (no 'per_rank')")
        return upgraded(data), None
    run = load([source], findings=False)
    return summarize(run), run


def upgraded(summary: dict[str, Any]) -> dict[str, Any]:
    """A summary of an older ddpmon's ``report --json`` in today's words: it called the
    parts of a step ``phases`` (the slowest rank's ``phase``) and a rank's busy time
    ``median_compute_seconds``."""
    renames = {"phases": "parts", "phase": "part", "median_compute_seconds": "median_busy_seconds"}

    def renamed(d: Any) -> Any:
        if not isinstance(d, dict):
            return d
        return {renames.get(k, k) if renames.get(k, k) not in d else k: v for k, v in d.items()}

    out = renamed(summary)
    out["slowest_rank"] = renamed(out.get("slowest_rank"))
    if isinstance(out.get("per_rank"), list):
        out["per_rank"] = [renamed(r) for r in out["per_rank"]]
    return out


def _daemons(source: str, found: Sequence[str]) -> tuple[str | None, list[str]] | None:
    """(job or None, addresses) of ``[JOB@]HOST:PORT[,HOST:PORT...]``, or of ``JOB@`` on the
    daemons ``found``; None when it is not that."""
    job, at, hosts = source.rpartition("@")
    if at and not hosts:
        if not found:
            raise ValueError(
                f"{source}: names no daemon: write HOST:PORT[,HOST:PORT...] after the @, or "
                "find them with --from, --from-file or --prometheus"
            )
        return job or None, list(found)
    addresses = hosts.split(",")
    if not all(a and address_problem(a) is None for a in addresses):
        return None
    return job or None, addresses


def change(a: float | None, b: float | None) -> float | None:
    """Relative change from a to b (0.1 = +10%), None when either is unknown or a is 0."""
    if a is None or b is None or a == 0:
        return None
    return (b - a) / a


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """The rows of the comparison and the sentences that explain the step time's change."""
    rows: list[dict[str, Any]] = []

    def row(name: str, va: Any, vb: Any, unit: str = "s", group: str = "run") -> None:
        rows.append(
            {
                "group": group,
                "name": name,
                "a": va,
                "b": vb,
                "unit": unit,
                "delta": (vb - va)
                if isinstance(va, (int, float)) and isinstance(vb, (int, float))
                else None,
                "change": change(va, vb),
            }
        )

    row("median step time", a.get("median_step_seconds"), b.get("median_step_seconds"))
    row("throughput", a.get("steps_per_second"), b.get("steps_per_second"), "steps/s")
    row(
        "exposed communication share",
        a.get("exposed_comm_share"),
        b.get("exposed_comm_share"),
        "ratio",
    )
    if a.get("gpu_utilization_ratio") is not None or b.get("gpu_utilization_ratio") is not None:
        row(
            "GPU utilisation",
            a.get("gpu_utilization_ratio"),
            b.get("gpu_utilization_ratio"),
            "ratio",
        )
    for p in PARTS:
        va, vb = (a.get("parts") or {}).get(p), (b.get("parts") or {}).get(p)
        if va is not None or vb is not None:
            row(PART_LABELS[p], va, vb, group="part")
    ba = {x["index"]: x for x in a.get("buckets") or []}
    bb = {x["index"]: x for x in b.get("buckets") or []}
    for index in sorted(set(ba) | set(bb)):
        row(
            f"bucket {index} all-reduce",
            (ba.get(index) or {}).get("median_seconds"),
            (bb.get(index) or {}).get("median_seconds"),
            group="bucket",
        )
    ra = {r["rank"]: r for r in a.get("per_rank") or []}
    rb = {r["rank"]: r for r in b.get("per_rank") or []}
    ranks = []
    for rank in sorted(set(ra) & set(rb)):
        x, y = ra[rank], rb[rank]
        deltas = {
            p: (y["parts"].get(p) or 0.0) - (x["parts"].get(p) or 0.0)
            for p in PARTS
            if x["parts"].get(p) is not None or y["parts"].get(p) is not None
        }
        part = max(deltas, key=lambda p: abs(deltas[p])) if deltas else None
        ranks.append(
            {
                "rank": rank,
                "a_step": x.get("median_step_seconds"),
                "b_step": y.get("median_step_seconds"),
                "a_busy": x.get("median_busy_seconds"),
                "b_busy": y.get("median_busy_seconds"),
                "busy_delta": _minus(y.get("median_busy_seconds"), x.get("median_busy_seconds")),
                "part": part,
                "part_delta": deltas.get(part) if part else None,
                "a_slower": x.get("slower"),
                "b_slower": y.get("slower"),
                "a_slower_steps": x.get("slower_steps"),
                "b_slower_steps": y.get("slower_steps"),
            }
        )
    return {
        "a": _label(a),
        "b": _label(b),
        "rows": rows,
        "ranks": ranks,
        "explanation": explain(a, b, ranks),
        "scaling": scaling(a.get("training") or {}, b.get("training") or {}),
    }


LINEAR_RULE = frozenset({"SGD", "ASGD"})
"""Optimizers whose learning rate scales with the global batch (the linear scaling rule, with
a warm-up: Goyal et al., 2017)..."""
SQUARE_ROOT_RULE = frozenset(
    {"Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "SparseAdam"}
)
"""...and adaptive ones, with its square root (Krizhevsky, 2014; Malladi et al., 2022)."""
FOLLOWS = 0.05
"""A learning rate within 5% of what a rule gives follows it."""


def scaling(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """When the two runs' global batches differ: by how much, and whether the peak learning
    rate followed, by the rule for the optimizer (a note with the numbers, no verdict)."""
    ga, gb = a.get("global_batch_size"), b.get("global_batch_size")
    if not ga or not gb or ga == gb:
        return []
    k = gb / ga
    lines = [
        f"global batch differs: B takes {gb} samples per optimizer step, A {ga} (x{k:.2f}; "
        f"{_batch_words(b)} against {_batch_words(a)})"
    ]
    oa, ob = a.get("optimizer") or {}, b.get("optimizer") or {}
    la, lb = oa.get("peak_learning_rate"), ob.get("peak_learning_rate")
    if not la or not lb:
        lines.append("  the learning rates are not known (a run from an older ddpmon?)")
        return lines
    name = oa.get("name")
    if name != ob.get("name"):
        lines.append(
            f"  the optimizers differ ({name} against {ob.get('name')}): no rule relates their "
            f"learning rates (peak {la:.4g} in A, {lb:.4g} in B)"
        )
        return lines
    ratio = lb / la
    rules = {"linear": k, "square-root": k**0.5}
    rule = "linear" if name in LINEAR_RULE else "square-root" if name in SQUARE_ROOT_RULE else None
    followed = [r for r, want in rules.items() if abs(ratio / want - 1) <= FOLLOWS]
    said = f"  peak learning rate {lb:.4g} in B against {la:.4g} in A (x{ratio:.2f})"
    if rule is None:
        said += (
            f"; {name} has no usual rule here: the linear rule gives x{k:.2f}, the "
            f"square-root rule x{k**0.5:.2f}"
        )
    elif rule in followed:
        said += f": it followed the {rule} scaling rule for {name} (x{rules[rule]:.2f})"
    else:
        said += (
            f": the {rule} scaling rule for {name} gives x{rules[rule]:.2f} "
            f"({la * rules[rule]:.4g}); B's did not follow it"
            + (f" (it follows the {followed[0]} rule)" if followed else "")
        )
    lines.append(said)
    if ratio > 1 + FOLLOWS:  # a larger rate: the rules go with a warm-up
        peak = ob.get("peak_step")
        lines.append(
            f"  B reached that rate at step {peak}, after a warm-up of {peak - 1} steps"
            if peak and peak > 1
            else "  B ran at that rate from its first step: no warm-up (the linear rule "
            "goes with one, to the scaled rate over the first epochs)"
        )
    return lines


def _batch_words(t: dict[str, Any]) -> str:
    """``8 x 2 micro-batches x 4 ranks``: how a global batch is made."""
    micro, world = t.get("micro_batches"), t.get("world_size")
    return (
        f"{t.get('batch_size') or '?'} x {micro or '?'} micro-batch{'' if micro == 1 else 'es'} "
        f"x {world or '?'} rank{'' if world == 1 else 's'}"
    )


def _minus(x: Any, y: Any) -> float | None:
    return x - y if isinstance(x, (int, float)) and isinstance(y, (int, float)) else None


def _label(s: dict[str, Any]) -> dict[str, Any]:
    return {
        "job": s.get("job"),
        "sources": s.get("sources"),
        "ranks": s.get("ranks"),
        "steps": s.get("steps"),
    }


def explain(a: dict[str, Any], b: dict[str, Any], ranks: list[dict[str, Any]]) -> list[str]:
    """Sentences: the step time's change, the parts that make it up, the ranks behind it."""
    sa, sb = a.get("median_step_seconds"), b.get("median_step_seconds")
    if sa is None or sb is None:
        return ["no step times to compare (a run without history?)"]
    delta, rel = sb - sa, change(sa, sb) or 0.0
    if abs(rel) < NOISE:
        return [
            f"step time unchanged ({format_seconds(sa)} -> {format_seconds(sb)}, {rel * 100:+.1f}%)"
        ]
    lines = [
        f"step time {'up' if delta > 0 else 'down'} {rel * 100:+.1f}% "
        f"({format_seconds(sa)} -> {format_seconds(sb)}, {delta * 1e3:+.1f} ms per step)"
    ]
    moved_parts = []
    for p in PARTS:
        pa, pb = (a.get("parts") or {}).get(p), (b.get("parts") or {}).get(p)
        if pa is not None and pb is not None:
            moved_parts.append((pb - pa, p))
    moved_parts.sort(key=lambda t: -abs(t[0]) if (t[0] > 0) == (delta > 0) else 0)
    for d, p in moved_parts[:2]:
        if (d > 0) == (delta > 0) and abs(d) >= NOISE * sa:
            lines.append(
                f"  {PART_LABELS[p]}: {d * 1e3:+.1f} ms per step ({abs(d / delta) * 100:.0f}% of the change)"
            )
    moved = [r for r in ranks if r["busy_delta"] is not None]
    if moved:
        top = max(moved, key=lambda r: r["busy_delta"] * (1 if delta > 0 else -1))
        others = [r["busy_delta"] for r in moved if r is not top]
        typical = statistics.median(others) if others else 0.0
        if abs(top["busy_delta"] - typical) >= NOISE * sa and len(moved) > 1:
            lines.append(
                f"  rank {top['rank']} explains it: its busy time changed {top['busy_delta'] * 1e3:+.1f} ms "
                f"(the other ranks {abs(typical * 1e3) if abs(typical) < 5e-5 else typical * 1e3:+.1f} ms), most in {PART_LABELS.get(top['part'], top['part'])} "
                f"({(top['part_delta'] or 0) * 1e3:+.1f} ms); the others wait for it in exposed communication"
            )
        else:
            lines.append(
                f"  every rank changed alike (busy time {typical * 1e3:+.1f} ms per rank): "
                "not one straggler"
            )
    return lines


# -- output -------------------------------------------------------------------------------------


def _value(v: Any, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "s":
        return format_seconds(v)
    if unit == "ratio":
        return pct(v)
    return f"{v:.2f} {unit}"


def _pct(c: float | None) -> str:
    return "-" if c is None else f"{c * 100 + 0.0:+.1f}%".replace("-0.0%", "+0.0%")


def render_text(result: dict[str, Any], width: int = 100) -> str:
    a, b = result["a"], result["b"]
    out = [
        f"A: {a['job']} ({a['ranks']} ranks, {a['steps']} steps)  {', '.join(a['sources'] or [])}",
        f"B: {b['job']} ({b['ranks']} ranks, {b['steps']} steps)  {', '.join(b['sources'] or [])}",
        "",
    ]
    out.append(f"{'':32} {'A':>14} {'B':>14} {'change':>9}")
    group = None
    for r in result["rows"]:
        if r["group"] != group:
            group = r["group"]
            out.append(
                {"run": "run", "part": "parts of the step (median per step)", "bucket": "buckets"}[
                    group
                ]
            )
        flag = " <" if r["change"] is not None and abs(r["change"]) >= 0.10 else ""
        out.append(
            f"  {r['name']:30} {_value(r['a'], r['unit']):>14} {_value(r['b'], r['unit']):>14} "
            f"{_pct(r['change']):>9}{flag}"
        )
    if result["ranks"]:
        out.append("ranks (median busy time per step: step time minus exposed communication)")
        for r in result["ranks"]:
            out.append(
                f"  rank {r['rank']:<25} {format_seconds(r['a_busy']):>14} "
                f"{format_seconds(r['b_busy']):>14} "
                f"{_pct(change(r['a_busy'], r['b_busy'])):>9}  most in "
                f"{PART_LABELS.get(r['part'], '-')} ({(r['part_delta'] or 0) * 1e3:+.1f} ms)"
                + _slower_text(r)
            )
    out.append("")
    out += result["explanation"]
    if result.get("scaling"):
        out += ["", *result["scaling"]]
    return "\n".join(out) + "\n"


def _slower_text(r: dict[str, Any]) -> str:
    """How much slower than the others the rank was in A and in B, each over its whole run
    (the report's figure, ``steps.over``)."""
    said = [
        f"{run} {steps.slower(r[run.lower() + '_slower'])} {steps.over(r[run.lower() + '_slower_steps'], whole=True)}"
        for run in ("A", "B")
        if r.get(run.lower() + "_slower") is not None and r.get(run.lower() + "_slower_steps")
    ]
    return "; than the others: " + ", ".join(said) if said else ""


def render_html(result: dict[str, Any], runs: tuple[Run | None, Run | None]) -> str:
    import html

    e = html.escape
    rows = "\n".join(
        f'<tr data-name="{e(r["name"])}"><td>{e(r["name"])}</td><td>{e(_value(r["a"], r["unit"]))}</td>'
        f"<td>{e(_value(r['b'], r['unit']))}</td><td>{e(_pct(r['change']))}</td></tr>"
        for r in result["rows"]
    )
    ranks = "\n".join(
        f"<tr><td>{r['rank']}</td><td>{e(format_seconds(r['a_busy']))}</td>"
        f"<td>{e(format_seconds(r['b_busy']))}</td>"
        f"<td>{e(_pct(change(r['a_busy'], r['b_busy'])))}</td>"
        f"<td>{e(PART_LABELS.get(r['part'], '-'))} ({(r['part_delta'] or 0) * 1e3:+.1f} ms)</td></tr>"
        for r in result["ranks"]
    )
    a, b = result["a"], result["b"]
    body = (
        f"<p>A: {e(str(a['job']))} ({e(', '.join(a['sources'] or []))})<br>"
        f"B: {e(str(b['job']))} ({e(', '.join(b['sources'] or []))})</p>"
        f"<h2>What changed</h2><pre id='explanation'>{e(chr(10).join(result['explanation']))}</pre>"
        + (
            f"<h2>Batch and learning rate</h2><pre id='scaling'>{e(chr(10).join(result['scaling']))}</pre>"
            if result.get("scaling")
            else ""
        )
        + f"<table class='summary'><tr><th></th><th>A</th><th>B</th><th>change</th></tr>{rows}</table>"
        f"<h2>Ranks (median busy time per step)</h2><table><tr><th>rank</th><th>A</th><th>B</th>"
        f"<th>change</th><th>part that moved most</th></tr>{ranks}</table>"
        f"<h2>Plots</h2><div id='charts'></div>"
    )
    charts = []
    part_rows = [r for r in result["rows"] if r["group"] == "part"]
    if part_rows:
        charts.append(
            {
                "id": "parts",
                "title": "Parts of the step, median per step",
                "kind": "bars",
                "x": {
                    "label": "part",
                    "values": list(range(len(part_rows))),
                    "labels": [r["name"] for r in part_rows],
                },
                "y_label": "time per step",
                "unit": "ms",
                "note": "A left, B right",
                "series": [
                    {
                        "name": "A",
                        "values": [
                            None if r["a"] is None else round(r["a"] * 1e3, 3) for r in part_rows
                        ],
                    },
                    {
                        "name": "B",
                        "values": [
                            None if r["b"] is None else round(r["b"] * 1e3, 3) for r in part_rows
                        ],
                    },
                ],
            }
        )
    if all(runs):
        steps = [_median_steps(r) for r in runs]  # type: ignore[arg-type]
        xs = sorted(set(steps[0]) | set(steps[1]))
        charts.append(
            {
                "id": "step_time",
                "title": "Step time, median of the ranks",
                "kind": "line",
                "x": {"label": "step", "values": xs},
                "y_label": "step time",
                "unit": "ms",
                "note": "",
                "series": [
                    {"name": name, "values": [_to_ms(s.get(x)) for x in xs]}
                    for name, s in zip(("A", "B"), steps)
                ],
            }
        )
    return html_page.page("ddpmon compare", body, charts)


def _to_ms(v: float | None) -> float | None:
    return None if v is None else float(f"{v * 1e3:.4g}")


def _median_steps(run: Run) -> dict[int, float]:
    by_bin: dict[int, list[float]] = {}
    for h in run.ranks.values():
        for b, v in zip(h.binned.get("bin", []), h.binned.get("step_seconds", [])):
            if v is not None:
                by_bin.setdefault((b + 1) * run.stride, []).append(v)
    return {x: statistics.median(v) for x, v in by_bin.items()}
