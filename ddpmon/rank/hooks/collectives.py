"""Tracking of the collectives this rank issues: barrier, all_reduce, broadcast, ...

While a monitor is attached, the collective functions of ``torch.distributed`` are replaced
by thin wrappers that note each call in the Recorder (sequence number per process group, op,
bytes, the user's call site) and keep it in flight until the call returns or, for
``async_op=True``, until the returned Work's future completes. This is what shows that one
rank issued a collective the others never did. The wrappers call the original function with
the original arguments and return its result unchanged; they never issue a collective of
their own. Detach restores the original functions.

DDP's gradient buckets are counted by the timing comm hook (``bucket_launched``); when its
hook calls ``dist.all_reduce``, the call is kept in flight here as that bucket's collective
but not counted a second time, and it leaves the in-flight list when the hook's own
completion callback reports the bucket done (no callback of its own on the hot path).

Code that bound a function before attach (``from torch.distributed import all_reduce``) keeps
the original and is not tracked.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ...frames import DDPMON_DIR, is_library, short_path
from ...fuses import Fuse
from .. import torch_api
from ..recorder import Recorder

# op -> (position, keyword) of the tensor(s) this rank sends, (position, keyword) of the group.
_SPECS: dict[str, tuple[int | None, str | None, int, str]] = {
    "all_reduce": (0, "tensor", 2, "group"),
    "all_reduce_coalesced": (0, "tensors", 2, "group"),
    "broadcast": (0, "tensor", 2, "group"),
    "reduce": (0, "tensor", 3, "group"),
    "all_gather": (1, "tensor", 2, "group"),
    "all_gather_into_tensor": (1, "input_tensor", 2, "group"),
    "all_gather_coalesced": (1, "input_tensor_list", 2, "group"),
    "reduce_scatter": (1, "input_list", 3, "group"),
    "reduce_scatter_tensor": (1, "input", 3, "group"),
    "all_to_all": (1, "input_tensor_list", 2, "group"),
    "all_to_all_single": (1, "input", 4, "group"),
    "gather": (0, "tensor", 3, "group"),
    "scatter": (0, "tensor", 3, "group"),
    "barrier": (None, None, 0, "group"),
    "monitored_barrier": (None, None, 0, "group"),
    "all_gather_object": (None, None, 2, "group"),
    "broadcast_object_list": (None, None, 2, "group"),
    "gather_object": (None, None, 3, "group"),
    "scatter_object_list": (None, None, 3, "group"),
}
_P2P: dict[str, tuple[int | None, str | None, int, str]] = {
    "send": (0, "tensor", 2, "group"),
    "recv": (0, "tensor", 2, "group"),
    "isend": (0, "tensor", 2, "group"),
    "irecv": (0, "tensor", 2, "group"),
    "send_object_list": (None, None, 2, "group"),
    "recv_object_list": (None, None, 2, "group"),
}
TRACKED = tuple(_SPECS) + tuple(_P2P) + ("batch_isend_irecv",)

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_COMM_HOOK_FILE = os.path.join(DDPMON_DIR, "timing", "hook.py")
_C10D_FILES = tuple(
    os.path.join(_TORCH_DIR, "distributed", name)
    for name in ("distributed_c10d.py", "c10d_logger.py")
)
_MAX_DEPTH = 64
_CALLERS = 1


class CollectiveTracker:
    """Wraps the ``torch.distributed`` collectives for one Recorder; ``remove()`` undoes it."""

    def __init__(self, recorder: Recorder, fuse: Fuse) -> None:
        self._recorder = recorder
        self._fuse = fuse
        self._local = threading.local()
        self._groups: dict[int, tuple[Any, str, int]] = {}
        self._originals: dict[str, Callable[..., Any]] = {}
        self._wrappers: dict[str, Callable[..., Any]] = {}
        self.active = False

    def install(self) -> None:
        for name in TRACKED:
            original = getattr(dist, name, None)
            if original is None or getattr(original, "_ddpmon_tracked", False):
                continue  # absent in this torch, or another monitor already tracks it
            wrapper = self._wrap(name, original)
            self._originals[name] = original
            self._wrappers[name] = wrapper
            setattr(dist, name, wrapper)
        self.active = True

    def remove(self) -> None:
        """Restore the original functions (where nobody replaced ours since)."""
        self.active = False
        for name, original in self._originals.items():
            if getattr(dist, name, None) is self._wrappers[name]:
                setattr(dist, name, original)
        self._originals.clear()
        self._wrappers.clear()

    # -- the wrapper ----------------------------------------------------------------------

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        tracker = self

        @functools.wraps(original)
        def tracked(*args: Any, **kwargs: Any) -> Any:
            local = tracker._local
            if not tracker.active or not tracker._fuse.ok or getattr(local, "busy", False):
                return original(*args, **kwargs)
            entry = counted = None
            try:
                caller = sys._getframe(1)
                if _in_comm_hook(caller):  # a bucket's collective: the bucket is its entry
                    return original(*args, **kwargs)
                entry, counted = tracker._begin(name, args, kwargs, caller)
            except Exception as exc:
                tracker._fuse.blow(exc)
            if entry is None:
                return original(*args, **kwargs)
            local.busy = True
            try:
                result = original(*args, **kwargs)
            except BaseException as exc:
                tracker._end(entry, counted, f"{type(exc).__name__}: {exc}"[:300])  # type: ignore[arg-type]
                raise
            finally:
                local.busy = False
            if counted:  # a bucket's collective is done when its bucket is (bucket_completed)
                tracker._completion(entry, counted, result)
            return result

        tracked._ddpmon_tracked = True  # type: ignore[attr-defined]
        return tracked

    def _begin(
        self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], caller: Any
    ) -> tuple[dict[str, Any], bool]:
        site, function, in_hook, callers = _call_site(caller)
        bucket = self._recorder.launched_bucket if in_hook else None
        tensor = None
        if name == "batch_isend_irecv":
            ops = list(args[0] if args else kwargs.get("p2p_op_list", ()))
            group = getattr(ops[0], "group", None) if ops else None
            nbytes: int | None = sum(_nbytes(getattr(op, "tensor", None)) or 0 for op in ops)
            p2p = True
        else:
            p2p = name in _P2P
            tpos, tkey, gpos, gkey = (_P2P if p2p else _SPECS)[name]
            group = _arg(args, kwargs, gpos, gkey)
            tensor = _arg(args, kwargs, tpos, tkey) if tkey is not None else None
            nbytes = _nbytes(tensor) if tkey is not None else None
        gname, gsize = self._group(group)
        counted = bucket is None
        entry = self._recorder.collective_began(
            name,
            gname,
            gsize,
            nbytes,
            site,
            function,
            bucket=bucket,
            p2p=p2p,
            counted=counted,
            callers=callers,
        )
        if name != "batch_isend_irecv" and tensor is not None:
            entry["dtype"], entry["numel"] = _shape(tensor)
        return entry, counted

    def _completion(self, entry: dict[str, Any], counted: bool, result: Any) -> None:
        """Sync calls are done when they return; async ones (they return a Work, or a list
        of them) when the last Work's future completes."""
        works = result if isinstance(result, list) else [result]
        works = [w for w in works if w is not None and hasattr(w, "get_future")]
        if not works:
            self._end(entry, counted)
            return
        try:
            future = works[-1].get_future()
            entry["async_op"] = True
            future.add_done_callback(functools.partial(self._future_done, entry, counted))
        except Exception:
            entry["completion"] = "unknown"  # this backend has no future: done when issued
            self._end(entry, counted)

    def _future_done(self, entry: dict[str, Any], counted: bool, future: Any) -> None:
        error = None
        try:
            future.wait()
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"[:300]
        self._end(entry, counted, error)

    def _end(self, entry: dict[str, Any], counted: bool, error: str | None = None) -> None:
        try:
            self._recorder.collective_ended(entry, error, counted=counted)
        except Exception as exc:
            self._fuse.blow(exc)

    def _group(self, group: Any) -> tuple[str, int]:
        """(name, size) of a process group; None is the default group. Cached per object."""
        if group is None:
            group = dist.group.WORLD
        cached = self._groups.get(id(group))
        if cached is not None and cached[0] is group:
            return cached[1], cached[2]
        name, size = group_identity(group)
        if len(self._groups) > 256:
            self._groups.clear()
        self._groups[id(group)] = (group, name, size)
        return name, size


