"""Everything that runs inside the training process: the monitor and its hooks, the
recorder and its books, the bucket and step clocks, the watchdog, how a rank ends, the
rank's advice checks, its exporter and the state and history writers.

This is the only package that imports torch. Nothing outside it imports it except the
package's face (``ddpmon.attach``), the launcher and the framework integrations
(tests/unit/test_layout.py holds the line); it imports the torch-free leaves below it
(``state``, ``steps``, ``activity``, ``metrics``, ``collectors``, ``advice``, ``config``).
"""
