"""The bucket-timing decision, every combination of its inputs against the rules in words."""

from __future__ import annotations

import itertools

import pytest

from ddpmon.config import BUCKET_TIMING_MODES
from ddpmon.rank.timing.policy import ERROR, RULES, plan

BOOLS = (True, False)


def expected(option: str, c10d: bool, user: bool, earlier: bool) -> tuple[str, str]:
    """(source, comm hook), as the README states the rules."""
    if option == "c10d" and not c10d:
        return ERROR, "none"  # asked for c10d where there is none: an error that says why
    if earlier:  # DDP still holds ddpmon's hook: it serves this monitor, timing unless off
        return ("off" if option == "off" else "hook"), "rebind"
    if option == "off":
        return "off", "user" if user else "none"
    if option == "hook":
        return "hook", "install"
    if option == "flight_recorder":  # only when asked for; tried anywhere: its self-check says
        return "flight_recorder", "user" if user else "none"  # what is missing
    if c10d:  # auto or c10d where NCCL's timing exists: nothing of ddpmon's on the all-reduce
        return "c10d", "user" if user else "none"
    # auto without c10d: a Python hook only when the user's runs in Python anyway
    return ("hook", "install") if user else ("off", "none")


COMBINATIONS = list(itertools.product(BUCKET_TIMING_MODES, BOOLS, BOOLS, BOOLS))


@pytest.mark.parametrize("option,c10d,user,earlier", COMBINATIONS)
def test_every_combination(option: str, c10d: bool, user: bool, earlier: bool) -> None:
    chosen = plan(option, c10d, user, earlier)
    assert (chosen.source, chosen.comm_hook) == expected(option, c10d, user, earlier)
    assert chosen.time_later_hook == (
        option == "auto" and chosen.source == "off" and chosen.comm_hook == "none"
    )
    assert chosen.mark_untimed == (chosen.source == "off" and not c10d)
    assert chosen.read_layout == (
        chosen.source in ("c10d", "flight_recorder") or chosen.mark_untimed
    )


def test_every_rule_is_reachable() -> None:
    """No row of the table is shadowed by the rows above it."""
    used = set()
    for key in COMBINATIONS:
        for i, (*pattern, _source, _hook) in enumerate(RULES):
            if all(p is None or p == k for p, k in zip(pattern, key)):
                used.add(i)
                break
    assert used == set(range(len(RULES)))


def test_an_unknown_option_is_an_error() -> None:
    with pytest.raises(ValueError):
        plan("sometimes", True, False, False)
