"""The one definition of a rank's state file, ``<state_dir>/rank-<R>.json``.

Every writer (the recorder's snapshot, the watchdog's hang report, the exit record) builds
these records, and every reader (doctor, daemon, top, report) gets them from ``parse``, so a
misspelt key is an error where it is written rather than a missing fact where it is read.
``FORMAT`` is the schema version written into each file; ``parse`` also reads the previous
one and names the version of a file it cannot read. ``docs/state.md`` describes the fields
and ``state-schema.json`` beside this module is the JSON Schema generated from them
(``python -m tools.state_schema`` rewrites it).

Records are built once and then only read: the recorder publishes a fresh ``RankState`` for
each snapshot instead of changing one that a reader may hold.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from . import records
from .records import SchemaError

FORMAT = 4
"""The schema version this ddpmon writes (the state file's ``format`` key)."""
READABLE = (1, 2, 3, 4)
"""Versions ``parse`` reads. Version 1 lacks nothing that version 2 needs; its in-flight
entries spelt ``async`` for ``async_op``. Version 2 named the stage ``phase`` (the rank's and
the hang report's), and ``first_step`` ``init``. Versions 1 to 3 called ``timings.parts``,
the parts of a step, ``timings.phases``."""
MAX_RANKS = 1 << 20
"""Ranks and world sizes beyond this are not a real job's (a forged file)."""
SCHEMA_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "state-schema.json")


class Stage(str, Enum):
    """Where a rank is in its life, from its process's start to its end: one word each.
    (A step's parts, forward, backward, ..., as timed, are another vocabulary: ``steps``.)
    The stages before ``first_step`` are known under ``ddpmon run`` and
    ``python -m ddpmon.launch`` only, which watch the process from its start."""

    STARTING = "starting"
    """The script runs; it has not called ``init_process_group`` yet."""
    RENDEZVOUS = "rendezvous"
    """In ``init_process_group``, reaching the store (``MASTER_ADDR:MASTER_PORT``)."""
    INIT_PROCESS_GROUP = "init_process_group"
    """In ``init_process_group``, the store reached: the backend waits for every rank."""
    GROUP_READY = "group_ready"
    """``init_process_group`` returned; no DDP model built yet."""
    BUILDING_DDP = "building_ddp"
    """In DDP's constructor, which checks the parameters' shapes across ranks (a collective)."""
    FIRST_STEP = "first_step"
    """Attached to its DDP model; its first forward has not started."""
    FORWARD = "forward"
    AFTER_FORWARD = "after_forward"
    BACKWARD = "backward"
    ALLREDUCE = "allreduce"
    """The backward's own work is done; DDP's gradient all-reduce goes on."""
    AFTER_BACKWARD = "after_backward"
    OPTIMIZER = "optimizer"
    AFTER_OPTIMIZER = "after_optimizer"
    DETACHED = "detached"
    """Its monitor was detached (at exit, or by ``Monitor.detach()``)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


BEFORE_FIRST_STEP = (
    Stage.STARTING,
    Stage.RENDEZVOUS,
    Stage.INIT_PROCESS_GROUP,
    Stage.GROUP_READY,
    Stage.BUILDING_DDP,
)
"""The stages of a rank that has no DDP model attached yet."""


@dataclass(slots=True)
class Frame:
    """One frame of a Python stack."""

    file: str | None = None
    line: int | None = None
    function: str | None = None
    code: str | None = None


@dataclass(slots=True)
class Thread:
    """One Python thread's stack, innermost frame last."""

    name: str = ""
    ident: int | None = None
    main: bool = False
    daemon: bool | None = None
    owns_gil: bool | None = None
    """From py-spy: the thread held the GIL when read."""
    active: bool | None = None
    frames: list[Frame] = field(default_factory=list)


