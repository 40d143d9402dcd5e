"""The launchers' findings (verdict not_started), from what each node's ``ddpmon run``
recorded (``state/launcher.py``), for a job whose ranks did not all start:

=================  ==========================================================================
kind               when
=================  ==========================================================================
port_in_use        a node could not serve the rendezvous store: its port is taken (by whom)
launch_failed      a node's launcher ended on another error before its ranks started
master_unreachable a node cannot reach the endpoint it was given: each error, how often
node_missing       the node that serves the store waits for more nodes than are seen; in a
                   dynamic (c10d) rendezvous, fewer nodes joined than it needs
=================  ==========================================================================

In a static rendezvous the ranks start only once every node has met at the master's store,
so a node with a wrong ``--master-addr`` or one that never started leaves nothing but these
records: the node is named, with the address it was given and why it cannot connect. A
dynamic (c10d) rendezvous assigns node ranks only once complete, so there the doctor says how
many of how many joined, and which, as torch's rendezvous knows them.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...formats import format_seconds
from ...state.launcher import LauncherStage, LauncherState
from ..findings import Finding
from ..load import Launcher, Unreachable

FRESH_SECONDS = 10.0
"""A launcher record rewritten within this is a launcher alive (it writes every second)."""
UNREACHABLE_SECONDS = 10.0
"""How long a node's attempts to reach the endpoint must have failed before it is named: a
launcher that starts beside the store it connects to (``--standalone``, node 0 of a static
rendezvous) is refused a moment while that store comes up."""
ARRIVAL_SECONDS = 10.0
"""How long a dynamic rendezvous must have waited short of nodes before the absent ones are
called missing: the nodes of a job start within seconds of each other."""
ALIVE = (LauncherStage.STARTING, LauncherStage.RENDEZVOUS, LauncherStage.RUNNING)
RECENT_SECONDS = 900.0
"""A launcher that failed within this belongs to the job asked about."""


def findings(
    launchers: Sequence[Launcher], now: float, unreachable: Sequence[Unreachable] = ()
) -> list[Finding]:
    live = [
        x
        for x in launchers
        if x.record.stage == LauncherStage.RENDEZVOUS and now - x.mtime < FRESH_SECONDS
    ]
    failed = [
        x
        for x in launchers
        if x.record.stage == LauncherStage.FAILED and now - x.mtime < RECENT_SECONDS
    ]
    out = [_failed(x.record) for x in failed]
    servers = [x.record for x in live if x.record.serves_store]
    cut_off = [
        x.record
        for x in live
        if not x.record.serves_store
        and (failing := _failing(x.record))
        and (x.record.now_unix or now) - min(a.first_unix for a in failing) >= UNREACHABLE_SECONDS
    ]
    out += [_unreachable(r, servers, now) for r in cut_off]
    arrived = [
        x.record for x in launchers if x.record.stage in ALIVE and now - x.mtime < FRESH_SECONDS
    ]
    for s in servers:
        missing = _missing(s, arrived)
        if missing:
            out.append(_node_missing(s, missing, now, unreachable))
    short: dict[str, LauncherState] = {}  # one per endpoint: the record that saw the most
    for x in live:
        seen = x.record.rendezvous
        if (
            seen is not None
            and not seen.complete
            and len(seen.joined) < seen.min_nodes
            and _waited(x.record, now) >= ARRIVAL_SECONDS
        ):
            other = short.get(x.record.endpoint)
            if other is None or len(seen.joined) > len(other.rendezvous.joined):  # type: ignore[union-attr]
                short[x.record.endpoint] = x.record
    live_records = [x.record for x in live]
    out += [_rendezvous_short(r, live_records, cut_off, now, unreachable) for r in short.values()]
    return out


def starting(launchers: Sequence[Launcher], now: float) -> Finding | None:
    """A job whose launchers live and found nothing wrong (``findings``) while no rank has
    written yet: it is starting (an info note, verdict healthy), not a state directory with
    nothing to diagnose."""
    live = [
        x.record for x in launchers if x.record.stage in ALIVE and now - x.mtime < FRESH_SECONDS
    ]
    if not live:
        return None
    return Finding(
        "starting",
        "info",
        [],
        "the job is starting: "
        + "; ".join(_where(r, now) for r in live)
        + ", and no rank has written its state yet",
        [_expects(r) for r in live if r.stage == LauncherStage.STARTING],
    )


def _where(r: LauncherState, now: float) -> str:
    if r.stage != LauncherStage.STARTING:
        return f"{r.node}'s launcher is in {r.stage}"
    took = format_seconds(max(0.0, (r.now_unix or now) - r.started_unix))
    return (
        f"{r.node}'s launcher has been starting for {took} "
        f"({' '.join(r.command[:1]) or '?'}; torch loading, no rendezvous tried yet)"
    )


def _expects(r: LauncherState) -> str:
    """What a starting launcher's command line expects."""
    command = " ".join(r.command)
    per_node = f", {r.nproc_per_node} processes each" if r.nproc_per_node else ""
    return (
        f"{r.node}: {command[:300]}; {r.nnodes} node{'s' if r.nnodes != '1' else ''}{per_node}, "
        f"rendezvous {r.rdzv_backend} at {r.endpoint}"
    )


