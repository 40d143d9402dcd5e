"""The doctor's rules: from the views of every rank to a verdict and findings.

One rule, one ``kind``: each rule is a function over plain views (``RankView``) in a module
of its own, its docstring says what it catches and why. ``VERDICT_RULES`` is walked in
order and the first rule that answers gives the verdict, so the order is the precedence:

===================  ============  ===================================================
kind                 verdict       when
===================  ============  ===================================================
finished             healthy       every rank exited without an error (straggler when
                                   a rank straggled over its last steps)
mismatch             desync        the ranks' collectives differ under one sequence
                                   number (op, order, dtype or element count)
left_early           desync        the first rank to end exited cleanly while others
                                   still needed it
lost_node            dead_rank     every rank of a node is gone without a word (its
                                   daemon does not answer, or all went silent); the
                                   others failed on connections to it or wait
same_error           dead_rank     every rank raised the same exception at the same
                                   place: a bug in the code, not one rank
dead_rank            dead_rank     a rank died, crashed or went silent first
not_arrived          not_started   before the first step: ranks wait longer than
                                   a stall in init_process_group (or DDP's
                                   constructor) for ranks still starting or
                                   without a process
stuck_rank           hang          a rank makes no progress outside any collective
cannot_write         cannot_write  ranks' state files are stale because they cannot
                                   write them (a full disk): not frozen, not killed
busy                 healthy       ranks work outside a step (evaluation, checkpoint);
                                   the others wait for them: not a hang
not_joining          hang          ranks wait in a collective another rank runs past
missing_rank         hang          all wait in one collective; members have no file
gpu_behind           hang          all wait in one collective; a rank's GPU has not
                                   started it (NCCL's flight recorder)
comm_hang            hang          all wait in one collective; none is behind
desync               desync        the ranks wait in different collectives
straggler            straggler     a rank computes clearly slower than the others
===================  ============  ===================================================

(``slowest_rank``, an info note, says how far the slowest rank is when it is at least 5%
slower but not yet out of its noise.)

No rule answering means healthy. The advice rules (``advice``: same data on every rank,
diverged replicas, NaN origin, device mapping, ...) are notes and never change the verdict. A job whose ranks were all ended while hung is first put
back as it was at their last writes (``ended_while_hung``). The other rules add notes (and so does
``cannot_write`` when another rule gives the verdict):
``JOB_RULES`` over all ranks, ``RANK_RULES`` on each rank (``memory_creep``, a warning, among them), and those of ``files`` on the
state directory (see ``ddpmon.doctor.examine``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from ..findings import Finding, Verdict
from ..load import Unreachable
from ..view import RankView, settle
from . import advice as advice_rules
from . import (
    busy,
    cannot_write,
    comm_hang,
    dead_rank,
    desync,
    ended_while_hung,
    fingerprint,
    lost_node,
    memory_creep,
    not_joining,
    not_started,
    rank_notes,
    same_error,
    straggler,
    stuck_rank,
    unused_parameters,
)

VerdictRule = Callable[[list[RankView], list[int]], Verdict | None]
"""(views, ranks of the job without a state file) -> a verdict, or None: not this one."""


def verdict_rules(unreachable: Sequence[Unreachable] = ()) -> tuple[VerdictRule, ...]:
    """The verdict rules in precedence order; ``lost_node`` also knows the ``--from`` daemons
    that did not answer."""
    return (
        dead_rank.finished,
        fingerprint.mismatch,
        dead_rank.left_early,
        functools.partial(lost_node.lost_node, unreachable=unreachable)
        if unreachable
        else lost_node.lost_node,
        same_error.same_error,
        dead_rank.dead_rank,
        not_started.not_arrived,
        stuck_rank.stuck_rank,  # (busy never answers when this one does)
        cannot_write.cannot_write,
        busy.busy,
        not_joining.not_joining,
        comm_hang.missing_rank,
        comm_hang.gpu_behind,
        comm_hang.comm_hang,
        desync.desync,
        straggler.straggler,
    )


VERDICT_RULES = verdict_rules()
JOB_RULES: tuple[Callable[[list[RankView]], list[Finding]], ...] = (
    unused_parameters.unused_parameters,
    unused_parameters.needless_find_unused_parameters,
    advice_rules.advice,  # silent mistakes (docs/advice.md): never a verdict
    advice_rules.rank_as_device,
    straggler.slowest_within_noise,
)
RANK_RULES: tuple[Callable[[RankView, list[int]], Finding | None], ...] = (
    rank_notes.no_stack,
    rank_notes.ddpmon_part_off,
    memory_creep.memory_creep,
)


def decide(
    views: list[RankView], missing: list[int], unreachable: Sequence[Unreachable] = ()
) -> Verdict:
    """The verdict, the suspect ranks and the findings behind them: the first rule of
    ``VERDICT_RULES`` that answers. ``unreachable``: the ``--from`` daemons that did not
    answer (their ranks are among ``missing``)."""
    if not views:
        return Verdict("no_data", [], [])
    lost_node.mark_vanished(views)
    settle(views)
    replayed = ended_while_hung.applies(views)
    if replayed:
        ended_while_hung.replay(views)
    found = next(
        (v for rule in verdict_rules(unreachable) if (v := rule(views, missing)) is not None), None
    )
    if found is None:
        found = Verdict("healthy", [], [])
    if found.verdict != "cannot_write" and (unwritten := cannot_write.finding(views)) is not None:
        found.findings.append(
            unwritten
        )  # ranks that cannot write, beside the cause another rule names
    if replayed:
        found.findings.append(ended_while_hung.ended_while_hung(views))
    return found


def notes(views: list[RankView], suspects: list[int]) -> list[Finding]:
    """The findings of ``JOB_RULES`` then, rank by rank, of ``RANK_RULES``."""
    out = [f for rule in JOB_RULES for f in rule(views)]
    for v in views:
        out += [f for rule in RANK_RULES if (f := rule(v, suspects)) is not None]
    return out