@dataclass(slots=True)
class Collective:
    """A collective this rank issued: in flight, or done (``completed_unix`` set)."""

    seq: int
    """Sequence number within its process group (``p2p:<group>`` for point-to-point)."""
    op: str
    """torch's name of the operation (``all_reduce``, ``barrier``, ...)."""
    group: str = "?"
    group_size: int = 0
    bytes: int | None = None
    """Bytes this rank sends, where known."""
    dtype: str | None = None
    """The tensor's dtype (``float32``; ``mixed`` for a list of several), where known."""
    numel: int | None = None
    """Elements this rank contributes (summed over a list of tensors), where known."""
    call_site: str = "?"
    """``file:line`` of the first frame outside torch and ddpmon (``DDP backward`` for a bucket)."""
    function: str = ""
    issued_unix: float = 0.0
    bucket: int | None = None
    """Index of the DDP gradient bucket this collective reduces."""
    step: int | None = None
    callers: list[str] = field(default_factory=list)
    p2p: bool = False
    async_op: bool = False
    completion: str | None = None
    """``unknown`` when the backend gives no way to see an async collective complete."""
    completed_unix: float | None = None
    seconds: float | None = None
    error: str | None = None
    age_seconds: float | None = None
    """Seconds in flight when a hang report was written."""
    source: str | None = None
    """Where a reader found it, when not the rank's own record (``flight recorder``)."""

    @property
    def site_key(self) -> str:
        """The key of ``RankState.collective_sites`` this collective counts under."""
        return site_key(self.op, self.call_site, self.callers, self.bucket)

    def describe(self, short: bool = False) -> str:
        """The collective as a reader finds it in the code: op, sequence number, group and
        where it was issued. The one wording for hang lines, the doctor and its report;
        ``short`` for a table cell (op, sequence number, bucket or call site)."""
        if short:
            bucket = f" (DDP bucket {self.bucket})" if self.bucket is not None else ""
            where = "" if self.call_site == "DDP backward" else f" at {self.call_site}"
            return f"{self.op} #{self.seq}{bucket}{where}"
        head = f"{self.op} #{self.seq} (group {self.group}"
        if self.source == "flight recorder":
            return f"{head}, from torch's flight recorder)"
        if self.bucket is not None and self.call_site == "DDP backward":
            return f"{head}, gradient bucket {self.bucket} of DDP's backward)"
        bucket = f", DDP bucket {self.bucket}" if self.bucket is not None else ""
        func = f" in {self.function}" if self.function else ""
        caller = f", called from {self.callers[0]}" if self.callers else ""
        return f"{head}{bucket}, issued at {self.call_site}{func}{caller})"


def site_key(
    op: str | None, call_site: str | None, callers: list[str] | None, bucket: int | None
) -> str:
    """The key of ``RankState.collective_sites``: op, call site and its first caller; all
    DDP buckets issued from one place share a key."""
    key = f"{op} {call_site}"
    if callers:
        key += f" < {callers[0]}"
    return key + (" (DDP bucket)" if bucket is not None else "")


@dataclass(slots=True)
class Summary:
    """Median, last and largest value over the recent steps."""

    median: float
    last: float
    max: float


@dataclass(slots=True)
class Timings:
    """Per-step times over the last ``window_steps`` steps (null: not measured)."""

    window_steps: int = 0
    step_seconds: Summary | None = None
    forward_seconds: Summary | None = None
    backward_seconds: Summary | None = None
    compute_seconds: Summary | None = None
    """Forward plus backward compute."""
    exposed_comm_seconds: Summary | None = None
    """End of backward compute to DDP having every bucket back."""
    data_wait_seconds: Summary | None = None
    """End of the previous step to the first forward: where a data loader's time goes."""
    optimizer_seconds: Summary | None = None
    """torch.optim optimizer steps (any optimizer, through torch's global step hooks)."""
    other_seconds: Summary | None = None
    """The rest of the step's wall time (the parts sum to the step)."""
    busy_seconds: Summary | None = None
    """The step less its waiting for other ranks (exposed communication)."""
    parts: StepParts | None = None
    """Where the time of the last steps went, part by part."""


@dataclass(slots=True)
class StepParts:
    """Mean seconds per step of each part over the last ``steps`` steps (at most 20); the parts
    sum to ``step_seconds``. The straggler score compares ranks on their busy time, the step
    less waiting for the other ranks: step by step on ``recent``, or on ``busy_seconds`` in
    files without it."""

    steps: int = 0
    step_seconds: float = 0.0
    data_wait_seconds: float = 0.0
    h2d_seconds: float | None = None
    """Host-to-device copies, where visible (null: counted in data wait)."""
    forward_seconds: float = 0.0
    backward_seconds: float = 0.0
    exposed_comm_seconds: float = 0.0
    optimizer_seconds: float = 0.0
    other_seconds: float = 0.0
    busy_seconds: float = 0.0
    """Step less waiting for the other ranks: a trimmed mean over the steps (the median in
    files of an older ddpmon, those without ``busy_error_seconds``)."""
    busy_spread_seconds: float = 0.0
    """The median absolute deviation of the busy times from their median."""
    busy_error_seconds: float | None = None
    """The standard error of ``busy_seconds``: the straggler score's noise (null from an
    older ddpmon, whose readers estimated it from ``busy_spread_seconds``)."""
    micro_steps: float = 0.0
    """Backward passes per step (more than 1 under gradient accumulation)."""
    gaps: dict[str, float] = field(default_factory=dict)
    """Of ``other_seconds``, the mean seconds per step of each stretch between ddpmon's
    hooks, by where it lies (``steps.GAP_TABLE``: ``after_forward``,
    ``between_micro_steps``, ``before_optimizer``, ``after_optimizer``); empty from an older
    ddpmon."""
    recent: RecentSteps | None = None
    """The last steps one by one, which the straggler score compares step by step (null
    from an older ddpmon, whose files are compared on the means above)."""


