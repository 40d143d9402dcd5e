"""The doctor's rules: from every rank's state (and its process) to one verdict.

Each rank is first put in one state: running (progress recently), waiting (no progress,
a collective in flight), stuck (no progress, no collective in flight), frozen (its process
is there but its state file is no longer rewritten: the main thread holds the GIL or the
process is stopped), dead (the process is gone without a word), crashed (it ended with an
uncaught exception), exited (it ended without one), silent (another host; its file stopped
changing). The verdict then follows, first match wins:

- a rank ended first (dead/crashed/silent) -> dead_rank, that rank; a rank that left cleanly
  while the others still needed it -> desync (it had fewer batches);
- ranks without progress outside any collective (stuck, frozen) -> hang, those ranks;
- ranks waiting while others keep running without joining -> hang, the running ones;
- waiting ranks in different collectives -> desync, the odd ones;
- every rank waiting in the same collective -> hang in the communication layer (no suspect
  rank), or the ranks without a state file when the group has members the doctor cannot see;
- otherwise the job progresses: straggler when one rank computes clearly slower (the others
  wait for it), else healthy.

Times are compared on one clock: each file's writer times are shifted by its own offset
(see load.py), and the doctor's clock is compared only with file modification times.
"""

from __future__ import annotations

import re
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ..recorder import site_key_of
from .load import StateFile
from .procs import Liveness

VERDICTS = ("healthy", "hang", "dead_rank", "desync", "straggler", "no_data")
STALE_MIN = 10.0
STALE_FACTOR = 5.0
STALL_MIN = 5.0
STALL_FACTOR = 5.0
STRAGGLER_RATIO = 1.25
STRAGGLER_MIN_SECONDS = 0.005
STRAGGLER_MIN_STEPS = 5
GONE = ("dead", "crashed", "exited", "silent")
STALLED = ("waiting", "stuck", "frozen")
PEER_FAILURE = re.compile(
    r"connection (closed|reset|refused)|closed by peer|broken pipe|timed out|timeout|"
    r"communicator was aborted|watchdog caught|recvbytes|sendbytes|socket|peer|"
    r"processgroup.*abort|nccl error|gloo",
    re.IGNORECASE,
)


@dataclass
class Finding:
    kind: str
    severity: str  # error | warning | info
    ranks: list[int]
    summary: str
    evidence: list[str] = field(default_factory=list)
    fix: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind, "severity": self.severity, "ranks": self.ranks,
            "summary": self.summary, "evidence": self.evidence, "fix": self.fix,
        }


@dataclass
class RankView:
    """One rank as the doctor sees it. Times in seconds; ``*_ago`` relative to now."""

    file: StateFile
    liveness: Liveness
    age: float
    status: str = "running"
    silent: float = 0.0
    stall_after: float = STALL_MIN
    in_flight: list[dict[str, Any]] = field(default_factory=list)
    stack: list[dict[str, Any]] | None = None
    stack_source: str | None = None
    stack_error: str | None = None
    gone_at: float | None = None
    stalled_when_written: bool = False

    @property
    def data(self) -> dict[str, Any]:
        return self.file.data

    @property
    def rank(self) -> int:
        return self.file.rank

    @property
    def waiting(self) -> dict[str, Any] | None:
        """The collective this rank is blocked in: its oldest in flight."""
        return min(self.in_flight, key=lambda e: e.get("issued_unix", 0.0)) if self.in_flight else None

    @property
    def exception(self) -> str | None:
        return (self.data.get("exit") or {}).get("exception")

    def timing(self, name: str) -> float | None:
        value = ((self.data.get("timings") or {}).get(name) or {}).get("median")
        return value if isinstance(value, (int, float)) else None

    def as_dict(self) -> dict[str, Any]:
        d = self.data
        waiting = self.waiting
        main = _main_thread(self.stack)
        return {
            "rank": self.rank,
            "host": d.get("host"),
            "pid": d.get("pid"),
            "status": self.status,
            "alive": self.liveness.alive,
            "liveness": self.liveness.detail,
            "step": d.get("step"),
            "phase": d.get("phase"),
            "silent_seconds": round(self.silent, 3),
            "file_age_seconds": round(self.age, 3),
            "waiting_in": _brief_entry(waiting) if waiting else None,
            "in_flight": len(self.in_flight),
            "collectives_issued": (d.get("collectives") or {}).get("issued"),
            "hang_reported": bool(d.get("hang")),
            "exit": d.get("exit"),
            "compute_seconds": self.timing("compute_seconds"),
            "exposed_comm_seconds": self.timing("exposed_comm_seconds"),
            "stack": {"source": self.stack_source, "frames": main["frames"][-20:]} if main else None,
            "stack_error": self.stack_error,
            "backend": d.get("backend"),
            "debug_level": d.get("debug_level"),
            "ddp": d.get("ddp"),
            "file": self.file.path,
        }


