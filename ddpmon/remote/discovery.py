"""Where a job's node daemons are, for the readers of daemons (``doctor``, ``report``,
``compare``): a file of addresses (``--from-file``), or the targets of the Prometheus that
already scrapes them (``--prometheus``), since at a hundred nodes nobody lists daemons by
hand. What is found is read exactly as ``--from`` addresses are (``daemons.py``). Torch-free.
"""

from __future__ import annotations

import json
import time
import urllib.parse
from collections.abc import Sequence

from ..errors import DiscoveryError
from ..webconfig import HttpConfig
from . import daemons

DAEMON_JOBS = ("ddpmon-daemons", "ddpmon-daemon")
"""The scrape jobs ddpmon ships for its daemons: ``ddpmon-daemons`` in
deploy/prometheus/prometheus.yml (and docker-compose), ``ddpmon-daemon`` in docs/daemon.md's
static example, and the Kubernetes PodMonitor ``ddpmon-daemon``, whose job the Prometheus
Operator calls ``NAMESPACE/ddpmon-daemon``. Found by name rather than by what a target serves:
the targets API says nothing of that, and asking every target (ranks, node_exporters) would
cost a request each."""

PROMETHEUS_TIMEOUT_SECONDS = 3.0
"""To connect to Prometheus and between reads, as for a daemon."""
PROMETHEUS_DEADLINE_SECONDS = 10.0
"""For its whole list of targets: a few MiB at ten thousand targets."""
TARGETS_MAX_BYTES = 64 * 2**20
PROMETHEUS = daemons.Server(
    "Prometheus", "http://prometheus:9090", "--prometheus-http-config", prefix=True
)


def read_address_file(path: str) -> list[str]:
    """The daemon addresses in ``path``, one a line (``HOST:PORT`` or ``https://HOST:PORT``, as
    ``--from`` takes them); blank lines and ``#`` comments are skipped. A line that is not an
    address is named by its number, and so is a file that holds none."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        why = getattr(exc, "strerror", None) or exc
        raise DiscoveryError(f"--from-file {path}: cannot be read ({why})") from None
    addresses = []
    for number, line in enumerate(lines, 1):
        address = line.split("#", 1)[0].strip()
        if not address:
            continue
        problem = daemons.address_problem(address)
        if problem:
            raise DiscoveryError(
                f"--from-file {path}, line {number}: {daemons.without_credentials(address)!r} "
                f"is not a daemon's address: {problem} (one HOST:PORT a line; # starts a comment)"
            )
        addresses.append(address)
    if not addresses:
        raise DiscoveryError(
            f"--from-file {path}: holds no address; write one daemon a line, HOST:PORT "
            "(for example node1:9490)"
        )
    return addresses


def scrape_job_matches(job: str, pool: str, names: Sequence[str]) -> bool:
    """Whether a target of the scrape job ``job`` (its ``job`` label) in the scrape pool
    ``pool`` belongs to one of the jobs ``names``: the job itself, its last ``/``-part (the
    Prometheus Operator's ``NAMESPACE/NAME``), or the pool (as Prometheus' targets page shows it)."""
    return any(name in (job, job.rpartition("/")[2], pool) for name in names)


def daemon_address(scrape_url: str) -> str:
    """A daemon's address as ``--from`` takes it, from the URL Prometheus scrapes it at:
    ``HOST:PORT`` for http, ``https://HOST:PORT`` for https."""
    parts = urllib.parse.urlsplit(scrape_url)
    host = parts.netloc.rpartition("@")[2]
    if ":" not in host.rpartition("]")[2]:  # the scheme's default port, written out
        host += ":443" if parts.scheme == "https" else ":80"
    return f"https://{host}" if parts.scheme == "https" else host


def prometheus_daemons(
    url: str,
    jobs: Sequence[str] = (),
    client: HttpConfig | None = None,
    timeout: float = PROMETHEUS_TIMEOUT_SECONDS,
    deadline: float = PROMETHEUS_DEADLINE_SECONDS,
) -> list[str]:
    """The addresses of the node daemons that the Prometheus at ``url`` scrapes: its active
    targets (``/api/v1/targets``), up or down, of the scrape jobs ``jobs`` (default:
    ``DAEMON_JOBS``), each once, sorted. A daemon Prometheus cannot scrape is listed all the same, so
    that the reader names it as it names a ``--from`` daemon that does not answer."""
    names = tuple(jobs) or DAEMON_JOBS
    problem = daemons.address_problem(url, PROMETHEUS)
    if problem:
        raise DiscoveryError(
            f"--prometheus {daemons.without_credentials(url)!r} is not valid: {problem}"
        )
    api = daemons.base_url(url) + "/api/v1/targets?state=active"
    _, body, _ = daemons.fetch(
        api, timeout, time.monotonic() + deadline, TARGETS_MAX_BYTES, client or HttpConfig()
    )
    if isinstance(body, BaseException):
        hint = (
            " (give its credentials in an http_config file: --prometheus-http-config FILE)"
            if getattr(body, "code", None) in (401, 403)
            else ""
        )
        raise DiscoveryError(
            f"--prometheus {url}: Prometheus cannot be asked for its targets at {api} "
            f"({daemons.why(body, timeout)}){hint}; is Prometheus running there, and is that "
            "the URL of its web UI?"
        )
    try:
        data = json.loads(body)
        targets = data["data"]["activeTargets"] if data.get("status") == "success" else None
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
        targets = None
    if not isinstance(targets, list):
        raise DiscoveryError(
            f"--prometheus {url}: {api} answered, but not as Prometheus' targets API does "
            f"({bytes(body[:80])!r}); give the URL of the Prometheus server itself, such as "
            "http://prometheus:9090"
        )
    found: set[str] = set()
    seen_jobs: set[str] = set()
    for target in targets:
        if not isinstance(target, dict) or not isinstance(target.get("scrapeUrl"), str):
            continue
        labels = target["labels"] if isinstance(target.get("labels"), dict) else {}
        job, pool = str(labels.get("job", "")), str(target.get("scrapePool", ""))
        seen_jobs.add(job)
        if scrape_job_matches(job, pool, names):
            found.add(daemon_address(target["scrapeUrl"]))
    if not found:
        looked = ", ".join(names) + ("" if jobs else " (ddpmon's own names for its daemons)")
        others = ", ".join(sorted(seen_jobs)) or "none: it scrapes nothing"
        raise DiscoveryError(
            f"--prometheus {url}: no active target of the scrape job {looked}; its jobs: "
            f"{others}. Name the daemons' job with --prometheus-job NAME"
        )
    return sorted(found)
