"""The test folders say what their tests need: a unit test starts no process (the guard in
tests/unit/conftest.py), and no test module imports another (shared helpers live in
tests/support)."""

from __future__ import annotations

import ast
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.no_processes import ProcessStarted
from tests.unit.conftest import ATTEMPTS

TESTS = Path(__file__).resolve().parents[1]


def test_a_unit_test_cannot_start_a_process(request: pytest.FixtureRequest) -> None:
    starts = {
        "subprocess.run": lambda: subprocess.run([sys.executable, "-c", "pass"], check=False),
        "os.popen": lambda: os.popen("true").read(),
        "os.system": lambda: os.system("true"),
        "os.fork": os.fork,
        "multiprocessing": lambda: (
            multiprocessing.get_context("spawn").Process(target=print).start()
        ),
    }
    for _what, start in starts.items():
        with pytest.raises(ProcessStarted, match="move it to tests/processes"):
            start()
    attempts = request.node.stash[ATTEMPTS]
    assert len(attempts) == len(starts), attempts
    attempts.clear()  # refused on purpose: this test passes


def _imported_modules(path: Path) -> list[str]:
    package = ".".join(path.relative_to(TESTS.parent).parent.parts)
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1]
                    + ([base] if base else [])
                )
            names += [base] + [f"{base}.{a.name}" for a in node.names]
    return names


def test_no_test_module_imports_another() -> None:
    offenders = [
        f"{path.relative_to(TESTS.parent)} imports {name}"
        for path in sorted(TESTS.rglob("*.py"))
        for name in _imported_modules(path)
        if name.startswith("tests.") and name.rpartition(".")[2].startswith("test_")
    ]
    assert not offenders, "put shared helpers in tests/support: " + "; ".join(offenders)
