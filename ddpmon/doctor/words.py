"""The doctor's wording: what to do about each finding (``FIX_*``, ``fix_*``), the rerun
advice by backend, and the sentences that describe a rank or a collective in evidence.

Rules decide; this module only says. Keeping the words here lets a rule stay a few lines
of logic, and lets the texts be read (and reviewed) together.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Iterable, Sequence

from .. import steps
from ..activity import CPU_BUSY, IO_BUSY, STILL_SECONDS, Status
from ..advice.words import REDUCTION_ERROR
from ..formats import format_seconds
from ..state.fault import path_for as fault_path
from ..state.files import ROOM_BYTES
from ..state.schema import Collective, WriteFailure
from . import flight
from .view import RankView, main_thread

# -- what to do -------------------------------------------------------------------------------

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
FIX_STRAGGLER_PART = {
    "data_wait": "look at its data loader (num_workers, storage, decoding, augmentation, "
    "pin_memory) and at what the loop does before the forward",
    "h2d": "look at its host-to-device copies (pin_memory=True and .to(device, non_blocking=True))",
    "forward": "look at its forward: bigger or longer inputs on that rank, or a slower device "
    "(throttling, another process on it: `ddpmon top`, nvidia-smi)",
    "backward": "look at its backward: bigger or longer inputs on that rank, or a slower device "
    "(throttling, another process on it: `ddpmon top`, nvidia-smi)",
    "optimizer": "look at its optimizer step: a slower device or CPU, CPU offload, or "
    "rank-specific work in a custom optimizer",
    "other": "look at the code that rank runs outside its forward, backward and optimizer "
    "step (`ddpmon doctor` says where in the step)",
}
"""The fix for a straggler whose cause is the part named (one of ``steps.BUSY_PARTS``)."""


def straggler_summary(
    rank: int,
    score: float,
    cause: str | None,
    share: float,
    gap: str | None = None,
    frame: str | None = None,
    *,
    window: str | None = None,
) -> str:
    """``rank 1 is 41% slower than the others over its last 50 steps, 95% of it in data
    wait: look at its data loader (...)``; ``window``: the steps the figure is over
    (``steps.over``); for the time outside the measured parts, where it lies (``gap``, one
    of ``steps.GAPS``) and the user's frame most of its stack samples there were in
    (``frame``)."""
    text = f"rank {rank} is {steps.slower(score)} than the others" + (
        f" {window}" if window else ""
    )
    if cause is None:
        return text + ", spread over several parts of the step"
    where = f"in {steps.PART_LABELS[cause]}"
    fix = FIX_STRAGGLER_PART[cause]
    if cause == "other" and gap is not None:
        where = steps.GAP_LABELS[gap]
        fix = f"look at the code that rank runs {where}"
    if frame is not None:
        fix = f"look at {frame}, where most of its stack samples there were"
    return f"{text}, {share:.0%} of it {where}: {fix}"


FIX_BUSY = (
    "Nothing to fix if this work is expected (evaluation, a checkpoint, logging): ddpmon never "
    "counts a rank that works as hung. Ranks that wait for it meanwhile are ended by their "
    "process group's own timeout (init_process_group(timeout=)): keep that above the longest "
    "such pause."
)
FIX_PEERS_FAILED = (
    "Every rank that ended failed in communication, so the cause is not among them: "
    "look for the first error in the logs of all ranks (also those without a state "
    "file here), at the hosts (`dmesg`, OOM killer) and at the network between them."
)
FIX_UNUSED = (
    "Expected for branches some ranks skip (DDP needs find_unused_parameters=True "
    "for them); otherwise make those parameters take part in the loss."
)
FIX_PART_OFF = "Training is not affected; the rank's log has the traceback. Please report it."
FIX_NO_STATE_FILES = (
    "Attach ddpmon in the training script (`ddpmon.attach(model)`) and point the "
    "doctor at the job's state directory (DDPMON_STATE_DIR; by default <tmp>/ddpmon-<uid>/<job>)."
)
FIX_MISSING_RANKS = (
    "Those ranks have not attached yet, or write their state files on another host: "
    "give every rank the same shared DDPMON_STATE_DIR, or run the doctor on each host."
)
FIX_LEFTOVER = "Delete state files of runs that ended."
FIX_BAD_STATE_FILE = (
    "A rank replaces its state file atomically, so a truncated or corrupt one was written "
    "by something else or the disk is full; delete it if that rank no longer runs."
)
FIX_UNREACHABLE_DAEMON = (
    "Start `ddpmon daemon --serve-state` on that node (docs/daemon.md) and check the "
    "address and any firewall between here and there."
)


def fix_crashed(v: RankView) -> str:
    """A rank that failed on its own (an error, a fatal signal, a non-zero exit): the cause."""
    e = v.ending
    where = e.where if e else None
    at = f" at {where}" if where else ""
    if e is not None and e.signal:
        return (
            f"Rank {v.rank} was killed by {e.signal}{at} (its Python stack is in "
            f"{os.path.basename(fault_path(v.file.path))} beside its state file). "
            + FIX_SIGNAL.get(e.signal, "")
            + " The other ranks failed or wait because of it."
        )
    if e is not None and not e.exception:
        return (
            f"Rank {v.rank} called {e.how or 'exit'}({e.code}){at}: find out why it chose to end "
            "with that status (its log, the condition before that call). The other ranks failed "
            "or wait because of it."
        )
    unused = failed_on_unused(v)
    if unused:
        return (
            f'Rank {v.rank} raised DDP\'s "{REDUCTION_ERROR}"{at}: {unused_cause(unused)}. '
            + fix_unused_failure(unused)
            + " The other ranks failed or wait because of it."
        )
    return (
        f"Rank {v.rank} raised {short_exception(v.exception or '?')}{at}"
        + ": fix that error. The other ranks failed or wait because of it."
    )


def failed_on_unused(v: RankView) -> list[str]:
    """The parameters whose missing gradients made the rank fail: DDP's "Expected to have
    finished reduction" error, with the names the rank recorded; [] for any other end (or
    when the unused parameters are on another rank)."""
    return list(v.state.unused_parameters) if REDUCTION_ERROR in (v.exception or "") else []


def unused_cause(names: Sequence[str]) -> str:
    """Why DDP raised its reduction error, in a clause."""
    return (
        f"{len(names)} parameter(s) received no gradient in the step before ({names_shown(names)}) "
        "and DDP runs with find_unused_parameters=False"
    )


def fix_unused_failure(names: Sequence[str]) -> str:
    return (
        f"Make {names_shown(names)} take part in the loss on every rank (or drop them from the "
        "model), or pass find_unused_parameters=True to DistributedDataParallel if they are "
        "skipped on purpose (it costs a traversal of the autograd graph every step)."
    )


def names_shown(names: Sequence[str], most: int = 8) -> str:
    """Parameter names for a sentence: folded (``fold_names``), the first ``most`` of them."""
    folded = fold_names(names)
    return ", ".join(folded[:most]) + (
        f" (+{len(folded) - most} more below)" if len(folded) > most else ""
    )


FIX_SIGNAL = {
    "SIGABRT": "A backend abort is typical (gloo aborts when a message of another size than "
    "it expects arrives: ranks that issue different collectives), as is a failed C++ "
    'assertion; the reason is on the rank\'s stderr ("terminate called after throwing ...").',
    "SIGSEGV": "A crash in native code (an extension, a mismatched library build, a bad pointer "
    "from a custom op).",
    "SIGBUS": "Often shared memory exhausted (/dev/shm too small for DataLoader workers or NCCL).",
    "SIGFPE": "An integer division by zero in native code.",
    "SIGILL": "A binary built for another CPU (instruction set) than this one.",
}


def fix_mismatch(field: str) -> str:
    """The ranks issued different collectives under one sequence number."""
    if field in ("op", "call"):
        return FIX_DESYNC + (
            " Collectives issued in a different order per rank are the same bug: iterate over a "
            "sorted list, not a set or a dict filled differently per rank."
        )
    return (
        "Every rank must pass tensors of the same shape and dtype to a collective: look at "
        "how the tensor at that call site is built (a per-rank batch size or metric count, a "
        "dtype that depends on the data or on autocast). Pad to a common size (all_gather the "
        "sizes first) or cast before the call."
    )


def fix_died(v: RankView) -> str:
    """A rank that ended without any record: killed from outside."""
    pid = v.state.pid
    return (
        f"Rank {v.rank} (pid {pid} on {v.state.host}) vanished without a trace: no exception, "
        "no exit status and no fatal signal were recorded, so it was most likely killed from "
        f"outside with SIGKILL. Check `dmesg` or `journalctl -k` for the kernel's OOM killer "
        f"('Killed process {pid}'), and the scheduler's log for a kill or preemption. "
        "The other ranks failed or wait because of it."
    )


def fix_cannot_write(state_dir: str, ended: bool) -> str:
    """Ranks that cannot write their state files (cannot_write)."""
    text = (
        f"Free space on the file system of {state_dir} (`df -h {state_dir}`), or set DDPMON_STATE_DIR "
        "to a directory on another file system for the next run. Training is not affected: the "
        "ranks try again with backoff and write again by themselves once there is room (their "
        "step histories keep the last 1,024 steps in memory meanwhile, and name the steps they "
        "lose). What a live rank does now: `py-spy dump --pid PID`."
    )
    if ended:
        text += (
            " A rank that ended could not record how: its log says (its exit status, a "
            "traceback), and `dmesg` names the OOM killer if it was killed."
        )
    return text


def fix_lost_node(where: str) -> str:
    """A node gone with its ranks (lost_node)."""
    return (
        f"Check {where}: is it up, and what ended it (power, a kernel panic, the network; "
        "`journalctl -k` or `dmesg` there, the scheduler's record of the node), or were all its "
        "ranks killed (the OOM killer, a preemption)? The other ranks failed or wait because it "
        "went away: their connection errors are consequences. Restart the job once the node is "
        "back, or without it (torchrun --nnodes=MIN:MAX carries on with the nodes left)."
    )


def fix_missing_rank(unseen: list[int]) -> str:
    return (
        "Look at " + who(unseen) + " directly (their logs, `py-spy dump` on their "
        "hosts, or `ddpmon doctor` on their hosts): they are in this group but report "
        "nothing here (not attached, another host without a shared state directory, "
        "or never started)."
    )


def gpu_wait(seconds: float) -> str:
    """What a rank's ``activity.gpu_behind_seconds`` says, in a clause."""
    return f"waiting for its GPU, which has not finished the work the rank enqueued {seconds:.0f} s ago"


