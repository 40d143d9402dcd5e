"""The node daemon (``ddpmon daemon``): one per node, exporting what a rank cannot say
about itself. A runtime of its own, like the rank wing and the offline readers: it never
imports torch or the rank wing (``tests/unit/test_boundaries.py``)."""

from .node import Daemon

__all__ = ["Daemon"]