def group_identity(group: Any) -> tuple[str, int]:
    """(name, size) of a process group, the key its collectives are numbered under."""
    if group is None:
        group = dist.group.WORLD
    try:
        name = torch_api.process_group_name(group)
    except torch_api.Missing as missing:
        torch_api.off(missing)
        name = "?"
    except Exception:
        name = "?"
    try:
        size = int(group.size())
    except Exception:
        size = 0
    return name, size


def _in_comm_hook(frame: Any, depth: int = 4) -> bool:
    """True when ddpmon's comm hook is among the next ``depth`` frames out: the default hook
    and torch's wrappers call the collective two or three frames below it."""
    while frame is not None and depth > 0:
        code = frame.f_code
        if code.co_name == "__call__" and code.co_filename == _COMM_HOOK_FILE:
            return True
        frame = frame.f_back
        depth -= 1
    return False


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], pos: int | None, key: str | None) -> Any:
    if key is not None and key in kwargs:
        return kwargs[key]
    if pos is not None and pos < len(args):
        return args[pos]
    return None


def _shape(value: Any) -> tuple[str | None, int | None]:
    """(dtype, element count) of a collective's tensor or tensors: its fingerprint, which
    the doctor compares across ranks (a size or dtype mismatch aborts or hangs the backend)."""
    if isinstance(value, torch.Tensor):
        return str(value.dtype).replace("torch.", ""), value.numel()
    if (
        isinstance(value, (list, tuple))
        and value
        and all(isinstance(v, torch.Tensor) for v in value)
    ):
        dtypes = {str(v.dtype).replace("torch.", "") for v in value}
        return (dtypes.pop() if len(dtypes) == 1 else "mixed"), sum(v.numel() for v in value)
    return None, None