def fix_gpu_behind(behind: list[int]) -> str:
    return (
        "Find what " + who(behind) + " enqueued on the GPU before this collective and never "
        "finishes: a kernel that does not end (a custom CUDA or Triton kernel, a spin-wait), a "
        "stream waiting for an event nobody records, a hung device (`nvidia-smi`; `dmesg` for "
        "Xid errors). `py-spy dump --native --pid PID` shows where its host waits."
    )


def fix_other_job(other: str) -> str:
    return f"Pass --job {other} to diagnose that one; remove the files of jobs that ended."


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
        if debug_level in (None, "OFF")
        else f"The job runs with TORCH_DISTRIBUTED_DEBUG={debug_level}: its logs have more"
    )
    if desync:
        text += "; a `dist.monitored_barrier()` before the suspect code names the ranks that never reach it"
    return text + "."


def fix_comm(backend: str | None, debug_level: str | None = None) -> str:
    if "nccl" in str(backend):
        return (
            "No rank is behind: check the network and NCCL. "
            + rerun_advice(backend, debug_level)
            + " Check NCCL_SOCKET_IFNAME and NCCL_IB_* settings, firewalls between hosts, and "
            "the GPUs (nvidia-smi; `dmesg` for Xid errors)."
        )
    return (
        "No rank is behind: check the network between the ranks (GLOO_SOCKET_IFNAME picks the "
        "interface; firewalls, MTU, a link that drops packets). "
        + rerun_advice(backend, debug_level)
    )


