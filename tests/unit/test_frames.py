"""The one rule for whose code a frame runs."""

from __future__ import annotations

import importlib.util
import json
import threading

import ddpmon.rank.watchdog
from ddpmon.frames import is_library


def test_libraries_are_torch_ddpmon_the_standard_library_and_installed_packages() -> None:
    torch_origin = importlib.util.find_spec("torch").origin
    assert is_library(torch_origin)
    assert is_library(ddpmon.rank.watchdog.__file__)
    assert is_library(threading.__file__) and is_library(json.__file__)
    assert is_library("/opt/venv/lib/python3.11/site-packages/lightning/trainer.py")
    assert is_library("/usr/lib/python3/dist-packages/numpy/core.py")
    assert is_library("<frozen runpy>")


def test_the_users_code_is_not() -> None:
    assert not is_library(__file__)
    assert not is_library("/home/me/train.py")
    assert not is_library("<stdin>")  # an interactive session is the user's own code