@dataclass
class Diagnosis:
    verdict: str
    suspect_ranks: list[int]
    findings: list[Finding]
    ranks: list[RankView]
    job: str | None = None
    state_dir: str | None = None
    jobs: dict[str, list[int]] = field(default_factory=dict)
    generated_unix: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "suspect_ranks": self.suspect_ranks,
            "findings": [f.as_dict() for f in self.findings],
            "ranks": [r.as_dict() for r in self.ranks],
            "job": self.job,
            "state_dir": self.state_dir,
            "jobs": self.jobs,
            "generated_unix": self.generated_unix,
        }


# -- per rank ---------------------------------------------------------------------------------


def view(f: StateFile, liveness: Liveness, now: float, stall: float | None) -> RankView:
    """Place one rank in its state from its file and its process."""
    d = f.data
    age = max(0.0, now - f.mtime)
    off = f.offset
    last = d.get("last_progress_unix")
    silent = age + max(0.0, d["now_unix"] - last) if isinstance(last, (int, float)) and isinstance(d.get("now_unix"), (int, float)) else age
    slowest = ((d.get("timings") or {}).get("step_seconds") or {}).get("max")
    stall_after = stall if stall is not None else max(STALL_MIN, STALL_FACTOR * (slowest or 0.0))
    in_flight = []
    for e in d.get("in_flight") or []:
        if isinstance(e, dict) and isinstance(e.get("issued_unix"), (int, float)):
            in_flight.append(dict(e, age_seconds=round(now - (e["issued_unix"] + off), 3)))
    if not in_flight and "nccl" in str(d.get("backend")):
        # NCCL ops leave the CPU at once; the flight recorder knows which ones the GPU has
        # not completed. (gloo completes on the CPU, where ddpmon tracks it exactly, and its
        # flight-recorder completion states lag behind.)
        in_flight = [dict(e, age_seconds=round(now - (e["issued_unix"] + off), 3)) for e in flight_recorder_waits(d)]
    v = RankView(f, liveness, age, silent=silent, stall_after=stall_after, in_flight=in_flight)
    interval = state_interval(d)
    stale = age > max(STALE_MIN, STALE_FACTOR * interval)
    exit_record = d.get("exit")
    if isinstance(exit_record, dict):  # it ended (possibly still tearing down)
        v.status = "crashed" if exit_record.get("exception") else "exited"
        t = exit_record.get("unix")
        v.gone_at = t + off if isinstance(t, (int, float)) else f.mtime
    elif liveness.alive is False:
        v.status = "exited" if d.get("phase") == "detached" else "dead"
        v.gone_at = f.mtime + interval / 2
    elif liveness.alive is None and stale:
        v.status = "silent"
        v.gone_at = f.mtime + interval / 2
    elif liveness.stopped or (liveness.alive and stale):
        v.status = "frozen"
    elif d.get("hang") or silent > stall_after:
        v.status = "waiting" if in_flight else "stuck"
    written_silent = silent - age
    v.stalled_when_written = bool(d.get("hang")) or written_silent > stall_after
    if v.status in GONE:  # the ages that matter are those at its last write
        for e in v.in_flight:
            e["age_seconds"] = round((d.get("now_unix") or e["issued_unix"]) - e["issued_unix"], 3)
    return v