# -- a rank, a collective, in words -----------------------------------------------------------


def ended(v: RankView, brief: bool = False) -> str:
    e = v.ending
    if v.status == Status.CRASHED and e is not None:
        if e.signal:
            return f"was killed by {e.signal}" if brief else f"was killed by {e.exception}"
        if not e.exception:
            return f"exited with status {e.code}" + ("" if brief else f" ({e.how})")
        return "crashed" if brief else f"crashed ({short_exception(e.exception)})"
    if v.status == Status.CRASHED:
        return "crashed"
    if v.status == Status.SILENT:
        return "stopped writing its state file (on another host: dead or frozen)"
    if v.status == Status.EXITED:
        return "exited"
    return (
        "died"
        if brief
        else "vanished without a trace (killed from outside: SIGKILL, the OOM killer)"
    )


_WRAPPED = re.compile(
    r"^(?:\w+(?:Error|Exception): )?Got the following error when running the callback: "
)


def short_exception(text: str, limit: int = 160) -> str:
    """The first line of an exception without torch's callback wrappers, shortened."""
    line = text.strip().splitlines()[0] if text.strip() else text
    while True:
        stripped = _WRAPPED.sub("", line)
        if stripped == line:
            break
        line = stripped
    return line if len(line) <= limit else line[: limit - 3] + "..."


