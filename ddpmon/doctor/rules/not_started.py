"""not_arrived (verdict not_started): the job has not reached its first step because ranks
have not arrived where the others wait for them.

Under ``ddpmon run`` each rank writes its stage from its process's start
(``state.schema.Stage``): a rank still ``starting`` (its own code before
``init_process_group``: a dataset prepared on one rank, a download) holds every other rank
in ``init_process_group`` until the process group's timeout, and nothing else says so. The
ranks without a file are told apart from those that are there: no process of theirs has
written (not started, or started without ``ddpmon run``). Where a late rank is comes from
its own sample of its main thread ("prepare_dataset, train.py:5").

Ranks never arrive together: one imports or builds its data a few seconds longer than
another, and the first waits in ``init_process_group`` meanwhile. So a wait is a finding only
once it is a stall (longer than the waiting rank's ``stall_after``); until then the job is
starting, whoever has not arrived yet.
"""

from __future__ import annotations

from ...formats import format_seconds
from ...state.schema import BEFORE_FIRST_STEP, Stage
from .. import words
from ..findings import Finding, Verdict
from ..view import GONE, RankView

ARRIVED = (Stage.RENDEZVOUS, Stage.INIT_PROCESS_GROUP, Stage.BUILDING_DDP, Stage.FIRST_STEP)
"""Stages of a rank that waits on the others (or on the store) before the first step."""
ON_ITS_OWN = (Stage.STARTING, Stage.GROUP_READY)
"""Stages of a rank that runs its own code, not yet at the next step the others wait in."""


def not_arrived(views: list[RankView], missing: list[int]) -> Verdict | None:
    if not any(v.state.stage in BEFORE_FIRST_STEP for v in views):
        return None
    if any(v.state.step > 0 or v.status in GONE for v in views):
        return None  # it stepped once (another rule), or a rank died first (dead_rank)
    late = [v for v in views if v.state.stage in ON_ITS_OWN]
    waiting = [v for v in views if v.state.stage in ARRIVED]
    if not any(in_stage(v) > v.stall_after for v in waiting):  # nobody held up for long
        parts = [f"rank {v.rank} {where_short(v)}" for v in waiting + late]
        if missing:
            parts.append(f"{words.who(missing)} not yet there")
        summary = "the job is starting: " + "; ".join(parts)
        return Verdict("healthy", [], [Finding("starting", "info", [], summary)])
    evidence = [arrival_line(v) for v in waiting + late]
    evidence += [
        f"rank {r}: no state file: no process of rank {r} has started under ddpmon run "
        "(its node's launcher has not started it)"
        for r in missing
    ]
    suspects = sorted([v.rank for v in late] + list(missing))
    parts = []
    if waiting:
        first = waiting[0].state.startup
        store = f" at {first.store}" if first and first.store else ""
        parts.append(
            f"{words.who([v.rank for v in waiting])} {words.verb(waiting, 'waits', 'wait')} "
            f"in {waiting[0].state.stage}{store} for {format_seconds(max(map(in_stage, waiting)))}"
        )
    for v in late:
        parts.append(f"rank {v.rank} has not arrived: {where_short(v)}")
    if missing:
        parts.append(
            f"{words.who(missing)} {words.verb(missing, 'has', 'have')} no process (never started)"
        )
    summary = "the job has not reached its first step: " + "; ".join(parts)
    fix = _fix(waiting, late, missing)
    return Verdict(
        "not_started",
        suspects,
        [
            Finding(
                "not_arrived",
                "error",
                suspects or [v.rank for v in waiting],
                summary,
                evidence,
                fix,
            )
        ],
    )


def in_stage(v: RankView) -> float:
    """Seconds the rank has been in its stage, on the doctor's clock."""
    s = v.state
    since = s.startup.stage_since_unix if s.startup else None
    if since is None or s.now_unix is None:
        return v.silent
    return max(0.0, s.now_unix - since) + v.age


def where_short(v: RankView) -> str:
    """``in prepare_dataset, train.py:5, starting for 32.0 s``."""
    act = v.state.activity
    place = ""
    if act is not None and act.where:
        site, _, function = act.where.partition(" in ")
        place = f"in {function}, {site}, " if function else f"at {site}, "
    return f"{place}{v.state.stage} for {format_seconds(in_stage(v))}"


def arrival_line(v: RankView) -> str:
    s = v.state
    up = s.startup
    head = f"rank {v.rank} (pid {s.pid} on {s.host}): "
    if s.stage in ON_ITS_OWN:
        line = head + "not arrived, " + where_short(v)
        if act := s.activity:
            if act.callers:
                line += f"; called from {', '.join(act.callers[:3])}"
            line += f"; main thread CPU {act.cpu_share:.0%}"
        return line
    line = head + f"{s.stage} for {format_seconds(in_stage(v))}"
    if up is not None and up.backend:
        line += f" (backend {up.backend}, store {up.store or '?'})"
    if up is not None and up.error:
        line += f"; init_process_group raised {up.error}"
    return line


def _fix(waiting: list[RankView], late: list[RankView], missing: list[int]) -> str:
    out = []
    if late:
        out.append(
            f"{words.who([v.rank for v in late])} {words.verb(late, 'runs', 'run')} "
            "its own code while the others wait in init_process_group (or DDP's constructor) "
            "for it, up to the process group's timeout. If that work is expected (a dataset "
            "prepared on one rank), do it before init_process_group on every rank, or give "
            "init_process_group(timeout=...) room for it; otherwise see what it does: py-spy "
            f"dump --pid {late[0].state.pid}."
        )
    if missing:
        out.append(
            f"Start {words.who(missing)} (or find why not): see its node's launcher output, "
            "and ask every node: ddpmon doctor --from HOST:PORT for each node's daemon."
        )
    if not out and waiting and all(v.state.stage == Stage.RENDEZVOUS for v in waiting):
        out.append(
            "Every rank waits to reach the store: check MASTER_ADDR and MASTER_PORT "
            "(--master-addr, --master-port) on every node, and that the port is open."
        )
    if not out:
        out.append(
            "Every rank is there and the backend cannot connect them: check that the "
            "interface variables (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME) name a network "
            "every node reaches, and the firewall between the nodes."
        )
    return " ".join(out)