def flight_recorder_waits(d: dict[str, Any]) -> list[dict[str, Any]]:
    """Collectives that torch's flight recorder (in the rank's hang report) shows enqueued
    and not completed: the first one per process group, numbered by torch's own sequence."""
    fr = (d.get("hang") or {}).get("flight_recorder") or {}
    entries = [e for e in fr.get("entries") or [] if isinstance(e, dict) and not e.get("is_p2p")]
    out = []
    for pg, status in sorted((fr.get("pg_status") or {}).items()):
        try:
            enqueued = int(status["last_enqueued_collective"])
            completed = int(status["last_completed_collective"])
        except (KeyError, TypeError, ValueError):
            continue
        if enqueued <= completed:
            continue
        seq = completed + 1
        match = next((
            e for e in entries
            if e.get("collective_seq_id") == seq
            and pg in (str(e.get("pg_id")), str((e.get("process_group") or [None])[0]))
        ), {})
        created = match.get("time_created_ns")
        out.append({
            "seq": seq,
            "op": str(match.get("profiling_name", "?")).split(":")[-1],
            "group": pg,
            "group_size": 0,
            "bytes": None,
            "call_site": "?",
            "function": "",
            "issued_unix": created / 1e9 if isinstance(created, (int, float)) else (d.get("last_progress_unix") or 0.0),
            "source": "flight recorder",
        })
    return out


def state_interval(d: dict[str, Any]) -> float:
    """Seconds between the rank's state-file rewrites."""
    value = d.get("state_interval")
    return float(value) if isinstance(value, (int, float)) and value > 0 else 1.0


# -- across ranks -----------------------------------------------------------------------------


def decide(views: list[RankView], missing: list[int]) -> tuple[str, list[int], list[Finding]]:
    """The verdict, the suspect ranks and the findings behind them."""
    if not views:
        return "no_data", [], []
    gone = [v for v in views if v.status in GONE]
    stalled = [v for v in views if v.status in STALLED]
    if gone and _killed_while_hung(views):
        for v in views:  # diagnose the hang as it was when the ranks were ended
            v.status = "waiting" if v.in_flight else "stuck"
        verdict, suspects, findings = _stalled(views, views, missing)
        findings.append(Finding(
            "ended_while_hung", "info", [v.rank for v in views],
            "every rank's process is gone without an error of its own, and each one was "
            "stalled at its last state-file write: this is the hang as it was when the ranks "
            "were ended (by a timeout, the scheduler or a person)",
        ))
        return verdict, suspects, findings
    if gone:
        result = _gone(views, gone, stalled)
        if result is not None:
            return result
    if stalled:
        return _stalled(views, stalled, missing)
    straggler = _straggler(views)
    if straggler is not None:
        return "straggler", straggler.ranks, [straggler]
    return "healthy", [], []


def _killed_while_hung(views: list[RankView]) -> bool:
    """All processes gone without an exit record of their own, each one stalled when it
    last wrote its state file."""
    return all(
        v.status in ("dead", "silent") and v.stalled_when_written for v in views
    )


