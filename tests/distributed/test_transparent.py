"""Attaching changes nothing the user's code can do with the model: a real 2-rank job does
each thing to a plain DDP model and to a watched twin, and the outcomes must be the same."""

from __future__ import annotations

import pytest
import torch

from tests.support.harness import run_ranks
from tests.support.torch_features import COMPILE_CHECK

CHECKS = (
    "pickle",
    "deepcopy",
    "deepcopy_find_unused",
    "torch_save",
    "torch_save_find_unused",
    "state_dict",
    "no_sync",
    "join",
    "static_graph",
    "comm_hook_after_attach",
    "detach",
    "compile",
)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    workdir = tmp_path_factory.mktemp("transparent")
    results = run_ranks(
        ",".join(CHECKS),
        2,
        workdir,
        timeout=200,
        env={"DDPMON_STATE_DIR": ""},
        module="tests.distributed.transparent_worker",
    )
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
        assert "Traceback" not in r.stderr, r.stderr[-3000:]  # the normal exit ran clean
    return {name: [r.result[name] for r in results] for name in CHECKS}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("check", CHECKS)
def test_same_as_without_ddpmon(outcomes: dict[str, list[dict]], check: str) -> None:
    if check == "compile" and not COMPILE_CHECK:
        pytest.skip(
            f"torch {torch.__version__} has no torch.compiler.is_compiling: compiled models are not watched"
        )
    for rank, result in enumerate(outcomes[check]):
        assert "ok" in result["plain"], (
            f"rank {rank}: the plain model itself failed: {result['plain']}"
        )
        assert result["watched"] == result["plain"], (
            f"rank {rank}: {check} differs with ddpmon attached"
        )


@pytest.mark.timeout(300)
def test_copies_carry_no_ddpmon(outcomes: dict[str, list[dict]]) -> None:
    for check in (
        "pickle",
        "deepcopy",
        "deepcopy_find_unused",
        "torch_save",
        "torch_save_find_unused",
    ):
        for result in outcomes[check]:
            assert result["watched"]["ok"]["clean"] is True, check


@pytest.mark.timeout(300)
def test_the_watched_twin_was_watched(outcomes: dict[str, list[dict]]) -> None:
    """The comparisons mean something only if ddpmon saw the watched model's steps."""
    assert all(r["steps"] >= 2 for r in outcomes["static_graph"])
    assert all(r["steps"] >= 1 for r in outcomes["comm_hook_after_attach"])