def _nbytes(value: Any) -> int | None:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) or 0 for v in value)
    return None


_LIBRARY, _USER, _HOOK = 0, 1, 2
_KINDS: dict[Any, tuple[int, bool]] = {}  # code object -> (kind, may serve as the fallback)


def _kind(code: Any) -> tuple[int, bool]:
    """Whether a code object is a library's (``frames.is_library``), the user's, or ddpmon's comm hook:
    decided once per code object, so the walk below costs a dict lookup a frame."""
    kind = _KINDS.get(code)
    if kind is None:
        filename = code.co_filename
        if filename == _COMM_HOOK_FILE and code.co_name == "__call__":
            kind = (_HOOK, False)
        elif not is_library(filename):
            kind = (_USER, False)
        else:
            kind = (_LIBRARY, filename.startswith(_TORCH_DIR) and filename not in _C10D_FILES)
        if len(_KINDS) > 4096:
            _KINDS.clear()
        _KINDS[code] = kind
    return kind


def _call_site(frame: Any) -> tuple[str, str, bool, list[str]]:
    """(``file:line``, function, in the comm hook, callers) of the first frame of the user's
    code (outside torch, ddpmon and other libraries); ``callers`` are the next user frames out (``file:line in function``), which
    tell apart calls through a shared helper. A call from inside ddpmon's comm hook is a
    bucket's collective: the walk stops there (it runs for every bucket of every step)."""
    fallback = None
    found: list[Any] = []
    depth = 0
    while frame is not None and depth < _MAX_DEPTH and len(found) <= _CALLERS:
        kind, may_fallback = _kind(frame.f_code)
        if kind == _HOOK:
            if found:  # a hook of the user's own, in user code
                return _site(found[0]), found[0].f_code.co_name, True, []
            return "DDP backward", "backward", True, []
        if kind == _USER:
            found.append(frame)
        elif not found and fallback is None and may_fallback:
            fallback = frame
        frame = frame.f_back
        depth += 1
    if not found:
        if fallback is None:
            return "?", "?", False, []
        name = fallback.f_code.co_filename
        return (
            f"torch/{name[len(_TORCH_DIR) :]}:{fallback.f_lineno}",
            fallback.f_code.co_name,
            False,
            [],
        )
    return (
        _site(found[0]),
        found[0].f_code.co_name,
        False,
        [f"{_site(f)} in {f.f_code.co_name}" for f in found[1:]],
    )


def _site(frame: Any) -> str:
    return f"{short_path(frame.f_code.co_filename)}:{frame.f_lineno}"