@dataclass(slots=True)
class RecentSteps:
    """Each of a rank's last steps (at most 150, the job's first few left out), one list per
    quantity, in step order. The straggler score compares ranks on the same steps, so that
    what slows every rank at once (a neighbour's job, a shared core) cancels out."""

    step: list[int] = field(default_factory=list)
    busy_seconds: list[float] = field(default_factory=list)
    """The step less its waiting for the other ranks."""
    data_wait_seconds: list[float] = field(default_factory=list)
    h2d_seconds: list[float] = field(default_factory=list)
    forward_seconds: list[float] = field(default_factory=list)
    backward_seconds: list[float] = field(default_factory=list)
    optimizer_seconds: list[float] = field(default_factory=list)
    other_seconds: list[float] = field(default_factory=list)


@dataclass(slots=True)
class Bucket:
    """One DDP gradient bucket: its layout and its all-reduces so far."""

    index: int
    bytes: int = 0
    dtype: str = ""
    num_parameters: int = 0
    parameters: list[str] = field(default_factory=list)
    """Parameter names, at most 200."""
    count: int = 0
    """All-reduces timed."""
    last_seconds: float | None = None
    mean_seconds: float | None = None
    ready_seconds: float | None = None
    """When its gradients were all ready, seconds after its step began (last step)."""
    busbw_bytes_per_second: float | None = None
    bytes_total: int = 0


@dataclass(slots=True)
class Counts:
    issued: int = 0
    completed: int = 0


@dataclass(slots=True)
class Hang:
    """The watchdog's report of a rank without progress."""

    detected_unix: float
    last_progress_unix: float
    silent_seconds: float
    timeout_seconds: float
    timeout_source: str
    """``configured``, ``learned`` or ``warm-up``."""
    step: int = 0
    stage: Stage = Stage.FIRST_STEP
    in_flight: list[Collective] = field(default_factory=list)
    last_collective: Collective | None = None
    threads: list[Thread] = field(default_factory=list)
    """Every Python thread's stack, the main thread first."""
    flight_recorder: dict[str, Any] | None = None
    """torch's flight recorder: latest entries and per-group status (NCCL)."""
    flight_recorder_error: str | None = None
    extras_error: str | None = None


@dataclass(slots=True)
class Activity:
    """What the rank's main thread does, sampled by its watchdog about once a second
    (``ddpmon/activity.py``)."""

    state: str
    """``stepping``, ``busy``, ``waiting`` or ``stuck``."""
    sampled_unix: float = 0.0
    still_seconds: float = 0.0
    """Seconds the main thread's stack has not changed."""
    cpu_share: float = 0.0
    """Share of one core the main thread used over the seconds its stack has been still
    (at least the last second) (0..1)."""
    runnable_share: float = 0.0
    """Share of those seconds the process's threads ran or were ready to run, summed over
    its threads (at most 1; waiting known on Linux) (0..1)."""
    wait_share: float = 0.0
    """Share of those seconds the process's threads were ready to run but waited for a CPU
    (an oversubscribed machine; Linux), summed over its threads (0..1)."""
    io_bytes_per_second: float = 0.0
    """Bytes the process read and wrote per second over those seconds."""
    where: str | None = None
    """``file:line in function`` of the main thread's innermost user frame."""
    callers: list[str] = field(default_factory=list)
    """The user frames that led there (``file:line in function``), innermost first."""
    loops: list[list[int]] = field(default_factory=list)
    """For ``where`` and each caller, the first and last line of the innermost loop that
    line is in (empty when in none): whether a rank stands inside its training loop."""
    hang_timeout_seconds: float | None = None
    """The rank's hang timeout when sampled (null: off)."""
    gpu_behind_seconds: float | None = None
    """Seconds the rank's GPU has not finished the work enqueued at its last step boundary,
    asked only while the rank makes no progress (null: finished, not asked, or no GPU)."""


