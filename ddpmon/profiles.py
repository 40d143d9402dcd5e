"""A capture's trace (torch.profiler's Chrome/Perfetto JSON) read as what each operator and
each of the user's Python functions costs per step on its own, and where operators are
called from; two ranks compared function by function and operator by operator.

Pure and torch-free: ``ddpmon capture --compare`` reads the two traces the ranks wrote. An
operator's *self time* is its duration less that of the operators it ran inside it, on the
same thread (``cpu_op`` events); a GPU kernel's is its duration (``kernel``, ``gpu_memcpy``,
``gpu_memset``). Its *call site* is the innermost frame of the user's code around it in the
Python stack the trace records (``python_function`` events, from ``with_stack=True``): the
function and the line it starts on (torch records a frame's line as it is entered), or the
function alone for a frame that was running before the recording began (the training loop:
its line then is where the recording began, not the call). Times per step divide by the
steps recorded (torch's ``ProfilerStep#N`` spans).
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from . import frames
from .errors import StateFileError
from .formats import format_milliseconds
from .state import captures, files

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
LIBRARIES = frozenset(
    {
        "torch",
        "torchvision",
        "torchaudio",
        "torchtext",
        "functorch",
        "triton",
        "numpy",
        "ddpmon",
        "apex",
        "deepspeed",
        "transformers",
        "accelerate",
        "lightning",
        "pytorch_lightning",
    }
) | frozenset(getattr(sys, "stdlib_module_names", ()))
"""Top-level packages whose frames are not the user's: torch prints a frame's file relative
to the import path it came from, so ``torch/nn/modules/module.py`` or ``threading.py``."""
_FRAME = re.compile(r"^(?P<file>.+)\((?P<line>\d+)\): (?P<func>.+)$")
MIN_DIFFERENCE_MS = 0.01
"""Differences smaller than this (ms per step) are not listed."""


@dataclass
class Op:
    """One operator (or GPU kernel) over a whole capture: self time in microseconds, calls,
    and self time by call site."""

    name: str
    device: str
    """cpu or gpu"""
    self_us: float = 0.0
    calls: int = 0
    sites: dict[str, float] = field(default_factory=dict)


@dataclass
class Profile:
    """One rank's capture: its operators and how many steps it recorded."""

    path: str
    rank: int | None
    steps: int
    first_step: int | None
    last_step: int | None
    ops: dict[tuple[str, str], Op]
    functions: dict[str, Op] = field(default_factory=dict)
    """The user's Python functions by call site (``get_batch (train.py:40)``), each with its
    self time: its time less that of the user's functions it calls and of the collectives it
    waits in (the library code it calls is its own: ``time.sleep``, ``torch.stack``)."""

    def function_ms_per_step(self, site: str) -> float:
        op = self.functions.get(site)
        return op.self_us / 1000.0 / self.steps if op else 0.0

    def ms_per_step(self, key: tuple[str, str]) -> float:
        op = self.ops.get(key)
        return op.self_us / 1000.0 / self.steps if op else 0.0

    @property
    def total_ms_per_step(self) -> float:
        return (
            sum(op.self_us for op in self.ops.values() if op.device == "cpu") / 1000.0 / self.steps
        )


def read(path: str) -> Profile:
    """The trace at ``path``, read as untrusted input (no symlink, a regular file, at most
    the size a capture writes); StateFileError says what is wrong."""
    raw = files.read_bytes(path, captures.MAX_TRACE_BYTES)
    try:  # torch 2.2 writes some Python frames' names with stray bytes: not UTF-8, raw control characters
        data = json.loads(raw.decode("utf-8", errors="replace"), strict=False)
    except (ValueError, RecursionError) as exc:
        raise StateFileError(path, f"is not a JSON trace ({exc})") from None
    return parse(data, path)


