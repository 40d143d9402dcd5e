"""The one rule for whose code a frame runs."""

from __future__ import annotations

import importlib.util
import json
import threading

import ddpmon.rank.watchdog
from ddpmon.frames import is_library, is_library_anywhere


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


def test_a_frame_recorded_anywhere_by_its_path_alone() -> None:
    """Frames from a rank on another host: known by their paths' shape, and ddpmon's own
    modules by their path inside the package, so that a checkout or a project in a directory
    called ddpmon is still the user's code."""
    assert is_library_anywhere("/srv/ddpmon/ddpmon/rank/hooks/collectives.py")  # a checkout
    assert is_library_anywhere("/opt/venv/lib/python3.12/site-packages/ddpmon/activity.py")
    assert is_library_anywhere("/usr/lib/python3.12/threading.py") and is_library_anywhere(
        "<frozen runpy>"
    )
    assert not is_library_anywhere("/srv/ddpmon/tests/scenarios/worker.py")
    assert not is_library_anywhere("/home/me/ddpmon/train.py")
    assert not is_library_anywhere("/home/me/train.py")
