"""The doctor's output: JSON for scripts, and for people the culprit first (like
torchelastic's "root cause (first observed failure)"), then one row per rank. Colour only
on a terminal, and never when NO_COLOR is set."""

from __future__ import annotations

import json
import os
import re
import shutil
import textwrap
from typing import IO, Any

from ..activity import Status
from ..advice import KINDS as ADVICE_KINDS
from . import words
from .findings import Diagnosis, Finding
from .view import GONE, RankView

_COLOURS = {"red": "31", "green": "32", "yellow": "33", "bold": "1", "dim": "2"}
_VERDICT_COLOUR = {
    "healthy": "green",
    "straggler": "yellow",
    "cannot_write": "yellow",
    "no_data": "yellow",
}
_STATUS_COLOUR = {
    Status.STEPPING: "green",
    Status.WAITING: "yellow",
    Status.BUSY: "yellow",
    Status.STUCK: "red",
    Status.FROZEN: "red",
    Status.DEAD: "red",
    Status.CRASHED: "red",
    Status.SILENT: "red",
    Status.EXITED: "dim",
    Status.UNKNOWN: "yellow",
}
_HEADLINE = {
    "healthy": "no problem found",
    "hang": "the job is hung",
    "dead_rank": "a rank died",
    "desync": "the ranks are out of step",
    "straggler": "a rank is slower than the others",
    "cannot_write": "ranks cannot write their state files",
    "not_started": "the job has not reached its first step",
    "no_data": "nothing to diagnose",
}


def as_json(diagnosis: Diagnosis) -> str:
    """Indented, with one line per rank: a 1,024-rank job's answer stays readable and
    greppable by rank, and is written by json's C encoder (indenting is pure Python)."""
    whole = diagnosis.as_dict()
    ranks = whole.pop("ranks")
    head = json.dumps(whole, indent=2, default=str)
    rows = ",\n".join("    " + json.dumps(r, default=str) for r in ranks)
    return head[:-2] + ',\n  "ranks": [' + (f"\n{rows}\n  " if rows else "") + "]\n}"


def use_colour(stream: IO[str]) -> bool:
    return hasattr(stream, "isatty") and stream.isatty() and not os.environ.get("NO_COLOR")


def render(diagnosis: Diagnosis, colour: bool = False, width: int | None = None) -> str:
    """The human report."""
    width = width or min(120, shutil.get_terminal_size((100, 20)).columns)

    def paint(text: str, name: str) -> str:
        return f"\033[{_COLOURS[name]}m{text}\033[0m" if colour else text

    d = diagnosis
    lines = []
    verdict = d.verdict.upper().replace("_", " ")
    where = (
        f"job {d.job!r}, {len(d.ranks)} rank{'s' if len(d.ranks) != 1 else ''}, " if d.job else ""
    )
    kinds = {f.kind for f in d.findings}
    headline = (
        "a node is lost"
        if "lost_node" in kinds
        else "every rank failed in the same place"
        if "same_error" in kinds
        else _HEADLINE[d.verdict]
    )
    warned = list(dict.fromkeys(f.kind for f in d.findings if f.severity == "warning"))
    if d.verdict == "healthy" and warned:  # never "no problem found" above a warning
        count = sum(f.severity == "warning" for f in d.findings)
        title = (
            f"{paint(verdict, 'yellow')} (no hang or crash), {count} warning{'s' if count != 1 else ''}: "
            + ", ".join(warned)
        )
    else:
        title = f"{paint(verdict, _VERDICT_COLOUR.get(d.verdict, 'red'))} - {headline}"
    lines.append(f"ddpmon doctor: {title} ({where}{d.state_dir})")
    main = [
        f
        for f in d.findings
        if f.severity in ("error", "warning")
        and f.kind in _ROOT_KINDS
        and (f.kind != "cannot_write" or d.verdict == "cannot_write")
    ]  # else a note beside the cause
    rest = [f for f in d.findings if f not in main]
    for f in main:
        lines.append("")
        title = "root cause (first observed failure)" if f.kind == "dead_rank" else "root cause"
        if f.kind == "straggler":
            title = "slowest rank"
        lines.append(paint(f"{title}: ", "bold") + f.summary)
        lines += _block(f, width)
    if rest:
        lines.append("")
        lines.append(paint("also found:", "bold"))
        for f in rest:
            lines += _wrap(f"[{f.severity}] {f.summary}", width, "  ", "    ")
            if f.kind in ADVICE_KINDS:  # the evidence a user checks before changing the script
                for line in f.evidence:
                    lines += _wrap(f"- {line}", width, "    ", "      ")
            if f.fix:
                lines += _wrap(f"fix: {f.fix}", width, "    ", "      ")
    if d.ranks:
        lines.append("")
        lines += _table(d.ranks, paint)
    if d.attempts:
        lines.append("")
        lines.append(paint("earlier attempts:", "bold"))
        for a in d.attempts:
            lines += _wrap(attempt_line(a), width, "  ", "    ")
    return "\n".join(lines) + "\n"


