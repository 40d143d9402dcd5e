"""On PYTHONPATH, arms tests/support/injector.py's fault and clock_shift.py's shifted clock in
every process of a job, then runs the sitecustomize this one stands in front of, if any."""

import importlib.machinery as _machinery
import importlib.util as _util
import os as _os
import sys as _sys

_here = _os.path.dirname(_os.path.abspath(__file__))
_root = _os.path.dirname(_os.path.dirname(_os.path.dirname(_here)))
_sys.path.insert(0, _root)
try:
    from tests.support import clock_shift as _clock_shift
    from tests.support import injector as _injector
finally:
    _sys.path.remove(_root)
_clock_shift.install()
_injector.install()
_rest = [p for p in _sys.path if _os.path.abspath(p or ".") != _here]
_spec = _machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.loader is not None:
    _module = _util.module_from_spec(_spec)
    _sys.modules["sitecustomize"] = _module
    _spec.loader.exec_module(_module)
