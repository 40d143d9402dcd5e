"""collectors/nvml.py: NVML absent for real, every other NVML failure through a fake driver,
device mapping through CUDA_VISIBLE_DEVICES, values and units, slow queries kept off the
scrape path, and a GPU that is lost mid-run."""

from __future__ import annotations

import logging
import sys
import time

import pynvml
import pytest

from ddpmon.collectors import nvml
from tests.support.nvml_fake import FakeDriver, FakeGpu, real_nvml_works, two_gpus


def _lines(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


# -- NVML that cannot work here --------------------------------------------------------------


@pytest.mark.skipif(real_nvml_works(), reason="this machine has a working NVML")
def test_real_nvml_absent_one_clear_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "ddpmon")
    assert nvml.open_nvml("rank 0") is None
    lines = _lines(caplog, "GPU metrics are off")
    assert len(lines) == 1, lines
    assert (
        "rank 0" in lines[0]
        and "libnvidia-ml.so.1" in lines[0]
        and "NVMLError_LibraryNotFound" in lines[0]
    )

    caplog.clear()
    assert nvml.rank_gpu("job", 0, 0, uuid="0f0f0f0f-0000-0000-0000-000000000000") is None
    assert len(_lines(caplog, "GPU metrics are off")) == 1


def test_package_missing(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    assert nvml.open_nvml("daemon") is None
    (line,) = _lines(caplog, "GPU metrics are off")
    assert "nvidia-ml-py package is not installed" in line and "pip install nvidia-ml-py" in line


@pytest.mark.parametrize(
    "code, words",
    [
        (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "different versions"),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "kernel driver is not loaded"),
        (pynvml.NVML_ERROR_NO_PERMISSION, "/dev/nvidia"),
        (pynvml.NVML_ERROR_UNKNOWN, "NVML failed"),
    ],
)
def test_init_failures_say_why(
    code: int, words: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    FakeDriver(two_gpus(), init_error=code).install(monkeypatch)
    assert nvml.open_nvml("rank 1") is None
    assert nvml.rank_gpu("job", 1, 0) is None
    lines = _lines(caplog, "GPU metrics are off")
    assert len(lines) == 2 and all(words in line and "rank 1" in line for line in lines), lines


# -- which NVML device is the rank's --------------------------------------------------------


@pytest.fixture
def four(monkeypatch: pytest.MonkeyPatch) -> FakeDriver:
    gpus = [
        FakeGpu(
            uuid=f"GPU-{i}{i}aa0000-0000-4000-8000-00000000000{i}",
            bus_id=f"00000000:{16 * (i + 1):02X}:00.0",
        )
        for i in range(4)
    ]
    gpus[3].mig_uuids = ("MIG-77770000-1111-5000-8000-000000000000",)
    return FakeDriver(gpus).install(monkeypatch)


def test_resolve_through_cuda_visible_devices(four: FakeDriver) -> None:
    nv = nvml.open_nvml("test")
    gpu, how = nvml.resolve(nv, 0, "2,0")
    assert (gpu.index, how) == (2, "unconfirmed")
    gpu, how = nvml.resolve(nv, 1, "2,0")
    assert gpu.index == 0
    gpu, _ = nvml.resolve(nv, 0, None)
    assert gpu.index == 0
    # UUIDs, also abbreviated as CUDA allows, and a MIG instance (its physical GPU)
    assert nvml.resolve(nv, 0, "GPU-11aa")[0].index == 1
    assert nvml.resolve(nv, 1, f"GPU-00aa,{four.gpus[3].uuid}")[0].index == 3
    assert nvml.resolve(nv, 0, "MIG-77770000-1111-5000-8000-000000000000")[0].index == 3
    # torch's UUID of the device wins over the list
    gpu, how = nvml.resolve(nv, 0, "1", uuid=four.gpus[2].uuid[4:])  # as torch prints it
    assert (gpu.index, gpu.uuid, how) == (2, four.gpus[2].uuid, "uuid")
    assert nvml.resolve(nv, 0, "1", uuid=four.gpus[2].uuid) == (gpu, "uuid")
    assert (
        nvml.resolve(nv, 0, None, uuid="GPU-77770000-1111-5000-8000-000000000000")[0].index == 3
    )  # MIG
    # PCI bus id confirms, or corrects CUDA's fastest-first order
    assert nvml.resolve(nv, 0, "1", pci_bus_id="0000:20:00.0") == (
        nvml.describe_gpu(nv, four.handles[1]),
        "pci_bus_id",
    )
    gpu, how = nvml.resolve(nv, 0, "1", pci_bus_id="00000000:40:00.0")
    assert (gpu.index, how) == (3, "pci_bus_id")


def test_resolve_bad_inputs_say_what(four: FakeDriver) -> None:
    nv = nvml.open_nvml("test")
    with pytest.raises(
        LookupError, match=r"cuda:2 is not in CUDA_VISIBLE_DEVICES='0,1' \(2 entries\)"
    ):
        nvml.resolve(nv, 2, "0,1")
    with pytest.raises(LookupError, match="neither an index nor a GPU-/MIG- UUID"):
        nvml.resolve(nv, 0, "abc")
    with pytest.raises(LookupError, match="matches 4 GPUs by UUID, not one"):
        nvml.resolve(nv, 0, "GPU-")
    with pytest.raises(LookupError, match="PCI bus id 00000000:99:00.0, which NVML does not know"):
        nvml.resolve(nv, 0, "0", pci_bus_id="0000:99:00.0")


def test_rank_gpu_labels(four: FakeDriver, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "ddpmon")
    gpu = nvml.rank_gpu("jobA", 3, 0, uuid=four.gpus[2].uuid[4:], visible="2")
    assert gpu is not None
    assert gpu.labels == {"job": "jobA", "rank": "3", "gpu": "2", "gpu_uuid": four.gpus[2].uuid}
    assert _lines(caplog, "cuda:0 is NVML GPU 2")


# -- values ------------------------------------------------------------------------------------


def test_reader_values_units_and_labels(monkeypatch: pytest.MonkeyPatch) -> None:
    driver = FakeDriver(two_gpus()).install(monkeypatch)
    nv = nvml.open_nvml("test")
    reader = nvml.GpuReader(nv, nvml.list_gpus(nv)[0])
    labels = {"job": "j", "rank": "0", "gpu": "0", "gpu_uuid": driver.gpus[0].uuid}
    reader.refresh_slow()
    got = {
        (n, tuple(sorted(set(lab.items()) - set(labels.items())))): v
        for n, lab, v in reader.read(labels)
    }
    assert all(set(labels.items()) <= set(lab.items()) for _, lab, _ in reader.read(labels))
    assert got[("ddpmon_gpu_utilization_ratio", ())] == pytest.approx(0.37)
    assert got[("ddpmon_gpu_memory_used_bytes", ())] == 10 * 2**30
    assert got[("ddpmon_gpu_memory_total_bytes", ())] == 80 * 2**30
    assert got[("ddpmon_gpu_power_watts", ())] == pytest.approx(312.5)
    assert got[("ddpmon_gpu_energy_joules_total", ())] == pytest.approx(123456.789)
    assert got[("ddpmon_gpu_temperature_celsius", ())] == 54
    assert got[("ddpmon_gpu_sm_clock_hertz", ())] == 1980e6
    assert got[("ddpmon_gpu_ecc_errors_total", (("type", "corrected"),))] == 3
    assert got[("ddpmon_gpu_ecc_errors_total", (("type", "uncorrected"),))] == 1
    assert got[("ddpmon_gpu_pcie_replays_total", ())] == 7
    reasons = {k[1][0][1]: v for k, v in got.items() if k[0] == "ddpmon_gpu_clock_event_active"}
    assert reasons == {
        name: float(name in ("sw_power_cap", "sw_thermal_slowdown"))
        for name, _ in nvml.CLOCK_EVENT_REASONS
    }
    assert len(reasons) == 9


def test_unsupported_query_is_skipped_for_good(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "ddpmon")
    driver = FakeDriver(two_gpus(unsupported={"ecc", "power"})).install(monkeypatch)
    nv = nvml.open_nvml("test")
    reader = nvml.GpuReader(nv, nvml.list_gpus(nv)[0])
    for _ in range(3):
        reader.refresh_slow()
        names = {n for n, _, _ in reader.read({})}
    assert "ddpmon_gpu_ecc_errors_total" not in names and "ddpmon_gpu_power_watts" not in names
    assert "ddpmon_gpu_energy_joules_total" in names and "ddpmon_gpu_temperature_celsius" in names
    assert driver.calls["nvmlDeviceGetPowerUsage"] == 1
    assert driver.calls["nvmlDeviceGetTotalEccErrors"] == 2  # corrected and uncorrected, once each
    assert len(_lines(caplog, "is not available")) == 3


def test_memory_v1_where_the_driver_lacks_v2(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeDriver(two_gpus(unsupported={"memory_v2"})).install(monkeypatch)
    nv = nvml.open_nvml("test")
    reader = nvml.GpuReader(nv, nvml.list_gpus(nv)[0])
    got = {n: v for n, _, v in reader.read({})}
    assert got["ddpmon_gpu_memory_used_bytes"] == 10 * 2**30 + 512 * 2**20  # total - free
    assert got["ddpmon_gpu_memory_total_bytes"] == 80 * 2**30


def test_old_driver_throttle_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeDriver(two_gpus(), missing=("nvmlDeviceGetCurrentClocksEventReasons",)).install(monkeypatch)
    nv = nvml.open_nvml("test")
    reader = nvml.GpuReader(nv, nvml.list_gpus(nv)[1])
    active = {
        lab["reason"]: v for n, lab, v in reader.read({}) if n == "ddpmon_gpu_clock_event_active"
    }
    assert active["gpu_idle"] == 1.0 and sum(active.values()) == 1.0


def test_slow_queries_stay_off_the_scrape_path(monkeypatch: pytest.MonkeyPatch) -> None:
    driver = FakeDriver(two_gpus()).install(monkeypatch)
    gpu = nvml.rank_gpu("j", 0, 0, slow_interval=0.3)
    assert gpu is not None
    deadline = time.monotonic() + 5
    while not any(n == "ddpmon_gpu_energy_joules_total" for n, _, _ in gpu.samples()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    for _ in range(200):
        gpu.samples()
    assert driver.calls["nvmlDeviceGetTotalEnergyConsumption"] == 1
    assert driver.calls["nvmlDeviceGetUtilizationRates"] >= 200
    time.sleep(0.35)
    gpu.samples()  # stale now: refreshed in the background, this scrape does not wait
    deadline = time.monotonic() + 5
    while driver.calls["nvmlDeviceGetTotalEnergyConsumption"] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_gpu_lost_mid_run(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    driver = FakeDriver(two_gpus()).install(monkeypatch)
    gpu = nvml.rank_gpu("j", 5, 0)
    assert gpu is not None and gpu.samples()
    driver.gpus[0].lost = True
    assert gpu.samples() == []
    calls = sum(driver.calls.values())
    assert gpu.samples() == [] and gpu.samples() == []
    assert sum(driver.calls.values()) == calls  # no NVML call once the GPU is known lost
    (line,) = _lines(caplog, "is lost")
    assert "rank 5" in line and "XID 79" in line and "its metrics are off" in line


# -- every failure says why, in the log and in the state file ----------------------------------


def test_init_failure_is_noted_as_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    FakeDriver(two_gpus(), init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED).install(monkeypatch)
    notes: list[str] = []
    assert nvml.rank_gpu("job", 2, 0, note=notes.append) is None
    (line,) = _lines(caplog, "GPU metrics are off")
    assert notes == [
        "GPU metrics are off: the NVIDIA kernel driver is not loaded (nvidia-smi fails too): "
        "load it (modprobe nvidia) or reinstall the driver (NVMLError_DriverNotLoaded)"
    ]
    assert line == f"ddpmon: rank 2: {notes[0]}"


def test_package_missing_is_noted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    notes: list[str] = []
    assert nvml.rank_gpu("job", 0, 0, note=notes.append) is None
    assert notes == [
        "GPU metrics are off: the nvidia-ml-py package is not installed (pip install nvidia-ml-py)"
    ]


@pytest.mark.parametrize(
    "cuda, visible, uuid, pci, why",
    [
        (0, "7", None, None, "CUDA_VISIBLE_DEVICES entry '7' is not one of NVML's 2 GPU(s)"),
        (3, "0,1", None, None, "cuda:3 is not in CUDA_VISIBLE_DEVICES='0,1' (2 entries)"),
        # torch's UUID unknown to NVML and nothing to check the list's entry with: refused
        (
            1,
            "0,1",
            "GPU-99990000-0000-4000-8000-000000000000",
            None,
            "torch's UUID of cuda:1, GPU-99990000-0000-4000-8000-000000000000, is not one NVML knows, and "
            "torch gives no PCI bus id to check the CUDA_VISIBLE_DEVICES entry '1' against: that GPU could be "
            "another one",
        ),
        (
            0,
            "1",
            None,
            "0000:77:00.0",
            "cuda:0 has PCI bus id 00000000:77:00.0, which NVML does not know",
        ),
    ],
)
def test_no_gpu_mapped_to_the_rank_says_why(
    cuda: int,
    visible: str,
    uuid: str | None,
    pci: str | None,
    why: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    driver = FakeDriver(two_gpus()).install(monkeypatch)
    notes: list[str] = []
    assert nvml.rank_gpu("job", 1, cuda, uuid, pci, visible=visible, note=notes.append) is None
    (line,) = _lines(caplog, "GPU metrics are off")
    (text,) = notes
    assert line == f"ddpmon: rank 1: {text}"
    assert text.startswith(f"GPU metrics are off: cannot find cuda:{cuda} in NVML: {why}")
    assert text.endswith("(the node daemon, `ddpmon daemon`, still exports every GPU of the node)")
    assert driver.initialised == 0, "NVML released again"


def test_a_torch_uuid_nvml_does_not_know_is_settled_by_the_pci_bus_id(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    driver = FakeDriver(two_gpus()).install(monkeypatch)
    notes: list[str] = []
    gpu = nvml.rank_gpu(
        "job",
        0,
        0,
        "GPU-99990000-0000-4000-8000-000000000000",
        "0000:2A:00.0",
        visible="0",
        note=notes.append,
    )
    assert gpu is not None and gpu.labels["gpu_uuid"] == driver.gpus[1].uuid and notes == []


def test_a_mig_instance_is_served_as_its_gpu_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """In MIG mode a rank runs on one instance; NVML's figures are the whole GPU's (and it
    has no utilization there): kept, labelled with the physical GPU, and said once."""
    gpus = two_gpus()
    gpus[1].mig_uuids = ("MIG-5a5a0000-1111-5000-8000-000000000000",)
    gpus[1].unsupported = {"utilization"}
    FakeDriver(gpus).install(monkeypatch)
    notes: list[str] = []
    gpu = nvml.rank_gpu(
        "job",
        4,
        0,
        "GPU-5a5a0000-1111-5000-8000-000000000000",
        "00000000:2A:00.0",
        note=notes.append,
    )  # torch's UUID of a MIG device, as device_identity writes it
    assert gpu is not None and gpu.labels["gpu"] == "1"
    (text,) = notes
    assert text.startswith(
        f"cuda:0 is a MIG instance of NVML GPU 1 ({gpus[1].uuid}): the GPU metrics are "
        "the whole GPU's, shared with its other instances"
    )
    assert _lines(caplog, "MIG instance") == [f"ddpmon: rank 4: {text}"]
    names = {n for n, _, _ in gpu.samples()}
    assert "ddpmon_gpu_memory_used_bytes" in names and "ddpmon_gpu_utilization_ratio" not in names
    gpu.close()


def test_an_unconfirmed_mapping_and_a_gpu_without_mig_support(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    FakeDriver(two_gpus(unsupported={"mig"})).install(monkeypatch)  # NVML_ERROR_NOT_SUPPORTED
    notes: list[str] = []
    gpu = nvml.rank_gpu("job", 0, 0, visible="0", note=notes.append)
    assert gpu is not None
    assert notes == [
        "cuda:0 taken to be NVML GPU 0 (GPU-1f1e0c3a-0000-4000-8000-000000000000) without "
        "confirmation by UUID or PCI bus id (torch reports neither)"
    ]
    gpu.close()


def test_a_lost_gpu_is_noted(monkeypatch: pytest.MonkeyPatch) -> None:
    driver = FakeDriver(two_gpus()).install(monkeypatch)
    notes: list[str] = []
    gpu = nvml.rank_gpu("j", 5, 0, driver.gpus[0].uuid, note=notes.append)
    assert gpu is not None and notes == []
    driver.gpus[0].lost = True
    assert gpu.samples() == []
    (text,) = notes
    assert text.startswith(f"GPU 0 ({driver.gpus[0].uuid}): the GPU is lost") and text.endswith(
        "its metrics are off"
    )


def test_rank_sources_notes_the_gpu_in_the_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the rank's collectors into the recorder, whose notes the state file holds."""
    from ddpmon.rank import torch_memory
    from ddpmon.rank.recorder import Recorder
    from ddpmon.rank.sources import rank_sources
    from ddpmon.state.schema import Identity

    FakeDriver(two_gpus(), init_error=pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH).install(
        monkeypatch
    )
    monkeypatch.setattr(
        torch_memory,
        "device_identity",
        lambda index: ("GPU-1f1e0c3a-0000-4000-8000-000000000000", None),
    )
    rec = Recorder(Identity(rank=0), world_size=1)
    sources, closers = rank_sources("j", 0, "cuda:0", True, rec.note)
    assert len(sources) == 2 and closers == [], "host metrics and torch's allocator go on"
    assert "different versions" in rec.state().notes["gpu_metrics"]

    rec = Recorder(Identity(rank=0), world_size=1)
    monkeypatch.setattr(torch_memory, "device_identity", lambda index: 1 / 0)
    rank_sources("j", 0, "cuda:0", True, rec.note)
    assert (
        rec.state().notes["gpu_metrics"]
        == "GPU metrics are off: ZeroDivisionError('division by zero')"
    )
    rec = Recorder(Identity(rank=0), world_size=1)
    rank_sources("j", 0, "cpu", True, rec.note)
    assert rec.state().notes == {}
