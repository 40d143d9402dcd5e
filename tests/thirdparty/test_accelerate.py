"""Accelerate's own test script of gradient accumulation with and without ``no_sync``
(``accelerate/test_utils/scripts/test_sync.py``), under ``ddpmon run`` (tests/thirdparty/jobs.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.thirdparty.jobs import (
    JOB_TIMEOUT,
    diagnosed,
    healthy,
    needs,
    never_blamed_another,
)

pytestmark = pytest.mark.timeout(JOB_TIMEOUT + 30)


# -- Accelerate's own test script ------------------------------------------------------------------


def accelerate_script(name: str) -> str:
    spec = importlib.util.find_spec("accelerate")
    assert spec is not None and spec.origin is not None
    return str(Path(spec.origin).parent / "test_utils" / "scripts" / name)


def test_accelerate_test_sync_healthy(tmp_path: Path) -> None:
    """Accumulation with and without no_sync, several models, on 2 CPU ranks
    (ACCELERATE_USE_CPU: what ``accelerate launch --cpu`` sets)."""
    needs("accelerate")
    answers = healthy(tmp_path, accelerate_script("test_sync.py"), ACCELERATE_USE_CPU="1")
    assert len(answers) >= 2


def test_accelerate_test_sync_killed_rank(tmp_path: Path) -> None:
    """Rank 1 SIGKILLed in its 3rd optimizer step: a dead rank, rank 1."""
    needs("accelerate")
    answer, answers = diagnosed(
        tmp_path,
        "dead_rank",
        accelerate_script("test_sync.py"),
        inject="kill:1:torch.optim.adamw:AdamW.step:after=2",
        ACCELERATE_USE_CPU="1",
    )
    assert (answer["verdict"], answer["suspect_ranks"]) == ("dead_rank", [1]), answer["findings"]
    never_blamed_another(answers, 1)