@dataclass(slots=True)
class Startup:
    """A rank's way from its process's start to its DDP model (``ddpmon run`` and
    ``python -m ddpmon.launch`` watch it; the writer's clock)."""

    process_started_unix: float
    stage_since_unix: float | None = None
    """When the rank entered the stage it was last in before its first step."""
    backend: str | None = None
    """``init_process_group``'s backend, once called."""
    store: str | None = None
    """The store ``init_process_group`` reaches: ``host:port`` (``env://``'s MASTER_ADDR and
    MASTER_PORT), or the ``init_method`` given."""
    init_started_unix: float | None = None
    """When ``init_process_group`` was called."""
    store_reached_unix: float | None = None
    init_done_unix: float | None = None
    """When ``init_process_group`` returned."""
    ddp_started_unix: float | None = None
    """When DDP's constructor was called."""
    error: str | None = None
    """``Type: message`` of an exception ``init_process_group`` raised (a timeout, a refused
    connection)."""


@dataclass(slots=True)
class Clock:
    """The rank's clock against rank 0's, measured once at start through the job's store
    (``ddpmon/clocks.py``: the round trip with the least delay). Readers subtract the offset
    from this rank's times to put them on rank 0's clock."""

    offset_seconds: float
    """This rank's clock minus rank 0's (0 on rank 0)."""
    delay_seconds: float
    """The round trip it came from: the offset is true within half of it."""
    measured_unix: float
    """When it was measured (this rank's clock)."""


@dataclass(slots=True)
class Exit:
    """How the interpreter ended."""

    unix: float
    exception: str | None = None
    """``Type: message`` of the uncaught exception, null for a clean exit."""
    where: str | None = None
    """``file:line in function`` of the innermost user frame of that exception (for
    ``sys.exit`` and ``os._exit``: of their caller)."""
    code: int | None = None
    """The exit status, where known: non-zero is a failure (``sys.exit(3)``: 3)."""
    how: str | None = None
    """``exception``, ``sys.exit``, ``os._exit``, ``end`` (the interpreter ended normally),
    ``hang_abort`` (ended by ddpmon after a proven hang, ``hang_action=abort``; exit status
    87) or ``signal`` (a reader's record from the rank's faulthandler file)."""
    signal: str | None = None
    """The fatal signal (``SIGSEGV``, ``SIGABRT``, ...): never written by the rank, which
    cannot run Python then; readers fill it from ``rank-<R>.fault``."""
    threads: list[Thread] = field(default_factory=list)
    """With ``signal``: every thread's Python stack as faulthandler wrote it."""
    culprits: list[int] = field(default_factory=list)
    """With ``hang_abort``: the ranks the hang was pinned on (this rank when it was stuck
    itself; the peers that had not joined its collective when it waited)."""


@dataclass(slots=True)
class WriteFailure:
    """The last spell of failed writes of one of the rank's files (docs/state.md, "When a
    write fails"): the rank retries with backoff and training goes on."""

    error: str
    """What the system said: ``No space left on device`` (SQLite's "database or disk is full"
    is given as that too), or ``Type: message`` when there is no system error."""
    since_unix: float
    """The first failure of this spell."""
    last_unix: float
    """The latest failed write."""
    errno: str | None = None
    """The error's name (``ENOSPC``), null when there is none."""
    count: int = 1
    """Failed writes in this spell."""
    total: int = 1
    """Failed writes since the rank attached (``ddpmon_state_write_failures_total``)."""
    ended_unix: float | None = None
    """When a write got through again; null while the writes fail."""


@dataclass(slots=True)
class Advice:
    """A silent DDP mistake this rank saw (docs/advice.md lists every ``kind``)."""

    kind: str
    severity: str = "warning"
    """``warning`` (the result or the cost is wrong) or ``info``."""
    summary: str = ""
    evidence: list[str] = field(default_factory=list)
    fix: str = ""
    step: int | None = None
    """The step in which it was first seen."""
    unix: float | None = None
    ranks: list[int] = field(default_factory=list)
    """The ranks it concerns, when it compares ranks (else this rank)."""


