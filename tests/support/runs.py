"""Synthetic runs (history stores with a known straggler, and without one) that the report
tests read in-process and as commands."""

from __future__ import annotations

import pytest

from tools import synthetic


@pytest.fixture(scope="module")
def slow_run(tmp_path_factory: pytest.TempPathFactory) -> str:
    d = tmp_path_factory.mktemp("slow")
    synthetic.write_run(str(d), 4, 300, slow_rank=2, slow_seconds=0.03, job="slow")
    return str(d)


@pytest.fixture(scope="module")
def even_run(tmp_path_factory: pytest.TempPathFactory) -> str:
    d = tmp_path_factory.mktemp("even")
    synthetic.write_run(str(d), 4, 300, slow_rank=None, job="even")
    return str(d)
