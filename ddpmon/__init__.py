"""ddpmon: observability and debugging for PyTorch DistributedDataParallel.

    import ddpmon
    monitor = ddpmon.attach(ddp_model)   # after DistributedDataParallel(...)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

from .config import Config  # noqa: E402
from .errors import AttachError, ConfigError, DdpmonError, StateFileError  # noqa: E402

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

    from .monitor import Monitor

__all__ = [
    "attach", "Monitor", "Config", "DdpmonError", "AttachError", "ConfigError",
    "StateFileError", "__version__",
]


def attach(ddp_model: DistributedDataParallel, **options: Any) -> Monitor:
    """Monitor ``ddp_model`` on this rank; returns the Monitor handle.

    Options (each also a ``DDPMON_<NAME>`` variable; an explicit argument wins): job, port,
    bind, state_dir, state_interval, hang_timeout, hang_timeout_floor, comm_hook,
    comm_state, nvml, bucket_metrics, unused_parameters_advice_steps. See ``Config``.
    """
    from .monitor import Monitor

    return Monitor(ddp_model, Config.from_env(**options))


def __getattr__(name: str) -> Any:
    if name == "Monitor":  # imported lazily: the doctor and daemon never import torch
        from .monitor import Monitor

        return Monitor
    raise AttributeError(f"module 'ddpmon' has no attribute {name!r}")
