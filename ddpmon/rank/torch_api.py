"""The private torch APIs ddpmon relies on, one small function each.

torch may drop or rename a private name in any release. Each function here looks its API up
when it is called and, where torch has none, raises ``Missing`` (the API and the torch
version); the part of ddpmon that needs it calls ``off`` and switches itself off with one
log line (and a note in the state file), never an exception into the training loop, while
every other part goes on. Nothing else in the rank wing touches these names.

=====================================================  ===========================================
API                                                    without it
=====================================================  ===========================================
``DistributedDataParallel._get_ddp_logging_data``      DDP's settings in the state file, DDP's
                                                       bucket layout (buckets without a comm hook,
                                                       c10d matching) and the check for a built-in
                                                       comm hook at attach are off
``DistributedDataParallel._check_comm_hook``           comm hooks given to ddpmon or registered
                                                       after attach are not checked first (DDP
                                                       would refuse a bad one at registration)
``DistributedDataParallel._comm_hooks``                nothing: a hook registered before attach is
                                                       still found through the logging data
``Variable._execution_engine.queue_callback``          the end-of-backward and gradient-sync marks
(``torch.autograd.graph.queue_callback`` from 2.15)    are off: backward time and the wait for the
                                                       gradients are not measured, steps end at
                                                       their optimizer step
``ProcessGroup._register_on_completion_hook``,         c10d bucket timing (NCCL): ``auto`` does
``ProcessGroup._enable_collectives_timing``            without it, ``bucket_timing='c10d'`` is
                                                       refused at attach; without the second,
                                                       no durations in NCCL's flight recorder
``ProcessGroup._get_backend`` (and its                 nothing: ``dist.get_backend`` names it;
``options._timeout``)                                  the doctor gives no time by which a wait
                                                       for a busy rank ends
``distributed_c10d._get_process_group_name``           nothing while groups have ``group_name``;
                                                       else collectives of every group are numbered
                                                       as one group, ``?``
``distributed_c10d._get_default_store``                the clock's offset from rank 0's: readers
                                                       estimate it from file modification times
``torch._C._distributed_c10d._dump_fr_trace_json``     the flight recorder's entries in hang
(and ``_dump_fr_trace``, ``_dump_nccl_trace[_json]``)  reports (the report says why), and bucket
                                                       timing from the flight recorder
``Tensor._backward_hooks``,                            nothing: the output's backward hook is
``Node._register_hook_dict``                           registered through the public
                                                       ``Tensor.register_hook`` (about 28 us more a
                                                       step, most of it its handle)
``torch.compiler.is_compiling`` (public, not in 2.2)   watching torch.compile'd models: Dynamo
                                                       breaks the graph at ddpmon's hooks
``torch.autograd._profiler_enabled``                   ``ddpmon capture``: a capture ends at once,
                                                       its status saying why
``torch.autograd.profiler._is_profiler_enabled``       nothing: the thread's own flag is asked
``torch.utils.flop_counter.flop_registry`` (the        the model's FLOPs per step, achieved FLOP/s
formulas of the public ``FlopCounterMode``; its        and MFU (samples and tokens per second stay)
``mod_tracker`` is set aside where it has one)
``torch.distributed.debug._WORKER_SERVER``,            a rank that ends does not stop the debug
``torch.distributed.debug._DEBUG_SERVER_PROC``         server the program started first (see
                                                       ``debug_server.py``)
=====================================================  ===========================================

Three are read outside the rank wing. ``state/root.py`` agrees the default job name through
the job's store (``distributed_c10d._get_default_store``) and, without it, names the job
from the launcher process, saying so in one line the same way. The framework integrations
(``integrations/_common.py``) find DDP inside a torch.compile'd model by its ``_orig_mod``;
without it the model is taken for one that is not DDP, as their one warning says. The
launcher under ``ddpmon run`` (``agent.py``) reads a dynamic rendezvous handler's
``_state_holder.state`` (who joined); without it, its record holds the connection probes.
"""

from __future__ import annotations

import json
import logging
import pickle
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("ddpmon")


class Missing(Exception):
    """This torch has no ``api``; ``part`` is what ddpmon switches off without it."""

    def __init__(self, api: str, part: str) -> None:
        self.api, self.part = api, part
        super().__init__(f"torch {torch.__version__} has no {api}")

    @property
    def line(self) -> str:
        """``<part> off: torch <version> has no <api>``."""
        return f"{self.part} off: {self}"


_said: set[str] = set()
_said_lock = threading.Lock()


