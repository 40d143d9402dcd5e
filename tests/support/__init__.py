"""Helpers the test folders share. A test module imports its helpers from here (or from a
helper module of its own folder), never from another test module.

- states.py: state files as ranks write them, built from the schema's records
- commands.py: ddpmon's commands in a process of their own (the doctor, the daemon)
- harness.py: a real multi-process gloo job, one OS process per rank
- c10d.py: c10d's WorkInfo, made by hand, recorded from a live clock, replayed
- nvml_fake.py: a stand-in NVML driver for the collectors and the daemon
- injector.py (armed by inject_site/sitecustomize.py): a fault in an unmodified script, one
  rank, at a function it names (INJECT_FAULT)
- clock_shift.py (armed the same way): one rank's clock shifted in its process (SHIFT_CLOCK)
- torch_gate_site/sitecustomize.py: holds ``import torch`` in ``ddpmon run`` and its
  torchrun agent until a test opens the gate (TORCH_IMPORT_GATE), to ask during that window
"""