def gone_line(v: RankView) -> str:
    s = v.state
    where = v.ending.where if v.ending else None
    return (
        f"rank {v.rank} (host {s.host}, pid {s.pid}): {ended(v)}"
        + (f" at {where}" if where else "")
        + f"; last seen at step {s.step}, stage {s.stage}, {v.liveness.detail}"
    )


def stuck_line(v: RankView) -> str:
    s = v.state
    if v.status == Status.FROZEN:
        what = (
            f"frozen: its state file was last written {v.age:.0f} s ago while its process "
            "lives (step and stage are as of then; its live stack is below where py-spy could read it)"
        )
    else:
        act = s.activity
        what = "not in any collective" + (
            f", at {act.where}" if act is not None and act.where else ""
        )
        if act is not None and act.gpu_behind_seconds:
            what += (
                f", {gpu_wait(act.gpu_behind_seconds)} (a kernel that does not end, or a collective "
                "whose peers never joined: see the flight recorder in its hang report)"
            )
    after = (
        f"; its last collective was {entry_name(s.last_collective)}"
        f"{flight.beside(v, s.last_collective)}"
        if s.last_collective
        else ""
    )
    return (
        f"rank {v.rank} (host {s.host}, pid {s.pid}): no progress for {v.silent:.1f} s, "
        f"step {s.step}, stage {s.stage}, {what}{after}"
    )


def unwritten_line(v: RankView) -> str:
    """A rank that cannot write its state file: what its old file says, and its process."""
    s = v.state
    alive = v.liveness.alive
    process = (
        "its process runs"
        if alive
        else "its process has ended"
        if alive is False
        else "its process is on another host"
    ) + f" ({v.liveness.detail})"
    if alive is False:
        process += ", without a record of how"
    return (
        f"rank {v.rank} (host {s.host}, pid {s.pid}): its state file was last written {v.age:.0f} s ago, "
        f"at step {s.step}, stage {s.stage}; {process}"
    )


def write_failure_line(v: RankView, what: str, f: WriteFailure) -> str:
    """A spell of failed writes that a rank's last file records."""
    written = v.state.now_unix
    lasted = f" for {written - f.since_unix:.0f} s" if written is not None else ""
    return (
        f"rank {v.rank}: its last state file that got through says writing its {what} had failed"
        f"{lasted} ({f.count} {'try' if f.count == 1 else 'tries'}: {f.error})"
    )


def free_space_line(state_dir: str, free: tuple[int, int]) -> str:
    """The file system of a state directory that has no room."""
    space, inodes = free
    text = f"the file system of {state_dir} has {space / 2**10:.0f} KiB free"
    if inodes == 0:
        text += " and no free inode"
    return text + f" (under {ROOM_BYTES >> 20} MiB: full)"


