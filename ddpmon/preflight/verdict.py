"""Who is slow: from the measured links and each node's checks, name the slow host, the slow
link and the bad host, and write the table. Pure (no torch, no I/O), so it is tested alone.

A link is slow when its bandwidth is under ``SLOW_RATIO`` of the reference, or its latency
over ``1 / SLOW_RATIO`` times the reference latency plus ``LATENCY_SLACK_SECONDS``. The
reference is the median, over hosts, of each host's best link: one bad host pulls down every
link it is on, but not the best link of the others, so a median over links would not do. A
host every link of which is slow is the slow host (its links are its fault, not listed again);
a slow link between hosts that have fast links elsewhere is a slow link. Two nodes have one
link and nothing to compare it with: they are judged only by ``min_bandwidth`` when given.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from ..formats import format_seconds

SLOW_RATIO = 0.25
"""A link under a quarter of the reference bandwidth is slow."""
LATENCY_SLACK_SECONDS = 0.002
"""Latency must also exceed the reference by this much: microseconds of noise are no finding."""


@dataclass
class Link:
    """One measured pair of nodes (by node rank; ``a < b``)."""

    a: int
    b: int
    bandwidth_bytes_per_second: float
    latency_seconds: float
    slow: list[str] = field(default_factory=list)
    """Why the link is slow ("bandwidth", "latency"); empty when it is not."""


@dataclass
class Verdict:
    slow_hosts: list[str]
    bad_hosts: list[str]
    slow_links: list[tuple[str, str]]
    reasons: dict[str, list[str]]
    """Per host (or ``"A <-> B"`` for a link): why it is named, one sentence each."""

    @property
    def healthy(self) -> bool:
        return not (self.slow_hosts or self.bad_hosts or self.slow_links)


def rounds(nodes: int) -> list[list[tuple[int, int]]]:
    """Every pair of ``nodes`` once, in rounds where each node is in at most one pair (the
    circle method): ``nodes - 1`` rounds for an even count, ``nodes`` for an odd one."""
    if nodes < 2:
        return []
    order: list[int | None] = list(range(nodes)) + ([None] if nodes % 2 else [])
    out = []
    for _ in range(len(order) - 1):
        half = len(order) // 2
        pairs = [(order[i], order[-1 - i]) for i in range(half)]
        out.append(
            sorted((min(a, b), max(a, b)) for a, b in pairs if a is not None and b is not None)
        )
        order = [order[0], order[-1], *order[1:-1]]
    return out


def judge(
    links: list[Link],
    hosts: dict[int, str],
    problems: dict[int, list[str]],
    min_bandwidth: float | None = None,
) -> Verdict:
    """Mark each slow link (in place) and name the slow hosts, slow links and bad hosts.
    ``hosts`` maps node rank to host name; ``problems`` a node's failed checks."""
    reasons: dict[str, list[str]] = {}
    best: dict[int, Link] = {}
    for link in links:
        for node in (link.a, link.b):
            held = best.get(node)
            if held is None or link.bandwidth_bytes_per_second > held.bandwidth_bytes_per_second:
                best[node] = link
    compare = len(hosts) >= 3 and len(best) >= 3
    ref_bw = (
        statistics.median(link.bandwidth_bytes_per_second for link in best.values())
        if compare
        else None
    )
    fastest = {
        n: min(link.latency_seconds for link in links if n in (link.a, link.b)) for n in best
    }
    ref_lat = statistics.median(fastest.values()) if compare else None
    for link in links:
        link.slow = []
        floor = min_bandwidth if min_bandwidth is not None else None
        if ref_bw is not None and link.bandwidth_bytes_per_second < SLOW_RATIO * ref_bw:
            link.slow.append("bandwidth")
        elif floor is not None and link.bandwidth_bytes_per_second < floor:
            link.slow.append("bandwidth")
        if ref_lat is not None and link.latency_seconds > max(
            ref_lat / SLOW_RATIO, ref_lat + LATENCY_SLACK_SECONDS
        ):
            link.slow.append("latency")
    slow_hosts = []
    for node in sorted(best):
        mine = [link for link in links if node in (link.a, link.b)]
        if mine and all(link.slow for link in mine) and (compare or min_bandwidth is not None):
            if len(best) == 2:
                continue  # one link between two nodes: which end is at fault cannot be told
            slow_hosts.append(node)
            reasons.setdefault(hosts[node], []).append(
                f"every link of {hosts[node]} is slow: "
                + ", ".join(f"{_describe(link, hosts)}" for link in mine)
                + _against(ref_bw, ref_lat, min_bandwidth)
            )
    slow_links = []
    for link in links:
        if link.slow and link.a not in slow_hosts and link.b not in slow_hosts:
            slow_links.append((hosts[link.a], hosts[link.b]))
            reasons.setdefault(f"{hosts[link.a]} <-> {hosts[link.b]}", []).append(
                f"the link {_describe(link, hosts)} is slow while both hosts have fast links"
                + _against(ref_bw, ref_lat, min_bandwidth)
                + ": check the cables, ports and switch between them"
            )
    bad_hosts = []
    for node, found in sorted(problems.items()):
        if found:
            bad_hosts.append(hosts[node])
            reasons.setdefault(hosts[node], []).extend(found)
    return Verdict(
        slow_hosts=[hosts[n] for n in slow_hosts],
        bad_hosts=bad_hosts,
        slow_links=slow_links,
        reasons=reasons,
    )