def parse(data: Any, path: str = "<trace>") -> Profile:
    """A parsed Chrome trace as a Profile; StateFileError when it is not one."""
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise StateFileError(path, "is not a Chrome trace (no traceEvents list)")
    meta = data.get("ddpmon") if isinstance(data.get("ddpmon"), dict) else {}
    if isinstance(data.get("ddpmon"), str):  # torch writes metadata values as given
        try:
            meta = json.loads(data["ddpmon"])
        except ValueError:
            meta = {}
    threads: dict[tuple[Any, Any], list[tuple[float, float, int, str, dict[str, Any]]]] = (
        defaultdict(list)
    )
    gpu: list[dict[str, Any]] = []
    step_spans = 0
    recording = float("inf")  # when the first recorded step began (no steps: every line kept)
    for e in data["traceEvents"]:
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        cat, name = e.get("cat"), e.get("name")
        ts, dur = e.get("ts"), e.get("dur")
        if not isinstance(name, str) or not _number(ts) or not _number(dur) or dur < 0:  # type: ignore[operator]
            continue
        if cat == "user_annotation" and name.startswith("ProfilerStep#"):
            step_spans += 1
            recording = min(recording, float(ts))  # type: ignore[arg-type]
        elif cat in GPU_CATEGORIES:
            gpu.append(e)
        elif cat in ("cpu_op", "python_function") or cat in LAUNCH_CATEGORIES:
            # order at equal starts: the longer first, a Python frame before the op it calls
            order = 0 if cat == "python_function" else 1
            threads[(e.get("pid"), e.get("tid"))].append((float(ts), -float(dur), order, cat, e))  # type: ignore[arg-type]
    if not step_spans:
        recording = float("-inf")
    ops: dict[tuple[str, str], Op] = {}
    functions: dict[str, Op] = {}
    launch_sites: dict[Any, str] = {}
    for events in threads.values():
        _fold_thread(sorted(events, key=lambda t: t[:3]), ops, functions, launch_sites, recording)
    for e in gpu:
        op = ops.setdefault((e["name"], "gpu"), Op(e["name"], "gpu"))
        op.self_us += float(e["dur"])
        op.calls += 1
        args = e.get("args") if isinstance(e.get("args"), dict) else {}
        site = launch_sites.get(args.get("correlation"))  # type: ignore[union-attr]
        if site:
            op.sites[site] = op.sites.get(site, 0.0) + float(e["dur"])
    steps = step_spans or (meta.get("steps") if isinstance(meta.get("steps"), int) else 0) or 1  # type: ignore[union-attr]
    return Profile(
        path,
        _int(meta.get("rank")),  # type: ignore[union-attr]
        steps,
        _int(meta.get("first_step")),  # type: ignore[union-attr]
        _int(meta.get("last_step")),  # type: ignore[union-attr]
        ops,
        functions,
    )


def _fold_thread(
    events: list[tuple[float, float, int, str, dict[str, Any]]],
    ops: dict[tuple[str, str], Op],
    functions: dict[str, Op],
    launch_sites: dict[Any, str],
    recording: float,
) -> None:
    """One thread's events, sorted by start: self times of its operators (each less the
    operators it encloses) and of the user's functions (``Profile.functions``), and the
    user's frame around each operator (frames begun before ``recording`` without their
    line)."""
    stack: list[list[Any]] = []  # [end, category, op record or site, children's time]
    for ts, neg_dur, _, cat, e in events:
        while stack and stack[-1][0] <= ts:
            _close(stack.pop(), stack, functions)
        end = ts - neg_dur
        if cat == "python_function":
            site = _user_site(e["name"], with_line=ts >= recording)
            stack.append([end, cat, (site, -neg_dur) if site else None, 0.0])
            continue
        site = next(
            (
                entry[2][0]
                for entry in reversed(stack)
                if entry[1] == "python_function" and entry[2]
            ),
            None,
        )
        if cat in LAUNCH_CATEGORIES:
            correlation = (
                (e.get("args") or {}).get("correlation")
                if isinstance(e.get("args"), dict)
                else None
            )
            if correlation is not None and site:
                launch_sites[correlation] = site
            continue
        op = ops.setdefault((e["name"], "cpu"), Op(e["name"], "cpu"))
        op.calls += 1
        stack.append([end, cat, (op, site, -neg_dur), 0.0])
    while stack:
        _close(stack.pop(), stack, functions)


