"""The README's promises that scripts rely on stay true."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ddpmon.config import Config
from ddpmon.metrics import catalog

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_readme_lists_every_metric() -> None:
    missing = [m.name for m in catalog.METRICS if f"`{m.name}`" not in README]
    assert missing == []


def test_readme_lists_every_option() -> None:
    missing = [f.name for f in dataclasses.fields(Config) if f"`{f.name}`" not in README]
    assert missing == []


def test_quickstart_shows_the_two_commands() -> None:
    quickstart = README.split("## Quickstart", 1)[1].split("##", 1)[0]
    assert "make demo" in quickstart and "make test" in quickstart
