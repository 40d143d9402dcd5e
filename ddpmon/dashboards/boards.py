"""ddpmon's two Grafana boards: the DDP job overview and the DDP GPUs board.

Each board is a list of panels, grouped in small functions by the row they form on screen
(``model.layout`` fills rows of 24 columns in order, so the order here is the order on the
board). A panel's description says what it shows and what a bad value looks like.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..metrics.catalog import DAEMON_ACTIVITIES, RANK_ACTIVITIES
from .model import Panel, Query, dashboard, mapping, thresholds

# Selectors shared by the panels: one DDP job, the chosen ranks.
SEL = '{job="$job", rank=~"$rank"}'
JOB = '{job="$job"}'
RATE = "$__rate_interval"

ZERO_TO_ONE = {"min": 0, "max": 1}
RATIO_THRESHOLDS = thresholds((None, "green"), (0.2, "orange"), (0.3, "red"))


def _rate(name: str, sel: str = SEL) -> str:
    return f"rate({name}{sel}[{RATE}])"


def _per_step(
    numerator: Sequence[str],
    by: str = "rank",
    sel: str = SEL,
    count: str = "ddpmon_step_seconds_count",
) -> str:
    """Mean seconds per step of the summed histogram sums ``numerator``, grouped ``by``."""
    grouping = f"sum by ({by}) " if by else "sum "
    num = " + ".join(_rate(n, sel) for n in numerator)
    return f"{grouping}({num}) / {grouping}({_rate(count, sel)})"


# -- DDP job overview --------------------------------------------------------------------------


def overview() -> dict[str, Any]:
    """The DDP job overview: progress, stragglers, communication, health."""
    panels = [
        *_at_a_glance(),
        *_progress(),
        *_stragglers(),
        *_step_breakdown(),
        *_communication(),
        *_health(),
        *_memory(),
    ]
    return dashboard(
        "ddpmon-ddp-overview",
        "DDP job overview",
        "One PyTorch DDP job as ddpmon sees it: speed, stragglers, gradient communication, "
        "unused parameters, hangs, liveness and memory per rank.",
        panels,
    )


def _at_a_glance() -> list[Panel]:
    """The top row of stats: speed, step time, exposed communication, ranks, hangs, unused."""
    return [
        Panel(
            "stat",
            "Steps per second",
            "Training steps per second of the job, the mean of its ranks over 5 minutes "
            "(recorded). Every rank of a DDP job steps in lockstep, so this is the job's "
            "speed. Bad: a drop from the usual value (a straggler, slow data loading, a "
            "slower network) or 0 (a hang).",
            "suffix:steps/s",
            [Query(f"job:ddpmon_steps_per_second:rate5m{JOB}", "steps/s")],
            w=4,
            h=4,
        ),
        Panel(
            "stat",
            "Mean step time",
            "Mean wall time of one training step over the job's ranks and the last 5 minutes "
            "(recorded). Bad: growing over time or well above what this model usually takes; "
            "look at the step parts below to see which part grew.",
            "s",
            [Query(f"job:ddpmon_step_seconds:mean_rate5m{JOB}", "step time")],
            w=4,
            h=4,
        ),
        Panel(
            "stat",
            "Exposed communication",
            "Share of the job's step time spent waiting for gradient all-reduces after "
            "backward compute finished (communication not hidden behind compute), over 10 "
            "minutes as DDPHighExposedCommunication reads it (recorded). Bad: above about 30% "
            "(orange from 20%): the network is too slow for this model size, buckets are badly "
            "sized, or the ranks wait for a straggler.",
            "percentunit",
            [Query(f"job:ddpmon_exposed_comm_ratio:rate10m{JOB}", "exposed")],
            w=4,
            h=4,
            defaults={"thresholds": RATIO_THRESHOLDS, "min": 0, "max": 1},
        ),
        Panel(
            "stat",
            "Ranks reporting",
            "Ranks of this job whose metrics endpoint Prometheus scraped. Bad: fewer than the "
            "job's world size (the world_size label of ddpmon_rank_info): a rank died, or its "
            "endpoint is not scraped.",
            "short",
            [Query(f"job:ddpmon_ranks_reporting:count{JOB}", "ranks")],
            w=4,
            h=4,
        ),
        Panel(
            "stat",
            "Ranks suspected hung",
            "Ranks of the job whose watchdog (or the node daemon, from the rank's state file) "
            "reports a suspected hang. Good: 0. Bad: 1 or more: run `ddpmon doctor` on the "
            "node for the culprit rank and its Python stack.",
            "short",
            [Query(f"job:ddpmon_ranks_hung:count{JOB} or vector(0)", "hung ranks")],
            w=4,
            h=4,
            defaults={"thresholds": thresholds((None, "green"), (1, "red"))},
        ),
        Panel(
            "stat",
            "Unused parameters",
            "Most parameters that got no gradient in the last step, on any rank of the job. "
            "Bad: above 0 when the model should use every parameter (a skipped branch), or "
            "rising during training; with find_unused_parameters=False DDP will fail.",
            "short",
            [Query(f"job:ddpmon_unused_parameters:max{JOB}", "unused")],
            w=4,
            h=4,
            defaults={"thresholds": thresholds((None, "green"), (1, "orange"))},
        ),
    ]


def _progress() -> list[Panel]:
    """Step time (mean and p90) and steps per second, per rank."""
    return [
        Panel(
            "timeseries",
            "Step time per rank",
            "Mean and 90th percentile step time of each rank. All ranks of a DDP job take "
            "the same time per step (they synchronise every step). Bad: a rising trend, "
            "spikes, or a p90 far above the mean (irregular stalls such as data loading).",
            "s",
            [
                Query(
                    f"sum by (rank) ({_rate('ddpmon_step_seconds_sum')}) / "
                    f"sum by (rank) ({_rate('ddpmon_step_seconds_count')})",
                    "rank {{rank}} mean",
                ),
                Query(
                    f"histogram_quantile(0.9, sum by (rank, le) ({_rate('ddpmon_step_seconds_bucket')}))",
                    "rank {{rank}} p90",
                ),
            ],
        ),
        Panel(
            "timeseries",
            "Steps per second per rank",
            "Training throughput of each rank in steps per second. Ranks move together; "
            "bad: a fall to 0 on every rank (a hang or a dead rank) or a slow decline.",
            "suffix:steps/s",
            [Query(f"sum by (rank) ({_rate('ddpmon_steps_total')})", "rank {{rank}}")],
        ),
    ]


BUSY_PER_STEP = f"job_rank:ddpmon_busy_seconds_per_step:rate5m{SEL}"
"""Each rank's busy time per step: its step parts less the wait for the other ranks
(ddpmon/steps.py), recorded from the per-part seconds."""
STRAGGLER_SCORE = f"job_rank:ddpmon_straggler_score:rate5m{SEL}"
"""The straggler score per rank: busy time per step against the job's median rank, minus 1
(recorded: DDPStraggler reads the same series)."""


def _stragglers() -> list[Panel]:
    """Which rank sets the pace: busy time against all-reduce wait, and the straggler score."""
    return [
        Panel(
            "bargauge",
            "Straggler: busy time per step",
            "Each rank's own work per step: its step less the time it waits for the other "
            "ranks (data wait, forward, backward, optimizer and the rest). The slowest rank "
            "has the longest bar and every other rank waits for it. Bad: one rank clearly "
            "longer than the rest; the step parts panel and `ddpmon doctor` name the part.",
            "s",
            [Query(BUSY_PER_STEP, "rank {{rank}}", instant=True)],
            w=8,
        ),
        Panel(
            "bargauge",
            "Straggler: all-reduce wait per step",
            "Exposed communication per step of each rank: time from the end of its backward "
            "compute until its all-reduces finished. Fast ranks wait longest for a straggler, "
            "so the straggler is the rank with the shortest bar here and the longest busy "
            "bar. Bad: large waits on all ranks but one.",
            "s",
            [
                Query(
                    _per_step(
                        ("ddpmon_exposed_comm_seconds_sum",),
                        count="ddpmon_exposed_comm_seconds_count",
                    ),
                    "rank {{rank}}",
                    instant=True,
                )
            ],
            w=8,
        ),
        Panel(
            "timeseries",
            "Straggler score",
            "How much slower each rank's busy time per step is than the job's median rank "
            "(0 = the median, 0.2 = 20% slower). Bad: a rank persistently at 10% or more "
            "(orange) or 20% (red, the DDPStraggler alert after 10 minutes): it sets the pace "
            "of the whole job. `ddpmon doctor` names the part of the step that explains it.",
            "percentunit",
            [Query(STRAGGLER_SCORE, "rank {{rank}}")],
            w=8,
            defaults={"thresholds": thresholds((None, "green"), (0.1, "orange"), (0.2, "red"))},
        ),
    ]


def _step_breakdown() -> list[Panel]:
    """Where the step goes: time per part, and the exposed communication share per rank."""
    return [
        Panel(
            "timeseries",
            "Step parts",
            "Mean time per step in each part of the step over the job's ranks (recorded, 5 "
            "minutes): data wait (the data loader), forward, backward compute, exposed "
            "communication, optimizer and the rest (logging, host work); they add up to the "
            "step time. Bad: data wait, exposed communication or other growing into a large "
            "share of the step.",
            "s",
            [Query(f"job_phase:ddpmon_step_phase_seconds_per_step:rate5m{JOB}", "{{phase}}")],
            defaults={"custom": {"stacking": {"mode": "normal"}, "fillOpacity": 40}},
        ),
        Panel(
            "timeseries",
            "Exposed communication ratio per rank",
            "Share of each rank's step time spent waiting for all-reduces after its backward "
            "compute. Bad: above 30% for a long time (DDPHighExposedCommunication); one rank "
            "far lower than the others is the straggler the others wait for.",
            "percentunit",
            [
                Query(
                    f"sum by (rank) ({_rate('ddpmon_exposed_comm_seconds_sum')}) / "
                    f"sum by (rank) ({_rate('ddpmon_step_seconds_sum')})",
                    "rank {{rank}}",
                )
            ],
            defaults={"thresholds": RATIO_THRESHOLDS, "min": 0, "max": 1},
        ),
    ]


def _communication() -> list[Panel]:
    """Gradient buckets: all-reduce time, bus bandwidth, sizes, ready times; traffic per rank."""
    return [
        Panel(
            "timeseries",
            "All-reduce time per bucket",
            "Mean duration of each gradient bucket's all-reduce (from the bucket becoming "
            "ready to the collective completing), over the job's ranks (recorded, 5 minutes; "
            "one line, bucket all, where ranks export the summary). Bucket 0 holds the last "
            "layers and is reduced first. Bad: one bucket far slower than its size explains, "
            "or all buckets slowing down (network trouble, a straggler).",
            "s",
            [Query(f"job_bucket:ddpmon_allreduce_seconds:mean_rate5m{JOB}", "bucket {{bucket}}")],
        ),
        Panel(
            "timeseries",
            "Bus bandwidth per bucket",
            "Bus bandwidth of each bucket's last all-reduce (nccl-tests definition: bytes / "
            "time x 2(n-1)/n), averaged over the selected ranks. Bad: far below what the "
            "interconnect delivers in nccl-tests (small buckets are latency bound and always "
            "lower), or a sudden drop.",
            "Bps",
            [
                Query(
                    f"avg by (bucket) (ddpmon_allreduce_bus_bandwidth_bytes_per_second{SEL})",
                    "bucket {{bucket}}",
                )
            ],
        ),
        Panel(
            "bargauge",
            "Bucket sizes",
            "Size of each gradient bucket's buffer (DDP's bucket_cap_mb caps it). Bad: many "
            "tiny buckets (latency bound all-reduces) or a single huge one (no overlap of "
            "communication with backward compute).",
            "bytes",
            [
                Query(
                    f"max by (bucket) (ddpmon_bucket_size_bytes{SEL})",
                    "bucket {{bucket}}",
                    instant=True,
                )
            ],
            w=8,
        ),
        Panel(
            "timeseries",
            "Bucket ready time",
            "When each bucket's gradients were all ready, in seconds after its step began "
            "(last step, mean over the selected ranks). Buckets become ready in order during "
            "backward. Bad: all buckets ready only at the very end (nothing to overlap).",
            "s",
            [Query(f"avg by (bucket) (ddpmon_bucket_ready_seconds{SEL})", "bucket {{bucket}}")],
            w=8,
        ),
        Panel(
            "timeseries",
            "All-reduce traffic per rank",
            "Gradient bytes each rank all-reduces per second (algorithm bytes, not bus "
            "bytes). Equal on every rank. Bad: a drop with steady step count (buckets "
            "skipped) or a fall to 0 (no step finishes).",
            "Bps",
            [Query(f"sum by (rank) ({_rate('ddpmon_allreduce_bytes_total')})", "rank {{rank}}")],
            w=8,
        ),
    ]


def _health() -> list[Panel]:
    """Per rank: unused parameters, progress, hang state, activity, liveness, collectives in flight."""
    return [
        Panel(
            "timeseries",
            "Unused parameters per rank",
            "Parameters that got no gradient in the last step, per rank (names are in the "
            "rank's state file and log). Bad: a value above 0 that appears mid-training or "
            "differs between ranks (a branch skipped on some ranks).",
            "short",
            [Query(f"max by (rank) (ddpmon_unused_parameters{SEL})", "rank {{rank}}")],
            w=8,
        ),
        Panel(
            "timeseries",
            "Time since last progress",
            "Seconds since each rank last made progress (a step, a bucket, a collective), as "
            "the rank reports it and as the node daemon reads it from the state file. "
            "Healthy: under a step time. Bad: growing steadily on any rank (a hang; "
            "DDPJobNoProgress fires after 10 minutes).",
            "s",
            [
                Query(
                    f"time() - max by (rank) (ddpmon_last_progress_timestamp_seconds{SEL})",
                    "rank {{rank}}",
                ),
                Query(
                    f"time() - max by (rank) (ddpmon_rank_last_progress_timestamp_seconds{SEL})",
                    "rank {{rank}} (daemon)",
                ),
            ],
            w=8,
        ),
        Panel(
            "state-timeline",
            "Hang state per rank",
            "Whether the rank's watchdog (or the node daemon, from the state file) suspects "
            "a hang. Good: ok everywhere. Bad: 'hang suspected' on a rank: run `ddpmon "
            "doctor` on its node.",
            "short",
            [
                Query(f"max by (rank) (ddpmon_hang_suspected{SEL})", "rank {{rank}}"),
                Query(f"max by (rank) (ddpmon_rank_hang_suspected{SEL})", "rank {{rank}} (daemon)"),
            ],
            w=8,
            defaults={
                **ZERO_TO_ONE,
                "mappings": mapping((0, "ok", "green"), (1, "hang suspected", "red")),
                "thresholds": thresholds((None, "green"), (1, "red")),
            },
        ),
        Panel(
            "state-timeline",
            "Activity per rank",
            "What each rank is doing, by its own watchdog (ddpmon_activity) or, when its "
            "endpoint is silent, by its node daemon (ddpmon_rank_activity): stepping, busy "
            "(outside a step: evaluation, checkpoint), waiting (in a collective), stuck (no "
            "progress, no CPU, no I/O), frozen, dead, crashed. Good: stepping everywhere. "
            "Bad: one rank stuck, busy, frozen, dead or crashed while the others wait: it "
            "is the culprit (DDPHangCulprit names it once the hang timeout has passed).",
            "short",
            [
                Query(
                    f"({_activity_code('ddpmon_activity', RANK_ACTIVITIES)}) or "
                    f"({_activity_code('ddpmon_rank_activity', DAEMON_ACTIVITIES)})",
                    "rank {{rank}}",
                )
            ],
            w=8,
            defaults={
                "min": 0,
                "max": len(DAEMON_ACTIVITIES) - 1,
                "mappings": mapping(
                    *((i, a, ACTIVITY_COLOURS[a]) for i, a in enumerate(DAEMON_ACTIVITIES))
                ),
            },
        ),
        Panel(
            "state-timeline",
            "Liveness per rank",
            "Whether each rank is alive: as the node daemon sees the process and its state "
            "file heartbeat, and whether Prometheus can scrape the rank's endpoint. Good: up "
            "everywhere. Bad: down on a rank while the others are up: they will block in "
            "their next collective (DDPRankDown).",
            "short",
            [
                Query(f"max by (rank) (ddpmon_rank_up{SEL})", "rank {{rank}} (daemon)"),
                Query(
                    f"max by (rank) (max by (instance, rank) (last_over_time(ddpmon_rank_info{SEL}[1h]))"
                    f" * on (instance) group_left () max by (instance) (up))",
                    "rank {{rank}} (endpoint)",
                ),
            ],
            w=8,
            defaults={
                **ZERO_TO_ONE,
                "mappings": mapping((0, "down", "red"), (1, "up", "green")),
                "thresholds": thresholds((None, "red"), (1, "green")),
            },
        ),
        Panel(
            "timeseries",
            "Collectives in flight per rank",
            "Collectives each rank issued that have not completed yet. Healthy: brief spikes "
            "during backward that return to 0 every step. Bad: stuck above 0 while progress "
            "stops: the rank waits in a collective for a peer that never joins.",
            "short",
            [Query(f"max by (rank) (ddpmon_collectives_in_flight{SEL})", "rank {{rank}}")],
            w=8,
        ),
    ]


def _memory() -> list[Panel]:
    """Per rank: its memory, the trend the rank fits to it, the time left while it creeps."""
    return [
        Panel(
            "timeseries",
            "Resident memory per rank",
            "Resident memory (RSS) of each rank's process. Healthy: flat after the first "
            "steps, a step up once (a cache filled) included. Bad: rising step after step "
            "on one rank (a leak: the trend panel beside this one shows its rate).",
            "bytes",
            [Query(f"max by (rank) (ddpmon_process_resident_memory_bytes{SEL})", "rank {{rank}}")],
            w=8,
        ),
        Panel(
            "timeseries",
            "Memory growth per rank",
            "The robust trend each rank fits to its memory (Theil-Sen over its last readings "
            "and each half: noise and a rise that came once do not move it): the rank's "
            "process or its fastest-growing DataLoader worker, resident (rss) or proportional "
            "(pss) memory, torch's allocated or reserved GPU memory. Healthy: near 0. Bad: "
            "one series well above the others, lasting (`ddpmon doctor` names it: "
            "memory_creep).",
            "Bps",
            [
                Query(
                    f"max by (rank, process, kind) (ddpmon_memory_growth_bytes_per_second{SEL})",
                    "rank {{rank}} {{process}} {{kind}}",
                )
            ],
            w=8,
        ),
        Panel(
            "timeseries",
            "Time left before a memory limit",
            "While a memory series of a rank creeps (1 MiB a step or more, in every third "
            "of its window): the time before the nearest one reaches its limit (the GPU's "
            "memory, the host's available memory, the cgroup's limit) at its present rate. "
            "Good: no data (nothing creeps). Bad: any line; the lower, the sooner the rank "
            "is killed (run `ddpmon doctor` for the cause and the fix).",
            "s",
            [Query(f"min by (rank) (ddpmon_memory_creep_seconds_left{SEL})", "rank {{rank}}")],
            w=8,
        ),
    ]


ACTIVITY_COLOURS = {
    "stepping": "green",
    "busy": "blue",
    "waiting": "yellow",
    "stuck": "red",
    "frozen": "purple",
    "dead": "dark-red",
    "crashed": "dark-red",
}
"""How the activity panel shows each activity (``catalog.DAEMON_ACTIVITIES``, in order)."""


def _activity_code(metric: str, activities: Sequence[str]) -> str:
    """One number per rank for a state set: the index of its current activity in
    ``DAEMON_ACTIVITIES`` (a state-timeline maps numbers to words)."""
    terms = [
        f'{DAEMON_ACTIVITIES.index(a)} * max by (rank) ({metric}{{job="$job", rank=~"$rank", activity="{a}"}})'
        for a in activities
        if DAEMON_ACTIVITIES.index(a)
    ]
    return " + ".join(terms)


# -- DDP GPUs ----------------------------------------------------------------------------------

GPU_LEGEND = "rank {{rank}} gpu {{gpu}}"
BY_GPU = "max by (rank, gpu)"
THROTTLE_REASONS = "(?i).*(thermal|power_?brake|hw_?slowdown).*"
"""Clock-event reasons that mean the GPU is held down by heat or power (not idle, not the
application clock setting, not the usual software power cap at full load)."""


def gpus() -> dict[str, Any]:
    """The DDP GPUs board: each rank's GPU from NVML (and the node daemon for XIDs)."""
    panels = [*_gpu_load(), *_gpu_power_and_clocks(), *_gpu_errors_and_energy()]
    return dashboard(
        "ddpmon-ddp-gpus",
        "DDP GPUs",
        "The GPU of every rank of one PyTorch DDP job: utilization, memory, power, "
        "temperature, clocks and throttling, ECC and XID errors.",
        panels,
    )