def _close(entry: list[Any], stack: list[list[Any]], functions: dict[str, Op]) -> None:
    if entry[1] == "python_function":
        if entry[2] is None:
            return  # a library's frame: its time is its user caller's
        site, dur = entry[2]
        fn = functions.setdefault(site, Op(site.split(" (", 1)[0], "python"))
        fn.self_us += max(0.0, dur - entry[3])
        fn.calls += 1
        _charge_caller(stack, dur)
        return
    if entry[1] != "cpu_op":
        return
    op, site, dur = entry[2]
    own = max(0.0, dur - entry[3])
    op.self_us += own
    key = site or "?"
    op.sites[key] = op.sites.get(key, 0.0) + own
    parent = next((e for e in reversed(stack) if e[1] == "cpu_op"), None)
    if parent is not None:
        parent[3] += dur
    if op.name.startswith(COLLECTIVE_PREFIXES) and not any(
        e[1] == "cpu_op" and e[2][0].name.startswith(COLLECTIVE_PREFIXES) for e in stack
    ):
        _charge_caller(stack, dur)  # waiting for the other ranks: not the function's own


def _charge_caller(stack: list[list[Any]], dur: float) -> None:
    """Take ``dur`` off the self time of the innermost user function open on ``stack``."""
    caller = next((e for e in reversed(stack) if e[1] == "python_function" and e[2]), None)
    if caller is not None:
        caller[3] += dur


def _user_site(frame: str, with_line: bool = True) -> str | None:
    """``forward (model.py:40)`` (or ``forward (model.py)``) for a frame of the user's code,
    None for a library's."""
    m = _FRAME.match(frame)
    if not m:
        return None  # a call into C ("<built-in method mm of type object ...>")
    path = m.group("file")
    if is_library_file(path):
        return None
    return (
        f"{m.group('func')} ({path}:{m.group('line')})"
        if with_line
        else f"{m.group('func')} ({path})"
    )


def is_library_file(path: str) -> bool:
    """A frame's file, as torch prints it, is torch's, the standard library's or an installed
    package's: what a reader skips to find the user's code."""
    if path.startswith("<") or "site-packages" in path or "dist-packages" in path:
        return True
    if path.startswith("/"):
        return frames.is_library(path)
    top = path.split("/", 1)[0]
    return top.removesuffix(".py") in LIBRARIES


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _int(x: Any) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


# -- two ranks, operator by operator ----------------------------------------------------------


@dataclass(frozen=True)
class Difference:
    """An operator's self time per step on a rank and on its peer (milliseconds), and the
    call site where most of the difference is."""

    name: str
    device: str
    ms: float
    peer_ms: float
    site: str | None

    @property
    def delta(self) -> float:
        return self.ms - self.peer_ms


def compare(profile: Profile, peer: Profile) -> list[Difference]:
    """Every operator whose self time per step differs between ``profile`` and ``peer``, the
    largest excess of ``profile`` first and its largest shortfall last."""
    out = []
    for key in set(profile.ops) | set(peer.ops):
        ms, peer_ms = profile.ms_per_step(key), peer.ms_per_step(key)
        if abs(ms - peer_ms) < MIN_DIFFERENCE_MS:
            continue
        out.append(
            Difference(key[0], key[1], ms, peer_ms, _site(profile, peer, key, ms >= peer_ms))
        )
    return sorted(out, key=lambda d: (-d.delta, d.name))


def compare_functions(profile: Profile, peer: Profile) -> list[Difference]:
    """``compare`` for the user's Python functions (``Profile.functions``): device
    ``python``, the site being where the function is (``train.py:40``)."""
    out = []
    for site in set(profile.functions) | set(peer.functions):
        ms, peer_ms = profile.function_ms_per_step(site), peer.function_ms_per_step(site)
        if abs(ms - peer_ms) < MIN_DIFFERENCE_MS:
            continue
        name, _, where = site.partition(" (")
        out.append(Difference(name, "python", ms, peer_ms, where.removesuffix(")") or None))
    return sorted(out, key=lambda d: (-d.delta, d.name))


def _site(profile: Profile, peer: Profile, key: tuple[str, str], more: bool) -> str | None:
    """The call site that accounts for most of the difference (on the rank that spends more)."""
    a = profile.ops.get(key) if more else peer.ops.get(key)
    b = peer.ops.get(key) if more else profile.ops.get(key)
    if a is None:
        return None
    a_steps, b_steps = (profile.steps, peer.steps) if more else (peer.steps, profile.steps)
    deltas = {
        site: us / a_steps - (b.sites.get(site, 0.0) / b_steps if b else 0.0)
        for site, us in a.sites.items()
    }
    best = max(deltas, key=lambda s: (deltas[s], s != "?"), default=None)
    return None if best in (None, "?") else best


