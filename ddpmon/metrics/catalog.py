"""The one list of ddpmon's metric names. Exporters, dashboards and alert rules use only these.

Prometheus naming: base units (seconds, bytes, joules, hertz, celsius, watts), ``_total`` for
counters, ratios 0..1. Every per-rank series carries ``job`` and ``rank``; ``bucket`` is only
ever the bucket index (or ``all`` when per-bucket series are aggregated).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..activity import Status


@dataclass(frozen=True)
class Metric:
    name: str
    kind: str  # gauge | counter | histogram | info
    help: str
    labels: tuple[str, ...] = ("job", "rank")
    source: str = "rank"  # rank | gpu | host | daemon
    summary: bool = False
    """A rank exports it with ``metrics_detail="summary"`` too: the alert rules or the job
    overview board read it (the node daemon's series do not depend on it)."""
    summary_bounds: tuple[float, ...] = ()
    """A histogram's bounds that summary keeps (exact: the counts are cumulative); the
    others are dropped, ``+Inf``, sum and count stay."""


RANK = ("job", "rank")
BUCKET = ("job", "rank", "bucket")
GPU = ("job", "rank", "gpu", "gpu_uuid")

RANK_ACTIVITIES: tuple[str, ...] = tuple(
    map(str, (Status.STEPPING, Status.BUSY, Status.WAITING, Status.STUCK))
)
"""The values of ``activity`` a rank exports about itself (``ddpmon_activity``): its
watchdog's word (``ddpmon/activity.py``)."""
DAEMON_ACTIVITIES: tuple[str, ...] = RANK_ACTIVITIES + tuple(
    map(str, (Status.FROZEN, Status.DEAD, Status.CRASHED))
)
"""The values the node daemon exports for a rank (``ddpmon_rank_activity``): the rank's
word from its state file while its process runs and the file is fresh, else what only
another process sees: stopped or no longer writing (frozen), gone without a word (dead),
gone with an exception, a fatal signal or a non-zero exit status (crashed)."""

METRICS: tuple[Metric, ...] = (
    # -- the training rank ------------------------------------------------------------------
    Metric(
        "ddpmon_rank_info",
        "gauge",
        "Always 1; labels describe the rank (world size, local rank, host, backend, versions, "
        "where bucket timing comes from).",
        RANK
        + (
            "world_size",
            "local_rank",
            "host",
            "backend",
            "torch_version",
            "debug_level",
            "version",
            "bucket_timing",
        ),
        summary=True,
    ),
    Metric(
        "ddpmon_steps_total",
        "counter",
        "Training steps completed: optimizer steps after synchronised gradients (without an "
        "optimizer, synchronised backward passes).",
        summary=True,
    ),
    Metric(
        "ddpmon_micro_steps_total",
        "counter",
        "Backward passes of the steps completed (gradient accumulation's no_sync passes included).",
    ),
    Metric(
        "ddpmon_samples_total",
        "counter",
        "Samples of the steps completed: the first dimension of the model's first input, summed "
        "over each step's training forwards (sum by job of its rate: the job's samples per second).",
    ),
    Metric(
        "ddpmon_tokens_total",
        "counter",
        "Tokens of the steps completed, where the model's first input is a 2-D integer tensor "
        "(token ids): its elements. Absent otherwise.",
    ),
    Metric(
        "ddpmon_model_flops_per_step",
        "gauge",
        "The model's FLOPs in one optimizer step (forward, backward, every micro-step), counted once "
        "on one real step with torch's FLOP counter. Absent until counted.",
    ),
    Metric(
        "ddpmon_achieved_flops_per_second",
        "gauge",
        "The model's FLOPs per step over the mean step time of the recent steps.",
    ),
    Metric(
        "ddpmon_device_peak_flops_per_second",
        "gauge",
        "The device's dense peak FLOP/s for the type most of the model's FLOPs run in (NVIDIA "
        "datasheets, ddpmon/peaks.py). Absent where unknown (a CPU, an unlisted GPU).",
    ),
    Metric(
        "ddpmon_mfu_ratio",
        "gauge",
        "Model FLOPs utilisation: achieved FLOP/s over the device's dense peak (0..1). Absent where "
        "the peak is unknown.",
        summary=True,
    ),
    Metric(
        "ddpmon_step_seconds",
        "histogram",
        "Wall time of a training step, from the end of the previous one to its optimizer step "
        "(or its synchronised backward).",
        summary=True,
        summary_bounds=(0.1, 0.5, 1.0, 5.0, 30.0),
    ),
    Metric(
        "ddpmon_step_phase_seconds_total",
        "counter",
        "Seconds of the steps completed, by part of the step (data_wait, h2d, forward, "
        "backward, exposed_comm, optimizer, other); the parts sum to the step time.",
        RANK + ("phase",),
        summary=True,
    ),
    Metric(
        "ddpmon_data_wait_seconds",
        "histogram",
        "Time per step from the end of the previous step to the first forward: the data "
        "loader (and host-to-device copies).",
    ),
    Metric(
        "ddpmon_optimizer_seconds",
        "histogram",
        "Time per step in torch.optim optimizer steps (torch's global step hooks).",
    ),
    Metric(
        "ddpmon_other_seconds",
        "histogram",
        "The rest of a step's wall time: outside forward, backward, communication, optimizer "
        "and data wait (logging, gradient clipping, the loop's own work).",
    ),
    Metric("ddpmon_forward_seconds", "histogram", "Time in the DDP module's forward per step."),
    Metric(
        "ddpmon_backward_seconds",
        "histogram",
        "Backward compute time per step: from backward start to the last gradient ready.",
    ),
    Metric(
        "ddpmon_exposed_comm_seconds",
        "histogram",
        "Communication not hidden behind compute: end of backward compute to DDP having "
        "every bucket's all-reduce done.",
        summary=True,
    ),
    Metric(
        "ddpmon_allreduce_seconds",
        "histogram",
        "A bucket's gradient all-reduce: launch (bucket ready) to completion; "
        "with bucket_timing=c10d or flight_recorder, NCCL's GPU time.",
        BUCKET,
        summary=True,
    ),
    Metric(
        "ddpmon_allreduce_bytes_total",
        "counter",
        "Gradient bytes all-reduced per bucket.",
        BUCKET,
        summary=True,
    ),
    Metric(
        "ddpmon_allreduce_bus_bandwidth_bytes_per_second",
        "gauge",
        "Bus bandwidth of the bucket's last all-reduce (nccl-tests: bytes/time x 2(n-1)/n).",
        BUCKET,
        summary=True,
    ),
    Metric(
        "ddpmon_bucket_ready_seconds",
        "gauge",
        "When the bucket's gradients were all ready, seconds after its step began (last step).",
        BUCKET,
        summary=True,
    ),
    Metric(
        "ddpmon_bucket_size_bytes",
        "gauge",
        "Size of the bucket's gradient buffer.",
        BUCKET,
        summary=True,
    ),
    Metric("ddpmon_bucket_parameters", "gauge", "Number of parameters in the bucket.", BUCKET),
    Metric(
        "ddpmon_unused_parameters",
        "gauge",
        "Parameters that received no gradient in the last step.",
        summary=True,
    ),
    Metric(
        "ddpmon_last_progress_timestamp_seconds",
        "gauge",
        "Unix time of the rank's last observed progress (step, bucket, collective).",
        summary=True,
    ),
    Metric(
        "ddpmon_hang_suspected",
        "gauge",
        "1 while the watchdog suspects this rank is hung.",
        summary=True,
    ),
    Metric(
        "ddpmon_attempt",
        "gauge",
        "The job's attempt under a launcher that restarts it (TORCHELASTIC_RESTART_COUNT: 0 "
        "first); absent without one.",
        summary=True,
    ),
    Metric(
        "ddpmon_paused_seconds_total",
        "counter",
        "Seconds the rank paused between steps: evaluation, checkpoints, or a wait or silence "
        "its watchdog saw before the next step's first forward.",
    ),
    Metric(
        "ddpmon_learning_rate",
        "gauge",
        "The learning rate of the optimizer's last step (its first parameter group); absent "
        "before the first step or when not a plain number.",
    ),
    Metric(
        "ddpmon_global_batch_size",
        "gauge",
        "Samples per optimizer step over the job: the per-rank batch times micro-batches "
        "(gradient accumulation) times DDP's world size; absent until the first step.",
    ),
    Metric(
        "ddpmon_goodput_ratio",
        "gauge",
        "The job's goodput so far, on rank 0 only: its time in steps (less pauses) over the wall "
        "time since its first attempt's process started (0..1).",
    ),
    Metric(
        "ddpmon_goodput_productive_seconds",
        "gauge",
        "The job's time in steps so far, less the pauses between them, over every attempt (rank 0 "
        "only).",
    ),
    Metric(
        "ddpmon_goodput_lost_seconds",
        "gauge",
        "The job's wall time lost so far, over every attempt, by cause (rank 0 only): startup, "
        "pauses, hang_until_detected, hang_until_ended, after_last_step, restarts.",
        RANK + ("cause",),
    ),
    Metric(
        "ddpmon_activity",
        "gauge",
        "What the rank is doing, as its watchdog last saw it: 1 for the current activity, 0 for "
        f"the others (a state set: {', '.join(RANK_ACTIVITIES)}). Absent with the watchdog off.",
        RANK + ("activity",),
        summary=True,
    ),
    Metric(
        "ddpmon_collectives_issued_total",
        "counter",
        "Collectives this rank issued while monitored, by operation "
        "(DDP's buckets too, except on NCCL with bucket_timing c10d or off).",
        RANK + ("op",),
    ),
    Metric(
        "ddpmon_collectives_completed_total",
        "counter",
        "Collectives this rank saw complete, by operation.",
        RANK + ("op",),
    ),
    Metric(
        "ddpmon_collectives_in_flight",
        "gauge",
        "Collectives issued and not yet completed.",
        summary=True,
    ),
    Metric(
        "ddpmon_bucket_timing_unmatched_steps_total",
        "counter",
        "Steps whose all-reduces could not be matched to buckets (bucket_timing=c10d or flight_recorder), so untimed.",
    ),
    Metric(
        "ddpmon_advice",
        "gauge",
        "1 per silent DDP mistake this rank has seen, by kind (docs/advice.md): same data on "
        "every rank, no set_epoch, diverged replicas, NaN/Inf origin, device mapping, costly options.",
        RANK + ("kind",),
        summary=True,
    ),
    Metric(
        "ddpmon_internal_errors_total",
        "counter",
        "Parts of ddpmon that failed and switched themselves off.",
        RANK + ("part",),
        summary=True,
    ),
    Metric(
        "ddpmon_state_write_failures_total",
        "counter",
        "Writes of the rank's files that failed (a full disk, a read-only directory), by file: "
        "state (rank-<R>.json) or history (rank-<R>.history.sqlite); each is tried again with "
        "backoff, and training goes on.",
        RANK + ("file",),
    ),
    # -- the rank's GPU (NVML and torch's allocator) ----------------------------------------
    Metric(
        "ddpmon_gpu_utilization_ratio",
        "gauge",
        "GPU busy ratio over NVML's last sample period (0..1).",
        GPU,
        "gpu",
    ),
    Metric("ddpmon_gpu_memory_used_bytes", "gauge", "GPU memory in use (NVML).", GPU, "gpu"),
    Metric("ddpmon_gpu_memory_total_bytes", "gauge", "GPU memory in total (NVML).", GPU, "gpu"),
    Metric("ddpmon_gpu_power_watts", "gauge", "GPU power draw.", GPU, "gpu"),
    Metric(
        "ddpmon_gpu_energy_joules_total",
        "counter",
        "GPU energy since the driver loaded.",
        GPU,
        "gpu",
    ),
    Metric("ddpmon_gpu_temperature_celsius", "gauge", "GPU core temperature.", GPU, "gpu"),
    Metric("ddpmon_gpu_sm_clock_hertz", "gauge", "GPU SM clock.", GPU, "gpu"),
    Metric(
        "ddpmon_gpu_clock_event_active",
        "gauge",
        "1 while a clock event (throttle reason) holds the clocks down, by reason.",
        GPU + ("reason",),
        "gpu",
    ),
    Metric(
        "ddpmon_gpu_ecc_errors_total",
        "counter",
        "ECC errors since the driver loaded, by type.",
        GPU + ("type",),
        "gpu",
    ),
    Metric("ddpmon_gpu_pcie_replays_total", "counter", "PCIe replay events.", GPU, "gpu"),
    Metric(
        "ddpmon_gpu_xid_errors_total",
        "counter",
        "XID errors seen by the daemon, by code.",
        GPU + ("xid",),
        "daemon",
    ),
    Metric(
        "ddpmon_gpu_last_xid_timestamp_seconds",
        "gauge",
        "When an XID code was last seen.",
        GPU + ("xid",),
        "daemon",
    ),
    Metric(
        "ddpmon_torch_memory_allocated_bytes",
        "gauge",
        "Bytes held by tensors (torch allocator).",
        GPU,
        "gpu",
    ),
    Metric(
        "ddpmon_torch_memory_reserved_bytes",
        "gauge",
        "Bytes reserved by torch's caching allocator.",
        GPU,
        "gpu",
    ),
    Metric(
        "ddpmon_torch_memory_peak_allocated_bytes",
        "gauge",
        "Peak bytes held by tensors.",
        GPU,
        "gpu",
    ),
    # -- the rank's host process (psutil) ---------------------------------------------------
    Metric(
        "ddpmon_process_cpu_seconds_total",
        "counter",
        "CPU time of the rank's process.",
        RANK,
        "host",
    ),
    Metric(
        "ddpmon_process_resident_memory_bytes",
        "gauge",
        "Resident memory of the rank's process.",
        RANK,
        "host",
        summary=True,
    ),
    Metric("ddpmon_process_threads", "gauge", "Threads of the rank's process.", RANK, "host"),
    Metric("ddpmon_host_memory_used_bytes", "gauge", "Memory in use on the host.", RANK, "host"),
    Metric("ddpmon_host_memory_total_bytes", "gauge", "Memory of the host.", RANK, "host"),
    Metric(
        "ddpmon_dataloader_workers",
        "gauge",
        "Child processes of the rank (data-loader workers).",
        RANK,
        "host",
    ),
    Metric(
        "ddpmon_dataloader_workers_cpu_seconds_total",
        "counter",
        "CPU time of the rank's child processes.",
        RANK,
        "host",
    ),
    Metric(
        "ddpmon_memory_growth_bytes_per_second",
        "gauge",
        "The robust trend (Theil-Sen, over the rank's last samples) of a memory series: "
        "process is rank or worker (its fastest-growing DataLoader worker), kind is rss, pss, "
        "torch_allocated or torch_reserved; in summary detail only the fastest of them, as "
        'process and kind "all".',
        RANK + ("process", "kind"),
        "host",
        summary=True,
    ),
    Metric(
        "ddpmon_memory_creep_seconds_left",
        "gauge",
        "While a memory series of the rank creeps (docs/doctor.md, memory_creep): the seconds "
        "before the nearest of them reaches its limit (the GPU's memory, the host's available "
        "memory, the cgroup's limit) at its present rate.",
        RANK,
        "host",
        summary=True,
    ),
    # -- the node daemon ------------------------------------------------------------------------
    Metric(
        "ddpmon_rank_up",
        "gauge",
        "1 while the rank's process is alive and its heartbeat fresh (node daemon).",
        RANK,
        "daemon",
    ),
    Metric(
        "ddpmon_rank_last_progress_timestamp_seconds",
        "gauge",
        "The rank's last progress as read from its state file (node daemon).",
        RANK,
        "daemon",
    ),
    Metric(
        "ddpmon_rank_hang_suspected",
        "gauge",
        "1 while the rank's state file carries a hang report (node daemon).",
        RANK,
        "daemon",
    ),
    Metric(
        "ddpmon_rank_attempt",
        "gauge",
        "The attempt the rank's state file names (TORCHELASTIC_RESTART_COUNT; node daemon).",
        RANK,
        "daemon",
    ),
    Metric(
        "ddpmon_hang_aborts_total",
        "counter",
        "Attempts, among those kept in the state directory, that ddpmon ended on this rank after a "
        "proven hang (hang_action=abort; node daemon).",
        RANK,
        "daemon",
    ),
    Metric(
        "ddpmon_rank_activity",
        "gauge",
        "What the rank is doing as the node daemon sees it: 1 for the current activity, 0 for the "
        f"others (a state set: {', '.join(DAEMON_ACTIVITIES)}); frozen, dead and crashed are what "
        "a rank cannot say itself (node daemon).",
        RANK + ("activity",),
        "daemon",
    ),
    Metric(
        "ddpmon_gpu_process_info",
        "gauge",
        "1 per process on a GPU, with the rank it belongs to when known (node daemon).",
        ("gpu", "gpu_uuid", "pid", "job", "rank"),
        "daemon",
    ),
    Metric(
        "ddpmon_node_ranks_up",
        "gauge",
        "Ranks of the job on this node whose process runs and whose heartbeat is fresh "
        "(node daemon; the sum of its ddpmon_rank_up).",
        ("job",),
        "daemon",
    ),
    Metric(
        "ddpmon_node_ranks",
        "gauge",
        "Ranks of the job on this node by what they are doing (activity: "
        f"{', '.join(DAEMON_ACTIVITIES)}; node daemon).",
        ("job", "activity"),
        "daemon",
    ),
    Metric(
        "ddpmon_node_step_seconds_max",
        "gauge",
        "The longest step time of the job's running ranks on this node, each rank's median "
        "over its recent steps (node daemon, from the state files).",
        ("job",),
        "daemon",
    ),
    Metric(
        "ddpmon_node_step_seconds_median",
        "gauge",
        "The median over the job's running ranks on this node of each rank's median step time "
        "over its recent steps (node daemon).",
        ("job",),
        "daemon",
    ),
    Metric(
        "ddpmon_node_busy_seconds_max",
        "gauge",
        "The largest busy time (a step less its wait for the other ranks: the straggler "
        "score's measure) of the job's running ranks on this node, each rank's median over its "
        "recent steps (node daemon).",
        ("job",),
        "daemon",
    ),
    Metric(
        "ddpmon_node_busy_seconds_median",
        "gauge",
        "The median over the job's running ranks on this node of each rank's median busy time "
        "(node daemon).",
        ("job",),
        "daemon",
    ),
    Metric(
        "ddpmon_node_slowest_rank",
        "gauge",
        "The rank whose busy time is ddpmon_node_busy_seconds_max: the node's candidate "
        "straggler (its number as the value, not a label; node daemon).",
        ("job",),
        "daemon",
    ),
    Metric(
        "ddpmon_node_resident_memory_bytes",
        "gauge",
        "Resident memory of the job's running rank processes on this node, summed (node daemon).",
        ("job",),
        "daemon",
    ),
    Metric(
        "ddpmon_daemon_info",
        "gauge",
        "Always 1; the daemon's host and version.",
        ("host", "version", "gpus"),
        "daemon",
    ),
)

BY_NAME: dict[str, Metric] = {m.name: m for m in METRICS}


@dataclass(frozen=True)
class Record:
    """A series Prometheus records from the ranks' (deploy/prometheus/ddpmon-rules.yml, first
    in its group, before the alerts that read it): a figure the boards and alert rules read,
    computed once per rule evaluation rather than by every panel and alert over every rank.
    Named as Prometheus advises, ``level:metric:operations``; the level says which labels it
    keeps."""

    name: str
    help: str
    sparse: bool = False
    """Series only for the ranks concerned (waiting, hung, silent): none in a healthy job."""


RECORDS: tuple[Record, ...] = (
    Record(
        "job_rank:ddpmon_busy_seconds_per_step:rate5m",
        "A rank's busy time per step (its step parts but the wait for the other ranks).",
    ),
    Record(
        "job_rank:ddpmon_straggler_score:rate5m",
        "A rank's busy time per step against the job's median rank, minus 1 (0.2: 20% slower).",
    ),
    Record("job:ddpmon_steps_per_second:rate5m", "Steps per second, the mean of the ranks."),
    Record("job:ddpmon_step_seconds:mean_rate5m", "Mean step time over every rank."),
    Record(
        "job:ddpmon_exposed_comm_ratio:rate10m",
        "Share of step time spent waiting for all-reduces after backward compute.",
    ),
    Record(
        "job_bucket:ddpmon_allreduce_seconds:mean_rate5m",
        'Mean all-reduce time of each bucket (bucket="all" in summary), over every rank.',
    ),
    Record(
        "job_phase:ddpmon_step_phase_seconds_per_step:rate5m",
        "Mean seconds per step in each part of the step, over every rank.",
    ),
    Record("job:ddpmon_ranks_reporting:count", "Ranks whose endpoint Prometheus scrapes."),
    Record(
        "job_rank:ddpmon_activity:not_stepping",
        "1 for a rank that is not stepping, with its activity, host and the instance that "
        "said it (no series while it steps): by its own word, else by its node daemon's.",
        sparse=True,
    ),
    Record(
        "job_rank:ddpmon_hang_suspected:max",
        "1 for a rank whose watchdog reports a hang, by its endpoint or its node daemon, with "
        "the instance that said it (no series for the others).",
        sparse=True,
    ),
    Record(
        "job_rank:ddpmon_rank_info:endpoint_down",
        "1, with its instance and host, for a rank scraped within the hour whose endpoint no "
        "longer answers (no series for the others).",
        sparse=True,
    ),
    Record(
        "job:ddpmon_ranks_waiting:count",
        "Ranks waiting in a collective, by their own word or else their node daemon's.",
    ),
    Record(
        "job:ddpmon_ranks_hung:count",
        "Ranks suspected hung, by their watchdog or their node daemon.",
    ),
    Record("job:ddpmon_unused_parameters:max", "Most parameters without gradient on any rank."),
)
RECORD_NAMES: frozenset[str] = frozenset(r.name for r in RECORDS)


def get(name: str) -> Metric:
    """The catalog entry for ``name``; a KeyError names the unknown metric."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(
            f"{name!r} is not in ddpmon's metric catalog (ddpmon/metrics/catalog.py)"
        ) from None


def series_names() -> set[str]:
    """Every name a scrape can show, histogram and counter suffixes included."""
    out = set()
    for m in METRICS:
        if m.kind == "histogram":
            out.update({m.name + "_bucket", m.name + "_sum", m.name + "_count"})
        else:
            out.add(m.name)
    return out