def _gpu_load() -> list[Panel]:
    """How busy each GPU is and the memory it holds (NVML and torch's allocator)."""
    return [
        Panel(
            "timeseries",
            "GPU utilization",
            "Share of time a kernel ran on each rank's GPU over NVML's sample period. Good: "
            "high and equal on every rank. Bad: one rank lower than the others (it waits: "
            "data loading, a straggler elsewhere) or all low (communication or input bound).",
            "percentunit",
            [Query(f"{BY_GPU} (ddpmon_gpu_utilization_ratio{SEL})", GPU_LEGEND)],
            w=8,
            defaults={"min": 0, "max": 1},
        ),
        Panel(
            "timeseries",
            "GPU memory used",
            "GPU memory in use on each rank's device (NVML, every process on it), with the "
            "device total. Bad: close to the total (the next allocation may fail with out of "
            "memory) or growing every step (a leak).",
            "bytes",
            [
                Query(f"{BY_GPU} (ddpmon_gpu_memory_used_bytes{SEL})", GPU_LEGEND),
                Query(f"{BY_GPU} (ddpmon_gpu_memory_total_bytes{SEL})", GPU_LEGEND + " total"),
            ],
            w=8,
        ),
        Panel(
            "timeseries",
            "torch allocator memory",
            "Memory held by tensors (allocated), kept by torch's caching allocator "
            "(reserved) and the peak allocated, per rank. Bad: reserved far above allocated "
            "(fragmentation) or allocated growing step after step (tensors kept alive).",
            "bytes",
            [
                Query(
                    f"{BY_GPU} (ddpmon_torch_memory_allocated_bytes{SEL})",
                    GPU_LEGEND + " allocated",
                ),
                Query(
                    f"{BY_GPU} (ddpmon_torch_memory_reserved_bytes{SEL})", GPU_LEGEND + " reserved"
                ),
                Query(
                    f"{BY_GPU} (ddpmon_torch_memory_peak_allocated_bytes{SEL})",
                    GPU_LEGEND + " peak",
                ),
            ],
            w=8,
        ),
    ]