def _failed(r: LauncherState) -> Finding:
    error = r.error or "?"
    if r.port_holder or "address already in use" in error.lower() or "EADDRINUSE" in error:
        held = f" by {r.port_holder}" if r.port_holder else ""
        port = r.endpoint.rsplit(":", 1)[-1]
        return Finding(
            "port_in_use",
            "error",
            [],
            f"{r.node} cannot serve the rendezvous store at {r.endpoint}: port {port} is "
            f"already in use{held}",
            [f"{r.node}: its launcher ended: {_first_line(error)}"],
            f"Free port {port} on {r.host} (end that process), or give every node another "
            "--master-port, the same on each.",
        )
    return Finding(
        "launch_failed",
        "error",
        [],
        f"{r.node}'s launcher failed before its ranks started: {_first_line(error)}",
        [f"{r.node}: rendezvous {r.rdzv_backend} at {r.endpoint}, {r.nnodes} nodes"],
        "Read that node's launcher output (above the traceback), fix what it names and "
        "start the job again on every node.",
    )


def _failing(r: LauncherState) -> list:
    """Its attempts that failed since it last reached the endpoint."""
    return [a for a in r.attempts if a.last_unix > (r.reached_unix or 0.0)]


def _unreachable(r: LauncherState, servers: list[LauncherState], now: float) -> Finding:
    failing = _failing(r)
    tried = ", ".join(f"{a.error} ({a.count} time{'s' if a.count != 1 else ''})" for a in failing)
    since = min(a.first_unix for a in failing)
    summary = (
        f"{r.node} cannot reach the rendezvous endpoint it was given, {r.endpoint}: "
        f"{tried} over {format_seconds(max(0.0, (r.now_unix or now) - since))}"
    )
    evidence = [f"{r.node}: {a.error}: {a.detail}" for a in failing]
    fix = (
        f"Give {r.node} the address and port of the node that serves the store "
        "(--master-addr, --master-port: that node's address on the network the nodes share, "
        f"the same on every node), and check the route and firewall from {r.host} to it."
    )
    for s in servers:
        evidence.append(f"{s.node} serves the store at {s.endpoint} and waits for the nodes")
        if s.endpoint != r.endpoint:
            summary += f"; {s.node} serves it at {s.endpoint}"
    return Finding("master_unreachable", "error", [], summary, evidence, fix)


def _expected(nnodes: str) -> int:
    try:
        return int(nnodes.split(":")[-1])
    except ValueError:
        return 0