def line(rank: int, peer: int, d: Difference) -> str:
    """``rank 1: +4.1 ms/step in aten::mm (9.3 vs 5.2 on rank 0), called from forward
    (model.py:40)``; a function: ``... in get_batch at train.py:40 (31.0 vs 1.0 on rank 0)``."""
    where = f", called from {d.site}" if d.site else ""
    what = {"cpu": d.name, "gpu": f"{d.name} (GPU)"}.get(d.device, d.name)
    if d.device == "python":
        what, where = (f"{d.name} at {d.site}" if d.site else d.name), ""
    return (
        f"rank {rank}: {'+' if d.delta >= 0 else '-'}{format_milliseconds(abs(d.delta))} ms/step in {what} "
        f"({format_milliseconds(d.ms)} vs {format_milliseconds(d.peer_ms)} on rank {peer}){where}"
    )


COLLECTIVE_PREFIXES = ("c10d::", "nccl:", "gloo:", "record_param_comms")
"""Operators that wait for the other ranks: their time is the peers' (or the network's),
not the rank's own work, so the comparison sets them apart."""


def is_collective(d: Difference) -> bool:
    return d.name.startswith(COLLECTIVE_PREFIXES)


def summary(
    rank: int, profile: Profile, peer_rank: int, peer: Profile, top: int = 5, fewer: int = 3
) -> list[str]:
    """The comparison in words: operator time per step on each rank, where ``rank`` spends
    more of its own work (largest first), then where it spends less, then the collectives'
    difference on its own (waiting, which a busy machine's scheduling also moves). First, the
    user's own Python functions on which ``rank`` spends more (self time): the code to look
    at, whether its time goes to operators or not (a data fetch, a sleep, a host sync)."""
    diffs = compare(profile, peer)
    slower_functions = [d for d in compare_functions(profile, peer) if d.delta > 0][:top]
    own = [d for d in diffs if not is_collective(d)]
    more = [d for d in own if d.delta > 0][:top]
    less = [d for d in reversed(own) if d.delta < 0][:fewer]
    lines = [
        f"operator self time per step: rank {rank} {format_milliseconds(profile.total_ms_per_step)} ms "
        f"over {profile.steps} steps, rank {peer_rank} {format_milliseconds(peer.total_ms_per_step)} ms "
        f"over {peer.steps} steps"
    ]
    if slower_functions:
        lines.append(
            f"your Python functions where rank {rank} spends more than rank {peer_rank} (self "
            "time: less the functions of yours they call and their waits for other ranks):"
        )
        lines += ["  " + line(rank, peer_rank, d) for d in slower_functions]
    if more:
        lines.append(f"where rank {rank} spends more than rank {peer_rank}:")
        lines += ["  " + line(rank, peer_rank, d) for d in more]
    else:
        lines.append(f"rank {rank} spends no more than rank {peer_rank} in any operator")
    if less:
        lines.append(f"where it spends less than rank {peer_rank}:")
        lines += ["  " + line(rank, peer_rank, d) for d in less]
    waiting = sum(d.delta for d in diffs if is_collective(d))
    if any(is_collective(d) for d in diffs):
        lines.append(
            f"in collectives (waiting for the other ranks, not its own work): rank {rank} "
            f"{'+' if waiting >= 0 else '-'}{format_milliseconds(abs(waiting))} ms/step "
            f"against rank {peer_rank}"
        )
    return lines


def as_json(profile: Profile, peer: Profile) -> list[dict[str, Any]]:
    """``compare_functions`` and ``compare`` as plain data (``ddpmon capture --json``)."""
    return [
        {
            "name": d.name,
            "device": d.device,
            "ms_per_step": round(d.ms, 4),
            "peer_ms_per_step": round(d.peer_ms, 4),
            "delta_ms_per_step": round(d.delta, 4),
            "site": d.site,
        }
        for d in compare_functions(profile, peer) + compare(profile, peer)
    ]
