"""The ranks' recent busy times, which the straggler rule reads to see whether a gap lasts
(``steps.sustained``): from each rank's history file beside its state file, or, for a job
asked ``--from`` its node daemons, from the daemon that served the rank's state
(``/history?rank=R&busy=SECONDS``: bounded, ``state/history.BUSY_ROWS`` steps at most), so
that ``doctor --from`` judges a straggler as the doctor on the node does. None when any rank's
cannot be had (history off, an older daemon): the window alone decides then."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from ..remote import daemons
from ..state import history
from .view import RankView

TIMEOUT_SECONDS = 3.0
DEADLINE_SECONDS = 5.0
"""For all daemons together, as the doctor's first read of them."""
MAX_BYTES = 1 << 20
Series = dict[str, list[Any]]


def recent(views: list[RankView], seconds: float, at_least: int) -> dict[int, Series] | None:
    """Per rank, the steps that ended within ``seconds`` of its last (at least its last
    ``at_least``): ``step``, ``end_unix`` and ``busy_seconds``, oldest first."""
    if any(v.file.daemon is not None for v in views):
        return _served(views, seconds, at_least)
    series = {}
    for v in views:
        path = history.path_for(os.path.dirname(v.file.path), v.rank)
        if not os.path.isfile(path):
            return None
        try:
            series[v.rank] = history.busy_since(path, seconds, at_least=at_least)
        except history.HistoryError:
            return None
    return series


def _served(views: list[RankView], seconds: float, at_least: int) -> dict[int, Series] | None:
    asks = []
    for v in views:
        if v.file.daemon is None:
            return None
        ask = history.Ask(
            job=v.file.state.job,
            rank=v.rank,
            busy=min(history.BUSY_SECONDS, math.ceil(seconds)),
            at_least=min(history.BUSY_ROWS, at_least),
        )
        asks.append(daemons.base_url(v.file.daemon.address) + "/history?" + ask.query())
    client = next(v.file.daemon.client for v in views if v.file.daemon is not None)
    answers = daemons.fetch_all(asks, TIMEOUT_SECONDS, DEADLINE_SECONDS, MAX_BYTES, client)
    series = {}
    for v, answer in zip(views, answers):
        if answer is None or not isinstance(answer[1], bytes):
            return None
        found = parse(answer[1])
        if found is None:
            return None
        series[v.rank] = found
    return series


def parse(body: bytes) -> Series | None:
    """A daemon's ``{"busy": {"step": [...], "end_unix": [...], "busy_seconds": [...]}}``,
    checked (a daemon's answer is input like any other); None when it is not that."""
    try:
        busy = json.loads(body).get("busy")
        columns = {k: busy[k] for k in ("step", "end_unix", "busy_seconds")}
    except (ValueError, AttributeError, KeyError, TypeError, RecursionError):
        return None
    lengths = {len(c) if isinstance(c, list) else -1 for c in columns.values()}
    if len(lengths) != 1 or not 0 <= lengths.pop() <= history.BUSY_ROWS:
        return None
    if not all(isinstance(s, int) and not isinstance(s, bool) for s in columns["step"]):
        return None
    for key in ("end_unix", "busy_seconds"):
        if not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
            for x in columns[key]
        ):
            return None
    return columns
