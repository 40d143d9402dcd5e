"""A stand-in for the NVIDIA driver, for machines without a GPU.

It replaces the functions of the real ``pynvml`` module that call into libnvidia-ml with
Python ones over a few fake GPUs. They return pynvml's own structures and raise pynvml's
own error classes, so ddpmon's NVML code runs unchanged against it. Used only for what
cannot happen for real here (GPUs, a lost GPU, XID events, a version mismatch); the
absent-library path is tested against the real pynvml.
"""

from __future__ import annotations

import collections
import queue
from dataclasses import dataclass, field
from typing import Any

import pynvml


def real_nvml_works() -> bool:
    """True on a machine whose real NVML initialises (a GPU machine)."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)  # pynvml maps the code to its subclass (NVMLError_GpuIsLost...)


@dataclass
class FakeGpu:
    uuid: str
    bus_id: str
    name: str = "NVIDIA H100 80GB HBM3"
    utilization: int = 37
    memory_used: int = 10 * 2**30
    memory_total: int = 80 * 2**30
    memory_reserved: int = 512 * 2**20
    power_mw: int = 312_500
    energy_mj: int = 123_456_789
    temperature: int = 54
    sm_mhz: int = 1980
    reasons: int = 0x4 | 0x20  # sw_power_cap, sw_thermal_slowdown
    ecc: tuple[int, int] = (3, 1)
    replays: int = 7
    pcie: tuple[int, int, int, int] = (16, 16, 4, 5)  # width, its maximum, generation, its maximum
    pids: list[int] = field(default_factory=list)
    mig_uuids: tuple[str, ...] = ()
    lost: bool = False
    unsupported: set[str] = field(default_factory=set)
    xid_events: bool = True


class Handle:
    def __init__(self, index: int, mig: str | None = None) -> None:
        self.index = index
        self.mig = mig


class FakeDriver:
    """``install(monkeypatch)`` puts it behind pynvml; ``calls`` counts each function's use."""

    def __init__(
        self, gpus: list[FakeGpu], init_error: int | None = None, missing: tuple[str, ...] = ()
    ) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.missing = missing  # functions this "driver" lacks (NVMLError_FunctionNotFound)
        self.calls: collections.Counter[str] = collections.Counter()
        self.handles = [Handle(i) for i in range(len(gpus))]
        self.events: queue.Queue[tuple[Handle, int]] = queue.Queue()
        self.initialised = 0

    def xid(self, index: int, code: int) -> None:
        self.events.put((self.handles[index], code))

    def install(self, monkeypatch: Any) -> FakeDriver:
        for name in dir(self):
            if name.startswith("nvml"):
                monkeypatch.setattr(pynvml, name, self._counted(name, getattr(self, name)))
        return self

    def _counted(self, name: str, fn: Any) -> Any:
        def call(*args: Any) -> Any:
            self.calls[name] += 1
            if name in self.missing:
                raise error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
            return fn(*args)

        return call

    def _gpu(self, handle: Handle, what: str = "") -> FakeGpu:
        gpu = self.gpus[handle.index]
        if gpu.lost:
            raise error(pynvml.NVML_ERROR_GPU_IS_LOST)
        if what in gpu.unsupported:
            raise error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    # -- library --------------------------------------------------------------------------------
    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise error(self.init_error)
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self.initialised -= 1

    # -- devices --------------------------------------------------------------------------------
    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Handle:
        if not 0 <= index < len(self.gpus):
            raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self.handles[index]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Handle:
        for handle, gpu in zip(self.handles, self.gpus):
            if gpu.uuid == uuid:
                return handle
            if uuid in gpu.mig_uuids:
                return Handle(handle.index, mig=uuid)
        raise error(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetHandleByPciBusId(self, bus_id: str) -> Handle:
        for handle, gpu in zip(self.handles, self.gpus):
            if gpu.bus_id.upper() == bus_id.upper():
                return handle
        raise error(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceIsMigDeviceHandle(self, handle: Handle) -> bool:
        return handle.mig is not None

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, handle: Handle) -> Handle:
        return self.handles[handle.index]

    def nvmlDeviceGetMigMode(self, handle: Handle) -> list[int]:
        enabled = int(bool(self._gpu(handle, "mig").mig_uuids))  # [current, pending]
        return [enabled, enabled]

    def nvmlDeviceGetIndex(self, handle: Handle) -> int:
        self._gpu(handle)
        return handle.index

    def nvmlDeviceGetUUID(self, handle: Handle) -> str:
        return self._gpu(handle).uuid

    def nvmlDeviceGetName(self, handle: Handle) -> str:
        return self._gpu(handle).name

    def nvmlDeviceGetPciInfo(self, handle: Handle) -> Any:
        gpu = self._gpu(handle)
        info = pynvml.nvmlPciInfo_t()
        info.busId = gpu.bus_id.encode()
        info.busIdLegacy = gpu.bus_id[4:].encode()
        return info

    # -- metrics --------------------------------------------------------------------------------
    def nvmlDeviceGetUtilizationRates(self, handle: Handle) -> Any:
        gpu = self._gpu(handle, "utilization")
        return pynvml.c_nvmlUtilization_t(gpu=gpu.utilization, memory=gpu.utilization // 2)

    def nvmlDeviceGetMemoryInfo(self, handle: Handle, version: int | None = None) -> Any:
        gpu = self._gpu(handle, "memory")
        if not version:  # v1: used = total - free, reserved memory included
            return pynvml.c_nvmlMemory_t(
                total=gpu.memory_total,
                free=gpu.memory_total - gpu.memory_used,
                used=gpu.memory_used + gpu.memory_reserved,
            )
        if "memory_v2" in gpu.unsupported:
            raise error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return pynvml.c_nvmlMemory_v2_t(
            version=version,
            total=gpu.memory_total,
            reserved=gpu.memory_reserved,
            free=gpu.memory_total - gpu.memory_used - gpu.memory_reserved,
            used=gpu.memory_used,
        )

    def nvmlDeviceGetPowerUsage(self, handle: Handle) -> int:
        return self._gpu(handle, "power").power_mw

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Handle) -> int:
        return self._gpu(handle, "energy").energy_mj

    def nvmlDeviceGetTemperature(self, handle: Handle, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return self._gpu(handle, "temperature").temperature

    def nvmlDeviceGetClockInfo(self, handle: Handle, clock: int) -> int:
        assert clock == pynvml.NVML_CLOCK_SM
        return self._gpu(handle, "clock").sm_mhz

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Handle) -> int:
        return self._gpu(handle, "reasons").reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: Handle) -> int:
        return self._gpu(handle, "reasons").reasons

    def nvmlDeviceGetTotalEccErrors(self, handle: Handle, error_type: int, counter: int) -> int:
        assert counter == pynvml.NVML_VOLATILE_ECC
        gpu = self._gpu(handle, "ecc")
        return gpu.ecc[0] if error_type == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED else gpu.ecc[1]

    def nvmlDeviceGetPcieReplayCounter(self, handle: Handle) -> int:
        return self._gpu(handle, "replays").replays

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: Handle) -> int:
        return self._gpu(handle, "pcie").pcie[0]

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: Handle) -> int:
        return self._gpu(handle, "pcie").pcie[1]

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: Handle) -> int:
        return self._gpu(handle, "pcie").pcie[2]

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: Handle) -> int:
        return self._gpu(handle, "pcie").pcie[3]

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Handle) -> list[Any]:
        gpu = self._gpu(handle, "processes")
        return [pynvml.nvmlFriendlyObject({"pid": p, "usedGpuMemory": 2**30}) for p in gpu.pids]

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: Handle) -> list[Any]:
        self._gpu(handle, "processes")
        return []

    # -- events ---------------------------------------------------------------------------------
    def nvmlEventSetCreate(self) -> object:
        return object()

    def nvmlDeviceGetSupportedEventTypes(self, handle: Handle) -> int:
        return pynvml.nvmlEventTypeXidCriticalError if self._gpu(handle).xid_events else 0

    def nvmlDeviceRegisterEvents(self, handle: Handle, types: int, event_set: object) -> None:
        assert types == pynvml.nvmlEventTypeXidCriticalError

    def nvmlEventSetWait(self, event_set: object, timeout_ms: int) -> Any:
        try:
            handle, code = self.events.get(timeout=timeout_ms / 1000.0)
        except queue.Empty:
            raise error(pynvml.NVML_ERROR_TIMEOUT) from None
        return pynvml.nvmlFriendlyObject(
            {
                "device": handle,
                "eventType": pynvml.nvmlEventTypeXidCriticalError,
                "eventData": code,
                "gpuInstanceId": 0,
                "computeInstanceId": 0,
            }
        )

    def nvmlEventSetFree(self, event_set: object) -> None:
        pass


def two_gpus(**first: Any) -> list[FakeGpu]:
    return [
        FakeGpu(
            uuid="GPU-1f1e0c3a-0000-4000-8000-000000000000", bus_id="00000000:18:00.0", **first
        ),
        FakeGpu(
            uuid="GPU-2b2d9e77-0000-4000-8000-000000000001",
            bus_id="00000000:2A:00.0",
            utilization=0,
            temperature=41,
            reasons=0x1,
        ),
    ]