@dataclass(slots=True)
class ParamPrint:
    """A sampled fingerprint of every parameter and buffer at the start of one step."""

    step: int
    digest: int
    """CRC-32 over ``tensors``."""
    tensors: list[int] = field(default_factory=list)
    """CRC-32 of a few sampled elements of each tensor, in ``Fingerprints.names`` order."""


@dataclass(slots=True)
class NonFinite:
    """The first step in which this rank's own gradients were not finite (before the all-reduce)."""

    step: int
    parameter: str = ""
    """The first parameter (in DDP's order) whose gradient was not finite."""
    unix: float | None = None


@dataclass(slots=True)
class Fingerprints:
    """What the ranks compare (ddpmon/advice/compare.py): sampled, read a step late, no GPU sync."""

    batch: list[list[int]] = field(default_factory=list)
    """``[step, crc]`` of the input batch of the last steps (a few sampled elements)."""
    params: list[ParamPrint] = field(default_factory=list)
    """The last few parameter-and-buffer fingerprints."""
    names: list[str] = field(default_factory=list)
    """Parameter names, then buffers as ``buffer:<name>``."""
    nonfinite: NonFinite | None = None
    nonfinite_checked_step: int = 0
    """The last step whose gradients were checked for NaN/Inf."""


@dataclass(slots=True)
class DataInfo:
    """What this rank's data looked like, where ddpmon could see it."""

    sampler: str | None = None
    """Class name of the sampler of the DataLoader iterated last (``DistributedSampler``, ...)."""
    shuffle: bool | None = None
    batch_size: int | None = None
    """Per-rank batch size: the first dimension of the model's first input."""
    micro_batches: int | None = None
    """Forward-backward passes per optimizer step (gradient accumulation), from the first
    step; null until a step has ended."""
    global_batch_size: int | None = None
    """Samples per optimizer step: ``batch_size`` x ``micro_batches`` x DDP's world size."""
    epoch: int | None = None
    gpu_uuid: str | None = None
    """The UUID of this rank's GPU (``GPU-...``), to find ranks that share one."""
    cuda_current_device: int | None = None


@dataclass(slots=True)
class FlopCount:
    """The model's FLOPs in one optimizer step, counted once, on one real step, by torch's
    FLOP counter (``torch.utils.flop_counter.FlopCounterMode``): forward, backward and every
    micro-step of the step, as the operators that torch counts (matmuls, convolutions,
    attention) ran them."""

    per_step: int
    step: int
    """The step counted."""
    dtype: str | None = None
    """The type most of those FLOPs ran in (``bfloat16``; ``tf32`` for float32 matmuls
    that torch lets use TF32)."""
    device_name: str | None = None
    """The GPU's name as NVML gives it (null on a CPU)."""
    peak_flops_per_second: float | None = None
    """The device's dense peak for ``dtype`` (``ddpmon/peaks.py``); null where unknown."""
    peak_source: str | None = None
    """Where that peak comes from."""


@dataclass(slots=True)
class Throughput:
    """What this rank gets through per second of its steps, over its last ``window_steps``
    steps (the step whose FLOPs were counted left out: the counter slows it)."""

    window_steps: int = 0
    step_seconds: float | None = None
    """The mean step time over the window: what the rates divide by."""
    samples_total: int = 0
    """Samples of the steps done: the first dimension of the model's first input, summed
    over each step's training forwards (micro-steps too)."""
    tokens_total: int = 0
    """Tokens of the steps done, where the first input is a 2-D integer tensor (its
    elements); 0 otherwise."""
    samples_per_second: float | None = None
    tokens_per_second: float | None = None
    """Null unless the first input is a 2-D integer tensor (token ids)."""
    flop_count: FlopCount | None = None
    """Null until the count is done, or when it failed (``errors`` says why)."""
    achieved_flops_per_second: float | None = None
    """``flop_count.per_step`` over the mean step time."""
    mfu: float | None = None
    """Model FLOPs utilisation: achieved over the device's dense peak (0..1); null where the
    peak is unknown (a CPU, a GPU not in ``ddpmon/peaks.py``)."""