def wait_line(v: RankView) -> str:
    e = v.waiting
    s = v.state
    if e is None:
        return f"rank {v.rank}: no progress for {v.silent:.1f} s, step {s.step}, stage {s.stage}"
    return (
        f"rank {v.rank} (host {s.host}, pid {s.pid}) has waited "
        f"{e.age_seconds or 0.0:.1f} s in {entry_name(e)}, step {s.step}{flight.beside(v, e)}"
    )


def group_timeout_end(waiting: list[RankView], working: list[RankView]) -> str:
    """When the waiting ranks' process group's own timeout ends their wait (and the job),
    should the busy ranks never join: "" when their files do not say."""
    ends = [
        (
            v.state.group_timeout_seconds - (v.waiting.age_seconds or 0.0),
            v.state.group_timeout_seconds,
        )
        for v in waiting
        if v.waiting is not None and v.state.group_timeout_seconds
    ]
    if not ends:
        return ""
    left, timeout = min(ends)
    return (
        f"; should {who([v.rank for v in working])} never join, the process group's timeout "
        f"({timeout:.0f} s) ends the job in about {max(0.0, left):.0f} s"
    )


NOTABLE_CPU_WAIT = 0.05
"""Share of the time a rank's threads waited for a CPU that the busy line names."""


def busy_line(v: RankView) -> str:
    s = v.state
    act = s.activity
    if v.status == Status.STEPPING:  # rules/common.evaluating
        return (
            f"rank {v.rank} (host {s.host}, pid {s.pid}): makes progress without stepping (forward passes "
            f"without gradients, an evaluation), step {s.step}, at {act.where if act and act.where else '?'}"
        )
    how = []
    if act is not None and act.state != Status.BUSY:  # activity.working_since: not judged yet
        into = act.sampled_unix - s.last_progress_unix if s.last_progress_unix is not None else None
        how.append(
            "its watchdog last sampled it "
            + (f"{into:.1f} s " if into is not None and into >= 0 else "")
            + f"into this silence ({act.state}), too soon to judge"
        )
    elif act is not None:
        if act.cpu_share >= CPU_BUSY:
            how.append(f"main thread at {act.cpu_share:.0%} CPU")
        if act.wait_share >= NOTABLE_CPU_WAIT:
            how.append(f"its threads waiting for a CPU {act.wait_share:.0%} of the time")
        if act.io_bytes_per_second >= IO_BUSY:
            how.append(f"{act.io_bytes_per_second / 1e6:.0f} MB/s of I/O")
        if act.still_seconds < STILL_SECONDS:
            how.append("its stack moves")
    return (
        f"rank {v.rank} (host {s.host}, pid {s.pid}): no step for {v.silent:.1f} s, busy at "
        f"{act.where if act and act.where else '?'}" + (f" ({', '.join(how)})" if how else "")
    )


def stack_lines(v: RankView) -> list[str]:
    main = main_thread(v.stack)
    if not main:
        return [
            f"rank {v.rank}: no stack ({v.stack_error or 'no hang report yet and py-spy not used'})"
        ]
    frames = [f for f in main.frames if not str(f.file).startswith("<frozen")][-8:]
    gil = " (holds the GIL)" if main.owns_gil else ""
    lines = [f"rank {v.rank} main thread{gil}, from {v.stack_source}, innermost last:"]
    lines += [f"  {f.file}:{f.line} in {f.function}" for f in frames]
    return lines


def ready_lines(views: list[RankView], slow: list[int]) -> list[str]:
    """When each rank's last gradient bucket was ready (when a slow rank reports it)."""
    ready = {}
    for v in views:
        times = [b.ready_seconds for b in v.state.buckets if b.ready_seconds is not None]
        if times:
            ready[v.rank] = max(times)
    if not ready or not any(r in ready for r in slow):
        return []
    return [
        "last gradient bucket ready after the step began: "
        + ", ".join(f"rank {r}: {format_seconds(ready[r])}" for r in sorted(ready))
    ]


