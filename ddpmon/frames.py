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


@functools.lru_cache(maxsize=1024)
def short_path(filename: str) -> str:
    """A path relative to the working directory when below it, else as given."""
    try:
        rel = os.path.relpath(filename)
    except ValueError:
        return filename
    return filename if rel.startswith("..") else rel
