"""What the framework integrations share: attach to a model the framework wrapped, without
ever stopping the training when that fails."""

from __future__ import annotations

import logging
from typing import Any

import ddpmon

log = logging.getLogger("ddpmon")


def check_options(options: dict[str, Any]) -> None:
    """Bad options are the user's mistake: say so when the callback is made, not mid-fit."""
    ddpmon.Config.from_env(**options)


def attach_wrapped(
    model: Any, options: dict[str, Any], framework: str, single_process_ok: bool = False
) -> Any:
    """``ddpmon.attach(model)`` for the model ``framework`` built; None (and one warning)
    when it is not a DistributedDataParallel model or cannot be attached."""
    from torch.nn.parallel import DistributedDataParallel

    inner = getattr(model, "_orig_mod", model)  # torch.compile's wrapper around DDP
    if not isinstance(inner, DistributedDataParallel):
        (log.info if single_process_ok else log.warning)(
            "ddpmon: %s did not wrap the model in DistributedDataParallel (it is a %s); "
            "ddpmon monitors DDP only, so this run is not monitored",
            framework,
            type(inner).__qualname__,
        )
        return None
    try:
        return ddpmon.attach(inner, **options)
    except ddpmon.DdpmonError as exc:
        log.warning(
            "ddpmon: cannot attach to the model %s wrapped (%s); training goes on unmonitored",
            framework,
            exc,
        )
        return None
