"""transformers.Trainer on a tiny GPT-2 built from a config, under ``ddpmon run`` (tests/thirdparty/jobs.py)."""

from __future__ import annotations

import json
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


# -- transformers.Trainer on a tiny GPT-2 ---------------------------------------------------------


def hf_trainer(tmp_path: Path, steps: int) -> list[str]:
    return [str(HERE / "hf_trainer_tiny.py"), str(tmp_path / "out"), str(steps)]


def test_transformers_trainer_healthy(tmp_path: Path) -> None:
    needs("transformers", "accelerate")
    healthy(tmp_path, *hf_trainer(tmp_path, 40))


def test_transformers_trainer_stalled_optimizer_on_one_rank(tmp_path: Path) -> None:
    """Rank 1's optimizer step never returns from its 11th call: a hang, rank 1, its stack in
    AdamW's step (what the Trainer calls), the other rank waiting in the gradient
    all-reduce."""
    needs("transformers", "accelerate")
    answer, answers = diagnosed(
        tmp_path,
        "hang",
        *hf_trainer(tmp_path, 40),
        inject="stall:1:torch.optim.adamw:AdamW.step:after=10",
    )
    assert (answer["verdict"], answer["suspect_ranks"]) == ("hang", [1]), answer["findings"]
    stuck = finding(answer, "stuck_rank")
    assert "stage optimizer, not in any collective" in stuck["evidence"][0], stuck
    stack = "\n".join(stuck["evidence"])
    assert "transformers/trainer.py" in stack and "injector.py" in stack, stack
    never_blamed_another(answers, 1)


def test_transformers_trainer_extra_barrier_on_one_rank(tmp_path: Path) -> None:
    """Rank 1 issues a barrier of its own before its 11th optimizer step: a desync, rank 1."""
    needs("transformers", "accelerate")
    answer, answers = diagnosed(
        tmp_path,
        "desync",
        *hf_trainer(tmp_path, 40),
        inject="desync:1:torch.optim.adamw:AdamW.step:after=10",
    )
    assert (answer["verdict"], answer["suspect_ranks"]) == ("desync", [1]), answer["findings"]
    assert "injector.py" in json.dumps(answer["findings"]), answer["findings"]  # its call site
    never_blamed_another(answers, 1)
