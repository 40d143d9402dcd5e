"""Monitor every DDP model a script builds, without changing the script.

``python -m ddpmon.launch SCRIPT [ARGS...]`` (or ``-m MODULE [ARGS...]``) runs the script as
``__main__``, as ``python SCRIPT ARGS`` would: same ``sys.argv``, ``sys.path[0]``,
``__file__`` and tracebacks; meanwhile every ``DistributedDataParallel`` built in the process
is attached with ``ddpmon.attach`` right after its constructor returns. ``ddpmon run`` starts
each rank this way under torchrun; for ``ddpmon run python train.py`` (a script that starts
its own processes) a ``sitecustomize`` that exists only for that run calls ``install()`` in
each of the run's Python processes.

Options come from the ``DDPMON_*`` variables. The first model of a process uses the
configured state directory; the k-th more (k = 1, 2, ...) writes into ``<state_dir>/model-k``
and serves metrics on an ephemeral port. Monitors are detached when the process exits, so
the last step is counted. Before any model exists, each rank of a launched job (RANK set)
publishes its stage from the start of its process (``rank/startup.py``): starting, in the
rendezvous or ``init_process_group`` (backend, store, since when), building DDP. A script
that calls ``ddpmon.attach`` itself gets the monitor that
is already there (or, with options, one attached again with them). For ``ddpmon run
--debug-server`` each rank starts torch's debug server just before its first monitor.
"""

from __future__ import annotations

import atexit
import builtins
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
import types
from typing import Any

from .rank import startup

log = logging.getLogger("ddpmon")

_TARGET = "torch.nn.parallel.distributed"
_C10D = "torch.distributed.distributed_c10d"
_MONITORS: list[tuple[Any, Any, dict[str, Any]]] = []  # (ddp, monitor, options) of this process
_installed = False
_original_attach: Any = None


def install() -> None:
    """From now on, attach ddpmon to every DistributedDataParallel this process builds.
    Cheap: torch is not imported here; the patch waits for torch's DDP module to load."""
    global _installed, _original_attach
    if _installed:
        return
    _installed = True
    import ddpmon

    _original_attach = ddpmon.attach
    ddpmon.attach = _attach_explicit  # type: ignore[assignment]
    _watch(_TARGET, "DistributedDataParallel", _patch)
    atexit.register(detach_all)  # registered before any monitor: runs after their own exit hooks


def monitors() -> list[Any]:
    """The monitors attached in this process through ``install()``, in build order."""
    return [monitor for _, monitor, _ in _MONITORS]


def detach_all() -> None:
    """Detach every monitor (at exit: the last step is counted and the state file written)."""
    for _, monitor, _ in _MONITORS:
        try:
            monitor.detach()
        except Exception as exc:  # never in the way of the process ending
            log.warning("ddpmon: detaching at exit failed: %r", exc)


# -- the patch ----------------------------------------------------------------------------


def _watch(name: str, attribute: str, patch: Any) -> None:
    """Call ``patch(module)`` on module ``name`` once it has run (it has ``attribute``): now
    when it is imported already, else when it is."""
    module = sys.modules.get(name)
    if module is not None and hasattr(module, attribute):
        patch(module)
    else:
        sys.meta_path.insert(0, _ModuleWatcher(name, patch))


