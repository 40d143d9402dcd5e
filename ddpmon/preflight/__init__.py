"""``ddpmon preflight``: a check of the nodes a job is about to use, before it starts.

A job of its own, launched by torchrun with the job's own options (``cli/preflight.py``):
each node checks itself (``checks``), node leaders measure their clock offsets and the links
between them with the job's backend (``node``, the one module here that imports torch), and
``verdict`` names the slow or bad host or link from what they measured (pure, tested alone).
"""