def off(missing: Missing, recorder: Any = None) -> str:
    """Switch ``missing.part`` off: one warning per process and API, and a line in
    ``recorder``'s note ``torch_api`` when a recorder is given; returns the line."""
    text = missing.line
    with _said_lock:
        first = missing.api not in _said
        _said.add(missing.api)
    if recorder is not None:
        notes = recorder.notes.get("torch_api")
        if text not in (notes or "").split("\n"):
            recorder.note("torch_api", f"{notes}\n{text}" if notes else text)
    if first:
        rank = getattr(getattr(recorder, "identity", None), "rank", None)
        if rank is None and dist.is_available() and dist.is_initialized():
            rank = dist.get_rank()
        log.warning(
            "ddpmon: %s%s; training goes on", "" if rank is None else f"rank {rank}: ", text
        )
    return text


def _find(owner: Any, name: str, api: str, part: str) -> Any:
    found = getattr(owner, name, None)
    if found is None:
        raise Missing(api, part)
    return found


# -- DistributedDataParallel ---------------------------------------------------------------

LOGGING_DATA = (
    "DDP's settings in the state file, its bucket layout (bucket series without a comm "
    "hook, c10d bucket timing) and the check for a built-in comm hook at attach"
)


def ddp_logging_data(ddp: Any) -> dict[str, Any]:
    """DDP's logging data (its settings, its bucket layout); takes the reducer's lock."""
    return dict(
        _find(
            ddp,
            "_get_ddp_logging_data",
            "DistributedDataParallel._get_ddp_logging_data",
            LOGGING_DATA,
        )()
    )


def check_ddp_logging_data(ddp: Any) -> None:
    """Missing unless DDP has its logging data (looked up, not read)."""
    _find(
        ddp, "_get_ddp_logging_data", "DistributedDataParallel._get_ddp_logging_data", LOGGING_DATA
    )


def check_comm_hook(ddp: Any, hook: Any) -> None:
    """DDP's own check of a comm hook's signature (raises what DDP raises)."""
    _find(
        ddp,
        "_check_comm_hook",
        "DistributedDataParallel._check_comm_hook",
        "checking a comm hook before ddpmon runs it (a bad one fails at its first bucket)",
    )(hook)


def registered_comm_hooks(ddp: Any) -> list[tuple[Any, Any]] | None:
    """The Python comm hooks DDP holds, ``(hook, state)``; None where DDP keeps no list
    (nothing is off: ``ddp_logging_data`` names a hook registered before attach too)."""
    hooks = getattr(ddp, "_comm_hooks", None)
    return list(hooks) if isinstance(hooks, list) else None


# -- autograd ------------------------------------------------------------------------------

BACKWARD_MARKS = (
    "the end-of-backward and gradient-sync marks (backward time and the wait for the "
    "gradients are not measured; steps end at their optimizer step)"
)


def autograd_callback_queue() -> Callable[[Callable[[], None]], None]:
    """The function that queues a callback to run once the current backward is done: the
    public ``torch.autograd.graph.queue_callback`` where torch has it (2.15), else the
    engine's."""
    public = getattr(torch.autograd.graph, "queue_callback", None)
    if public is not None:
        return public  # type: ignore[no-any-return]
    from torch.autograd.variable import Variable

    api = "torch.autograd.Variable._execution_engine.queue_callback"
    engine = _find(Variable, "_execution_engine", api, BACKWARD_MARKS)
    return _find(engine, "queue_callback", api, BACKWARD_MARKS)  # type: ignore[no-any-return]


def hook_tensor(tensor: torch.Tensor, hook: Callable[[torch.Tensor], Any]) -> None:
    """``tensor.register_hook(hook)`` for a fresh output tensor, without its removable handle:
    torch's own steps (a hooks dict on the tensor, handed to its ``grad_fn``), at about a
    third of the cost on a training step's cold cache (``benchmarks/cold_calls.py``). Any
    other tensor (a subclass, one with hooks already, a leaf, a torch without these names)
    goes through ``register_hook``."""
    grad_fn = tensor.grad_fn
    try:
        fresh = (
            grad_fn is not None and type(tensor) is torch.Tensor and tensor._backward_hooks is None
        )
        register = grad_fn._register_hook_dict if fresh else None  # type: ignore[union-attr]
    except AttributeError:  # (a torch without these names)
        register = None
    if register is None:
        tensor.register_hook(hook)
        return
    # torch's own kind of dict (a later register_hook keeps a weak reference to it); its
    # handles are numbered, so the key cannot clash.
    hooks: OrderedDict[Any, Any] = OrderedDict()
    hooks["ddpmon"] = hook
    tensor._backward_hooks = hooks  # type: ignore[assignment]
    register(tensor)


COMPILE = (
    "watching torch.compile'd models (Dynamo breaks the graph at ddpmon's hooks, and steps "
    "may go uncounted)"
)


