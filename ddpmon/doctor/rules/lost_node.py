"""lost_node (verdict dead_rank): a whole node is gone, and the ranks elsewhere failed on
their connections to it.

When a node dies (power, a kernel panic, everything on it killed), its ranks write nothing
more and its daemon stops answering; the ranks on the other nodes fail in their next
collective ("Connection reset by peer", "Connection closed by peer [ADDR]:PORT") or wait in
it. Read rank by rank, the first of those survivors to fail would be the culprit: the node
is, so its ranks are the suspects, named with its host and address.

A node is lost when its daemon (``--from``) does not answer and its ranks have no state
file here, or when every rank of one host stopped writing its state file (a shared
directory), and every rank elsewhere failed on a connection or waits, none with an error of
its own (those still running have yet to reach the collective that fails). Ranks that only
wait while a daemon does not answer are not enough: a cut link looks the same from here
(``missing_rank`` says what is known).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

from ...activity import Status
from .. import words
from ..findings import Finding, Verdict
from ..load import Unreachable
from ..view import GONE, RankView, state_interval
from .dead_rank import PEER_FAILURE

CLOSED = re.compile(
    r"reset by peer|closed by peer|connection (closed|reset|refused)|broken pipe", re.IGNORECASE
)
"""The far end closed the connection: its processes ended (a timeout says only that it went quiet)."""
PEER_ADDRESS = re.compile(r"\[([0-9A-Fa-f:.]+)\]:\d+")
"""gloo names the peer it lost: "Read error [10.0.0.2]:40123: Connection reset by peer"."""


def failed_on_connection(v: RankView) -> bool:
    return v.status == Status.CRASHED and bool(PEER_FAILURE.search(v.exception or ""))


def _stopped_before_failure(views: list[RankView]) -> list[tuple[RankView, float]]:
    """Ranks on other hosts (no process to check, no end recorded) whose state file stopped
    before another rank failed on a connection, each with the moment (the doctor's clock)
    it counts as gone: two write intervals after that failure, since a live rank rewrites
    its file, or records its own end, within one."""
    first = min(
        (v.gone_at for v in views if failed_on_connection(v) and v.gone_at is not None),
        default=None,
    )
    if first is None:
        return []
    return [
        (v, first + 2 * state_interval(v.state) + 0.5)
        for v in views
        if v.liveness.alive is None
        and v.ending is None
        and v.status not in GONE
        and v.file.written < first
    ]


def mark_vanished(views: list[RankView]) -> None:
    """Far ranks that stopped before another rank failed on a connection, and have not
    written since, are gone (silent) now, not once their files are 10 s old."""
    for v, at in _stopped_before_failure(views):
        if v.file.mtime + v.age > at:
            v.status = Status.SILENT
            v.gone_at = v.file.written + state_interval(v.state) / 2


def undecided(views: list[RankView]) -> float:
    """Seconds until every far rank that stopped before another rank failed on a connection
    can be told gone or alive (0: none waits)."""
    return max(
        (at - (v.file.mtime + v.age) for v, at in _stopped_before_failure(views)), default=0.0
    )


def lost_node(
    views: list[RankView], missing: list[int], unreachable: Sequence[Unreachable] = ()
) -> Verdict | None:
    """lost_node: every rank of a node is gone without a word (no state file behind a daemon
    that does not answer, or every rank of a host silent), and the others failed on their
    connections or wait; the node's ranks are the suspects."""
    by_host: dict[str, list[RankView]] = {}  # one pass: a thousand hosts' ranks
    for v in views:
        if v.state.host:
            by_host.setdefault(v.state.host, []).append(v)
    silent_hosts = sorted(
        h for h, on in by_host.items() if all(v.status == Status.SILENT for v in on)
    )
    lost = [v for h in silent_hosts for v in by_host[h]]
    unseen = list(missing) if unreachable else []
    lost_ids = {id(v) for v in lost}
    others = [v for v in views if id(v) not in lost_ids]
    if not (lost or unseen) or not others:
        return None
    failed = [v for v in others if failed_on_connection(v)]
    waiting = [v for v in others if v.status == Status.WAITING]
    running = [
        v for v in others if v.status == Status.STEPPING
    ]  # yet to reach the collective that fails
    if len(failed) + len(waiting) + len(running) != len(others):
        return None  # a survivor ended or stopped on its own: not (only) the node
    if not failed and not (lost and waiting):
        return None  # none failed on it: with its daemon silent, a cut link looks the same
    suspects = sorted({v.rank for v in lost} | set(unseen))
    nodes = _unseen_nodes(views, unseen)
    places = [f"host {h}" for h in silent_hosts] + ([_at(unreachable, nodes)] if unseen else [])
    where = " and ".join(places)
    it = "it" if len(silent_hosts) + (len(unreachable) if unseen else 0) == 1 else "them"
    what = []
    if unseen:
        daemons = (
            "its daemon does not answer" if len(unreachable) == 1 else "their daemons do not answer"
        )
        what.append(
            f"{daemons} and {words.who(unseen)} left no state file that can be read from here"
        )
    if lost:
        many = len(lost) > 1
        what.append(
            f"{words.who([v.rank for v in lost])} stopped writing "
            + ("their state files together" if many else "its state file")
        )
    quiet = bool(failed) and not any(CLOSED.search(v.exception or "") for v in failed)
    lost_or_cut = "lost or cut off" if quiet else "lost"
    summary = f"{where} {'is' if it == 'it' else 'are'} {lost_or_cut}: {' and '.join(what)}"
    if failed:
        summary += f"; {words.who([v.rank for v in failed])} failed on connections to {it}"
    if waiting:
        summary += f"; {words.who([v.rank for v in waiting])} {words.verb(waiting, 'waits', 'wait')} for {it}"

    evidence = (
        [f"the daemon {u.address} does not answer: {u.reason}" for u in unreachable]
        if unseen
        else []
    )
    if nodes:
        evidence.append(
            f"ranks {words.ranks(unseen)} are {', '.join(f'node {n} (GROUP_RANK {n})' for n in nodes)}: "
            f"the ranks seen are numbered rank = GROUP_RANK x {ranks_per_node(views)} + LOCAL_RANK"
        )
    evidence += [words.gone_line(v) for v in lost]
    if quiet:
        evidence.append(
            f"no connection was closed by the far end ({words.who([v.rank for v in failed])} timed "
            "out): the node is down, or the network to it is cut"
        )
    evidence += _named_addresses(failed, unreachable if unseen else ())
    evidence += [words.gone_line(v) for v in failed] + [words.wait_line(v) for v in waiting]
    return Verdict(
        "dead_rank",
        suspects,
        [
            Finding(
                "lost_node",
                "error",
                suspects,
                summary,
                evidence,
                words.fix_lost_node(where),
            )
        ],
    )


def _at(unreachable: Sequence[Unreachable], nodes: list[int]) -> str:
    """The unreachable nodes by what is known of them: their index, their daemon's address."""
    daemons = ", ".join(u.address for u in unreachable)
    if len(unreachable) == 1:
        return (
            f"node {nodes[0]} (GROUP_RANK {nodes[0]}) at {daemons}"
            if len(nodes) == 1
            else f"the node at {daemons}"
        )
    return f"the nodes at {daemons}"


def _named_addresses(failed: list[RankView], unreachable: Sequence[Unreachable]) -> list[str]:
    """What the survivors' errors say of the peer they lost, against the daemons' addresses."""
    lines = []
    for v in failed:
        for address in dict.fromkeys(PEER_ADDRESS.findall(v.exception or "")):
            match = next((u for u in unreachable if address in u.ips), None)
            lines.append(
                f"rank {v.rank} lost its connection to {address}"
                + (f", the address of the unreachable daemon {match.address}" if match else "")
            )
    return lines


def ranks_per_node(views: list[RankView]) -> int | None:
    """Ranks per node when the ranks seen are numbered as torchrun numbers them (rank =
    GROUP_RANK x ranks per node + LOCAL_RANK) and every node seen is seen whole; None when
    they are not."""
    known = [
        v.state for v in views if v.state.local_rank is not None and v.state.group_rank is not None
    ]
    if not known or len(known) != len(views):
        return None
    per = max(s.local_rank or 0 for s in known) + 1
    world = known[0].world_size or 0
    nodes = Counter(s.group_rank for s in known)
    if world % per or any(n != per for n in nodes.values()):
        return None
    if any(s.rank != (s.group_rank or 0) * per + (s.local_rank or 0) for s in known):
        return None
    return per


def _unseen_nodes(views: list[RankView], unseen: list[int]) -> list[int]:
    """The nodes (GROUP_RANK) the unseen ranks make up, when the ranks seen show the
    numbering and the unseen ranks are whole nodes; else empty."""
    per = ranks_per_node(views)
    if not unseen or per is None:
        return []
    nodes = sorted({r // per for r in unseen})
    return nodes if per * len(nodes) == len(set(unseen)) else []