def _gpu_power_and_clocks() -> list[Panel]:
    """Power, temperature, clocks and what holds the clocks down."""
    return [
        Panel(
            "timeseries",
            "GPU power",
            "Power draw of each rank's GPU. Good: similar on every rank under the same load. "
            "Bad: one GPU drawing much less than its peers (it is held down or starved), or "
            "all GPUs pinned at the power limit with clocks dropping.",
            "watt",
            [Query(f"{BY_GPU} (ddpmon_gpu_power_watts{SEL})", GPU_LEGEND)],
            w=8,
        ),
        Panel(
            "timeseries",
            "GPU temperature",
            "Core temperature of each rank's GPU (orange from 80 C, red from 87 C). Bad: well "
            "above its peers or near the GPU's slowdown temperature (nvidia-smi -q -d "
            "TEMPERATURE shows it): the GPU will throttle and become a straggler.",
            "celsius",
            [Query(f"{BY_GPU} (ddpmon_gpu_temperature_celsius{SEL})", GPU_LEGEND)],
            w=8,
            defaults={"thresholds": thresholds((None, "green"), (80, "orange"), (87, "red"))},
        ),
        Panel(
            "timeseries",
            "SM clock",
            "Streaming-multiprocessor clock of each rank's GPU. Good: at or near the boost "
            "clock under load and equal on every rank. Bad: one GPU clocked lower than the "
            "rest (see the clock events panel for why).",
            "hertz",
            [Query(f"{BY_GPU} (ddpmon_gpu_sm_clock_hertz{SEL})", GPU_LEGEND)],
            w=8,
        ),
        Panel(
            "timeseries",
            "Clock events by reason",
            "How many of the selected GPUs have each clock event (throttle reason) active. "
            "The software power cap at full load is common; bad: thermal slowdown, hardware "
            "slowdown or power brake on any GPU.",
            "short",
            [Query(f"sum by (reason) (ddpmon_gpu_clock_event_active{SEL})", "{{reason}}")],
            w=8,
        ),
        Panel(
            "state-timeline",
            "Thermal or power throttling per GPU",
            "Whether each rank's GPU is held down by heat or by a power brake (thermal "
            "slowdown, hardware slowdown, power brake). Good: full clocks everywhere. Bad: "
            "throttled on a GPU: that rank becomes a straggler (DDPGPUThermalThrottling, "
            "DDPGPUPowerThrottling).",
            "short",
            [
                Query(
                    f'{BY_GPU} (ddpmon_gpu_clock_event_active{{job="$job", rank=~"$rank", '
                    f'reason=~"{THROTTLE_REASONS}"}})',
                    GPU_LEGEND,
                )
            ],
            w=8,
            defaults={
                **ZERO_TO_ONE,
                "mappings": mapping((0, "full clocks", "green"), (1, "throttled", "red")),
                "thresholds": thresholds((None, "green"), (1, "red")),
            },
        ),
    ]