class _ModuleWatcher(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when one of torch's modules is imported, it lets the usual
    finders locate it and patches it once the module has run."""

    def __init__(self, name: str, patch: Any) -> None:
        self._name, self._patch = name, patch

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self._name:
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _PatchingLoader(spec.loader, self._patch)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, patch: Any) -> None:
        self._loader, self._patch = loader, patch

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__loader__ = self._loader  # the module looks as if loaded the usual way
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        self._patch(module)


def _patch(module: types.ModuleType) -> None:
    try:
        cls = module.DistributedDataParallel
        original = cls.__init__
        if getattr(original, "_ddpmon_launch", False):
            return

        @functools.wraps(original)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            startup.building_ddp()
            original(self, *args, **kwargs)
            _attach_built(self)

        __init__._ddpmon_launch = True  # type: ignore[attr-defined]
        cls.__init__ = __init__
    except Exception as exc:
        log.warning("ddpmon: cannot watch DistributedDataParallel (%r); nothing is monitored", exc)


def _attach_built(ddp: Any) -> None:
    """Attach to a DDP model that was just built; a failure is logged, never raised."""
    if any(d is ddp for d, _, _ in _MONITORS):
        return
    options: dict[str, Any] = {}
    try:
        from .config import Config

        index = len(_MONITORS)
        if not index:
            _start_debug_server(ddp)
        if index:
            config = Config.from_env()
            state_dir = config.resolved_state_dir(config.resolved_job())
            if state_dir is not None:
                options["state_dir"] = os.path.join(state_dir, f"model-{index}")
            if config.port > 0:
                options["port"] = 0
        monitor = _original_attach(ddp, **options)
    except Exception as exc:
        log.warning(
            "ddpmon: could not attach to the DistributedDataParallel model just built "
            "(%s); training goes on unmonitored",
            exc,
        )
        return
    _MONITORS.append((ddp, monitor, options))


def _start_debug_server(ddp: Any) -> None:
    """torch's debug server for ``ddpmon run --debug-server``, started before the first
    monitor: rank 0's frontend is a forked child, which then holds none of ddpmon's
    threads, sockets or files. Its dumps go into ``<state_dir>/debug-server/``."""
    from .config import Config, debug_server_request

    try:
        request = debug_server_request()
        if request is None:
            return
        from .rank import debug_server
        from .state import root

        config = Config.from_env()
        state_dir = config.resolved_state_dir(config.resolved_job())
        dump_dir = None
        if state_dir is not None:
            root.prepare(state_dir, explicit=config.state_dir is not None)
            dump_dir = os.path.join(state_dir, debug_server.DUMP_DIR)
        debug_server.start(request[0], dump_dir, request[1], debug_server.backend_of(ddp))
    except Exception as exc:
        log.warning("ddpmon: torch's debug server not started: %r; training goes on", exc)


def _attach_explicit(ddp_model: Any, **options: Any) -> Any:
    """``ddpmon.attach`` in a launched process: a model attached already keeps its monitor,
    unless options are given, which attach it again with them."""
    for i, (ddp, monitor, auto_options) in enumerate(_MONITORS):
        if ddp is not ddp_model:
            continue
        if not options:
            return monitor
        monitor.detach()
        merged = {**auto_options, **options}
        monitor = _original_attach(ddp_model, **merged)
        _MONITORS[i] = (ddp, monitor, merged)
        return monitor
    monitor = _original_attach(ddp_model, **options)
    _MONITORS.append((ddp_model, monitor, options))
    return monitor


_attach_explicit.__doc__ = "Monitor ``ddp_model`` on this rank (see ddpmon.attach)."


# -- running the script as __main__ -------------------------------------------------------

USAGE = "usage: python -m ddpmon.launch SCRIPT [ARGS...] | -m MODULE [ARGS...]"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or (argv[0] == "-m" and len(argv) < 2):
        print(USAGE, file=sys.stderr)
        sys.exit(_exits().EXIT_USAGE)
    install()
    if startup.begin() is not None:  # a rank of a launched job: its state from now on
        _watch(_C10D, "init_process_group", startup.patch_c10d)
    if argv[0] == "-m":
        _run_module(argv[1], argv[2:])
    else:
        _run_script(argv[0], argv[1:])


def _run_script(script: str, args: list[str]) -> None:
    path = os.path.abspath(script)
    try:
        with open(path, "rb") as f:
            source = f.read()
    except OSError as exc:  # the words python itself uses
        print(
            f"{sys.executable}: can't open file {path!r}: [Errno {exc.errno}] {exc.strerror}",
            file=sys.stderr,
        )
        sys.exit(_exits().EXIT_USAGE)
    sys.argv[:] = [script, *args]
    sys.path[0] = os.path.dirname(os.path.realpath(path))
    main_module = types.ModuleType("__main__")
    main_module.__dict__.update(
        __file__=path,
        __cached__=None,
        __package__=None,
        __spec__=None,
        __loader__=importlib.machinery.SourceFileLoader("__main__", path),
        __builtins__=builtins,
    )
    if sys.version_info < (3, 14):  # python's own __main__ has one from the start
        main_module.__annotations__ = {}
    sys.modules["__main__"] = main_module
    code = compile(source, path, "exec", dont_inherit=True)
    _run_as_main(lambda: exec(code, main_module.__dict__), path)


def _run_module(name: str, args: list[str]) -> None:
    import runpy

    spec = importlib.util.find_spec(name)
    if spec is None:
        print(f"{sys.executable}: No module named {name}", file=sys.stderr)
        sys.exit(_exits().EXIT_SCRIPT_FAILED)
    sys.argv[:] = [spec.origin or name, *args]
    _run_as_main(lambda: runpy.run_module(name, run_name="__main__", alter_sys=True), spec.origin)


def _run_as_main(run: Any, filename: str | None) -> None:
    """Run; an uncaught exception is reported as python reports it, from the user's first
    frame on (this module's and runpy's frames left out), and the process exits 1."""
    try:
        run()
    except SystemExit as exc:
        startup.ended(None, exc.code if isinstance(exc.code, int) else 1)
        raise
    except BaseException as exc:  # reported as python would, and turned into the exit status
        startup.ended(exc)
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != filename:
            tb = tb.tb_next
        tb = tb or exc.__traceback__
        exc = exc.with_traceback(tb)
        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, tb
        if hasattr(sys, "last_exc"):
            sys.last_exc = exc
        sys.excepthook(type(exc), exc, tb)
        codes = _exits()
        sys.exit(
            codes.EXIT_INTERRUPTED
            if isinstance(exc, KeyboardInterrupt)
            else codes.EXIT_SCRIPT_FAILED
        )
    startup.ended(None, 0)


def _exits() -> Any:
    """The exit-code table (``cli/exits.py``), imported only on the way out: the command
    line's modules have no business in a training process that runs."""
    from .cli import exits

    return exits


if __name__ == "__main__":
    from ddpmon.launch import (
        main as _main,  # the module's one copy, not this __main__ one
    )

    _main()
