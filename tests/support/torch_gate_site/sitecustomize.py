"""On PYTHONPATH with TORCH_IMPORT_GATE=DIR: ``import torch`` in ``python -m ddpmon`` (the
command line) waits until ``DIR/ddpmon`` exists, and in ``python -m ddpmon.agent`` until
``DIR/ddpmon.agent`` does (at most a minute; ``DIR/NAME.waiting`` says it waits), so that a test holds a launcher in the seconds
torch takes to load on a busy machine and asks the doctor then. Other processes (the ranks)
are not touched. Then runs the sitecustomize this one stands in front of, if any."""

import importlib.machinery as _machinery
import importlib.util as _util
import os as _os
import sys as _sys
import time as _time

_here = _os.path.dirname(_os.path.abspath(__file__))


class _Gate:
    def __init__(self, path: str) -> None:
        self.path = path

    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            _sys.meta_path.remove(self)
            open(self.path + ".waiting", "w").close()
            deadline = _time.monotonic() + 60
            while not _os.path.exists(self.path) and _time.monotonic() < deadline:
                _time.sleep(0.05)
        return None


_gate = _os.environ.get("TORCH_IMPORT_GATE")
_argv = getattr(_sys, "orig_argv", [])
if _gate and len(_argv) > 2 and _argv[1] == "-m" and _argv[2] in ("ddpmon", "ddpmon.agent"):
    _sys.meta_path.insert(0, _Gate(_os.path.join(_gate, _argv[2])))
_rest = [p for p in _sys.path if _os.path.abspath(p or ".") != _here]
_spec = _machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.loader is not None:
    _module = _util.module_from_spec(_spec)
    _sys.modules["sitecustomize"] = _module
    _spec.loader.exec_module(_module)
