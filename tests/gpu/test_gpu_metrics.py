"""GPU metrics against nvidia-smi, on a machine with NVIDIA GPUs (skipped elsewhere).

Each reading ddpmon takes from NVML is compared with what nvidia-smi reports for the same
GPU a moment later; values that move on their own (power, clocks, utilization) get
tolerances, identities and counters must agree exactly. Then a real CUDA rank with ddpmon
attached is checked for its own GPU's labels (through CUDA_VISIBLE_DEVICES) and torch's
allocator figures, and the node daemon for mapping that rank's process to it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from ddpmon.collectors import nvml

ROOT = Path(__file__).resolve().parents[2]


def _nvml_works() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        shutil.which("nvidia-smi") is None or not _nvml_works(),
        reason="needs an NVIDIA GPU, its driver and nvidia-smi",
    ),
]


def smi(index: int, *names: str) -> str | None:
    """One --query-gpu field of GPU ``index``, trying alternative names (drivers rename
    fields); None where nvidia-smi does not know or support it."""
    for name in names:
        r = subprocess.run(
            [
                "nvidia-smi",
                "-i",
                str(index),
                f"--query-gpu={name}",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        value = r.stdout.strip()
        if r.returncode == 0 and value and "N/A" not in value and "Not Supported" not in value:
            return value
    return None


def smi_replays(index: int) -> int | None:
    r = subprocess.run(
        ["nvidia-smi", "-q", "-i", str(index)], capture_output=True, text=True, timeout=30
    )
    m = re.search(r"Replays Since Reset\s*:\s*(\d+)", r.stdout)
    return int(m.group(1)) if m else None


def read(reader: nvml.GpuReader) -> dict[tuple[str, str], float]:
    reader.refresh_slow()
    return {
        (name, labels.get("reason") or labels.get("type") or ""): value
        for name, labels, value in reader.read({})
    }


@pytest.fixture(scope="module")
def nv() -> Any:
    nv = nvml.open_nvml("gpu test")
    assert nv is not None
    yield nv
    nvml.close_nvml(nv)


def test_every_gpu_matches_nvidia_smi(nv: Any) -> None:
    gpus = nvml.list_gpus(nv)
    assert len(gpus) >= 1
    for gpu in gpus:
        ours = read(nvml.GpuReader(nv, gpu))
        i = gpu.index
        assert gpu.uuid == smi(i, "uuid")
        assert gpu.pci_bus_id == nvml.normalize_bus_id(smi(i, "pci.bus_id"))
        assert gpu.name == smi(i, "name")

        mib = 2**20
        assert ours[("ddpmon_gpu_memory_total_bytes", "")] / mib == pytest.approx(
            float(smi(i, "memory.total")), abs=1
        )
        # nvidia-smi leaves driver-reserved memory out of memory.used on recent drivers only
        reserved = nv.nvmlDeviceGetMemoryInfo(gpu.handle, nv.nvmlMemory_v2).reserved / mib
        assert ours[("ddpmon_gpu_memory_used_bytes", "")] / mib == pytest.approx(
            float(smi(i, "memory.used")), abs=max(256, reserved + 64)
        )
        assert ours[("ddpmon_gpu_temperature_celsius", "")] == pytest.approx(
            float(smi(i, "temperature.gpu")), abs=3
        )
        util = smi(i, "utilization.gpu")
        if util is not None:
            assert ours[("ddpmon_gpu_utilization_ratio", "")] == pytest.approx(
                float(util) / 100, abs=0.25
            )
        power = smi(i, "power.draw.instant", "power.draw")
        if power is not None:
            assert ours[("ddpmon_gpu_power_watts", "")] == pytest.approx(
                float(power), rel=0.25, abs=30
            )
        sm = smi(i, "clocks.sm")
        assert ours[("ddpmon_gpu_sm_clock_hertz", "")] / 1e6 == pytest.approx(
            float(sm), rel=0.2, abs=150
        )

        reasons = smi(i, "clocks_event_reasons.active", "clocks_throttle_reasons.active")
        active = {r: v for (n, r), v in ours.items() if n == "ddpmon_gpu_clock_event_active"}
        assert set(active) == {name for name, _ in nvml.CLOCK_EVENT_REASONS}
        if reasons is not None:
            mask = int(reasons, 16)
            stable = (
                "hw_slowdown",
                "hw_thermal_slowdown",
                "hw_power_brake_slowdown",
                "sync_boost",
                "display_clock_setting",
                "applications_clocks_setting",
            )
            for name, bit in nvml.CLOCK_EVENT_REASONS:
                if name in stable:
                    assert active[name] == float(bool(mask & bit)), name

        for kind in ("corrected", "uncorrected"):
            theirs = smi(i, f"ecc.errors.{kind}.volatile.total")
            if theirs is not None:  # (ECC off or unsupported: nothing to compare)
                assert ours[("ddpmon_gpu_ecc_errors_total", kind)] == float(theirs)
        replays = smi_replays(i)
        if replays is not None:
            assert ours[("ddpmon_gpu_pcie_replays_total", "")] == replays


def test_energy_counts_what_power_draws(nv: Any) -> None:
    gpu = nvml.list_gpus(nv)[0]
    reader = nvml.GpuReader(nv, gpu)
    first = read(reader)
    watts, t0 = [], time.monotonic()
    while time.monotonic() - t0 < 3.0:
        watts.append(read(reader)[("ddpmon_gpu_power_watts", "")])
        time.sleep(0.1)
    reader.refresh_slow()
    joules = (
        read(reader)[("ddpmon_gpu_energy_joules_total", "")]
        - first[("ddpmon_gpu_energy_joules_total", "")]
    )
    expected = sum(watts) / len(watts) * (time.monotonic() - t0)
    assert 0.5 * expected <= joules <= 1.5 * expected, (joules, expected)


def _samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [
        (s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples
    ]


def test_rank_gpu_and_daemon_against_a_real_cuda_rank(nv: Any, tmp_path: Path) -> None:
    from ddpmon.daemon import Daemon

    gpus = nvml.list_gpus(nv)
    target = gpus[-1]  # the last GPU, so that cuda:0 is not NVML's 0 where there are several
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": str(target.index),
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    worker = subprocess.Popen(
        [sys.executable, "-m", "tests.gpu.gpu_worker", str(tmp_path)],
        cwd=ROOT,
        env=env,
        stdout=open(tmp_path / "stdout.txt", "w"),
        stderr=open(tmp_path / "stderr.txt", "w"),
    )
    try:
        deadline = time.monotonic() + 180
        while not (tmp_path / "result.json").exists():
            assert worker.poll() is None, (tmp_path / "stderr.txt").read_text()
            assert time.monotonic() < deadline, "the CUDA rank did not report"
            time.sleep(0.2)
        result = json.loads((tmp_path / "result.json").read_text())
        labels = {"job": "gpu-test", "rank": "0", "gpu": str(target.index), "gpu_uuid": target.uuid}
        got = {name: value for name, lab, value in _samples(result["metrics"]) if lab == labels}
        assert got["ddpmon_torch_memory_allocated_bytes"] == result["allocated"]
        assert got["ddpmon_torch_memory_reserved_bytes"] == result["reserved"]
        assert got["ddpmon_torch_memory_peak_allocated_bytes"] == result["peak"]
        assert got["ddpmon_gpu_memory_used_bytes"] >= result["reserved"]
        assert got["ddpmon_gpu_memory_total_bytes"] > 0
        assert 0 <= got["ddpmon_gpu_utilization_ratio"] <= 1
        assert got["ddpmon_gpu_sm_clock_hertz"] > 1e8

        daemon = Daemon(str(tmp_path / "state"), interval=60)
        daemon.start()
        try:
            registry = CollectorRegistry()
            registry.register(daemon)
            assert (
                registry.get_sample_value("ddpmon_rank_up", {"job": "gpu-test", "rank": "0"}) == 1
            )
            apps = subprocess.run(
                ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout
            if str(result["pid"]) in apps:  # (in a container NVML may see no processes at all)
                info = {
                    "gpu": str(target.index),
                    "gpu_uuid": target.uuid,
                    "pid": str(result["pid"]),
                    "job": "gpu-test",
                    "rank": "0",
                }
                assert registry.get_sample_value("ddpmon_gpu_process_info", info) == 1
                assert (
                    registry.get_sample_value("ddpmon_gpu_temperature_celsius", labels) is not None
                )
            for gpu in gpus:  # every GPU of the node
                assert any(
                    s.labels.get("gpu_uuid") == gpu.uuid
                    for m in registry.collect()
                    for s in m.samples
                    if s.name == "ddpmon_gpu_memory_total_bytes"
                )
        finally:
            daemon.stop()
    finally:
        (tmp_path / "stop").touch()
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
