"""``ddpmon top``: a per-rank table of a job, read from its state files (no torch import)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from .. import steps
from ..errors import StateFileError
from ..state import files, records, schema
from .common import add_state_dir_argument, default_state_dir, no_state_dir
from .exits import EXIT_OK, EXIT_USAGE

HELP = "show every rank of a job (steps, step time, communication, buckets) from its state files"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_state_dir_argument(p)
    p.add_argument("--once", action="store_true", help="print once and exit")
    p.add_argument("--buckets", action="store_true", help="also show each rank's buckets")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    p.add_argument("--json", action="store_true", help="print the state files as one JSON list")


def run(args: argparse.Namespace) -> int:
    state_dir = args.state_dir or default_state_dir("top")
    if not state_dir:
        print(no_state_dir("top"), file=sys.stderr)
        return EXIT_USAGE
    if not os.path.isdir(state_dir):
        print(f"ddpmon top: {state_dir!r} is not a directory", file=sys.stderr)
        return EXIT_USAGE
    clear = not args.once and sys.stdout.isatty()
    while True:
        states, problems = load(state_dir)
        if args.json:
            print(json.dumps(states, indent=1, default=str))
        else:
            if clear:
                print("\033[2J\033[H", end="")
            print(render(states, problems, buckets=args.buckets), flush=True)
        if args.once or args.json:
            return EXIT_OK
        time.sleep(args.interval)


def load(state_dir: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Every readable state file (as plain data, every key present) and the problems of
    the others."""
    states, problems = [], []
    for path in files.list_files(state_dir):
        try:
            states.append(schema.to_json(files.read(path)))
        except StateFileError as exc:
            problems.append(str(exc))
    return states, problems


def _cell_ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def _median(state: dict[str, Any], key: str) -> float | None:
    entry = (state.get("timings") or {}).get(key)
    return entry["median"] if entry else None


def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _part_lines(states: list[dict[str, Any]]) -> list[str]:
    """Where each rank's time goes (mean ms per step over its last steps) and how much
    slower it is than the others, with the doctor's straggler rule (ddpmon/steps.py), over
    the steps its window holds (``slower``: "+27%/50" is 27% slower over its last 50)."""
    parts = {}
    for s in states:
        p = (s.get("timings") or {}).get("parts")
        if p:
            parts[s.get("rank", 0)] = records.load(schema.StepParts, p, "timings.parts")
    if not parts:
        return []
    scores = steps.scores(parts)
    lines = [
        f"\nwhere the time goes (mean ms per step over the last {max(p.steps for p in parts.values())} steps)",
        f"{'rank':>4} "
        + " ".join(f"{part.column:>7}" for part in steps.PART_TABLE)
        + f" {'step':>8} {'busy':>7} {'slower/steps':>12}  straggler",
    ]
    for rank in sorted(parts):
        p, sc = parts[rank], scores.get(rank)
        verdict = ""
        if sc is not None and sc.straggler:
            verdict = f"yes: {steps.PART_LABELS[sc.cause]}" if sc.cause else "yes"
        lines.append(
            f"{rank:>4} "
            + " ".join(
                f"{_cell_ms(getattr(p, part.name + '_seconds')):>7}" for part in steps.PART_TABLE
            )
            + f" {_cell_ms(p.step_seconds):>8} {_cell_ms(p.busy_seconds):>7} "
            + f"{(f'{sc.score:+.0%}/{sc.steps}' if sc else '-'):>12}  {verdict}"
        )
    return lines


def render(
    states: list[dict[str, Any]], problems: Sequence[str] = (), buckets: bool = False
) -> str:
    """The table; times are medians over each rank's recent steps, in milliseconds."""
    if not states:
        return "no state files" + ("".join(f"\n  {p}" for p in problems))
    attempts = sorted({s.get("attempt") or 0 for s in states})
    attempt = f"attempt {'/'.join(str(a) for a in attempts)}  " if attempts != [0] else ""
    lines = [
        f"job {states[0].get('job')}  world size {states[0].get('world_size')}  {attempt}"
        f"(times: median ms over recent steps)",
        f"{'rank':>4} {'host':<12} {'pid':>7} {'step':>6} {'stage':<14} {'step':>8} {'fwd':>7} "
        f"{'bwd':>7} {'exposed':>8} {'unused':>6} {'idle s':>7}  status",
    ]
    for s in sorted(states, key=lambda s: s.get("rank", 0)):
        idle = (s.get("now_unix") or 0) - (s.get("last_progress_unix") or s.get("now_unix") or 0)
        status = (
            "HANG suspected"
            if s.get("hang")
            else ("detached" if s.get("stage") == "detached" else "ok")
        )
        lines.append(
            f"{s.get('rank', '?'):>4} {str(s.get('host') or '?')[:12]:<12} {s.get('pid') or '?':>7} "
            f"{s.get('step', 0):>6} {str(s.get('stage', '?')):<14} {_cell_ms(_median(s, 'step_seconds')):>8} "
            f"{_cell_ms(_median(s, 'forward_seconds')):>7} {_cell_ms(_median(s, 'backward_seconds')):>7} "
            f"{_cell_ms(_median(s, 'exposed_comm_seconds')):>8} {len(s.get('unused_parameters') or []):>6} "
            f"{idle:>7.1f}  {status}"
        )
    lines += _part_lines(states)
    for s in states:
        if s.get("unused_parameters"):
            names = s["unused_parameters"]
            lines.append(
                f"rank {s['rank']} unused parameters: {', '.join(names[:8])}"
                + (f" (+{len(names) - 8})" if len(names) > 8 else "")
            )
        for note in (s.get("notes") or {}).values():
            lines.append(f"rank {s['rank']}: {note}")
    if buckets:
        for s in sorted(states, key=lambda s: s.get("rank", 0)):
            lines.append(f"\nrank {s.get('rank')} buckets:")
            lines.append(
                f"  {'bucket':>6} {'size':>10} {'dtype':<9} {'params':>6} {'ready ms':>9} "
                f"{'mean ms':>8} {'last ms':>8} {'last busbw':>12}  count"
            )
            if not s.get("buckets"):
                why = (
                    "bucket timing is off (the default on gloo, where a Python comm hook costs "
                    "step time): attach(model, bucket_timing='hook') times them"
                    if s.get("bucket_timing") == "off"
                    else "none seen yet (DDP builds them after its first step)"
                )
                lines.append(f"  {why}")
            for b in s.get("buckets") or []:
                bw = b.get("busbw_bytes_per_second")
                lines.append(
                    f"  {b.get('index', '?'):>6} {_bytes(b.get('bytes')):>10} {str(b.get('dtype', '?')):<9} "
                    f"{b.get('num_parameters', '?'):>6} {_cell_ms(b.get('ready_seconds')):>9} "
                    f"{_cell_ms(b.get('mean_seconds')):>8} {_cell_ms(b.get('last_seconds')):>8} "
                    f"{(_bytes(bw) + '/s') if bw else '-':>12}  {b.get('count', 0)}"
                )
    lines.extend(f"unreadable: {p}" for p in problems)
    return "\n".join(lines)
