"""Preflight's pure parts: the rounds of pairs, who is named slow from measured links (one
slow host, one slow link, a healthy set with noise, two nodes), a node's own checks, GPU
health through the NVML stand-in, and the table."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

import pytest

from ddpmon.collectors import nvml
from ddpmon.preflight import checks
from ddpmon.preflight.verdict import Link, judge, rounds, table
from tests.support.nvml_fake import FakeDriver, two_gpus

HOSTS = {0: "a", 1: "b", 2: "c", 3: "d"}
FAST, SLOW = 1e9, 2.5e6


@pytest.mark.parametrize("nodes", range(1, 12))
def test_rounds_pair_every_node_once_each_round(nodes: int) -> None:
    schedule = rounds(nodes)
    pairs = [p for r in schedule for p in r]
    assert sorted(pairs) == list(itertools.combinations(range(nodes), 2))
    for r in schedule:
        busy = [n for p in r for n in p]
        assert len(busy) == len(set(busy))
    assert len(schedule) == (0 if nodes < 2 else nodes - 1 if nodes % 2 == 0 else nodes)


def links(nodes: int, bw: dict[tuple[int, int], float], lat: float = 1e-4) -> list[Link]:
    return [
        Link(a, b, bw.get((a, b), FAST), lat) for a, b in itertools.combinations(range(nodes), 2)
    ]


def test_a_host_whose_every_link_is_slow_is_named_alone() -> None:
    measured = links(3, {(0, 2): SLOW, (1, 2): SLOW * 1.1})
    verdict = judge(measured, HOSTS, {})
    assert verdict.slow_hosts == ["c"] and verdict.slow_links == [] and verdict.bad_hosts == []
    assert [link.slow for link in measured] == [[], ["bandwidth"], ["bandwidth"]]
    assert verdict.reasons["c"][0].startswith("every link of c is slow: a <-> c 2.5 MB/s, 100 µs")


def test_one_slow_pair_is_a_slow_link_not_a_host() -> None:
    verdict = judge(links(4, {(1, 2): SLOW}), HOSTS, {})
    assert verdict.slow_hosts == [] and verdict.slow_links == [("b", "c")]
    assert "check the cables" in verdict.reasons["b <-> c"][0]
    assert judge(links(3, {(0, 1): FAST / 5}), HOSTS, {}).slow_links == [("a", "b")]  # 5x


def test_noise_on_a_healthy_set_names_nobody() -> None:
    measured = links(4, {(0, 1): FAST * 0.5, (2, 3): FAST * 1.5, (0, 3): FAST * 0.6})
    verdict = judge(measured, HOSTS, {})
    assert verdict.healthy and not verdict.reasons


def test_latency_alone_makes_a_link_slow_past_a_floor() -> None:
    measured = links(3, {})
    measured[2].latency_seconds = 0.05  # b <-> c
    assert judge(measured, HOSTS, {}).slow_links == [("b", "c")]
    measured = links(3, {})
    measured[2].latency_seconds = 9e-4  # 9 times the others, but under a millisecond more
    assert judge(measured, HOSTS, {}).healthy


def test_two_nodes_are_judged_by_the_floor_alone() -> None:
    assert judge(links(2, {(0, 1): SLOW}), HOSTS, {}).healthy  # nothing to compare with
    verdict = judge(links(2, {(0, 1): SLOW}), HOSTS, {}, min_bandwidth=1e8)
    assert verdict.slow_hosts == [] and verdict.slow_links == [("a", "b")]
    assert "under --min-bandwidth 100.0 MB/s" in verdict.reasons["a <-> b"][0]


def test_a_failed_check_names_a_bad_host() -> None:
    verdict = judge(links(3, {}), HOSTS, {0: [], 1: ["/dev/shm is 64 MiB"], 2: []})
    assert verdict.bad_hosts == ["b"] and verdict.reasons == {"b": ["/dev/shm is 64 MiB"]}


def test_node_checks(tmp_path: Path) -> None:
    check = checks.check_node("a", 0, str(tmp_path / "not" / "made"), min_free_disk=0)
    assert check.free_disk_bytes and check.free_disk_bytes > 0 and check.problems == []
    assert check.shm_bytes is not None and check.open_files_soft is not None
    full = checks.check_node("a", 0, str(tmp_path), min_free_disk=2**60)
    assert (
        len(full.problems) == 1 and f"free in {tmp_path}, under --min-free-disk" in full.problems[0]
    )


def test_gpu_health_names_what_is_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = two_gpus(pcie=(8, 16, 4, 5))  # the first: ECC, thermal slowdown, half its lanes
    driver = FakeDriver(gpus).install(monkeypatch)
    nv = nvml.open_nvml("test")
    problems: list[str] = []
    facts = [checks.gpu_health(nv, g, problems) for g in nvml.list_gpus(nv)]
    assert facts[0]["ecc_uncorrected"] == 1 and facts[0]["pcie"]["width"] == 8
    first = [p for p in problems if p.startswith("GPU 0 (00000000:18:00.0): ")]
    assert len(first) == 3 and problems[3].startswith("GPU 1 (00000000:2A:00.0): 1 uncorrected")
    assert "1 uncorrected ECC errors since the driver loaded: reset or replace" in first[0]
    assert "sw_thermal_slowdown" in first[1] and "x8, the device's maximum x16" in first[2]
    assert "pcie_generation_note" in facts[1]  # generation 4 of 5 while idle: no problem
    assert driver.calls["nvmlDeviceGetMaxPcieLinkWidth"] == 2


def test_a_hung_nvml_is_a_problem_not_a_hang(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    driver = FakeDriver(two_gpus()).install(monkeypatch)
    monkeypatch.setattr(driver, "nvmlDeviceGetCount", lambda: release.wait(5) and 0)
    import pynvml

    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: release.wait(5) and 0)
    monkeypatch.setattr(checks, "_has_nvidia", lambda: True)
    monkeypatch.setattr(checks, "GPU_SECONDS", 0.2)
    check = checks.NodeCheck(host="a", node=0, checkpoint_dir=".")
    checks._gpus(check)
    release.set()
    assert check.problems == [
        "NVML did not answer within 0.2 s (a hung driver or GPU): run nvidia-smi on this node; "
        "drain it if that hangs too"
    ]


def test_table_names_the_slow_host_and_why() -> None:
    measured = links(3, {(0, 2): SLOW, (1, 2): SLOW})
    verdict = judge(measured, HOSTS, {})
    report = {
        "healthy": verdict.healthy,
        "slow_hosts": verdict.slow_hosts,
        "bad_hosts": verdict.bad_hosts,
        "slow_links": verdict.slow_links,
        "reasons": verdict.reasons,
        "links": [
            {
                "hosts": [HOSTS[x.a], HOSTS[x.b]],
                "bandwidth_bytes_per_second": x.bandwidth_bytes_per_second,
                "latency_seconds": x.latency_seconds,
                "slow": x.slow,
            }
            for x in measured
        ],
        "checks": {
            h: {
                "host": h,
                "node": n,
                "clock_offset_seconds": 0.001 * n,
                "problems": [],
                "warnings": [],
            }
            for n, h in list(HOSTS.items())[:3]
        },
        "allreduce": None,
        "backend": "gloo",
        "seconds": 4.2,
    }
    text = table(report)
    assert "a <-> c                                  2.5 MB/s" in text
    assert "c                     2       +2.0 ms  ok" in text
    assert text.splitlines()[-2] == "verdict: slow host c (4.2 s)"
    assert "\na <-> b                                 1.00 GB/s       100 µs\n" in text
    assert text.splitlines()[-1].startswith("  c: every link of c is slow")