def compiling_check() -> Callable[[], bool]:
    """The function that says whether torch.compile (Dynamo) is tracing now, which the hooks
    ask so as to step aside (public; torch 2.2 has none, and Dynamo there cannot trace past
    ddpmon's hooks whatever they ask)."""
    return _find(
        getattr(torch, "compiler", None), "is_compiling", "torch.compiler.is_compiling", COMPILE
    )  # type: ignore[no-any-return]


PROFILER = "ddpmon capture (it cannot tell whether the program's own profiler is on)"


def profiler_running() -> bool:
    """torch's profiler is on in this process: torch's process-wide flag (any thread's
    profiler; where torch has none, this thread's alone is asked) or this thread's."""
    from torch.autograd import profiler

    enabled = _find(
        torch.autograd, "_profiler_enabled", "torch.autograd._profiler_enabled", PROFILER
    )
    return bool(getattr(profiler, "_is_profiler_enabled", False)) or bool(enabled())


# -- the FLOP counter ----------------------------------------------------------------------

FLOPS = "the model's FLOPs per step, achieved FLOP/s and MFU"


class _NoModules:
    """What FlopCounterMode's module tracker is to it, without the tracker's hooks: every FLOP
    counted at the top (``Global``), which is all ddpmon reads. The tracker would hook every
    module's forward and the backward of its outputs, and its hooks raise into the training
    loop where they fail (a torch without the engine's ``queue_callback``)."""

    parents = frozenset({"Global"})

    def __enter__(self) -> _NoModules:
        return self

    def __exit__(self, *_exc: object) -> None:
        return None


def flop_counter(seen: Callable[[int, tuple[Any, ...]], None]) -> Any:
    """torch's FLOP counter (``FlopCounterMode``, not yet entered) whose formulas each hand
    ``seen(flops, args)`` what they counted. A formula that raises counts nothing and
    re-raises nothing: ``seen(-1, args)`` says so, and the operator's own result stands, so
    the training never sees it. Its module tracker (``mod_tracker``, where torch has one) is
    left out: nothing of it runs in the training's forward or backward."""
    from torch.utils import flop_counter as fc

    registry = _find(fc, "flop_registry", "torch.utils.flop_counter.flop_registry", FLOPS)

    def guarded(formula: Callable[..., int]) -> Callable[..., int]:
        def count(*args: Any, **kwargs: Any) -> int:
            try:
                flops = int(formula(*args, **kwargs))
            except Exception:
                seen(-1, args)
                return 0
            seen(flops, args)
            return flops

        count._get_raw = True  # type: ignore[attr-defined]  # (shape-wrapped already: torch's mark)
        return count

    counter = fc.FlopCounterMode(
        display=False, custom_mapping={op: guarded(f) for op, f in dict(registry).items()}
    )
    if hasattr(counter, "mod_tracker"):
        counter.mod_tracker = _NoModules()  # type: ignore[assignment]
    return counter


# -- process groups ------------------------------------------------------------------------


def check_completion_hook(group: Any) -> None:
    """Missing unless this torch can hand ``group``'s completed collectives to a hook."""
    for name in ("_register_on_completion_hook", "_enable_collectives_timing"):
        _find(group, name, f"ProcessGroup.{name}", "c10d bucket timing")


def register_completion_hook(group: Any, hook: Callable[[Any], None]) -> None:
    """Turn ``group``'s collective timing on and call ``hook(work_info)`` for each of its
    collectives that completes (NCCL only; c10d raises for other backends)."""
    check_completion_hook(group)
    group._enable_collectives_timing()  # required first; stays on if c10d refuses the hook
    group._register_on_completion_hook(hook)


def group_backend(group: Any, device: str) -> str:
    """The name of the backend that runs ``group``'s collectives of tensors on ``device``
    (Missing without ``_get_backend``: ``dist.get_backend`` names the group's then)."""
    get = _find(group, "_get_backend", "ProcessGroup._get_backend", "")
    return str(get(torch.device(device)).name())


def group_timeout(group: Any, device: str) -> float:
    """Seconds after which the backend that runs ``group``'s collectives on ``device`` gives
    up on one (``options._timeout``; Missing where torch does not say: the doctor then gives
    no time by which a wait ends)."""
    get = _find(group, "_get_backend", "ProcessGroup._get_backend", "")
    options = getattr(get(torch.device(device)), "options", None)
    timeout = getattr(options, "_timeout", None)
    if timeout is None:
        raise Missing("ProcessGroup backend options._timeout", "")
    return float(timeout.total_seconds())


def process_group_name(group: Any) -> str:
    """A process group's name, the key its collectives are numbered under."""
    name = getattr(group, "group_name", "")
    if name:
        return str(name)
    get = _find(
        dist.distributed_c10d,
        "_get_process_group_name",
        "distributed_c10d._get_process_group_name",
        "process group names (the collectives of every group are numbered as one group, '?')",
    )
    return str(get(group))