@dataclass(slots=True)
class MemoryTrend:
    """The robust trend of one memory series of a rank (``ddpmon/memory.py``): Theil-Sen
    slopes (the median of the pairwise slopes) of its last samples, the median of the
    window's three thirds', so that noise and a one-off rise do not move it. Samples
    are taken off the training thread once a state interval while steps go on, past the
    first steps (warm-up)."""

    process: str
    """``rank`` (the rank's own process) or ``worker`` (one of its DataLoader workers)."""
    kind: str
    """``rss``, ``pss`` (the host process's resident and proportional set sizes),
    ``torch_allocated`` or ``torch_reserved`` (torch's caching allocator on the GPU)."""
    pid: int
    bytes: int
    """The latest reading."""
    samples: int
    steps: int
    """Steps between the window's first and last samples."""
    bytes_per_step: float | None = None
    """The slope against the step count; null while the window spans too few steps."""
    bytes_per_second: float | None = None
    """The slope against the wall clock."""
    sustained: bool = False
    """Every third of the window grows at least half as fast as the median third: not a
    rise that came once and stayed flat."""
    noise_bytes: float = 0.0
    """The median absolute deviation of the readings from the trend line."""
    limit: str | None = None
    """What the series runs into: ``host`` (the host's available memory), ``cgroup`` (the
    rank's cgroup limit) or ``device`` (the GPU's memory)."""
    headroom_bytes: int | None = None
    """How far that limit is from the latest reading."""


@dataclass(slots=True)
class Memory:
    """The memory trends of a rank and of its DataLoader workers."""

    trends: list[MemoryTrend] = field(default_factory=list)
    sampled_unix: float | None = None
    """When the last sample was taken."""


@dataclass(slots=True)
class Optimizer:
    """The optimizer that steps the model, read at its step hook (``param_groups``' first
    group): what ``compare`` needs to say whether the learning rate followed the batch."""

    name: str
    """Its class name (``SGD``, ``AdamW``)."""
    learning_rate: float | None = None
    """The learning rate of its last step (null when not a plain number)."""
    peak_learning_rate: float | None = None
    """The largest learning rate of any step so far."""
    peak_step: int | None = None
    """The first step that ran at ``peak_learning_rate``: the warm-up's length when it rose."""


@dataclass(slots=True)
class Identity:
    """Who a rank is and where: the first fields of its state file and the labels of
    ``ddpmon_rank_info``. Set at attach; ``port``, ``bucket_timing``, ``ddp`` and
    ``state_interval`` once the parts that know them are installed."""

    rank: int
    """This rank in the job (torch.distributed's global rank)."""
    local_rank: int | None = None
    """LOCAL_RANK: its index on its node (the metrics port is base + local rank)."""
    world_size: int | None = None
    """The job's world size."""
    ddp_world_size: int | None = None
    """Size of DDP's process group (a subgroup under HSDP or 2-D parallelism)."""
    group_rank: int | None = None
    """GROUP_RANK: the node's index under torchrun."""
    host: str | None = None
    pid: int | None = None
    """The rank's process on ``host``."""
    process_started_unix: float | None = None
    """When that process was created (its host's clock, within a clock tick): where the
    job's wall time begins for goodput; null where not known."""
    port: int | None = None
    """The bound metrics port, null when the endpoint is off."""
    job: str | None = None
    """The ``job`` label of the rank's metrics."""
    attempt: int | None = None
    """Which attempt of the job this is under a launcher that restarts it (torchelastic's
    TORCHELASTIC_RESTART_COUNT: 0 first, 1 after the first restart); null without one.
    Earlier attempts' files are kept in ``attempt-<N>/`` (``state/attempts.py``)."""
    backend: str | None = None
    """DDP's process group backend (``nccl``, ``gloo``)."""
    group_timeout_seconds: float | None = None
    """The timeout of DDP's process group (``init_process_group(timeout=)``): what ends a
    collective that a busy rank never joins; null when torch does not say."""
    device: str | None = None
    """The device of the model's first parameter."""
    torch_version: str | None = None
    debug_level: str | None = None
    """TORCH_DISTRIBUTED_DEBUG as torch reads it."""
    version: str | None = None
    """ddpmon's version."""
    find_unused_parameters: bool | None = None
    num_parameters: int | None = None
    """Trainable parameter tensors of the model."""
    bucket_timing: str | None = None
    """Where bucket timing comes from on this rank: ``hook``, ``c10d`` or ``off``."""
    state_interval: float | None = None
    """Seconds between rewrites of this file."""
    ddp: dict[str, Any] = field(default_factory=dict)
    """Facts from DDP's own logging data."""