def flight_recorder_lines(waiting: list[RankView]) -> list[str]:
    lines = []
    for v in waiting:
        fr = (v.state.hang.flight_recorder if v.state.hang else None) or {}
        for pg, status in sorted((fr.get("pg_status") or {}).items()):
            lines.append(
                f"rank {v.rank} flight recorder, group {pg}: last enqueued collective "
                f"{status.get('last_enqueued_collective')}, last started "
                f"{status.get('last_started_collective')}, last completed "
                f"{status.get('last_completed_collective')}"
            )
    return lines


def entry_name(e: Collective | None) -> str:
    """A collective as a reader finds it in the code (``Collective.describe``)."""
    return e.describe() if e else "?"


def ranks(numbers: Iterable[int]) -> str:
    """Rank numbers, runs folded: ``0–1022, 1024``."""
    numbers = sorted(set(numbers))
    parts: list[str] = []
    i = 0
    while i < len(numbers):
        j = i
        while j + 1 < len(numbers) and numbers[j + 1] == numbers[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{numbers[i]}\u2013{numbers[j]}")
        else:
            parts += [str(n) for n in numbers[i : j + 1]]
        i = j + 1
    return ", ".join(parts)


_DIGITS = re.compile(r"\d+")


def fold_names(names: Sequence[str]) -> list[str]:
    """Every name, with those that differ only in their numbers folded into one pattern:
    ``layers.{0-31}.attn.weight``. Nothing is dropped; order of first appearance is kept."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(_DIGITS.sub("#", name), []).append(name)
    out = []
    for _pattern, members in groups.items():
        numbers = [_DIGITS.findall(m) for m in members]
        if len(members) < 3 or len({len(n) for n in numbers}) != 1:
            out += members
            continue
        varying = [k for k in range(len(numbers[0])) if len({n[k] for n in numbers}) > 1]
        if len(varying) != 1:
            out += members
            continue
        k = varying[0]
        values = sorted({int(n[k]) for n in numbers})
        folded = ranks(values).replace(", ", ",").replace("\u2013", "-")
        pieces = _DIGITS.split(members[0])
        digits = numbers[0]
        text = pieces[0]
        for index, value in enumerate(digits):
            text += ("{" + folded + "}" if index == k else value) + pieces[index + 1]
        out.append(text)
    return out


def who(numbers: Iterable[int]) -> str:
    numbers = sorted(numbers)
    return f"rank {numbers[0]}" if len(numbers) == 1 else f"ranks {ranks(numbers)}"


def verb(items: Collection[object], one: str, many: str) -> str:
    return one if len(items) == 1 else many


FIX_COPY_ON_READ = (
    "DataLoader workers that grow together are most often copy-on-read "
    "(pytorch/pytorch#13246): the Dataset holds Python objects (lists, dicts, strings) that "
    "the forked workers read, and each read touches their reference counts, so the pages "
    "they sit on are copied into every worker. Keep the data in numpy arrays or tensors "
    "(or a memory-mapped file) instead of lists of Python objects."
)
FIX_FRAGMENTATION = (
    "torch's allocated memory is flat while its reserved memory grows: the caching "
    "allocator fragments (varying tensor sizes leave blocks it cannot reuse). Set "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (or pad the varying shapes to a few "
    "sizes)."
)
FIX_TENSORS_KEPT = (
    "torch's allocated memory grows with the steps: tensors stay alive from step to step, "
    "often a loss or an output kept for logging without .item() or .detach(), or a list "
    "that grows. torch.cuda.memory._record_memory_history and a snapshot between two steps "
    "show what holds them."
)
FIX_HOST_LEAK = (
    "Something in the rank's process keeps memory from step to step: a list or cache that "
    "grows, tensors kept for logging. Compare two tracemalloc snapshots (or run memray) a "
    "few hundred steps apart."
)
FIX_WORKER_LEAK = (
    "A DataLoader worker keeps memory from batch to batch: a cache or list in the Dataset "
    "or its transforms that grows. Compare two tracemalloc snapshots inside the worker "
    "(worker_init_fn), or run one epoch with num_workers=0 under memray."
)
