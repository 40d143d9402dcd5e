"""tests/unit starts no process: a unit test (or one of its fixtures) that tries fails, naming
what it started. Tests that need a process of their own (the CLI as a user runs it, a process
standing in for a rank, a real DDP job, an external program) live in tests/processes,
tests/distributed or tests/integration. Threads (an HTTP server, a watchdog) are fine here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path

import pytest

from tests.support.no_processes import WHERE, refused

UNIT = Path(__file__).resolve().parent
ATTEMPTS = pytest.StashKey[list]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    # pytest calls this hook of a conftest for every test of the session, not only its folder's
    unit = Path(item.path).resolve().is_relative_to(UNIT)
    with refused(item.stash.setdefault(ATTEMPTS, [])) if unit else nullcontext():
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A phase that tried to start a process fails, even when the code under test caught the
    refusal and the test passed."""
    outcome = yield
    report = outcome.get_result()
    attempts = item.stash.get(ATTEMPTS, [])
    if attempts and report.passed:
        report.outcome = "failed"
        report.longrepr = (
            f"a unit test started a process ({'; '.join(attempts)}): move it to {WHERE}"
        )
    if report.when != "teardown":
        attempts.clear()


@pytest.fixture
def group(tmp_path: Path) -> Iterator[None]:
    """A one-rank gloo process group (a FileStore) for a DDP job in the test's own process."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()
