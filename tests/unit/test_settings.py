"""Live settings without processes: the values ``ddpmon set`` takes (``config.live_value``)
and the request file as hostile input (``state/settings.py``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ddpmon.config import LIVE_OPTIONS, live_value
from ddpmon.errors import ConfigError, StateFileError
from ddpmon.state import settings


@pytest.mark.parametrize(
    ("name", "text", "value"),
    [
        ("hang_timeout", "600", 600.0),
        ("hang_timeout", " 0 ", 0.0),
        ("hang_timeout", "auto", None),
        ("bucket_timing", "off", "off"),
        ("bucket_timing", "HOOK", "hook"),
        ("bucket_timing", "0", "off"),
    ],
)
def test_live_values(name: str, text: str, value: object) -> None:
    assert live_value(name, text) == value


@pytest.mark.parametrize(
    ("name", "text", "said"),
    [
        ("hang_timeout", "-1", "expected seconds >= 0 (0 = off), or auto"),
        ("hang_timeout", "nan", "expected seconds >= 0 (0 = off), or auto"),
        ("hang_timeout", "soon", "expected seconds >= 0 (0 = off), or auto"),
        ("bucket_timing", "c10d", "expected off, or hook where ddpmon's comm hook times"),
        ("port", "9600", "port is fixed at attach: restart the job with DDPMON_PORT"),
        ("hang_timout", "5", "one of the options that can change live: hang_timeout, bucket"),
    ],
)
def test_refusals_name_what_is_accepted(name: str, text: str, said: str) -> None:
    with pytest.raises(ConfigError) as caught:
        live_value(name, text)
    assert said in str(caught.value)
    assert str(caught.value).startswith(f"{name}={text.strip()!r} is not valid")


def test_every_live_option_is_described() -> None:
    from ddpmon.config import LIVE_VALUES

    assert set(LIVE_VALUES) == set(LIVE_OPTIONS)


def good(tmp_path: Path) -> settings.Request:
    return settings.Request("ab" * 8, 1, "job", 42, 1000.0, {"hang_timeout": "60"}, 1.0, 2.0)


def test_request_round_trip(tmp_path: Path) -> None:
    path = settings.write_request(str(tmp_path), good(tmp_path))
    assert settings.read_request(path, owner=os.geteuid()) == good(tmp_path)


def test_request_of_another_user_is_refused(tmp_path: Path) -> None:
    path = settings.write_request(str(tmp_path), good(tmp_path))
    with pytest.raises(StateFileError, match=r"belongs to uid \d+, not to the rank's user"):
        settings.read_request(path, owner=os.geteuid() + 1)


def test_request_through_a_link_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "real.request"
    target.write_text(json.dumps(good(tmp_path).to_json()))
    link = settings.request_path(str(tmp_path), 1)
    os.symlink(target, link)
    with pytest.raises(StateFileError, match="symbolic link"):
        settings.read_request(link, owner=os.geteuid())


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"changes": {}}, "has 0 changes"),
        ({"changes": {"../x": "1"}}, "expected option=text pairs"),
        ({"changes": {"hang_timeout": 5}}, "expected option=text pairs"),
        ({"nonce": "../../x"}, "expected 8 to 32 hex digits"),
        ({"pid": "42"}, "has pid='42'; expected int"),
        ({"kind": "ddpmon-capture-request"}, "is not a ddpmon settings file"),
    ],
)
def test_bad_requests_say_what_is_wrong(tmp_path: Path, change: dict, said: str) -> None:
    path = tmp_path / "set-1.request"
    path.write_text(json.dumps({**good(tmp_path).to_json(), **change}))
    with pytest.raises(StateFileError) as caught:
        settings.read_request(str(path))
    assert said in caught.value.reason


def test_prune_keeps_the_newest_answers_of_one_rank(tmp_path: Path) -> None:
    for i in range(6):
        status = settings.Status(f"{i:016x}", 1, written_unix=float(i))
        path = settings.write_status(str(tmp_path), status)
        os.utime(path, (1000 + i, 1000 + i))
    other = settings.write_status(str(tmp_path), settings.Status("f" * 16, 2))
    settings.prune(str(tmp_path), 1, keep=2)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [f"set-1-{4:016x}.status", f"set-1-{5:016x}.status", os.path.basename(other)]


def test_metrics_detail_changes_live() -> None:
    assert live_value("metrics_detail", " Summary ") == "summary"
    with pytest.raises(ConfigError, match="expected auto or full or summary"):
        live_value("metrics_detail", "terse")
