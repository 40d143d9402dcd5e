"""``ddpmon set`` through the node daemons (``--from``, ``--from-file``, ``--prometheus``):
the request sent to every daemon at once (``POST /set``, ``daemon/requests.py``), which
places it for the job's ranks it serves; then each rank's answer read back from the
daemons' ``/state`` (the state file's ``settings_answer``), until every rank has answered
or the deadline has passed. Torch-free.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..webconfig import HttpConfig
from . import daemons

TIMEOUT_SECONDS = 3.0
"""To connect to a daemon and between reads."""
ANSWER_MAX_BYTES = 64 * 2**20
POLL_SECONDS = 0.5


@dataclass
class RankAnswer:
    """One rank's outcome: placed by ``address`` and answered, refused, or silent."""

    address: str
    nonce: str | None = None
    """None: the daemon could not place the request (``not_placed``)."""
    not_placed: str | None = None
    applied: dict[str, Any] | None = None
    """None until the rank has answered."""
    refused: dict[str, str] = field(default_factory=dict)
    step: int = 0


@dataclass
class Outcome:
    job: str | None
    ranks: dict[int, RankAnswer] = field(default_factory=dict)
    daemons: dict[str, str] = field(default_factory=dict)
    """Address -> what went wrong with it (no answer, 401, 403 and why, not a daemon)."""
    jobs: set[str] = field(default_factory=set)
    """The jobs the daemons placed requests for (one, unless --job was left out)."""


def ask(
    addresses: Sequence[str],
    job: str | None,
    rank: int | None,
    changes: dict[str, str],
    deadline: float,
    client: HttpConfig,
) -> Outcome:
    """Send ``changes`` to every daemon and wait up to ``deadline`` seconds in all for the
    ranks' answers."""
    until = time.monotonic() + deadline
    out = Outcome(job)
    body = json.dumps({"job": job, "rank": rank, "changes": changes, "timeout": deadline})
    urls = [daemons.base_url(a) + "/set" for a in addresses]
    answers = daemons.fetch_all(
        urls, TIMEOUT_SECONDS, deadline, ANSWER_MAX_BYTES, client, body.encode()
    )
    for address, answer in zip(addresses, answers):
        placed = _placed(address, answer, out)
        for r, value in placed.items():
            out.ranks[r] = RankAnswer(address, **value)
    waiting = {r for r, a in out.ranks.items() if a.nonce}
    while waiting and time.monotonic() < until:
        where = sorted({out.ranks[r].address for r in waiting})
        states = daemons.fetch_all(
            [daemons.base_url(a) + "/state" for a in where],
            TIMEOUT_SECONDS,
            max(0.1, until - time.monotonic()),
            ANSWER_MAX_BYTES,
            client,
        )
        for address, state_answer in zip(where, states):
            for state in _states(state_answer):
                number, reply = state.get("rank"), state.get("settings_answer")
                if number not in waiting or not isinstance(reply, dict):
                    continue
                mine = out.ranks[number]
                if mine.address != address or reply.get("nonce") != mine.nonce:
                    continue
                applied, refused = reply.get("applied"), reply.get("refused")
                mine.applied = dict(applied) if isinstance(applied, dict) else {}
                mine.refused = {str(k): str(v) for k, v in (refused or {}).items()}
                step = reply.get("step")
                mine.step = step if isinstance(step, int) else 0
                waiting.discard(number)
        if waiting:
            time.sleep(min(POLL_SECONDS, max(0.0, until - time.monotonic())))
    return out


def _placed(address: str, answer: daemons.Answer | None, out: Outcome) -> dict[int, dict[str, Any]]:
    """The ranks one daemon's answer to ``POST /set`` names; its problem in ``out.daemons``."""
    if answer is None:
        out.daemons[address] = "did not answer in time"
        return {}
    _, body, _ = answer
    if isinstance(body, BaseException):
        out.daemons[address] = daemons.why(body, TIMEOUT_SECONDS)
        return {}
    try:
        data = json.loads(body)
        placed, refused = data["placed"], data["refused"]
        assert isinstance(placed, dict) and isinstance(refused, dict)
        ranks = {int(r): {"nonce": str(n)} for r, n in placed.items()}
        ranks.update({int(r): {"not_placed": str(w)} for r, w in refused.items()})
    except (ValueError, TypeError, KeyError, AssertionError, RecursionError):
        out.daemons[address] = "not ddpmon's answer to POST /set: is that a ddpmon daemon?"
        return {}
    if isinstance(data.get("job"), str) and ranks:
        out.jobs.add(data["job"])
    return ranks


def _states(answer: daemons.Answer | None) -> list[dict[str, Any]]:
    """The state files in a ``/state`` answer (none when it failed: the next look)."""
    if answer is None or isinstance(answer[1], BaseException):
        return []
    try:
        data = json.loads(answer[1])
    except (ValueError, RecursionError):
        return []
    return [s for s in data if isinstance(s, dict)] if isinstance(data, list) else []
