"""The advice component of a monitor: builds the checks, hears of step boundaries, records
each finding once (state file, log line, ``ddpmon_advice`` gauge) and removes it all at detach.

What it hears and hooks: the start and end of each training forward of the DDP module, from
the step hooks' own hooks (input fingerprint; whether a forward is DDP's); a forward
pre-hook on the inner module (parameter fingerprint, a training forward that bypasses DDP),
on the checked steps alone (``cadence.py``: a hook there puts every call of the inner module
on torch's slower path); a hook on each parameter's gradient (NaN/Inf, sampled), torch's
global optimizer step pre-hook, and wrappers of ``DataLoader.__iter__`` and
``DistributedSampler.__iter__``. Between the checked steps the training thread's calls
return at once: nothing is due until the step before the next checked one (``_quiet_until``,
``_next_check``). A thread compares this rank's fingerprints with its peers' state files
when they share the state directory (no collective). A failure switches advice off, never
training.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...advice import compare
from ...advice.words import FIX
from ...fuses import Fuse
from ...state import files, schema
from ...state.schema import Advice as Finding
from .. import transparent
from ..hooks.step import is_compiling
from ..recorder import Recorder
from . import cadence, data, devices, nonfinite, replicas
from .nonfinite import NonFiniteWatch
from .training import OptimizerSteps, StaticGraph

log = logging.getLogger("ddpmon")

PEER_INTERVAL = 2.0
"""Seconds between comparisons with the peers' state files (at most; twice the state file's
interval when that is shorter, at least half a second)."""
MAX_PEERS = 8
"""Peers each rank compares with: the next ranks, cyclically (mostly its own node's, where a
shared GPU shows). A job of thousands of ranks sharing one state directory must not have
every rank read every file; ``ddpmon doctor`` compares them all."""
MICRO_FALLBACK_STEPS = 10
"""Steps without a torch optimizer step after which micro-batches are counted per step of
ddpmon's (a job whose optimizer torch's global hook does not see)."""
CHECKED_FROM_EVERY_STEP_UNTIL = max(data.EVERY_STEP_UNTIL, nonfinite.EVERY_STEP_UNTIL)
"""The sampled checks' steps in one cadence (``cadence.py``): the batch and the gradient
checks, and the parameters' fingerprints, whose steps are among the batch checks'."""
CROSS_RANK = ("same_data", "replicas_diverged", "nonfinite_gradients", "shared_gpu")


class Advice:
    """Watches one DDP model for silent mistakes (ddpmon/advice/__init__.py lists them)."""

    def __init__(
        self,
        ddp: torch.nn.Module,
        recorder: Recorder,
        parameters: Sequence[tuple[str, torch.nn.Parameter]],
        state_dir: str | None,
        notify: Callable[[], None],
        fuse: Fuse,
    ) -> None:
        self._ddp = ddp
        self._rec = recorder
        self._notify = notify
        self._fuse = fuse
        self._rank = int(recorder.identity.rank)
        self._inner: Any = None  # the inner module's pre-hook, on checked steps
        self._removed = False
        self._in_ddp_forward = False
        self._summary_logged = False
        self._micro: int | None = None
        self._stop = threading.Event()
        self._peers: threading.Thread | None = None
        self._nonfinite: NonFiniteWatch | None = None
        self._optimizer: OptimizerSteps | None = None
        self._watching_data = False
        self._quiet_until = 0  # ``step_ended`` has nothing to do before this many steps
        self._next_check = 1  # the next step whose first forward the checks look at
        self.comparisons = 0  # with the peers' files, so far
        self.on_peers: Callable[[list[schema.RankState]], None] | None = None
        """Hears every reading of the peers' files, this rank's own state first (the stack
        sampler's suspicion: ``rank/stack_samples.py``)."""
        try:
            self._install(ddp, parameters, state_dir)
        except Exception as exc:  # advice is off then; attach and training go on
            self._fail(exc)

    def _install(
        self,
        ddp: torch.nn.Module,
        parameters: Sequence[tuple[str, torch.nn.Parameter]],
        state_dir: str | None,
    ) -> None:
        self._batches = data.BatchPrints()
        self._epochs = data.EpochWatch()
        self._sampler: tuple[str, bool | None, int | None] | None = None
        self._params = replicas.ParamPrints(ddp.module)  # type: ignore[arg-type]
        self._nonfinite = NonFiniteWatch(parameters)
        # find_unused_parameters: the static-graph and needless-search checks see each step
        self._every_step = bool(getattr(ddp, "find_unused_parameters", False))
        self._static = (
            StaticGraph() if self._every_step and not getattr(ddp, "static_graph", False) else None
        )
        self._optimizer = OptimizerSteps(
            self._synced_backwards, lambda: self._rec.backward_passes, self._accumulating
        )
        self._watch_inner(True)  # (step 1 is checked)
        transparent.install(ddp.module)  # copies of the inner module leave its hook out
        data.watch(self._loader_iterated, self._epoch_drawn)
        self._watching_data = True
        self._check_devices()
        if state_dir:
            self._peers = threading.Thread(
                target=self._compare_peers, args=(state_dir,), name="ddpmon-advice", daemon=True
            )
            self._peers.start()

    # -- findings -----------------------------------------------------------------------------

    def record(
        self,
        kind: str,
        summary: str,
        evidence: Sequence[str] = (),
        *,
        severity: str = "warning",
        step: int | None = None,
        ranks: Sequence[int] = (),
        fix: str | None = None,
        quiet: bool = False,
    ) -> None:
        """Keep a finding (each kind once) and say it once in the log."""
        if any(a.kind == kind for a in self._rec.advice):
            return
        finding = Finding(
            kind,
            severity,
            summary,
            list(evidence),
            FIX.get(kind, "") if fix is None else fix,
            self._rec.steps if step is None else step,
            time.time(),
            list(ranks) or [self._rank],
        )
        self._rec.advice.append(finding)
        if not quiet:
            log.warning("ddpmon: rank %d: %s [%s]. Fix: %s", self._rank, summary, kind, finding.fix)
        self._notify()

    # -- the training thread ----------------------------------------------------------------------

    def step_ended(self, steps: int) -> None:
        """At a step boundary: ``steps`` steps are done."""
        if steps < self._quiet_until or self._removed or not self._fuse.ok:
            return  # (most steps)
        try:
            changed = self._batches.collect() | self._params.collect()
            if self._micro is None and (micro := self._micro_batches(steps)) is not None:
                self._micro = micro
                changed = True
            if self._nonfinite.step_ended(steps):  # type: ignore[union-attr]
                step, name = self._nonfinite.first  # type: ignore[misc, union-attr]
                self.record(
                    "nonfinite_gradients",
                    f"this rank's own gradients were not finite in step {step} before the "
                    f"all-reduce, first in {name} (the origin, unless another rank's came earlier)",
                    [f"step {step}: isfinite(grad) false for {name}"],
                    step=step,
                )
                changed = True
            if (
                changed
                or self._nonfinite.checked_step != self._rec.fingerprints.nonfinite_checked_step  # type: ignore[union-attr]
            ):
                self._publish()
            if (
                not self._summary_logged
                and self._micro is not None
                and self._batches.batch_size is not None
            ):
                self._summarise()
            rec = self._rec
            if self._static is not None and self._static.step_ended(rec.unused_parameters):
                shown = ", ".join(rec.unused_parameters[:5])
                self.record(
                    "static_graph",
                    f"the same {len(rec.unused_parameters)} parameter(s) were unused in each of the last "
                    f"steps ({shown}): the graph is static",
                    severity="info",
                )
            if "find_unused_parameters" in rec.notes:
                self.record(
                    "needless_find_unused_parameters",
                    rec.notes["find_unused_parameters"],
                    severity="info",
                    quiet=True,
                )  # (hooks/autograd.py logged it)
            self._quiet_until = self._nothing_due_before(steps)
        except Exception as exc:
            self._fail(exc)

    def _nothing_due_before(self, steps: int) -> int:
        """The step count before which ``step_ended`` has nothing to do: none of the checks'
        values is on its way, the micro-batches are counted, no check looks at every step,
        and the next checked step's gradient hooks are armed at the step before it."""
        if (
            self._micro is None
            or self._every_step
            or self._batches.waiting
            or self._params.waiting
            or not self._nonfinite.idle  # type: ignore[union-attr]
        ):
            return 0
        return cadence.next_due(steps, CHECKED_FROM_EVERY_STEP_UNTIL) - 1

    def ddp_forward_started(self, args: Any, kwargs: Any) -> None:
        """A training forward of the DDP module starts (from the step hooks' pre-hook, past
        the step that ended there; not while torch.compile traces)."""
        if self._removed or not self._fuse.ok:
            return
        try:
            step = self._rec.steps + 1
            if step < self._next_check and self._inner is None:
                return  # (most forwards)
            checked = data.checked(step)
            if checked != (self._inner is not None):
                self._watch_inner(checked)
            if not checked:
                self._next_check = cadence.next_due(step, data.EVERY_STEP_UNTIL)
                return
            self._in_ddp_forward = True
            if self._batches.due(step):
                x = data.first_tensor(args, kwargs)
                if x is not None:
                    self._batches.take(step, x)
        except Exception as exc:
            self._fail(exc)

    def ddp_forward_ended(self) -> None:
        """The DDP module's forward returned or raised (from the step hooks' forward hook)."""
        self._in_ddp_forward = False

    def _watch_inner(self, on: bool) -> None:
        """The inner module's pre-hook on (a checked step: the parameters' fingerprint is
        due, and a training forward that bypasses DDP is named) or off. A loop that always
        bypasses DDP is named at its first forward, one that does now and then on its next
        checked step."""
        if on:
            if self._inner is None and not self._removed:
                self._inner = self._ddp.module.register_forward_pre_hook(  # type: ignore[union-attr]
                    self._before_inner_forward
                )
        elif self._inner is not None:
            self._inner.remove()
            self._inner = None

    def _before_inner_forward(self, module: torch.nn.Module, _args: Any) -> None:
        if not self._fuse.ok or not torch.is_grad_enabled() or is_compiling():
            return
        try:
            step = self._rec.steps + 1  # the step in progress
            if self._in_ddp_forward:
                if replicas.due(step):
                    self._params.take(step)
            elif module.training:
                site = replicas.call_site()
                self.record(
                    "inner_module_forward",
                    f"a training forward on the inner module (ddp.module) at {site}: its gradients "
                    "are not all-reduced, so this rank's replica drifts from the others",
                    [f"called at {site}, step {step}, with gradients enabled"],
                    step=step,
                )
        except Exception as exc:
            self._fail(exc)

    def _micro_batches(self, steps: int) -> int | None:
        """Backward passes per optimizer step (gradient accumulation): between the first two
        optimizer steps; for a job that steps no torch optimizer in its first
        ``MICRO_FALLBACK_STEPS`` steps, per step of ddpmon's."""
        optimizer = self._optimizer
        if optimizer is not None and optimizer.micro_batches is not None:
            return optimizer.micro_batches
        if steps >= MICRO_FALLBACK_STEPS and (optimizer is None or optimizer.seen == 0):
            return max(1, round(self._rec.micro_steps / steps))
        return None

    def _synced_backwards(self) -> int:
        rec = self._rec
        return rec.steps + (1 if rec.step_has_synced else 0)

    def _accumulating(self, per_step: int, synced: int) -> None:
        self.record(
            "accumulation_without_no_sync",
            f"{per_step} gradient all-reduces per optimizer step in each of the last steps: "
            "gradient accumulation without no_sync() all-reduces every micro-batch",
            [f"{synced} synchronised backwards so far; {per_step} in the last optimizer step"],
            step=self._rec.steps + 1,  # found at the optimizer step of the step in progress
        )

    # -- data ----------------------------------------------------------------------------------------

    def _loader_iterated(self, loader: Any) -> None:
        try:
            sampler = data.sampler_of(loader)
            name = type(sampler).__name__ if sampler is not None else None
            shuffle = getattr(sampler, "shuffle", None) if sampler is not None else None
            if name in ("RandomSampler",):
                shuffle = True
            elif name == "SequentialSampler":
                shuffle = False
            self._sampler = (name or "?", shuffle, getattr(loader, "batch_size", None))
            self._publish()
        except Exception as exc:
            self._fail(exc)

    def _epoch_drawn(self, sampler: Any, epoch: int) -> None:
        if self._removed or not self._fuse.ok:
            return
        try:
            if self._epochs.drawn(sampler, epoch) is not None:
                self.record(
                    "set_epoch_missing",
                    f"a shuffling DistributedSampler draws epoch {epoch}'s order again: "
                    "set_epoch() was not called, so every epoch sees the same order",
                    [
                        f"DistributedSampler(num_replicas={getattr(sampler, 'num_replicas', '?')}, "
                        f"rank={getattr(sampler, 'rank', '?')}, shuffle=True, seed={getattr(sampler, 'seed', '?')}) "
                        f"drew epoch {epoch} twice (a peek before the loop does not count)"
                    ],
                    step=self._rec.steps + 1,  # drawn for the step in progress
                )
        except Exception as exc:
            self._fail(exc)

    def _summarise(self) -> None:
        self._summary_logged = True
        self._publish()
        info = self._rec.data_info
        if self._rank == 0:
            ident = self._rec.identity
            sampler = f", sampler {info.sampler}" if info.sampler else ""
            micro = (
                f" x {info.micro_batches} micro-batches"
                if info.micro_batches and info.micro_batches > 1
                else ""
            )
            log.warning(
                "ddpmon: job: world size %s, backend %s, per-rank batch %s%s, global batch %s "
                "per optimizer step%s",
                ident.ddp_world_size,
                ident.backend,
                info.batch_size,
                micro,
                info.global_batch_size,
                sampler,
            )

    # -- devices ---------------------------------------------------------------------------------

    def _check_devices(self) -> None:
        device = str(self._rec.identity.device or "cpu")
        cuda = device.startswith("cuda") and torch.cuda.is_available()
        local = os.environ.get("LOCAL_RANK")
        facts = devices.DeviceFacts(
            device,
            self._rank,
            int(local) if local and local.isdigit() else None,
            torch.cuda.device_count() if cuda else 0,
            torch.cuda.current_device() if cuda else None,
        )
        found = devices.check(facts)
        if found:
            self.record(found.kind, found.summary, found.evidence, fix=found.fix, step=0)
        self._uuid = devices.gpu_uuid(device) if cuda else None
        self._current = facts.current_device
        self._publish()

    # -- publication -----------------------------------------------------------------------------

    def _publish(self) -> None:
        rec = self._rec
        batch = self._batches.batch_size
        world = int(rec.identity.ddp_world_size or rec.world_size)
        name, shuffle, _ = self._sampler or (None, None, None)
        micro = self._micro
        rec.data_info = schema.DataInfo(
            sampler=name,
            shuffle=shuffle,
            batch_size=batch,
            micro_batches=micro,
            global_batch_size=batch * micro * world if batch and micro else None,
            gpu_uuid=getattr(self, "_uuid", None),
            cuda_current_device=getattr(self, "_current", None),
        )
        first = self._nonfinite.first  # type: ignore[union-attr]
        rec.fingerprints = schema.Fingerprints(
            batch=[list(p) for p in self._batches.prints],
            params=[
                schema.ParamPrint(step, digest, list(per))
                for step, digest, per in self._params.prints
            ],
            names=list(self._params.names),
            nonfinite=schema.NonFinite(first[0], first[1], time.time()) if first else None,
            nonfinite_checked_step=self._nonfinite.checked_step,  # type: ignore[union-attr]
        )

    # -- peers ----------------------------------------------------------------------------------

    def _compare_peers(self, state_dir: str) -> None:
        """Compare with the other ranks' state files in a shared directory, every few seconds."""
        job = self._rec.identity.job
        interval = min(PEER_INTERVAL, max(0.5, 2 * float(self._rec.identity.state_interval or 1.0)))
        while not self._stop.wait(interval):
            try:
                self.compare_now(state_dir, job)
            except Exception as exc:
                log.debug("ddpmon: advice: comparing with peers failed: %r", exc)

    def compare_now(self, state_dir: str, job: Any) -> None:
        states = [self._rec.recent_state(PEER_INTERVAL)]  # the state file's, when recent
        world = int(self._rec.identity.world_size or 1)
        for peer_rank in sorted(
            {(self._rank + i) % world for i in range(1, MAX_PEERS + 1)} - {self._rank}
        ):
            try:
                peer = files.read(files.path_for(state_dir, peer_rank))
            except Exception:
                continue  # not written yet, gone, or not ddpmon's
            if peer.job == job:
                states.append(peer)
        if self.on_peers is not None:
            self.on_peers(states)
        for found in compare.compare(states):
            if self._rank in found.ranks:
                self.record(
                    found.kind,
                    found.summary,
                    found.evidence,
                    step=found.step,
                    ranks=found.ranks,
                    fix=found.fix,
                    severity=found.severity,
                )
        self.comparisons += 1

    # -- the end -----------------------------------------------------------------------------------

    def _fail(self, exc: BaseException) -> None:
        self._fuse.blow(exc)
        self.remove()

    def remove(self) -> None:
        if self._removed:
            return
        self._removed = True
        self._stop.set()
        self._watch_inner(False)
        if self._nonfinite is not None:
            self._nonfinite.remove()
        if self._optimizer is not None:
            self._optimizer.remove()
        if self._watching_data:
            data.unwatch(self._loader_iterated, self._epoch_drawn)
        transparent.remove(self._ddp.module)
        if self._peers is not None and self._peers is not threading.current_thread():
            self._peers.join(timeout=2.0)
