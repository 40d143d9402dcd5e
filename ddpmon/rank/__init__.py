"""Everything that runs inside the training process: the monitor and its hooks, the
recorder and its books, the bucket and step clocks, the watchdog, how a rank ends, the
rank's advice checks, its exporter and the state and history writers.

Of ddpmon's own code only this package, the demo, the framework integrations and
``ddpmon run`` (torchrun's argument parser) import torch. Nothing outside it imports it
except the package's face (``ddpmon.attach``), the launcher, the demo and the integrations
(tests/unit/test_boundaries.py holds the line); it imports the torch-free leaves below it
(``state``, ``steps``, ``activity``, ``metrics``, ``collectors``, ``advice``, ``config``).
"""