def _gone(views: list[RankView], gone: list[RankView], stalled: list[RankView]) -> tuple[str, list[int], list[Finding]] | None:
    failed = [v for v in gone if v.status != "exited"]
    if not failed and len(gone) == len(views):
        return "healthy", [], [Finding(
            "finished", "info", [v.rank for v in views],
            f"the job has ended: all {len(views)} ranks exited without an error",
        )]
    if not failed and not stalled:
        return None  # some ranks finished, the others still make progress

    def order(v: RankView) -> tuple[bool, float]:
        secondary = v.status == "crashed" and bool(PEER_FAILURE.search(v.exception or ""))
        return (secondary, v.gone_at if v.gone_at is not None else v.file.mtime)

    first = min(gone, key=order)
    others = sorted((v for v in gone if v is not first), key=order)
    evidence = [_gone_line(first)] + [_gone_line(v) for v in others]
    evidence += [_wait_line(v) for v in stalled]
    if first.status == "exited":
        waiting = [v.rank for v in stalled] + [v.rank for v in failed]
        return "desync", [first.rank], [Finding(
            "left_early", "error", [first.rank],
            f"rank {first.rank} left the job (exited without an error at step "
            f"{first.data.get('step')}) while {_who(waiting)} still needed it in "
            f"{'their' if len(waiting) > 1 else 'its'} collectives: the ranks did not run the "
            "same number of steps",
            evidence, FIX_UNEVEN,
        )]
    if first.exception and not PEER_FAILURE.search(first.exception):
        where = first.data["exit"].get("where")
        fix = (
            f"Rank {first.rank} raised {short_exception(first.exception)}"
            + (f" at {where}" if where else "")
            + ": fix that error. The other ranks failed or wait because of it."
        )
    elif first.exception:
        fix = (
            "Every rank that ended failed in communication, so the cause is not among them: "
            "look for the first error in the logs of all ranks (also those without a state "
            "file here), at the hosts (`dmesg`, OOM killer) and at the network between them."
        )
    else:
        pid = first.data.get("pid")
        fix = (
            f"Find out why rank {first.rank} (pid {pid} on {first.data.get('host')}) ended "
            "without a Python exception: its stderr or log for the first error; `dmesg` or "
            f"`journalctl -k` for the kernel's OOM killer ('Killed process {pid}') or a "
            "segfault; a call to os._exit or a signal (SIGKILL, SIGTERM from a scheduler). "
            "The other ranks failed or wait because of it."
        )
    summary = f"rank {first.rank} {_ended(first, brief=True)} first"
    if others:
        summary += f"; {_who([v.rank for v in others])} ended after it"
    if stalled:
        summary += f"; {_who([v.rank for v in stalled])} {_verb(stalled, 'waits', 'wait')} for it"
    return "dead_rank", [first.rank], [Finding("dead_rank", "error", [first.rank], summary, evidence, fix)]


def _stalled(views: list[RankView], stalled: list[RankView], missing: list[int]) -> tuple[str, list[int], list[Finding]]:
    stuck = [v for v in stalled if v.status in ("stuck", "frozen")]
    waiting = [v for v in stalled if v.status == "waiting"]
    running = [v for v in views if v.status == "running"]
    if stuck:
        evidence = []
        for v in stuck:
            evidence.append(_stuck_line(v))
            evidence += _stack_lines(v)
        evidence += [_wait_line(v) for v in waiting]
        frozen = [v for v in stuck if v.status == "frozen"]
        summary = f"{_who([v.rank for v in stuck])} {_verb(stuck, 'is', 'are')} stuck outside any collective"
        if waiting:
            summary += (
                f"; {_who([v.rank for v in waiting])} {_verb(waiting, 'waits', 'wait')} for "
                f"{_verb(stuck, 'it', 'them')} in {_entry_name(waiting[0].waiting)}"
            )
        fix = FIX_STUCK
        if frozen:
            fix = FIX_FROZEN + " " + fix
        return "hang", [v.rank for v in stuck], [Finding("stuck_rank", "error", [v.rank for v in stuck], summary, evidence, fix)]
    joined = {(e["group"], e["seq"]) for v in waiting for e in [v.waiting] if e}
    absent = [v for v in running if not any((e.get("group"), e.get("seq")) in joined for e in v.in_flight)]
    if absent:
        evidence = [_wait_line(v) for v in waiting] + [
            f"rank {v.rank} keeps making progress (step {v.data.get('step')}, phase "
            f"{v.data.get('phase')}) but has not issued it" for v in absent
        ]
        for v in absent:
            evidence += _stack_lines(v)
        return "hang", [v.rank for v in absent], [Finding(
            "not_joining", "error", [v.rank for v in absent],
            f"{_who([v.rank for v in waiting])} {_verb(waiting, 'waits', 'wait')} in "
            f"{_entry_name(waiting[0].waiting)}; {_who([v.rank for v in absent])} "
            f"{_verb(absent, 'runs', 'run')} on without issuing it",
            evidence, FIX_STUCK,
        )]
    waiting = waiting + [v for v in running if v not in absent]
    return _collectives(waiting, missing)


