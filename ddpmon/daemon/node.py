"""The node daemon: one per node, exporting what a rank cannot say about itself.

It exports every GPU of the node under the ranks' metric names (job and rank labels from
the rank whose process uses the GPU), the processes on each GPU mapped to ranks by pid,
XID errors from NVML events, and the liveness of every rank of this node whose state file
it reads: ``ddpmon_rank_up`` is 1 while the rank's process runs and its state file is
fresh, and drops to 0 within one ``interval`` of the process dying; ``ddpmon_rank_activity``
says what the rank is doing, frozen, dead or crashed included (``ranks.activity_of``).

A sampler thread builds one list of plain samples every ``interval`` seconds; a scrape
only formats the latest list, so scrapes cost nothing and never wait on NVML. The daemon
never imports torch, and nothing it reads (a missing directory, a corrupt file, a lost
GPU) stops it: each problem is logged once and the rest keeps being served.

The daemon composes: ``discovery`` (which state files), ``ranks`` (each rank's liveness),
``samples`` (what ``/metrics`` exports), ``routes`` (``/state``, ``/history``) and
``requests`` (``POST /set``, the one route that acts, off by default).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from ..collectors import nvml
from ..httpd import Query, Reader, Unhealthy
from ..metrics.exposition import Sample, families
from ..state import owners
from ..version import __version__
from ..webconfig import WebConfig
from .discovery import StateFiles
from .ranks import NodeRank, Ranks
from .requests import Requests
from .routes import Routes
from .samples import Gpus, HangAborts, node_samples, rank_samples

log = logging.getLogger("ddpmon")

HEALTHY_PASSES = 5
HEALTHY_MIN_SECONDS = 10.0


class Daemon:
    """Samples the node every ``interval`` seconds; its ``collect()`` serves the result."""

    def __init__(
        self,
        state_dir: str,
        interval: float = 1.0,
        stale_after: float = 15.0,
        gpus: bool = True,
        node_local: bool = False,
        slow_interval: float = nvml.SLOW_INTERVAL,
        max_per_user: int = owners.MAX_RANKS_PER_USER,
    ) -> None:
        self.state_dir = state_dir
        self.interval = interval
        self.files = StateFiles(state_dir, max_per_user)
        self._ranks = Ranks(self.files, stale_after, node_local)
        self.hostname = self._ranks.hostname
        self.routes = Routes(self.files, self._ranks.is_local, self.hostname)
        self._want_gpus = gpus
        self._gpus = Gpus(slow_interval)
        self._aborts = HangAborts(self.files)
        self._samples: list[Sample] = []
        self._last_pass = time.monotonic()
        self._failing: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ddpmon-daemon", daemon=True)

    # -- life cycle ----------------------------------------------------------------------------

    def start(self) -> None:
        if self._want_gpus:
            self._gpus.open()
        self.refresh()
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._gpus.close()

    @property
    def gpus(self) -> list[nvml.Gpu]:
        return self._gpus.gpus

    def requests(self, allowed: bool, web: WebConfig | None) -> Requests:
        """``POST /set`` over this node's ranks (``requests.py``): refused unless ``allowed``."""
        return Requests(
            self.files, self._ranks.is_local, self.hostname, allowed, web, self._ranks.stale_after
        )

    def ranks(self) -> list[NodeRank]:
        """This node's ranks (``ranks.Ranks``)."""
        return self._ranks.ranks()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.refresh()
                if self._failing:
                    log.warning("ddpmon: daemon: sampling works again")
                    self._failing = None
            except Exception as exc:  # the loop cannot die; say each new failure once
                if self._failing != repr(exc):
                    self._failing = repr(exc)
                    log.warning("ddpmon: daemon: a sampling pass failed: %r", exc, exc_info=exc)

    # -- what a scrape sees -------------------------------------------------------------------

    def collect(self) -> Iterator[Any]:
        yield from families(self._samples)

    def refresh(self) -> None:
        """One pass over the state files, the ranks' processes and the GPUs."""
        ranks = self.ranks()
        samples = rank_samples(ranks)
        samples += node_samples(ranks)
        samples += self._gpus.samples(ranks)
        samples += self._gpus.xid_samples()
        samples += self._aborts.samples()
        samples.append(
            (
                "ddpmon_daemon_info",
                {"host": self.hostname, "version": __version__, "gpus": str(len(self._gpus.gpus))},
                1.0,
            )
        )
        self._samples = samples
        self._last_pass = time.monotonic()

    @property
    def stale_after_seconds(self) -> float:
        """Age of the last finished sampling pass beyond which the daemon is unhealthy."""
        return max(HEALTHY_PASSES * self.interval, HEALTHY_MIN_SECONDS)

    def health_route(
        self, query: Query | None = None, reader: Reader | None = None
    ) -> tuple[str, bytes]:
        """``/healthz``: 200 while sampling passes finish, 503 (Unhealthy) once the last one
        is older than ``stale_after_seconds`` (a hung file system or NVML call): serving
        old samples forever would hide it, so a liveness probe restarts the daemon."""
        age = time.monotonic() - self._last_pass
        if age > self.stale_after_seconds or not self._thread.is_alive():
            raise Unhealthy(
                f"the last sampling pass finished {age:.0f} s ago "
                f"(interval {self.interval:g} s): sampling is stuck"
            )
        return "text/plain", f"ok: last sampling pass {age:.1f} s ago\n".encode()
