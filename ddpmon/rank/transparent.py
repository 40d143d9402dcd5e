"""Attaching must not change what the user's code can do with the model.

ddpmon leaves a few things on the DDP object while attached: forward hooks, a comm hook
(DDP keeps it for good), ``register_comm_hook`` standing in for DDP's, and its own
attributes. Pickling (``torch.save``) and ``copy.deepcopy`` copy an object's state, so that
state must not carry ddpmon: while attached, the model's ``__getstate__`` is DDP's own with
ddpmon's entries left out, and the user's comm hook (if one runs inside ddpmon's) in place
of ddpmon's. The copy is a plain DDP model, exactly as without ddpmon; the hooks themselves
hold nothing that a copy could reach.
"""

from __future__ import annotations

import collections
import weakref
from typing import Any

_ATTRIBUTES = (
    "forward",
    "register_comm_hook",
    "__getstate__",
    "_ddpmon_monitor",
    "_ddpmon_comm_hook",
)
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks")
_HOOK_FLAGS = (
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


def is_ddpmon(hook: Any) -> bool:
    """True for a hook that ddpmon registered (a function or bound method of ddpmon's)."""
    return str(getattr(hook, "__module__", None) or "").startswith("ddpmon.")


class StateWithoutDdpmon:
    """Stands in for ``ddp.__getstate__`` while ddpmon is attached (an instance attribute,
    which pickle and deepcopy look up before the class's)."""

    __slots__ = ("_ddp",)
    __module__ = "ddpmon.rank.transparent"

    def __init__(self, ddp: Any) -> None:
        self._ddp = weakref.ref(ddp)

    def __call__(self) -> dict[str, Any]:
        ddp = self._ddp()
        state: dict[str, Any] = type(ddp).__getstate__(ddp)  # type: ignore[assignment, call-arg, union-attr]
        for name in _ATTRIBUTES:
            state.pop(name, None)
        removed: set[int] = set()
        for name in _HOOK_DICTS:
            hooks = state.get(name)
            if hooks:
                removed.update(k for k, h in hooks.items() if is_ddpmon(h))
                state[name] = collections.OrderedDict(
                    (k, h) for k, h in hooks.items() if not is_ddpmon(h)
                )
        for name in _HOOK_FLAGS:
            flags = state.get(name)
            if flags:
                state[name] = collections.OrderedDict(
                    (k, v) for k, v in flags.items() if k not in removed
                )
        comm = ddp.__dict__.get("_ddpmon_comm_hook")
        if comm is not None and "_comm_hooks" in state:
            user = [(comm.hook, comm.state)] if comm.user_registered else []
            state["_comm_hooks"] = [
                entry for entry in state["_comm_hooks"] if entry[0] is not comm
            ] + user
        return state


def install(ddp: Any) -> None:
    ddp.__getstate__ = StateWithoutDdpmon(ddp)


def remove(ddp: Any) -> None:
    """At detach. ddpmon's comm hook stays registered (DDP cannot drop it), so the copy rule
    for it stays too."""
    if not isinstance(ddp.__dict__.get("__getstate__"), StateWithoutDdpmon):
        return
    if ddp.__dict__.get("_ddpmon_comm_hook") is None:
        del ddp.__getstate__
