"""One rank of a job that pauses between steps in every way a training script does:
``python -m tests.distributed.transition_worker SECONDS [POST_LOOP_SECONDS]``.

Same environment as ``worker.py`` (RANK, WORLD_SIZE, DDPMON_TEST_STORE, DDPMON_TEST_OUT,
DDPMON_STATE_DIR). The job trains a small DDP MLP with ddpmon attached (hang timeout 2 s,
so 10 s busy is its limit), then, each pause ``SECONDS`` long and marked
``mark-<rank>-<phase>`` in DDPMON_TEST_OUT as it begins:

``evaluation``  every rank evaluates the inner module under ``no_grad`` (no DDP forward,
                no heartbeat);
``checkpoint``  rank 0 serialises and writes a checkpoint while the others wait in a
                barrier;
``rank0_eval``  rank 0 evaluates through the DDP model under ``no_grad`` (its forwards
                are heartbeats, no step) while the others wait in a barrier;
``post_loop``   after a few more steps, every rank works after the loop
                (``POST_LOOP_SECONDS``, by default ``SECONDS``), then the final barrier.
                With DDPMON_TEST_STARVE=CPU, each rank first moves to that CPU at the
                lowest priority (its autogroup's nice 19), where the test runs a CPU hog:
                runnable, hardly ever scheduled; after the work it takes its priority
                back (with the privilege to; else it leaves with ``os._exit(0)`` after the
                final barrier: its teardown at the lowest priority can take a minute).
"""

from __future__ import annotations

import io
import os
import sys
import time

import torch
import torch.distributed as dist

from tests.distributed import hang_worker as hw
from tests.distributed.worker import batch


def mark(phase: str) -> None:
    open(os.path.join(hw.OUT, f"mark-{hw.RANK}-{phase}"), "w").close()


def work(seconds: float) -> None:
    """Python work inside one line: the main thread's stack looks still."""
    end = time.time() + seconds
    while time.time() < end:
        sum(i * i for i in range(20000))


def evaluate(model: torch.nn.Module, seconds: float) -> None:
    end = time.time() + seconds
    with torch.no_grad():
        while time.time() < end:
            model(torch.randn(64, 32))


def save_checkpoint(model: torch.nn.Module, seconds: float) -> None:
    end = time.time() + seconds
    while time.time() < end:
        buffer = io.BytesIO()
        torch.save(model.state_dict(), buffer)
        with open(os.path.join(hw.OUT, "checkpoint.pt"), "wb") as f:
            f.write(buffer.getvalue())
        work(0.05)


def starve(cpu: int) -> set[int]:
    """This rank on ``cpu`` at the lowest priority beside the test's hog; the CPUs it had."""
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    set_priority(19)
    return cpus


def set_priority(nice: int) -> bool:
    """This process's and its autogroup's nice value (the scheduler weighs autogroups, not
    processes); raising it back needs privileges. True when both were set."""
    done = True
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:
        done = not os.path.exists("/proc/self/autogroup")
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError:
        done = False
    return done


def main(seconds: float, post_loop: float) -> None:
    ddp, _mon, opt = hw.setup("transitions")
    for step in range(5):
        hw.train_step(ddp, opt, *batch(step))
    mark("evaluation")
    evaluate(ddp.module, seconds)
    mark("checkpoint")
    if hw.RANK == 0:
        save_checkpoint(ddp.module, seconds)
    dist.barrier()
    mark("rank0_eval")
    if hw.RANK == 0:
        evaluate(ddp, seconds)
    dist.barrier()
    for step in range(5, 10):
        hw.train_step(ddp, opt, *batch(step))
    mark("post_loop")
    starved = os.environ.get("DDPMON_TEST_STARVE")
    cpus = starve(int(starved)) if starved else set()
    work(post_loop)
    restored = not starved or set_priority(0)
    if starved:
        os.sched_setaffinity(0, cpus)
    mark("done")
    dist.barrier()
    if not restored:  # its teardown at the lowest priority can take a minute on a busy machine
        os._exit(0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(float(sys.argv[1]), float(sys.argv[-1]))
