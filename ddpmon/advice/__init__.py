"""Advice: the silent DDP mistakes that neither hang nor crash, found while the job runs.

Each check is a module of its own and reports findings with a stable ``kind``
(docs/advice.md lists them with their evidence and fix):

==============================  ===============  =============================================
kind                            module           what
==============================  ===============  =============================================
same_data                       data, compare    every rank trains on the same batches
set_epoch_missing               data             DistributedSampler re-iterated without set_epoch
replicas_diverged               replicas,        parameters or buffers differ between ranks
                                compare
inner_module_forward            replicas         a training forward on ``ddp.module``
nonfinite_gradients             nonfinite,       the rank whose own gradients first went
                                compare          NaN/Inf, before the all-reduce
device_mismatch                 devices          device index differs from LOCAL_RANK
shared_gpu                      devices, compare several ranks on one GPU
rank_as_device                  (doctor)         ``invalid device ordinal``: RANK used as device
accumulation_without_no_sync    training         two all-reduces per optimizer step
needless_find_unused_parameters training         find_unused_parameters=True, never needed
static_graph                    training         the graph is static: static_graph=True helps
==============================  ===============  =============================================

The checks run inside the training process (``ddpmon/rank/advice/``; ``watch.Advice`` is
the component the monitor builds). They issue no collective and never synchronise the GPU:
values on a GPU are copied without blocking and read a step later. This package holds what
the ranks and the doctor share, torch-free: the fixes (``words``) and ``compare``, which
compares the ranks' state files.
"""

from .words import FIX

KINDS: tuple[str, ...] = tuple(FIX)
"""Every advice kind, stable: metrics' ``kind`` label and the doctor's findings."""

__all__ = ["KINDS", "FIX"]