def attempt_line(a: dict[str, Any]) -> str:
    """One earlier attempt: how it ended, its culprit, its steps and the time lost after it."""
    culprits = a.get("culprit_ranks") or []
    who = f"culprit {words.who(culprits)}" if culprits else "no culprit known"
    lost = a.get("lost_seconds")
    after = f", {lost:.1f} s lost before attempt {a['attempt'] + 1}" if lost is not None else ""
    return f"attempt {a['attempt']}: {a['ended']}, {who}; {a['steps']} steps{after}"


_ROOT_KINDS = (
    "dead_rank",
    "same_error",
    "lost_node",
    "mismatch",
    "left_early",
    "cannot_write",
    "not_arrived",
    "port_in_use",
    "launch_failed",
    "master_unreachable",
    "node_missing",
    "stuck_rank",
    "not_joining",
    "desync",
    "comm_hang",
    "missing_rank",
    "gpu_behind",
    "straggler",
)


GROUP_FROM = 8
"""More lines or rows than this that differ only in the rank are grouped into one."""
_RANK_LINE = re.compile(r"^rank (\d+)(?: \(host [^,()]*, pid [^)]*\))?(.*)$")


def group_lines(lines: list[str]) -> list[str]:
    """Evidence lines that say the same of several ranks, as one line per group (``ranks
    0–1022 have waited 12.0 s in all_reduce #14``), in order of first appearance."""
    if len(lines) <= GROUP_FROM:
        return lines
    groups: dict[str, list[int]] = {}
    order: list[str] = []
    for line in lines:
        m = _RANK_LINE.match(line)
        key = m.group(2) if m else "\0" + line
        if key not in groups:
            groups[key] = []
            order.append(key)
        if m:
            groups[key].append(int(m.group(1)))
    out = []
    for key in order:
        if key.startswith("\0"):
            out.append(key[1:])
            continue
        ranks = groups[key]
        rest = key
        if len(ranks) > 1:
            rest = rest.replace(" has ", " have ", 1).replace(" is ", " are ", 1)
        out.append(f"{words.who(ranks)}{rest}")
    return out


def _block(f: Finding, width: int) -> list[str]:
    out = []
    for line in group_lines(f.evidence):
        if line.startswith("  "):  # a stack frame: keep it on one line
            out.append("    " + line.strip())
        else:
            out += _wrap(line, width, "  ", "    ")
    if f.fix:
        out += _wrap(f"fix: {f.fix}", width, "  ", "       ")
    return out


def _wrap(text: str, width: int, first: str, rest: str) -> list[str]:
    return textwrap.wrap(
        text, width, initial_indent=first, subsequent_indent=rest, break_on_hyphens=False
    ) or [first]


def _group_rows(
    rows: list[tuple[str, ...]], ranks: list[RankView]
) -> tuple[list[tuple[str, ...]], list[RankView]]:
    """Rows equal but for rank, host, pid and silence become one row (the first one's
    silence shown)."""
    groups: dict[tuple[str, ...], list[int]] = {}
    first: dict[tuple[str, ...], RankView] = {}
    for v, row in zip(ranks, rows):
        key = (row[1], row[4], row[5], _waiting_key(row[7]))
        groups.setdefault(key, []).append(v.rank)
        first.setdefault(key, v)
    out, views = [], []
    for key, members in groups.items():  # type: ignore[assignment]
        v = first[key]
        row = next(r for w, r in zip(ranks, rows) if w is v)
        hosts = (
            {str(w.state.host) for w in ranks if w.rank in set(members)}
            if len(members) > 1
            else {row[2]}
        )
        out.append(
            (
                words.ranks(members),
                row[1],
                row[2] if len(hosts) == 1 else f"{len(hosts)} hosts",
                row[3] if len(members) == 1 else "-",
                row[4],
                row[5],
                row[6],
                row[7],
            )
        )
        views.append(v)
    return out, views  # type: ignore[return-value]


def _waiting_key(cell: str) -> str:
    return cell.rsplit(",", 1)[0]


def _table(ranks: list[RankView], paint: Any) -> list[str]:
    header = ("rank", "status", "host", "pid", "step", "stage", "silent", "in collective")
    rows = []
    for v in ranks:
        s = v.state
        e = v.waiting
        waiting = "-"
        unknown = (
            v.status == Status.UNKNOWN
        )  # its file is old: neither its silence nor its wait is known
        if e and v.status not in GONE and not unknown:
            waiting = f"{e.describe(short=True)}, {e.age_seconds or 0:.1f} s"
        step = str(s.step)
        if v.status in (Status.FROZEN, Status.SILENT, Status.UNKNOWN):
            step += f" ({v.age:.0f} s old)"  # facts as of its last write, not now
        rows.append(
            (
                str(v.rank),
                v.status,
                str(s.host or "?"),
                str(s.pid or "?"),
                step,
                str(s.stage),
                "?" if unknown else f"{v.silent:.1f} s",
                waiting,
            )
        )
    if len(rows) > GROUP_FROM:
        rows, ranks = _group_rows(rows, ranks)  # type: ignore[arg-type, assignment]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    out = ["  ".join(h.ljust(widths[i]) for i, h in enumerate(header)).rstrip()]
    for v, row in zip(ranks, rows):
        cells = [c.ljust(widths[i]) for i, c in enumerate(row)]
        cells[1] = paint(cells[1], _STATUS_COLOUR.get(v.status, "bold"))
        out.append("  ".join(cells).rstrip())
    return out