def _describe(link: Link, hosts: dict[int, str]) -> str:
    return (
        f"{hosts[link.a]} <-> {hosts[link.b]} {format_rate(link.bandwidth_bytes_per_second)}, "
        f"{format_latency(link.latency_seconds)}"
    )


def _against(ref_bw: float | None, ref_lat: float | None, floor: float | None) -> str:
    if ref_bw is not None and ref_lat is not None:
        return f" (the hosts' best links: {format_rate(ref_bw)}, {format_latency(ref_lat)})"
    return f" (under --min-bandwidth {format_rate(floor)})" if floor is not None else ""


def format_rate(bytes_per_second: float | None) -> str:
    """A bandwidth for people: bytes per second in MB/s or GB/s (decimal, as links are sold)."""
    if bytes_per_second is None:
        return "-"
    if bytes_per_second >= 1e9:
        return f"{bytes_per_second / 1e9:.2f} GB/s"
    return f"{bytes_per_second / 1e6:.1f} MB/s"


def format_latency(seconds: float) -> str:
    """A link's latency: microseconds below a millisecond (where links are), else as every
    duration is written."""
    return f"{seconds * 1e6:.0f} µs" if seconds < 1e-3 else format_seconds(seconds)


def table(report: dict[str, Any]) -> str:
    """The report as node 0 prints it: hosts and their checks, links, all-reduce, verdict."""
    lines = ["HOST               NODE  CLOCK OFFSET  CHECKS"]
    for check in report["checks"].values():
        offset = check.get("clock_offset_seconds")
        found = check.get("problems") or []
        warned = check.get("warnings") or []
        status = "; ".join(found + warned) if (found or warned) else "ok"
        lines.append(
            f"{check['host']:<18} {check['node']:>4}  "
            f"{(f'{offset * 1e3:+.1f} ms' if offset is not None else '-'):>12}  {status}"
        )
    lines.append("")
    lines.append("LINK                                   BANDWIDTH      LATENCY")
    for link in report["links"]:
        pair = f"{link['hosts'][0]} <-> {link['hosts'][1]}"
        mark = ("slow " + ", ".join(link["slow"])) if link["slow"] else ""
        lines.append(
            f"{pair:<38} {format_rate(link['bandwidth_bytes_per_second']):>10} "
            f"{format_latency(link['latency_seconds']):>12}  {mark}".rstrip()
        )
    ar = report.get("allreduce")
    if ar:
        lines.append("")
        lines.append(
            f"all-reduce of {ar['bytes'] / 2**20:.0f} MiB over {ar['ranks']} ranks "
            f"({report['backend']}): bus bandwidth "
            + format_rate(ar["bus_bandwidth_bytes_per_second"])
        )
    lines.append("")
    if report["healthy"]:
        lines.append(
            f"verdict: healthy: no slow or bad host among {len(report['checks'])} "
            f"({report['seconds']:.1f} s)"
        )
    else:
        named = [f"slow host {h}" for h in report["slow_hosts"]]
        named += [f"bad host {h}" for h in report["bad_hosts"] if h not in report["slow_hosts"]]
        named += [f"slow link {a} <-> {b}" for a, b in report["slow_links"]]
        lines.append(f"verdict: {'; '.join(named)} ({report['seconds']:.1f} s)")
        for who, why in report["reasons"].items():
            for sentence in why:
                lines.append(f"  {who}: {sentence}")
    return "\n".join(lines)
