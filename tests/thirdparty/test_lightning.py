"""Lightning's demo BoringModel under its DDP strategy, under ``ddpmon run`` (tests/thirdparty/jobs.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.thirdparty.jobs import (
    HERE,
    JOB_TIMEOUT,
    diagnosed,
    finding,
    healthy,
    needs,
    never_blamed_another,
)

pytestmark = pytest.mark.timeout(JOB_TIMEOUT + 30)


# -- Lightning: its demo BoringModel, its DDP strategy ------------------------------------------


LIGHTNING = str(HERE / "lightning_boring.py")


def test_lightning_boring_model_healthy(tmp_path: Path) -> None:
    needs("lightning")
    healthy(tmp_path, LIGHTNING, "40")


def test_lightning_slow_optimizer_on_one_rank(tmp_path: Path) -> None:
    """Rank 1's SGD.step takes 100 ms more, before it calls Lightning's closure (forward and
    backward run inside the optimizer's step): a straggler, rank 1, in the optimizer (it
    was once called data wait, sending the user to the data loader). 150 steps: over the
    12 s a straggler's gap must last, in a job that ended too."""
    needs("lightning")
    answer, answers = diagnosed(
        tmp_path,
        "straggler",
        LIGHTNING,
        "150",
        inject="slow:1:torch.optim.sgd:SGD.step:seconds=0.1",
        until_end=True,
    )
    assert (answer["verdict"], answer["suspect_ranks"]) == ("straggler", [1]), answer["findings"]
    summary = finding(answer, "straggler")["summary"]
    assert "in optimizer" in summary and "data wait" not in summary, summary
    never_blamed_another(answers, 1)