def _collectives(waiting: list[RankView], missing: list[int]) -> tuple[str, list[int], list[Finding]]:
    """Every rank waits: in the same collective (communication layer, or an unseen member)
    or in different ones (desync)."""
    entries = {v.rank: v.waiting for v in waiting if v.waiting}
    evidence = [_wait_line(v) for v in waiting]
    if _same_collective(waiting):
        e = next(iter(entries.values()))
        size = e.get("group_size") or 0
        unseen = [r for r in missing if size == 0 or size > len(waiting)]
        if unseen:
            return "hang", unseen, [Finding(
                "missing_rank", "error", unseen,
                f"{_who(sorted(entries))} {_verb(entries, 'waits', 'wait')} in {_entry_name(e)}; the "
                f"group has {size or 'more'} members and {_who(unseen)} "
                f"{_verb(unseen, 'has', 'have')} no state file here",
                evidence + [f"no state file for ranks {_ranks(missing)}"],
                "Look at " + _who(unseen) + " directly (their logs, `py-spy dump` on their "
                "hosts, or `ddpmon doctor` on their hosts): they are in this group but report "
                "nothing here (not attached, another host without a shared state directory, "
                "or never started).",
            )]
        if "nccl" in str(waiting[0].data.get("backend")):
            evidence += _flight_recorder_lines(waiting)
        return "hang", [], [Finding(
            "comm_hang", "error", sorted(entries),
            f"all ranks wait in {_entry_name(e)} and none is behind: the collective itself "
            "does not complete (network or communication library)",
            evidence, fix_comm(waiting[0].data.get("backend"), waiting[0].data.get("debug_level")),
        )]
    odd = _odd_ranks(waiting)
    steps = {v.rank: v.data.get("step") for v in waiting}
    if len(set(steps.values())) > 1:
        evidence.append("the ranks are at different steps: " + ", ".join(f"rank {r}: {s}" for r, s in steps.items()))
    parts = []
    for v in sorted(waiting, key=lambda v: (v.rank not in odd, v.rank)):
        parts.append(f"rank {v.rank} in {_entry_name(v.waiting)}")
    summary = (
        f"the ranks wait in different collectives ({'; '.join(parts)}): "
        f"{_who(odd)} issued a collective the others did not"
    )
    fix = FIX_DESYNC + " " + rerun_advice(
        waiting[0].data.get("backend"), waiting[0].data.get("debug_level"), desync=True
    )
    return "desync", odd, [Finding("desync", "error", odd, summary, evidence, fix)]


def _same_collective(waiting: list[RankView]) -> bool:
    """True when the ranks wait in one collective: the same (group, seq, op), or a rank is
    one collective ahead after completing the one the others still wait in."""
    entries = [v.waiting for v in waiting if v.waiting]
    if len({(e.get("group"), e.get("seq"), e.get("op")) for e in entries}) == 1:
        return True
    if len({e.get("group") for e in entries}) != 1:
        return False
    low = min(e.get("seq", 0) for e in entries)
    behind = [e for e in entries if e.get("seq") == low]
    if len({e.get("op") for e in behind}) != 1:
        return False
    target = (behind[0].get("group"), low, behind[0].get("op"))
    for v in waiting:
        e = v.waiting
        if e is None or e.get("seq") == low:
            continue
        done = list(v.data.get("collective_log") or []) + [v.data.get("last_collective") or {}]
        if not any((c.get("group"), c.get("seq"), c.get("op")) == target and not c.get("error") for c in done):
            return False
    return True