def _missing(server: LauncherState, live: list[LauncherState]) -> list[int]:
    """The node ranks the server waits for and no live launcher of the job stands for."""
    expected = _expected(server.nnodes)
    port = server.endpoint.rsplit(":", 1)[-1]
    seen = {
        r.node_rank
        for r in live
        if r.node_rank is not None and r.endpoint.rsplit(":", 1)[-1] == port
    }
    return [n for n in range(expected) if n not in seen]


def _node_missing(
    s: LauncherState, missing: list[int], now: float, unreachable: Sequence[Unreachable]
) -> Finding:
    waited = format_seconds(max(0.0, (s.now_unix or now) - (s.stage_since_unix or s.started_unix)))
    names = ", ".join(f"node {n}" for n in missing)
    evidence = [f"{s.node} serves the store at {s.endpoint} and has waited {waited}"]
    evidence += [f"the daemon {u.address} does not answer: {u.reason}" for u in unreachable]
    return Finding(
        "node_missing",
        "error",
        [],
        f"{s.node} waits at {s.endpoint} for {_expected(s.nnodes)} nodes ({waited}); "
        f"{names} never arrived: no launcher of {'its' if len(missing) == 1 else 'theirs'} "
        "is seen",
        evidence,
        f"Start the job on {names} (ddpmon run with --nnodes={s.nnodes}, its --node-rank, and "
        f"--master-addr/--master-port of {s.host}), or find why it did not start. Ask every "
        "node's daemon (ddpmon doctor --from HOST:PORT for each) to see a node that started "
        "and cannot connect.",
    )


def _rendezvous_short(
    r: LauncherState,
    live: list[LauncherState],
    cut_off: list[LauncherState],
    now: float,
    unreachable: Sequence[Unreachable],
) -> Finding:
    """node_missing in a dynamic (c10d) rendezvous: no node ranks to name, but the
    rendezvous knows who joined and how many it needs; the launchers seen at its endpoint
    that have not joined are named apart (master_unreachable says why)."""
    seen = r.rendezvous
    assert seen is not None
    waited = format_seconds(_waited(r, now))
    joined = ", ".join(seen.joined) or "none"
    unjoined = [x.node for x in live if x.endpoint == r.endpoint and x in cut_off]
    absent = max(0, seen.min_nodes - len(seen.joined) - len(unjoined))
    needs = (
        str(seen.min_nodes)
        if seen.min_nodes == seen.max_nodes
        else f"at least {seen.min_nodes} (of up to {seen.max_nodes})"
    )
    summary = (
        f"the c10d rendezvous at {r.endpoint} has {len(seen.joined)} of {needs} nodes after "
        f"{waited} ({joined} joined)"
    )
    if unjoined:
        summary += f"; {', '.join(unjoined)} started and cannot reach it"
    if absent:
        summary += (
            f"; {absent} node{'s' if absent != 1 else ''} never arrived: no launcher of "
            f"{'its' if absent == 1 else 'theirs'} is seen"
        )
    evidence = [
        f"{x.node}: in the rendezvous at {x.endpoint} for "
        + format_seconds(_waited(x, now))
        + (f", {len(x.rendezvous.joined)} joined" if x.rendezvous is not None else "")
        for x in live
        if x.endpoint == r.endpoint
    ]
    if seen.waiting:
        evidence.append(f"waiting for the next round: {', '.join(seen.waiting)}")
    evidence += [f"the daemon {u.address} does not answer: {u.reason}" for u in unreachable]
    return Finding(
        "node_missing",
        "error",
        [],
        summary,
        evidence,
        f"Start the job on the missing node (ddpmon run with --nnodes={r.nnodes}, "
        f"--rdzv-backend {r.rdzv_backend} and --rdzv-endpoint {r.endpoint}, the same on every "
        "node), or find why it did not start. Ask every node's daemon (ddpmon doctor --from "
        "HOST:PORT for each) to see a node that started and cannot connect.",
    )


def _waited(r: LauncherState, now: float) -> float:
    """Seconds the launcher has been in its stage, on its own clock."""
    return max(0.0, (r.now_unix or now) - (r.stage_since_unix or r.started_unix))


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0][:400] if text.strip() else text
