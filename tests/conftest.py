"""Every state file a test leaves behind must fit the shipped schema; every test gets its own
"now" for the state files it builds (tests/support/states.py); the folders of long real jobs
run first."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddpmon.state import files, schema
from tests.support import states

pytest_plugins = ["tests.support.runs", "tests.support.roots"]  # fixtures shared by several folders


LAST = ("processes", "unit", "gpu")
"""Folders of short tests, run after the others: with a test file per worker at a time
(``make test``), a long file started last would leave the other worker idle meanwhile."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def order(item: pytest.Item) -> int:
        folder = item.path.relative_to(Path(__file__).parent).parts[0]
        return LAST.index(folder) + 1 if folder in LAST else 0

    items.sort(key=order)  # stable: each folder keeps its own order


@pytest.fixture(autouse=True)
def state_clock() -> None:
    """Files built with tests/support/states.py are written as of this test's start (minus
    their age), whatever ran before it and for how long."""
    states.restart_clock()


@pytest.fixture(autouse=True)
def state_files_fit_the_schema(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """After a test that ran a real job, validate the rank files it wrote (in its tmp_path)
    with JSON Schema and with the readers' own parser. Tests that plant bad files on
    purpose say so with ``@pytest.mark.bad_state_files``."""
    wanted = "tmp_path" in request.fixturenames and not request.node.get_closest_marker(
        "bad_state_files"
    )
    root = Path(request.getfixturevalue("tmp_path")) if wanted else None
    yield
    if root is None:
        return
    paths = [
        p
        for p in root.rglob("rank-*.json")
        if p.is_file() and not p.is_symlink() and files.NAME_PATTERN.match(p.name)
    ]
    if not paths:
        return
    import jsonschema

    validator = jsonschema.Draft202012Validator(schema.generated_schema())
    for path in paths:
        data = json.loads(path.read_text())
        if data.get("format") != schema.FORMAT:
            continue  # a test's own older or hand-made file
        errors = sorted(validator.iter_errors(data), key=lambda e: list(e.path))
        assert not errors, (
            f"{path} does not fit the state schema: {errors[0].message} at {list(errors[0].path)}"
        )
        files.read(str(path))