@dataclass(slots=True)
class StackSamples:
    """The training thread's stack, sampled often while the rank looked slower than its peers
    (``rank/stack_samples.py``): where in the user's own code its time went, by the stage it
    was in (``Stage``: ``after_forward`` is the gap between forward and backward)."""

    started_unix: float = 0.0
    """When the window of samples began."""
    seconds: float = 0.0
    """How long it has sampled so far."""
    count: int = 0
    """Samples taken (those with no user frame included)."""
    interval_seconds: float = 0.0
    """Between samples."""
    by_stage: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per stage, the samples of each innermost frame of the user's code ("train.py:118 in
    get_batch"), the 20 most sampled."""


@dataclass(slots=True)
class SettingsAnswer:
    """A rank's answer to the last ``ddpmon set`` request it took (``state/settings.py``),
    also written to ``set-<R>-<nonce>.status``: here it reaches ``ddpmon set --from``
    through a node daemon's ``/state``."""

    nonce: str
    """The request's, as the node daemon or the command chose it."""
    applied: dict[str, Any] = field(default_factory=dict)
    """Option -> the value now in use (null: a hang timeout learned again)."""
    refused: dict[str, str] = field(default_factory=dict)
    """Option -> why not, and what is accepted."""
    step: int = 0
    """The rank's step count when it answered."""
    written_unix: float = 0.0


@dataclass(slots=True)
class RankState(Identity):
    """Everything one rank publishes: who it is, where it is, what it measured."""

    step: int = 0
    """Steps done: optimizer steps after synchronised gradients (else synchronised backwards)."""
    micro_steps: int = 0
    """Backward passes of the steps done (gradient accumulation's no_sync passes included)."""
    stage: Stage = Stage.FIRST_STEP
    """Where the rank is in its life (``Stage``)."""
    startup: Startup | None = None
    """How it came up, from its process's start (under ``ddpmon run``; else null)."""
    started_unix: float | None = None
    """When the rank attached (the writer's clock, seconds since the epoch)."""
    clock: Clock | None = None
    """Its clock against rank 0's (null: not measured, as by an older ddpmon or a rank that
    never reached the job's store; readers then estimate it from the file's modification
    time)."""
    last_progress_unix: float | None = None
    """The rank's last observed progress: a forward, backward, bucket, collective or step."""
    now_unix: float | None = None
    """The writer's clock when written."""
    collectives: Counts = field(default_factory=Counts)
    """Collectives issued and completed while monitored."""
    in_flight: list[Collective] = field(default_factory=list)
    """Collectives issued and not yet completed, oldest first."""
    last_collective: Collective | None = None
    collective_log: list[Collective] = field(default_factory=list)
    """The last 32 completed collectives."""
    collective_seq: dict[str, int] = field(default_factory=dict)
    """Last sequence number per process group."""
    collective_sites: dict[str, int] = field(default_factory=dict)
    """Collectives issued per op and call site."""
    unused_parameters: list[str] = field(default_factory=list)
    """Parameters without a gradient in the last step (or named in DDP's error)."""
    buckets: list[Bucket] = field(default_factory=list)
    timings: Timings = field(default_factory=Timings)
    notes: dict[str, str] = field(default_factory=dict)
    """Advice and warnings by topic."""
    errors: dict[str, str] = field(default_factory=dict)
    """Parts of ddpmon that failed and switched themselves off, with the error."""
    write_failures: dict[str, WriteFailure] = field(default_factory=dict)
    """The last spell of failed writes of this rank's ``state`` file and ``history``, by file.
    The state file can hold its own spell only once a write gets through again: while one is
    failing, a reader sees an old file (docs/state.md)."""
    hang: Hang | None = None
    """The watchdog's report while it suspects a hang, else null."""
    exit: Exit | None = None
    """How the process ended, once it has."""
    advice: list[Advice] = field(default_factory=list)
    """Silent mistakes seen so far (ddpmon/advice/), each kind once."""
    fingerprints: Fingerprints = field(default_factory=Fingerprints)
    data: DataInfo = field(default_factory=DataInfo)
    activity: Activity | None = None
    """What the main thread does (stepping, busy, waiting, stuck), from the watchdog."""
    throughput: Throughput = field(default_factory=Throughput)
    """Samples, tokens and FLOPs per second, and MFU."""
    memory: Memory = field(default_factory=Memory)
    """Trends of the rank's and its workers' memory (``docs/doctor.md``: memory_creep)."""
    paused_seconds: float = 0.0
    """Seconds spent paused between steps: from the start of an evaluation (a forward
    without grad), or of the work or wait its watchdog saw (a checkpoint, a barrier), to the
    next step's first forward. Goodput counts them lost (``report/goodput.py``)."""
    optimizer: Optimizer | None = None
    """The model's optimizer and its learning rate; null before its first step."""
    stack_samples: StackSamples | None = None
    """The training thread's stack, sampled while this rank looked slower than its peers (the
    last window of samples); null when it never did."""
    settings_answer: SettingsAnswer | None = None
    """Its answer to the last ``ddpmon set`` request it took; null before any."""
    format: int = FORMAT
    """The schema version of this file."""
    file_mtime_unix: float | None = None
    """Added by the node daemon's ``/state``: the file's modification time on its host."""
    served_unix: float | None = None
    """Added by the node daemon's ``/state``: its clock when it answered."""

    def has_issued(self, entry: Collective) -> bool:
        """Whether this rank has issued ``entry`` (another rank's collective) or gone past
        it: its sequence number in that group has reached the entry's."""
        return self.collective_seq.get(entry.group, 0) >= entry.seq


