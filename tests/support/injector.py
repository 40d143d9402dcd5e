"""A fault injected into an unmodified training script from outside it, by the environment.

``INJECT_FAULT=KIND:RANK:MODULE:QUALNAME[:after=N][:seconds=S]`` wraps the function
``MODULE.QUALNAME`` (for example ``torch.optim.sgd:SGD.step`` or
``torch.utils.data.dataloader:_BaseDataLoaderIter.__next__``) once its module is imported, so
that from its N-th call on (N=0: the first), on rank RANK alone, it:

- ``stall``: never returns (sleeps in a loop, as a stuck data loader does);
- ``slow``: sleeps S seconds (default 0.05) before each call;
- ``kill``: SIGKILLs its own process (killed from outside: no exit record);
- ``desync``: issues one extra ``dist.barrier()`` first, that no other rank issues.

Started by ``tests/support/inject_site/sitecustomize.py`` on PYTHONPATH, so the script itself
is never touched. The rank is read when the function is called (``torch.distributed``'s, or
RANK), since launchers such as Lightning's set it after the process starts.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import signal
import sys
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any

VARIABLE = "INJECT_FAULT"
KINDS = ("stall", "slow", "kill", "desync")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    module: str
    qualname: str
    after: int = 0
    seconds: float = 0.05

    @classmethod
    def parse(cls, text: str) -> Fault:
        parts = text.split(":")
        if len(parts) < 4 or parts[0] not in KINDS:
            raise ValueError(
                f"{VARIABLE}={text!r}: expected KIND:RANK:MODULE:QUALNAME[:after=N][:seconds=S] "
                f"with KIND one of {', '.join(KINDS)}"
            )
        options = dict(p.split("=", 1) for p in parts[4:])
        return cls(
            parts[0],
            int(parts[1]),
            parts[2],
            parts[3],
            after=int(options.get("after", 0)),
            seconds=float(options.get("seconds", 0.05)),
        )


def current_rank() -> int | None:
    torch = sys.modules.get("torch")
    if (
        torch is not None
        and torch.distributed.is_available()
        and torch.distributed.is_initialized()
    ):
        return int(torch.distributed.get_rank())
    rank = os.environ.get("RANK")
    return int(rank) if rank is not None else None


def act(fault: Fault) -> None:
    if fault.kind == "stall":
        while True:
            time.sleep(1)
    elif fault.kind == "slow":
        time.sleep(fault.seconds)
    elif fault.kind == "kill":
        sys.stderr.write(f"injector: rank {fault.rank} killed in {fault.qualname}\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.kind == "desync":
        import torch.distributed as dist

        dist.barrier()


def wrap(fault: Fault, function: Any) -> Any:
    calls = 0

    @functools.wraps(function)
    def injected(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls > fault.after and current_rank() == fault.rank:
            act(fault)
        return function(*args, **kwargs)

    return injected


def patch(fault: Fault, module: ModuleType) -> None:
    *owners, name = fault.qualname.split(".")
    owner: Any = module
    for attribute in owners:
        owner = getattr(owner, attribute)
    setattr(owner, name, wrap(fault, getattr(owner, name)))


class _PatchOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds nothing itself; wraps the loader of one module so that it is patched once loaded."""

    def __init__(self, fault: Fault) -> None:
        self.fault = fault
        self.loader: Any = None

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != self.fault.module:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        self.loader, spec.loader = spec.loader, self
        sys.meta_path.remove(self)
        return spec

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        patch(self.fault, module)


def install() -> None:
    """Arm the fault that INJECT_FAULT names, if any (a bad value raises: the test is wrong)."""
    text = os.environ.get(VARIABLE)
    if not text:
        return
    fault = Fault.parse(text)
    if fault.module in sys.modules:
        patch(fault, sys.modules[fault.module])
    else:
        sys.meta_path.insert(0, _PatchOnImport(fault))