def _odd_ranks(waiting: list[RankView]) -> list[int]:
    """The ranks that issued what the others did not: a call site no other rank ever used,
    else the minority collective."""
    keys = {v.rank: _site_key(v.waiting) for v in waiting if v.waiting}
    sites = {v.rank: v.data.get("collective_sites") or {} for v in waiting}
    never = [r for r, k in keys.items() if all(not sites[o].get(k) for o in keys if o != r)]
    if 0 < len(never) < len(keys):
        return sorted(never)
    sig = {r: (e.get("group"), e.get("op"), _site_key(e)) for r, e in ((v.rank, v.waiting) for v in waiting) if e}
    counts = Counter(sig.values()).most_common()
    if len(counts) > 1 and counts[0][1] > counts[1][1]:
        return sorted(r for r, s in sig.items() if s != counts[0][0])
    return sorted(sig)


def _straggler(views: list[RankView]) -> Finding | None:
    """One or more ranks whose compute per step is clearly longer than the others'."""
    compute = {
        v.rank: v.timing("compute_seconds") for v in views
        if v.timing("compute_seconds") is not None
        and ((v.data.get("timings") or {}).get("window_steps") or 0) >= STRAGGLER_MIN_STEPS
    }
    if len(compute) < 2:
        return None
    values = sorted(compute.values())
    baseline = values[0] if len(values) == 2 else statistics.median(values)
    slow = sorted(
        r for r, c in compute.items()
        if c >= STRAGGLER_RATIO * baseline and c - baseline >= STRAGGLER_MIN_SECONDS
    )
    if not slow or len(slow) == len(compute):
        return None
    exposed = {v.rank: v.timing("exposed_comm_seconds") for v in views}
    others = [r for r in compute if r not in slow]
    evidence = [
        f"rank {r}: compute {_ms(compute[r])} per step (forward + backward, median), waits "
        f"{_ms(exposed.get(r))} for communication after backward"
        for r in sorted(compute)
    ]
    confirmed = all(
        exposed.get(s) is not None and all(exposed.get(o) is not None and exposed[s] <= exposed[o] for o in others)
        for s in slow
    )
    evidence.append(
        "confirmed: the slow rank waits least for communication (the others wait for it)"
        if confirmed else "the exposed communication times do not single it out"
    )
    evidence += _ready_lines(views, slow, others)
    ratio = max(compute[s] for s in slow) / baseline if baseline else float("inf")
    return Finding(
        "straggler", "warning", slow,
        f"{_who(slow)} {_verb(slow, 'computes', 'compute')} "
        f"{ratio:.1f}x slower than the others ({_ms(max(compute[s] for s in slow))} against "
        f"{_ms(baseline)} per step); the whole job runs at its speed",
        evidence, FIX_STRAGGLER,
    )


# -- words ------------------------------------------------------------------------------------

FIX_STUCK = (
    "Look at the stack above: the rank is not in any collective, so the others wait for it. "
    "Typical causes: a data loader or I/O call that blocks, an endless loop, a Python "
    "deadlock, or rank-conditional code that skips a collective. If the ranks have different "
    "numbers of batches, use DistributedSampler(dataset, drop_last=True) or "
    "torch.distributed.algorithms.Join."
)
FIX_FROZEN = (
    "A frozen rank's own watchdog cannot run (its main thread holds the GIL, or the process "
    "is stopped): read its live stack with `py-spy dump --pid PID`."
)
FIX_UNEVEN = (
    "Give every rank the same number of batches: DistributedSampler(dataset, drop_last=True), "
    "or wrap the training loop in `with torch.distributed.algorithms.Join([model]):` for "
    "uneven inputs; make any collective after the loop run on every rank."
)
FIX_DESYNC = (
    "Every rank must issue the same collectives in the same order. Look at the call site of "
    "the odd rank's collective: rank-conditional code (`if rank == 0: dist.barrier()`) must "
    "run on all ranks. If the ranks have different numbers of batches (uneven inputs), use "
    "DistributedSampler(dataset, drop_last=True) or torch.distributed.algorithms.Join."
)
FIX_STRAGGLER = (
    "Look at what differs on that rank: its data (longer sequences, bigger batches), its host "
    "or GPU (other processes, CPU contention, clocks or thermal throttling: `ddpmon top`, "
    "nvidia-smi), or work only that rank does (logging, evaluation, checkpointing)."
)