CLOCK = "the clock's offset from rank 0's (the doctor estimates it from file times)"


def default_store() -> Any:
    """The job's own c10d store (the default process group's)."""
    return _find(
        dist.distributed_c10d,
        "_get_default_store",
        "distributed_c10d._get_default_store",
        CLOCK,
    )()


# -- the flight recorder -------------------------------------------------------------------

FLIGHT_RECORDER_DUMPS = (
    "_dump_fr_trace_json",
    "_dump_nccl_trace_json",
    "_dump_fr_trace",
    "_dump_nccl_trace",
)
NCCL_RECORDER_DUMPS = (
    "_dump_nccl_trace_json",
    "_dump_fr_trace_json",
    "_dump_nccl_trace",
    "_dump_fr_trace",
)
"""Before torch 2.15 ProcessGroupNCCL records into a recorder of its own (of CUDA events),
which only ``_dump_nccl_trace*`` dumps; ``_dump_fr_trace*`` there dumps the other backends'
recorder, empty on an NCCL job (seen on torch 2.11, CUDA 13)."""


def flight_recorder_dump(
    backend: str | None = None, part: str = "the flight recorder in hang reports"
) -> dict[str, Any]:
    """torch's flight recorder, as its dump says it: ``{"version", "pg_status", "entries"}``.
    From torch 2.15 each backend records into its own recorder and the dump takes the
    backend's name (default ``gloo``): ``backend``, else the default group's, is asked for.
    NCCL's recorder is read with NCCL's own dump where this torch has one."""
    from torch._C import _distributed_c10d as c10d

    nccl = "nccl" in str(backend or _default_backend() or "")
    for name in NCCL_RECORDER_DUMPS if nccl else FLIGHT_RECORDER_DUMPS:
        dump = getattr(c10d, name, None)
        if dump is None:
            continue
        if name.endswith("_json"):
            return dict(
                json.loads(_call(name, dump, backend, includeCollectives=True, onlyActive=False))
            )
        return dict(
            pickle.loads(
                _call(
                    name,
                    dump,
                    backend,
                    includeCollectives=True,
                    includeStackTraces=False,
                    onlyActive=False,
                )
            )
        )
    raise Missing("torch._C._distributed_c10d._dump_fr_trace_json (nor _dump_fr_trace)", part)


def enable_collectives_timing(group: Any) -> None:
    """Have ``group`` time its collectives (NCCL: CUDA events around each, the durations the
    flight recorder and the completion hook report)."""
    _find(
        group,
        "_enable_collectives_timing",
        "ProcessGroup._enable_collectives_timing",
        "collective durations in the flight recorder",
    )()


def _call(name: str, dump: Callable[..., bytes], backend: str | None, **options: Any) -> bytes:
    """The dump, with the arguments this torch takes: the backend's name as well (2.15), the
    options alone, or none (2.2's ``_dump_nccl_trace``)."""
    backend = (backend or _default_backend()) if name.startswith("_dump_fr_") else None
    tries = ([{"backend": backend, **options}] if backend else []) + [options]
    for kwargs in tries:
        try:
            return dump(**kwargs)
        except TypeError:  # arguments this torch's dump does not take
            pass
    return dump()


def _default_backend() -> str | None:
    """The default group's backend, as the flight recorder names its instances; None
    without a process group."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    name = str(dist.get_backend())
    return "nccl" if "nccl" in name else name.rpartition(":")[2] or None


# -- torch.distributed.debug ---------------------------------------------------------------

DEBUG_SERVER = "stopping torch's debug server when the rank ends"


def debug_server() -> tuple[Any, Any]:
    """This process's debug server as ``torch.distributed.debug.start_debug_server`` keeps it:
    (the worker server, rank 0's frontend process), each None when there is none. Looked up
    only where the program imported the module: ddpmon never imports it for a program."""
    module = sys.modules.get("torch.distributed.debug")
    if module is None:
        return None, None
    if not hasattr(module, "_WORKER_SERVER") or not hasattr(module, "_DEBUG_SERVER_PROC"):
        raise Missing(
            "torch.distributed.debug._WORKER_SERVER (and _DEBUG_SERVER_PROC)", DEBUG_SERVER
        )
    return module._WORKER_SERVER, module._DEBUG_SERVER_PROC


def forget_debug_server() -> None:
    """Drop torch's references to a debug server that was stopped, as its own
    ``stop_debug_server`` does (which cannot stop a rank but 0: it has no frontend there)."""
    module = sys.modules.get("torch.distributed.debug")
    if module is not None:
        module._WORKER_SERVER = None  # type: ignore[attr-defined]  # private, some versions
        module._DEBUG_SERVER_PROC = None  # type: ignore[attr-defined]
