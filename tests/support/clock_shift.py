"""One rank's clock shifted inside its own process, as if its host's clock were off:
``SHIFT_CLOCK=RANK:SECONDS[,RANK:SECONDS...]`` replaces ``time.time`` and ``time.time_ns``
in the process whose RANK is listed (libfaketime is no use: it hangs Python's
``Event.wait``). The kernel's file times stay true, as a host's own would be to its files.

Armed by ``tests/support/inject_site/sitecustomize.py`` on PYTHONPATH, before the script or
ddpmon imports anything, so every ``time.time()`` of the process reads the shifted clock.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

VARIABLE = "SHIFT_CLOCK"


def shifts(text: str) -> dict[int, float]:
    """``"1:10,2:-7"`` as ``{1: 10.0, 2: -7.0}``."""
    out = {}
    for part in filter(None, text.split(",")):
        rank, _, seconds = part.partition(":")
        out[int(rank)] = float(seconds)
    return out


def value(given: Mapping[int, float]) -> str:
    return ",".join(f"{rank}:{seconds}" for rank, seconds in given.items())


def install(environ: Mapping[str, str] = os.environ) -> None:
    text = environ.get(VARIABLE)
    if not text:
        return
    shift = shifts(text).get(int(environ.get("RANK", "-1")))
    if not shift:
        return
    real, real_ns, shift_ns = time.time, time.time_ns, int(shift * 1e9)
    time.time = lambda: real() + shift
    time.time_ns = lambda: real_ns() + shift_ns