def _gpu_errors_and_energy() -> list[Panel]:
    """PCIe replays, ECC and XID errors, and the energy used over the time range."""
    return [
        Panel(
            "timeseries",
            "PCIe replays",
            "PCIe replay events per second on each rank's GPU link. Good: 0. Bad: a steady "
            "rate (a marginal link or riser, which also slows host-device copies).",
            "suffix:replays/s",
            [Query(f"sum by (rank, gpu) ({_rate('ddpmon_gpu_pcie_replays_total')})", GPU_LEGEND)],
            w=8,
        ),
        Panel(
            "timeseries",
            "ECC errors",
            "ECC errors each rank's GPU counted since the driver loaded, by type. Corrected "
            "errors in small numbers are harmless; bad: any uncorrected error (the job's "
            "results on that GPU are suspect; DDPGPUUncorrectedECCErrors) or corrected "
            "errors climbing fast.",
            "short",
            [
                Query(
                    f"max by (rank, gpu, type) (ddpmon_gpu_ecc_errors_total{SEL})",
                    GPU_LEGEND + " {{type}}",
                )
            ],
            w=8,
        ),
        Panel(
            "timeseries",
            "XID errors",
            "XID errors the node daemon saw on each rank's GPU, by XID code. Good: none. "
            "Bad: any (13, 31, 43: usually an application fault; 48, 63, 64, 74, 79, 92, 94, 95: "
            "the GPU, its memory or NVLink, and 48, 74, 79, 95 usually end the job; "
            "DDPGPUXidError).",
            "short",
            [
                Query(
                    f"sum by (rank, gpu, xid) (ddpmon_gpu_xid_errors_total{SEL})",
                    GPU_LEGEND + " xid {{xid}}",
                )
            ],
            w=8,
        ),
        Panel(
            "stat",
            "GPU energy over the time range",
            "Energy the selected ranks' GPUs used over the dashboard's time range. Useful to "
            "compare runs; bad: much more energy for the same number of steps than a "
            "previous run.",
            "joule",
            [Query(f"sum(increase(ddpmon_gpu_energy_joules_total{SEL}[$__range]))", "energy")],
            w=8,
            h=8,
        ),
    ]


# -- every board -------------------------------------------------------------------------------

BOARDS: dict[str, Callable[[], dict[str, Any]]] = {
    "ddp-job-overview.json": overview,
    "ddp-gpus.json": gpus,
}
"""Each board by the file name it is written under."""


def build() -> dict[str, dict[str, Any]]:
    """Every dashboard, by file name."""
    return {name: make() for name, make in BOARDS.items()}
