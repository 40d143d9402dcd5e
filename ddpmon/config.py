"""Configuration: one frozen dataclass, and the only place that reads DDPMON_* variables.

Every field can be given to ``attach(**options)`` or set as ``DDPMON_<FIELD>`` in the
environment; an explicit argument wins. Unknown names are errors, never ignored.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
from collections.abc import Callable, Mapping
from typing import Any, TypedDict

from .errors import ConfigError
from .state import root

BUCKET_METRICS_MODES = ("auto", "per_bucket", "aggregate", "off")
BUCKET_TIMING_MODES = ("auto", "hook", "c10d", "flight_recorder", "off")
HANG_ACTIONS = ("report", "abort")
AUTO_PER_BUCKET_LIMIT = 128
METRICS_DETAIL_MODES = ("auto", "full", "summary")
AUTO_FULL_WORLD_SIZE = 256
"""``metrics_detail="auto"`` exports every series up to this many ranks, the summary above:
a full job of 256 ranks with 30 buckets is about 220,000 series, a tenth of what one
Prometheus should hold in all (docs/metrics.md#series-per-job)."""


@dataclasses.dataclass(frozen=True)
class Config:
    """What one monitor does. Times are in seconds; ``None`` means "work it out"."""

    job: str | None = None
    """Job name, the ``job`` label of every series. Default: TORCHELASTIC_RUN_ID, else
    ``ddp-<launch id>``, unique per launch (state/root.py)."""
    port: int = 9500
    """Base port of the metrics endpoint; the rank with LOCAL_RANK=k serves on base+k.
    0 = an ephemeral port (written to the state file); negative = no endpoint."""
    bind: str = "0.0.0.0"
    """Address the metrics endpoint binds to."""
    state_dir: str | None = None
    """Directory of the per-rank state files. Default: ``<tmp>/ddpmon-<uid>/<job>``, private
    to the user (0700, checked before writing; docs/security.md). An empty string turns
    state files off."""
    state_interval: float = 1.0
    """Seconds between state-file rewrites (notable events also rewrite at once)."""
    hang_timeout: float | None = None
    """Seconds without progress before a hang is reported. None = learned from observed
    step times after warm-up: max(hang_timeout_floor, 10 x the slowest step). 0 = off."""
    hang_timeout_floor: float = 60.0
    """Lower bound of the learned hang timeout."""
    hang_action: str = "report"
    """What a proven hang does. ``report``: the hang report, the state file and a warning;
    the job goes on waiting. ``abort``: the same, then the rank aborts its process groups
    where the backend can (NCCL) and exits with ``HANG_EXIT_CODE`` (87), so that a launcher
    that restarts (``torchrun --max-restarts``) starts the next attempt. Without such a
    launcher the job's work is lost."""
    track_collectives: bool = True
    """Record every collective this rank issues through ``torch.distributed`` (op, bytes,
    call site, sequence number per process group) while attached."""
    bucket_timing: str = "auto"
    """Where per-bucket timing comes from. ``c10d``: NCCL's own per-collective timing
    (its completion hook), with DDP's C++ all-reduce (or your ``comm_hook``) left in place.
    ``hook``: a Python comm hook around the all-reduce (any backend; it costs a few percent
    of step time, docs/performance.md). ``flight_recorder``: the same NCCL timings read
    back from torch's flight recorder every few seconds (each read holds the GIL while
    torch serialises its ring buffer; it turns itself off where the recorder keeps no
    durations, as gloo's). ``auto``: ``c10d`` on NCCL; elsewhere ``hook`` when
    a comm hook of yours runs in Python anyway (``comm_hook``, or one registered after
    attach), else ``off``. ``off``: no per-bucket series, the rest as usual. True/False
    mean ``auto``/``off``."""
    comm_hook: Callable[..., Any] | None = None
    """A comm hook of your own, ``hook(state, bucket) -> Future[Tensor]``, that ddpmon
    registers and times. In the environment: a dotted path such as
    ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook``."""
    comm_state: Any = None
    """The state passed to ``comm_hook``; default: the DDP model's process group. An object:
    no ``DDPMON_COMM_STATE`` variable."""
    nvml: bool = True
    """Export this rank's GPU metrics from NVML (when a GPU and the NVML library exist)."""
    bucket_metrics: str = "auto"
    """``per_bucket`` (series per bucket), ``aggregate`` (``bucket="all"`` only), ``off``, or
    ``auto``: per bucket up to 128 buckets, aggregated above (a per-bucket scrape of 1,000
    buckets takes about a quarter of a second)."""
    metrics_detail: str = "auto"
    """How many series a rank exports. ``full``: every series (per bucket as
    ``bucket_metrics`` says). ``summary``: at most 40 per rank, the ones the shipped alert
    rules and the job overview board read (buckets folded into ``bucket="all"``, the GPU
    left to the node daemon; the rest stays in the state file and the report). ``auto``:
    full up to 256 ranks, summary above."""
    history: bool = True
    """Keep every step's timings in ``<state_dir>/rank-<R>.history.sqlite`` (written by a
    background thread) for ``ddpmon report`` and ``ddpmon compare``; needs state files."""
    unused_parameters_advice_steps: int = 100
    """Steps without any unused parameter after which find_unused_parameters=True is
    flagged as needless."""
    web_config_file: str | None = None
    """exporter-toolkit's web config file (TLS, basic auth), for the metrics endpoint, as
    node_exporter's ``--web.config.file`` reads it (docs/security.md). A file that cannot be
    used leaves the rank without an endpoint, with one warning saying why."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **options: Any) -> Config:
        """Build a Config from DDPMON_* variables, overridden by explicit ``options``."""
        environ = os.environ if environ is None else environ
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise ConfigError(
                unknown[0], options[unknown[0]], "one of the options " + ", ".join(sorted(names))
            )
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            var = "DDPMON_" + field.name.upper()
            if field.name in options and options[field.name] is not None:
                values[field.name] = options[field.name]
            elif environ.get(var, "") != "" and field.name != "comm_state":
                values[field.name] = _parse(var, field.name, environ[var])
        config = cls(**values)
        config._validate()
        return config

    def _validate(self) -> None:
        if not isinstance(self.port, int) or isinstance(self.port, bool):
            raise ConfigError("port", self.port, "an integer (0 = ephemeral, negative = off)")
        if self.port > 65535:
            raise ConfigError("port", self.port, "a port number up to 65535")
        for name in ("state_interval", "hang_timeout_floor"):
            if not _is_number(getattr(self, name)) or getattr(self, name) <= 0:
                raise ConfigError(name, getattr(self, name), "a positive number of seconds")
        if self.hang_timeout is not None and (
            not _is_number(self.hang_timeout) or self.hang_timeout < 0
        ):
            raise ConfigError(
                "hang_timeout", self.hang_timeout, "seconds >= 0 (0 = off, unset = learned)"
            )
        if isinstance(self.bucket_timing, bool):  # the older spelling
            object.__setattr__(self, "bucket_timing", "auto" if self.bucket_timing else "off")
        if self.bucket_timing not in BUCKET_TIMING_MODES:
            raise ConfigError(
                "bucket_timing",
                self.bucket_timing,
                " or ".join(BUCKET_TIMING_MODES) + " (or True/False)",
            )
        for name in ("nvml", "track_collectives", "history"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, getattr(self, name), "True or False")
        steps = self.unused_parameters_advice_steps
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ConfigError("unused_parameters_advice_steps", steps, "a positive integer")
        if self.hang_action not in HANG_ACTIONS:
            raise ConfigError("hang_action", self.hang_action, " or ".join(HANG_ACTIONS))
        if self.bucket_metrics not in BUCKET_METRICS_MODES:
            raise ConfigError(
                "bucket_metrics", self.bucket_metrics, " or ".join(BUCKET_METRICS_MODES)
            )
        if self.metrics_detail not in METRICS_DETAIL_MODES:
            raise ConfigError(
                "metrics_detail", self.metrics_detail, " or ".join(METRICS_DETAIL_MODES)
            )
        if self.comm_hook is not None and not callable(self.comm_hook):
            raise ConfigError(
                "comm_hook", self.comm_hook, "a callable hook(state, bucket) -> Future"
            )
        if self.job is not None and not str(self.job).strip():
            raise ConfigError("job", self.job, "a non-empty name")

    def resolved_job(self, environ: Mapping[str, str] | None = None) -> str:
        """The job label: explicit, else TORCHELASTIC_RUN_ID, else one unique per launch."""
        environ = os.environ if environ is None else environ
        if self.job:
            return str(self.job)
        return root.default_job(environ)

    def resolved_state_dir(self, job: str) -> str | None:
        """Where state files go; None when they are turned off."""
        if self.state_dir == "":
            return None
        if self.state_dir is not None:
            return self.state_dir
        return root.job_dir(job)


def metrics_detail(mode: str, world_size: int | None) -> str:
    """``full`` or ``summary``: what ``metrics_detail`` means for a job of ``world_size``
    (None: not known yet, full)."""
    if mode == "auto":
        return "summary" if (world_size or 0) > AUTO_FULL_WORLD_SIZE else "full"
    return mode


class Options(TypedDict, total=False):
    """``attach()``'s keyword options, typed for checkers and editors: Config's fields, each
    optional (tests/unit/test_config.py keeps the two the same)."""

    job: str | None
    port: int
    bind: str
    state_dir: str | None
    state_interval: float
    hang_timeout: float | None
    hang_timeout_floor: float
    hang_action: str
    track_collectives: bool
    bucket_timing: str
    comm_hook: Callable[..., Any] | None
    comm_state: Any
    nvml: bool
    bucket_metrics: str
    metrics_detail: str
    history: bool
    unused_parameters_advice_steps: int
    web_config_file: str | None


def default_state_root() -> str:
    """The directory that holds every job's state directory unless one is given (this
    user's, ddpmon/state/root.py): the one place the ranks, the doctor and top ask."""
    return root.default_root()


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def web_config_file(environ: Mapping[str, str] | None = None) -> str | None:
    """``DDPMON_WEB_CONFIG_FILE``, for the daemon (whose other settings are its flags)."""
    environ = os.environ if environ is None else environ
    return environ.get("DDPMON_WEB_CONFIG_FILE") or None


LIVE_OPTIONS = ("hang_timeout", "bucket_timing", "metrics_detail")
"""Options a running rank changes when asked (``ddpmon set``); the others are fixed at attach:
they decide what is installed (hooks, threads, the endpoint) or where files go."""
LIVE_VALUES = {
    "hang_timeout": "seconds >= 0 (0 = off), or auto (learned from the step times)",
    "bucket_timing": "off, or hook where ddpmon's comm hook times the buckets",
    "metrics_detail": " or ".join(METRICS_DETAIL_MODES),
}
"""What each live option takes, as a refusal names it."""


def live_value(name: str, text: str) -> Any:
    """``text`` as the new value of the live option ``name`` (``hang_timeout=auto``: None,
    learned); ConfigError says what is wrong and what is accepted."""
    if name not in LIVE_OPTIONS:
        if name in {f.name for f in dataclasses.fields(Config)}:
            expected = (
                f"an option that can change live ({', '.join(LIVE_OPTIONS)}); {name} is fixed "
                f"at attach: restart the job with DDPMON_{name.upper()}"
            )
        else:
            expected = "one of the options that can change live: " + ", ".join(LIVE_OPTIONS)
        raise ConfigError(name, text, expected)
    text = text.strip()
    if name == "hang_timeout" and text.lower() == "auto":
        return None
    try:
        value = _parse(name, name, text)
        Config(**{name: value})._validate()
    except ConfigError:
        raise ConfigError(name, text, LIVE_VALUES[name]) from None
    if name == "bucket_timing":
        value = "off" if value is False else value
        if value not in ("off", "hook"):
            raise ConfigError(name, text, LIVE_VALUES[name])
    if name == "hang_timeout" and not math.isfinite(value):
        raise ConfigError(name, text, LIVE_VALUES[name])
    return value


def _parse(var: str, name: str, text: str) -> Any:
    """Turn one DDPMON_* string into the field's type, or say what was expected."""
    text = text.strip()
    if name in ("port", "unused_parameters_advice_steps"):
        try:
            return int(text)
        except ValueError:
            raise ConfigError(var, text, "an integer") from None
    if name in ("state_interval", "hang_timeout", "hang_timeout_floor"):
        try:
            return float(text)
        except ValueError:
            raise ConfigError(var, text, "a number of seconds") from None
    if name == "bucket_timing" and text.lower() in BUCKET_TIMING_MODES:
        return text.lower()
    if name == "metrics_detail":
        if text.lower() not in METRICS_DETAIL_MODES:
            raise ConfigError(var, text, " or ".join(METRICS_DETAIL_MODES))
        return text.lower()
    if name == "hang_action":
        if text.lower() not in HANG_ACTIONS:
            raise ConfigError(var, text, " or ".join(HANG_ACTIONS))
        return text.lower()
    if name in ("nvml", "track_collectives", "history", "bucket_timing"):
        lowered = text.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        if name == "bucket_timing":
            raise ConfigError(var, text, ", ".join(BUCKET_TIMING_MODES) + " (or 1/0)")
        raise ConfigError(var, text, "1/true/yes/on or 0/false/no/off")
    if name == "comm_hook":
        return _import_hook(var, text)
    return text


def _import_hook(var: str, dotted: str) -> Callable[..., Any]:
    module_name, _, attr = dotted.rpartition(".")
    if not module_name:
        raise ConfigError(var, dotted, "a dotted path such as package.module.hook_function")
    try:
        hook: Callable[..., Any] = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(var, dotted, f"an importable hook function ({exc})") from None
    if not callable(hook):
        raise ConfigError(var, dotted, "a callable hook(state, bucket) -> Future")
    return hook


# -- `ddpmon run --debug-server`: not an option of attach, a request of the launcher ---------

DEBUG_SERVER_PORT_VAR = "DDPMON_RUN_DEBUG_SERVER_PORT"
DEBUG_SERVER_INTERVAL_VAR = "DDPMON_RUN_DEBUG_SERVER_INTERVAL"
DEBUG_SERVER_INTERVAL = 30.0
"""Seconds between two of the debug server's dumps unless ``--debug-server-interval`` says."""
DEBUG_SERVER_PACKAGES = ("jinja2", "aiohttp", "tabulate")
"""What torch's debug server imports on rank 0 (``ddpmon[debug-server]`` installs them)."""


def debug_server_request(environ: Mapping[str, str] | None = None) -> tuple[int, float] | None:
    """(port, dump interval) when ``ddpmon run --debug-server`` asked this rank to start
    torch's debug server, else None."""
    environ = os.environ if environ is None else environ
    port = environ.get(DEBUG_SERVER_PORT_VAR)
    if not port:
        return None
    return int(port), float(environ.get(DEBUG_SERVER_INTERVAL_VAR) or DEBUG_SERVER_INTERVAL)
