"""Whose code a stack frame runs: the user's, or a library's. One rule for the collectives'
call sites, the watchdog's hang line and the exit record (no torch import)."""

from __future__ import annotations

import functools
import importlib.util
import os
import sysconfig

DDPMON_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


@functools.lru_cache(maxsize=1)
def _library_roots() -> tuple[str, ...]:
    roots = [DDPMON_DIR, "<frozen"]
    try:
        spec = importlib.util.find_spec("torch")  # finds the package without importing it
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin:
        roots.append(os.path.dirname(os.path.abspath(spec.origin)) + os.sep)
    for key in ("stdlib", "platstdlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            roots.append(os.path.abspath(path) + os.sep)
    return tuple(roots)


@functools.lru_cache(maxsize=4096)
def is_library(filename: str) -> bool:
    """True for torch's, ddpmon's, the standard library's and installed packages' files:
    what a reader skips to find where the user's code stands."""
    if "site-packages" in filename or "dist-packages" in filename:
        return True
    return filename.startswith(_library_roots())


@functools.lru_cache(maxsize=4096)
def is_library_anywhere(filename: str) -> bool:
    """``is_library`` for a frame recorded by a rank, maybe on another host with other
    install paths: installed packages, the standard library, frozen modules, and ddpmon's own
    modules, known by their path inside the package (a checkout, or the user's own project,
    may be a directory called ddpmon too)."""
    if "site-packages" in filename or "dist-packages" in filename or "/lib/python3" in filename:
        return True
    if filename.startswith("<frozen"):
        return True
    head, sep, inside = filename.rpartition("/ddpmon/")
    return bool(sep) and inside in _ddpmon_modules()


@functools.lru_cache(maxsize=1)
def _ddpmon_modules() -> frozenset[str]:
    """The paths of ddpmon's Python files inside the package (``rank/watchdog.py``)."""
    out = set()
    for root, _dirs, names in os.walk(DDPMON_DIR):
        for name in names:
            if name.endswith(".py"):
                out.add(os.path.relpath(os.path.join(root, name), DDPMON_DIR).replace(os.sep, "/"))
    return frozenset(out)


@functools.lru_cache(maxsize=1024)
def short_path(filename: str) -> str:
    """A path relative to the working directory when below it, else as given."""
    try:
        rel = os.path.relpath(filename)
    except ValueError:
        return filename
    return filename if rel.startswith("..") else rel