def parse(data: object) -> RankState:
    """A state file's parsed JSON as a RankState; SchemaError says what is wrong."""
    if not isinstance(data, dict):
        raise SchemaError(
            "", "a JSON object", data, "is not a ddpmon state file (not a JSON object)"
        )
    version = data.get("format", 1)
    if version not in READABLE:
        newer = isinstance(version, int) and version > FORMAT
        raise SchemaError(
            "format",
            f"a state format this ddpmon reads ({', '.join(map(str, READABLE))})"
            + ("; it was written by a newer ddpmon: upgrade ddpmon here" if newer else ""),
            version,
        )
    if "rank" not in data:
        raise SchemaError("rank", "a rank", None, "is not a ddpmon state file (no 'rank' key)")
    if version == 1:
        data = _from_format_1(data)
    if version in (1, 2):
        data = _from_format_2(data)
    if version in (1, 2, 3):
        data = _from_format_3(data)
    state = records.load(RankState, data)
    if not 0 <= state.rank < MAX_RANKS:
        raise SchemaError("rank", f"an integer from 0 to {MAX_RANKS - 1}", state.rank)
    for name in ("world_size", "ddp_world_size"):
        size = getattr(state, name)
        if size is not None and not 1 <= size <= MAX_RANKS:
            raise SchemaError(name, f"an integer from 1 to {MAX_RANKS}", size)
    return state


def to_json(state: RankState) -> dict[str, Any]:
    """The state as plain JSON data, the file's body."""
    dumped: dict[str, Any] = records.dump(state)
    return dumped


def _from_format_1(data: dict[str, Any]) -> dict[str, Any]:
    def entry(e: Any) -> Any:
        if isinstance(e, dict) and "async" in e:
            e = dict(e)
            e["async_op"] = bool(e.pop("async"))
        return e

    out = dict(data)
    for key in ("in_flight", "collective_log"):
        if isinstance(out.get(key), list):
            out[key] = [entry(e) for e in out[key]]
    out["last_collective"] = entry(out.get("last_collective"))
    timings = out.get("timings")
    if isinstance(timings, dict) and timings.get("window_steps") is None:
        out["timings"] = dict(timings, window_steps=0)
    return out


def _from_format_3(data: dict[str, Any]) -> dict[str, Any]:
    timings = data.get("timings")
    if isinstance(timings, dict) and "phases" in timings and "parts" not in timings:
        timings = dict(timings)
        timings["parts"] = timings.pop("phases")
        return dict(data, timings=timings)
    return data


def _from_format_2(data: dict[str, Any]) -> dict[str, Any]:
    def stage(value: Any) -> Any:
        return Stage.FIRST_STEP.value if value in ("init", "", None) else value

    out = dict(data)
    if "phase" in out:
        out["stage"] = stage(out.pop("phase"))
    hang = out.get("hang")
    if isinstance(hang, dict) and "phase" in hang:
        hang = dict(hang)
        hang["stage"] = stage(hang.pop("phase"))
        out["hang"] = hang
    return out


def generated_schema() -> dict[str, Any]:
    schema = records.json_schema(RankState)
    schema["$id"] = "https://ddpmon.dev/schemas/rank-state.json"
    schema["title"] = f"ddpmon rank state file (format {FORMAT})"
    schema["properties"]["format"]["const"] = FORMAT
    return schema