def rerun_advice(backend: str | None, debug_level: str | None = None, desync: bool = False) -> str:
    """The variables to rerun with for more detail, by backend and the debug level the job
    already runs with (never DETAIL with gloo)."""
    nccl = "nccl" in str(backend)
    if debug_level == "DETAIL" and nccl:
        return (
            "The job already runs with TORCH_DISTRIBUTED_DEBUG=DETAIL: the ranks' logs hold "
            "torch's own collective checks (look for 'Detected mismatch between collectives'); "
            "add NCCL_DEBUG=WARN TORCH_NCCL_TRACE_BUFFER_SIZE=2000 TORCH_NCCL_DUMP_ON_TIMEOUT=1 "
            "for the flight recorder dump on a timeout (read it with `torchfrtrace`)."
        )
    if nccl:
        return (
            "To see more, rerun with TORCH_DISTRIBUTED_DEBUG=DETAIL TORCH_CPP_LOG_LEVEL=INFO "
            "NCCL_DEBUG=WARN TORCH_NCCL_TRACE_BUFFER_SIZE=2000 TORCH_NCCL_DUMP_ON_TIMEOUT=1 "
            "(the flight recorder dump on a timeout; read it with `torchfrtrace`)."
        )
    text = (
        "To see more, rerun with TORCH_DISTRIBUTED_DEBUG=INFO TORCH_CPP_LOG_LEVEL=INFO "
        "(not DETAIL with gloo: it crashes while building DDP on torch 2.11-2.13)"
        if debug_level in (None, "OFF") else
        f"The job runs with TORCH_DISTRIBUTED_DEBUG={debug_level}: its logs have more"
    )
    if desync:
        text += "; a `dist.monitored_barrier()` before the suspect code names the ranks that never reach it"
    return text + "."


def fix_comm(backend: str | None, debug_level: str | None = None) -> str:
    if "nccl" in str(backend):
        return (
            "No rank is behind: check the network and NCCL. " + rerun_advice(backend, debug_level)
            + " Check NCCL_SOCKET_IFNAME and NCCL_IB_* settings, firewalls between hosts, and "
            "the GPUs (nvidia-smi; `dmesg` for Xid errors)."
        )
    return (
        "No rank is behind: check the network between the ranks (GLOO_SOCKET_IFNAME picks the "
        "interface; firewalls, MTU, a link that drops packets). " + rerun_advice(backend, debug_level)
    )


def _ended(v: RankView, brief: bool = False) -> str:
    if v.status == "crashed":
        return "crashed" if brief or not v.exception else f"crashed ({short_exception(v.exception)})"
    if v.status == "silent":
        return "stopped writing its state file (on another host: dead or frozen)"
    if v.status == "exited":
        return "exited"
    return "died" if brief else "died without a Python exception (killed, os._exit, or a crash)"


_WRAPPED = re.compile(r"^(?:\w+(?:Error|Exception): )?Got the following error when running the callback: ")


def short_exception(text: str, limit: int = 160) -> str:
    """The first line of an exception without torch's callback wrappers, shortened."""
    line = text.strip().splitlines()[0] if text.strip() else text
    while True:
        stripped = _WRAPPED.sub("", line)
        if stripped == line:
            break
        line = stripped
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _gone_line(v: RankView) -> str:
    d = v.data
    where = (d.get("exit") or {}).get("where")
    return (
        f"rank {v.rank} (host {d.get('host')}, pid {d.get('pid')}): {_ended(v)}"
        + (f" at {where}" if where else "")
        + f"; last seen at step {d.get('step')}, phase {d.get('phase')}, {v.liveness.detail}"
    )


def _stuck_line(v: RankView) -> str:
    d = v.data
    what = "frozen: its state file is no longer rewritten" if v.status == "frozen" else "not in any collective"
    last = d.get("last_collective") or {}
    after = f"; its last collective was {_entry_name(last)}" if last else ""
    return (
        f"rank {v.rank} (host {d.get('host')}, pid {d.get('pid')}): no progress for {v.silent:.1f} s, "
        f"step {d.get('step')}, phase {d.get('phase')}, {what}{after}"
    )


