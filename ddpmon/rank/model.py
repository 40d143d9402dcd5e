"""What ddpmon needs to know of the DDP model it watches: whether it can be watched, its
trainable parameters by name, and the facts that identify the rank."""

from __future__ import annotations

import os
import socket
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..collectors import host
from ..errors import AttachError, ConfigError
from ..state import attempts
from ..state.schema import Identity
from ..version import __version__
from . import torch_api

_HOW_TO_WRAP = (
    "wrap the model first:\n"
    "    model = torch.nn.parallel.DistributedDataParallel(model)\n"
    "    monitor = ddpmon.attach(model)"
)


def check_attachable(ddp: Any) -> None:
    """AttachError, with the fix, for anything ddpmon cannot watch."""
    if not isinstance(ddp, DistributedDataParallel):
        raise AttachError(
            f"ddpmon.attach() needs a torch.nn.parallel.DistributedDataParallel model, got "
            f"{type(ddp).__module__}.{type(ddp).__qualname__}; {_HOW_TO_WRAP}"
        )
    if not dist.is_available() or not dist.is_initialized():
        raise AttachError(
            "torch.distributed is not initialized: call "
            "torch.distributed.init_process_group(...) before wrapping the model and attaching"
        )
    if getattr(ddp, "_ddpmon_monitor", None) is not None:
        raise AttachError(
            "ddpmon is already attached to this model; use the Monitor that attach() returned "
            "(or call its detach() first)"
        )
    if getattr(ddp, "_ddpmon_comm_hook", None) is None and (
        torch_api.registered_comm_hooks(ddp) or _builtin_hook_name(ddp)
    ):
        raise AttachError(
            "this model already has a comm hook, and DDP accepts only one; pass yours to "
            "ddpmon.attach(model, comm_hook=hook, comm_state=state) instead of registering it, "
            "or register it after attach()"
        )


def check_options(
    ddp: DistributedDataParallel, config: Any, local_rank: int, recorder: Any = None
) -> None:
    """ConfigError for options that cannot work with this model on this rank."""
    if config.port > 0 and config.port + local_rank > 65535:
        raise ConfigError(
            "port",
            config.port,
            f"a base port such that port + LOCAL_RANK ({local_rank}) is at most 65535",
        )
    if config.comm_hook is not None:
        try:
            check_comm_hook(ddp, config.comm_hook, recorder)
        except Exception as exc:
            raise ConfigError(
                "comm_hook",
                config.comm_hook,
                f"a comm hook that torch accepts here; torch refused it: {exc}",
            ) from None


def check_comm_hook(ddp: DistributedDataParallel, hook: Any, recorder: Any = None) -> None:
    """DDP's own check of a comm hook (raises what DDP raises); where torch has none, the
    hook is taken unchecked, said once."""
    try:
        torch_api.check_comm_hook(ddp, hook)
    except torch_api.Missing as missing:
        torch_api.off(missing, recorder)


def trainable_parameters(ddp: DistributedDataParallel) -> list[tuple[str, torch.nn.Parameter]]:
    """(fully qualified name, parameter) of every parameter DDP reduces, in its order."""
    ignored = getattr(ddp, "parameters_to_ignore", ())
    return [
        (name, p)
        for name, p in ddp.module.named_parameters()
        if p.requires_grad and name not in ignored
    ]


def identity(ddp: DistributedDataParallel, job: str) -> Identity:
    """Who this rank is: the identity fields of its state file and ``ddpmon_rank_info``."""
    rank = dist.get_rank()
    params = list(ddp.module.parameters())
    level = dist.get_debug_level()
    return Identity(
        rank=rank,
        local_rank=int(os.environ.get("LOCAL_RANK", rank)),
        world_size=dist.get_world_size(),  # the job's; DDP may run on a subgroup
        ddp_world_size=dist.get_world_size(ddp.process_group),
        group_rank=int(os.environ.get("GROUP_RANK", "0") or 0),
        host=socket.gethostname(),
        pid=os.getpid(),
        process_started_unix=host.process_started_unix(),
        job=job,
        attempt=attempts.attempt_of(),
        backend=str(dist.get_backend(ddp.process_group)),
        group_timeout_seconds=group_timeout(
            ddp.process_group, params[0].device if params else None
        ),
        device=str(params[0].device) if params else "cpu",
        torch_version=torch.__version__,
        debug_level=getattr(level, "name", str(level)),
        version=__version__,
        find_unused_parameters=bool(getattr(ddp, "find_unused_parameters", False)),
        num_parameters=sum(1 for p in params if p.requires_grad),
    )


def group_timeout(group: Any, device: torch.device | None) -> float | None:
    """Seconds after which the process group's backend gives up on a collective (what ends a
    wait for a rank that works on and never joins); None where torch does not say."""
    try:
        return torch_api.group_timeout(group, str(device) if device is not None else "cpu")
    except Exception:  # Missing, or a backend without options: nothing to say
        return None


def _builtin_hook_name(ddp: DistributedDataParallel) -> str:
    """The comm hook DDP's logging data names (a built-in one too), "" for none."""
    try:
        return str(torch_api.ddp_logging_data(ddp).get("comm_hook", "") or "")
    except torch_api.Missing as missing:
        torch_api.off(missing)
        return ""
    except Exception:
        return ""
