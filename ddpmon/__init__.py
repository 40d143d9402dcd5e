"""ddpmon: observability and debugging for PyTorch DistributedDataParallel.

import ddpmon
monitor = ddpmon.attach(ddp_model)   # after DistributedDataParallel(...)
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from .config import Config, Options
from .errors import AttachError, ConfigError, DdpmonError, StateFileError
from .version import __version__

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel
    from typing_extensions import Unpack

    from .rank.monitor import Monitor

__all__ = [
    "attach",
    "Monitor",
    "Config",
    "Options",
    "DdpmonError",
    "AttachError",
    "ConfigError",
    "StateFileError",
    "__version__",
]


def attach(ddp_model: DistributedDataParallel, **options: Unpack[Options]) -> Monitor:
    """Monitor ``ddp_model`` on this rank; returns the Monitor handle.

    Options, the fields of ``Config`` (each also a ``DDPMON_<NAME>`` variable but
    comm_state, an object; an explicit argument wins): job, port, bind, state_dir,
    state_interval, hang_timeout, hang_timeout_floor, hang_action, track_collectives,
    bucket_timing, comm_hook, comm_state, nvml, bucket_metrics, metrics_detail, history,
    unused_parameters_advice_steps, web_config_file.
    """
    return _monitor_class()(ddp_model, Config.from_env(**options))


def _monitor_class() -> type[Monitor]:
    """The Monitor class, imported on first use: it needs torch, which ddpmon does not
    install (the training environment brings its own build; the doctor and daemon run
    without it)."""
    try:
        from .rank.monitor import Monitor
    except ImportError as exc:
        if (exc.name or "").partition(".")[0] != "torch":
            raise
        raise AttachError(
            f"ddpmon.attach needs PyTorch, and this Python ({sys.executable}) cannot import "
            f"{exc.name} ({exc}). ddpmon does not install torch, so that it never replaces the build "
            "you chose: install ddpmon into the training environment that has torch, or install "
            "torch here first (https://pytorch.org/get-started/locally/), then ddpmon. The "
            "doctor, daemon and top need no torch."
        ) from exc
    return Monitor


def __getattr__(name: str) -> Any:
    if name == "Monitor":  # imported lazily: the doctor and daemon never import torch
        return _monitor_class()
    raise AttributeError(f"module 'ddpmon' has no attribute {name!r}")