def _wait_line(v: RankView) -> str:
    e = v.waiting
    d = v.data
    if e is None:
        return f"rank {v.rank}: no progress for {v.silent:.1f} s, step {d.get('step')}, phase {d.get('phase')}"
    return (
        f"rank {v.rank} (host {d.get('host')}, pid {d.get('pid')}) has waited "
        f"{e.get('age_seconds', 0.0):.1f} s in {_entry_name(e)}, step {d.get('step')}"
    )


def _stack_lines(v: RankView) -> list[str]:
    main = _main_thread(v.stack)
    if not main:
        return [f"rank {v.rank}: no stack ({v.stack_error or 'no hang report yet and py-spy not used'})"]
    frames = [f for f in main["frames"] if not str(f.get("file")).startswith("<frozen")][-8:]
    gil = " (holds the GIL)" if main.get("owns_gil") else ""
    lines = [f"rank {v.rank} main thread{gil}, from {v.stack_source}, innermost last:"]
    lines += [f"  {f.get('file')}:{f.get('line')} in {f.get('function')}" for f in frames]
    return lines


def _ready_lines(views: list[RankView], slow: list[int], others: list[int]) -> list[str]:
    ready = {}
    for v in views:
        buckets = [b for b in v.data.get("buckets") or [] if isinstance(b.get("ready_seconds"), (int, float))]
        if buckets:
            ready[v.rank] = max(b["ready_seconds"] for b in buckets)
    if not ready or not any(r in ready for r in slow):
        return []
    return ["last gradient bucket ready after the step began: " + ", ".join(
        f"rank {r}: {_ms(ready[r])}" for r in sorted(ready)
    )]


def _flight_recorder_lines(waiting: list[RankView]) -> list[str]:
    lines = []
    for v in waiting:
        fr = (v.data.get("hang") or {}).get("flight_recorder") or {}
        for pg, status in sorted((fr.get("pg_status") or {}).items()):
            lines.append(
                f"rank {v.rank} flight recorder, group {pg}: last enqueued collective "
                f"{status.get('last_enqueued_collective')}, last started "
                f"{status.get('last_started_collective')}, last completed "
                f"{status.get('last_completed_collective')}"
            )
    return lines


def _main_thread(threads: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    if not threads:
        return None
    return next((t for t in threads if t.get("main")), threads[0])


def _entry_name(e: dict[str, Any] | None) -> str:
    if not e:
        return "?"
    bucket = f", DDP bucket {e['bucket']}" if e.get("bucket") is not None else ""
    func = f" in {e['function']}" if e.get("function") else ""
    caller = f", called from {e['callers'][0]}" if e.get("callers") else ""
    if e.get("source") == "flight recorder":
        return f"{e.get('op')} #{e.get('seq')} (group {e.get('group')}, from torch's flight recorder)"
    if e.get("bucket") is not None and e.get("call_site") == "DDP backward":
        return f"{e.get('op')} #{e.get('seq')} (group {e.get('group')}, gradient bucket {e['bucket']} of DDP's backward)"
    return f"{e.get('op')} #{e.get('seq')} (group {e.get('group')}{bucket}, issued at {e.get('call_site')}{func}{caller})"


def _site_key(e: dict[str, Any] | None) -> str:
    return site_key_of(e) if e else ""


def _brief_entry(e: dict[str, Any]) -> dict[str, Any]:
    keys = ("op", "seq", "group", "group_size", "bytes", "call_site", "function", "bucket", "age_seconds")
    return {k: e.get(k) for k in keys if k in e}


def _ranks(ranks: Any) -> str:
    return ", ".join(str(r) for r in sorted(ranks))


def _who(ranks: Any) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_ranks(ranks)}"


def _verb(items: Any, one: str, many: str) -> str:
    return one if len(items) == 1 else many


def _ms(seconds: float | None) -> str:
    return "?" if seconds is None else f"{seconds * 1000:.1f} ms"
