"""GPU metrics from NVML. The only module that imports ``pynvml`` (nvidia-ml-py), lazily.

When NVML cannot work here (the package or the driver's library is missing, the driver is
not loaded, library and driver versions differ, no permission) ``open_nvml`` logs one line
that says why and what to do, and GPU metrics stay off; everything else goes on.

Most NVML queries take microseconds, but a few take milliseconds (total energy, ECC
counters, PCIe replays). ``GpuReader`` reads the quick ones on every call and the slow
ones only through ``refresh_slow()``, at most every ``slow_interval`` seconds, which
callers run off their own thread (``RankGpu``) or on a timer (the node daemon). A GPU
that vanishes (NVML: "GPU is lost", XID 79) turns its reader off with one log line.
Nothing here imports torch: the daemon uses this module too.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..fuses import Fuse

log = logging.getLogger("ddpmon")

Sample = tuple[str, dict[str, str], float]

SLOW_INTERVAL = 10.0
"""Seconds between reads of the slow NVML queries (energy, ECC, PCIe replays)."""

# NVML's clock event (throttle) reason bits, stable in its ABI; one 0/1 series per reason.
CLOCK_EVENT_REASONS: tuple[tuple[str, int], ...] = (
    ("gpu_idle", 0x1),
    ("applications_clocks_setting", 0x2),
    ("sw_power_cap", 0x4),
    ("hw_slowdown", 0x8),
    ("sync_boost", 0x10),
    ("sw_thermal_slowdown", 0x20),
    ("hw_thermal_slowdown", 0x40),
    ("hw_power_brake_slowdown", 0x80),
    ("display_clock_setting", 0x100),
)

XID_CRITICAL_ERROR_EVENT = 0x8  # nvmlEventTypeXidCriticalError

_WHY = {
    "NVMLError_LibraryNotFound": (
        "the NVML library libnvidia-ml.so.1 is not on this machine: no NVIDIA driver is "
        "installed, or (in a container) the NVIDIA container runtime did not mount it"
    ),
    "NVMLError_DriverNotLoaded": (
        "the NVIDIA kernel driver is not loaded (nvidia-smi fails too): load it "
        "(modprobe nvidia) or reinstall the driver"
    ),
    "NVMLError_LibRmVersionMismatch": (
        "the NVML library and the loaded kernel driver are different versions (the driver "
        "was upgraded without a reboot): reboot the node or reload the nvidia kernel modules"
    ),
    "NVMLError_NoPermission": "no permission to use the GPU devices (/dev/nvidia*): run as a user that may",
    "NVMLError_GpuIsLost": (
        "the GPU is lost (fallen off the bus, XID 79): drain the node, then reset or replace the GPU"
    ),
    "NVMLError_ResetRequired": "the GPU needs a reset (nvidia-smi -r) before it can be used again",
    "NVMLError_FunctionNotFound": (
        "the driver's NVML library lacks a function nvidia-ml-py needs (the driver is older "
        "than the package): upgrade the driver or install an older nvidia-ml-py"
    ),
}

_LOST = ("NVMLError_GpuIsLost", "NVMLError_ResetRequired")
_UNSUPPORTED = ("NVMLError_NotSupported", "NVMLError_NoPermission", "NVMLError_FunctionNotFound")


def explain(exc: BaseException) -> str:
    """A sentence for an NVML failure: what it means and what to do."""
    name = type(exc).__name__
    why = _WHY.get(name)
    return f"{why} ({name})" if why else f"NVML failed: {name}: {exc}"


def is_lost(exc: BaseException) -> bool:
    return type(exc).__name__ in _LOST


Note = Callable[[str], None]
"""Where a rank's GPU source says what is wrong with it besides the log (the state file's
``notes["gpu_metrics"]``)."""


def open_nvml(who: str, note: Note | None = None) -> Any | None:
    """Import pynvml and initialise NVML; the module, or None after one warning saying why
    GPU metrics are off (also given to ``note``). ``who`` names the caller in that line
    ("rank 3", "daemon")."""
    try:
        nv = importlib.import_module("pynvml")
    except ImportError:
        _off(who, "the nvidia-ml-py package is not installed (pip install nvidia-ml-py)", note)
        return None
    try:
        nv.nvmlInit()
    except Exception as exc:
        _off(who, explain(exc), note)
        return None
    return nv


def _off(who: str, why: str, note: Note | None) -> None:
    text = f"GPU metrics are off: {why}"
    log.warning("ddpmon: %s: %s", who, text)
    if note is not None:
        note(text)


def close_nvml(nv: Any) -> None:
    """Undo one ``open_nvml`` (NVML counts its initialisations)."""
    try:
        nv.nvmlShutdown()
    except Exception:
        pass


# -- devices ------------------------------------------------------------------------------------


@dataclass
class Gpu:
    """One physical GPU as NVML sees it. ``index`` is NVML's (PCI bus order), the ``gpu``
    label dcgm-exporter uses too."""

    index: int
    uuid: str
    pci_bus_id: str
    name: str
    handle: Any = field(repr=False, compare=False)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def normalize_bus_id(bus_id: str) -> str:
    """``0000:65:00.0`` and ``00000000:65:00.0`` alike become ``00000000:65:00.0``."""
    bus_id = bus_id.strip().upper()
    domain, sep, rest = bus_id.partition(":")
    return f"{domain.zfill(8)}{sep}{rest}" if sep else bus_id


def describe_gpu(nv: Any, handle: Any) -> Gpu:
    pci = nv.nvmlDeviceGetPciInfo(handle)
    bus_id = _text(getattr(pci, "busId", b"") or getattr(pci, "busIdLegacy", b""))
    return Gpu(
        index=int(nv.nvmlDeviceGetIndex(handle)),
        uuid=_text(nv.nvmlDeviceGetUUID(handle)),
        pci_bus_id=normalize_bus_id(bus_id),
        name=_text(nv.nvmlDeviceGetName(handle)),
        handle=handle,
    )


def list_gpus(nv: Any) -> list[Gpu]:
    """Every GPU of the node, by NVML index. A GPU NVML cannot describe (lost) is logged
    and left out."""
    gpus = []
    for index in range(nv.nvmlDeviceGetCount()):
        try:
            gpus.append(describe_gpu(nv, nv.nvmlDeviceGetHandleByIndex(index)))
        except Exception as exc:
            log.warning("ddpmon: GPU %d is left out: %s", index, explain(exc))
    return gpus


def _physical(nv: Any, handle: Any) -> Any:
    """The whole GPU behind a MIG instance handle (metrics are per physical GPU)."""
    try:
        if nv.nvmlDeviceIsMigDeviceHandle(handle):
            return nv.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)
    except Exception:
        pass
    return handle


def _by_uuid(nv: Any, text: str) -> Any | None:
    """The physical GPU whose (GPU- or MIG-) UUID is ``text``, with or without its prefix."""
    text, core = text.strip(), _strip_uuid(text)
    for candidate in (text, "GPU-" + core, "MIG-" + core):
        try:
            return _physical(nv, nv.nvmlDeviceGetHandleByUUID(candidate))
        except Exception:
            continue
    return None


def _strip_uuid(text: str) -> str:
    text = text.strip()
    for prefix in ("GPU-", "MIG-"):
        if text.upper().startswith(prefix):
            return text[len(prefix) :].lower()
    return text.lower()


def resolve(
    nv: Any,
    cuda_index: int,
    visible: str | None = None,
    uuid: str | None = None,
    pci_bus_id: str | None = None,
) -> tuple[Gpu, str]:
    """The NVML device behind torch's ``cuda:<cuda_index>``, and how it was confirmed.

    CUDA numbers only the devices in CUDA_VISIBLE_DEVICES (indices, or GPU-/MIG- UUIDs,
    possibly abbreviated), and by default orders them fastest first rather than by PCI bus
    as NVML does. So: torch's own UUID of the device wins when it matches an NVML device;
    otherwise the CUDA_VISIBLE_DEVICES entry is looked up and checked against torch's PCI
    bus id, which also decides when the two disagree. Raises LookupError with the reason.
    Returns (gpu, "uuid" | "pci_bus_id" | "unconfirmed").
    """
    if uuid:
        handle = _by_uuid(nv, uuid)
        if handle is not None:
            return describe_gpu(nv, handle), "uuid"
    entries = [e.strip() for e in visible.split(",")] if visible not in (None, "") else None
    if entries is not None and not 0 <= cuda_index < len(entries):
        raise LookupError(
            f"cuda:{cuda_index} is not in CUDA_VISIBLE_DEVICES={visible!r} ({len(entries)} entries)"
        )
    entry = entries[cuda_index] if entries is not None else str(cuda_index)
    if uuid and not pci_bus_id:
        raise LookupError(
            f"torch's UUID of cuda:{cuda_index}, {uuid}, is not one NVML knows, and torch gives no "
            f"PCI bus id to check the CUDA_VISIBLE_DEVICES entry {entry!r} against: that GPU could "
            "be another one"
        )
    if entry.upper().startswith(("GPU-", "MIG-")):
        gpu = _by_uuid_prefix(nv, entry)
    else:
        try:
            index = int(entry)
        except ValueError:
            raise LookupError(
                f"CUDA_VISIBLE_DEVICES entry {entry!r} is neither an index nor a GPU-/MIG- UUID"
            ) from None
        count = nv.nvmlDeviceGetCount()
        if not 0 <= index < count:
            raise LookupError(
                f"CUDA_VISIBLE_DEVICES entry {entry!r} is not one of NVML's {count} GPU(s)"
            )
        gpu = describe_gpu(nv, nv.nvmlDeviceGetHandleByIndex(index))
    if not pci_bus_id:
        return gpu, "unconfirmed"
    wanted = normalize_bus_id(pci_bus_id)
    if gpu.pci_bus_id == wanted:
        return gpu, "pci_bus_id"
    try:
        return describe_gpu(nv, nv.nvmlDeviceGetHandleByPciBusId(wanted)), "pci_bus_id"
    except Exception as exc:
        raise LookupError(
            f"cuda:{cuda_index} has PCI bus id {wanted}, which NVML does not know ({explain(exc)})"
        ) from None


def in_mig_mode(nv: Any, gpu: Gpu) -> bool:
    """Whether ``gpu`` is split into MIG instances: a CUDA process on it then runs on one
    instance, and NVML's figures of the GPU are those of every instance together."""
    try:
        current, _pending = nv.nvmlDeviceGetMigMode(gpu.handle)
        return bool(current)
    except Exception:  # a GPU without MIG, or a driver older than MIG
        return False


def _by_uuid_prefix(nv: Any, entry: str) -> Gpu:
    """A CUDA_VISIBLE_DEVICES UUID entry (CUDA accepts unique prefixes)."""
    handle = _by_uuid(nv, entry)
    if handle is not None:
        return describe_gpu(nv, handle)
    wanted = _strip_uuid(entry)
    matches = [g for g in list_gpus(nv) if _strip_uuid(g.uuid).startswith(wanted)]
    if len(matches) != 1:
        raise LookupError(
            f"CUDA_VISIBLE_DEVICES entry {entry!r} matches {len(matches)} GPUs by UUID, not one"
        )
    return matches[0]


# -- reading one GPU ------------------------------------------------------------------------


class GpuLost(Exception):
    """The GPU stopped answering NVML (fallen off the bus, XID 79, or needs a reset)."""


class GpuReader:
    """Reads one GPU. ``read()`` is cheap (microsecond NVML queries plus the cached slow
    values); ``refresh_slow()`` runs the slow queries. A query the GPU does not support
    (or that fails) is switched off for good after one log line, like psutil's capability
    checks; a lost GPU raises GpuLost from either."""

    def __init__(self, nv: Any, gpu: Gpu, slow_interval: float = SLOW_INTERVAL) -> None:
        self.nv = nv
        self.gpu = gpu
        self.slow_interval = slow_interval
        self._off: set[str] = set()
        self._slow: list[tuple[str, dict[str, str], float]] = []
        self._slow_at: float | None = None

    def slow_due(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return self._slow_at is None or now - self._slow_at >= self.slow_interval

    def read(self, labels: dict[str, str]) -> list[Sample]:
        nv, out = self.nv, []

        def add(name: str, value: float | None, extra: dict[str, str] | None = None) -> None:
            if value is not None:
                out.append((name, {**labels, **extra} if extra else labels, float(value)))

        util = self._query("utilization", nv.nvmlDeviceGetUtilizationRates)
        add("ddpmon_gpu_utilization_ratio", util.gpu / 100.0 if util is not None else None)
        memory = self._memory()
        if memory is not None:
            add("ddpmon_gpu_memory_used_bytes", memory.used)
            add("ddpmon_gpu_memory_total_bytes", memory.total)
        power = self._query("power", nv.nvmlDeviceGetPowerUsage)
        add("ddpmon_gpu_power_watts", power / 1000.0 if power is not None else None)
        add(
            "ddpmon_gpu_temperature_celsius",
            self._query("temperature", nv.nvmlDeviceGetTemperature, 0),
        )
        sm = self._query("sm_clock", nv.nvmlDeviceGetClockInfo, 1)  # NVML_CLOCK_SM, in MHz
        add("ddpmon_gpu_sm_clock_hertz", sm * 1e6 if sm is not None else None)
        reasons = self._clock_event_reasons()
        if reasons is not None:
            for name, bit in CLOCK_EVENT_REASONS:
                add(
                    "ddpmon_gpu_clock_event_active", 1.0 if reasons & bit else 0.0, {"reason": name}
                )
        for name, extra, value in self._slow:
            add(name, value, extra)
        return out

    def refresh_slow(self) -> None:
        """Read the slow queries now (milliseconds): total energy, ECC, PCIe replays."""
        nv, slow = self.nv, list[tuple[str, dict[str, str], float]]()
        energy = self._query("energy", nv.nvmlDeviceGetTotalEnergyConsumption)  # mJ
        if energy is not None:
            slow.append(("ddpmon_gpu_energy_joules_total", {}, energy / 1000.0))
        for kind, code in (("corrected", 0), ("uncorrected", 1)):  # volatile: since driver load
            count = self._query(f"ecc_{kind}", nv.nvmlDeviceGetTotalEccErrors, code, 0)
            if count is not None:
                slow.append(("ddpmon_gpu_ecc_errors_total", {"type": kind}, float(count)))
        replays = self._query("pcie_replays", nv.nvmlDeviceGetPcieReplayCounter)
        if replays is not None:
            slow.append(("ddpmon_gpu_pcie_replays_total", {}, float(replays)))
        self._slow = slow
        self._slow_at = time.monotonic()

    def processes(self) -> list[int]:
        """Pids of the processes using this GPU (compute and graphics), as NVML sees them."""
        pids: list[int] = []
        for what, fn in (
            ("compute_processes", self.nv.nvmlDeviceGetComputeRunningProcesses),
            ("graphics_processes", self.nv.nvmlDeviceGetGraphicsRunningProcesses),
        ):
            for proc in self._query(what, fn) or ():
                if proc.pid not in pids:
                    pids.append(int(proc.pid))
        return pids

    def _memory(self) -> Any:
        """Memory info v2, whose ``used`` leaves out driver-reserved memory as nvidia-smi
        does; v1 (used = total - free) where the driver lacks v2."""
        version = getattr(self.nv, "nvmlMemory_v2", None)
        if version is not None and "memory_v2" not in self._off:
            memory = self._query("memory_v2", self.nv.nvmlDeviceGetMemoryInfo, version)
            if memory is not None:
                return memory
        return self._query("memory", self.nv.nvmlDeviceGetMemoryInfo)

    def _clock_event_reasons(self) -> int | None:
        if "clock_events" not in self._off:
            try:
                return int(self.nv.nvmlDeviceGetCurrentClocksEventReasons(self.gpu.handle))
            except Exception as exc:
                if is_lost(exc):
                    raise GpuLost(explain(exc)) from None
                if (
                    not isinstance(exc, AttributeError)
                    and type(exc).__name__ != "NVMLError_FunctionNotFound"
                ):
                    self._switch_off("clock_events", exc)
                    return None
                self._off.add("clock_events")  # drivers before 535 call them throttle reasons
        reasons: int | None = self._query(
            "throttle_reasons", self.nv.nvmlDeviceGetCurrentClocksThrottleReasons
        )
        return reasons

    def _query(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        if what in self._off:
            return None
        try:
            return fn(self.gpu.handle, *args)
        except Exception as exc:
            if is_lost(exc):
                raise GpuLost(explain(exc)) from None
            return self._switch_off(what, exc)

    def _switch_off(self, what: str, exc: BaseException) -> None:
        self._off.add(what)
        level = logging.INFO if type(exc).__name__ in _UNSUPPORTED else logging.WARNING
        log.log(
            level,
            "ddpmon: GPU %d (%s): %s is not available (%s); not read again",
            self.gpu.index,
            self.gpu.uuid,
            what.replace("_", " "),
            explain(exc),
        )
        return None


# -- the rank's own GPU ------------------------------------------------------------------------


class RankGpu:
    """The sample source for one rank's GPU. Scrapes read the quick queries and the cached
    slow values; when those are older than ``slow_interval`` a short-lived thread refreshes
    them, so neither the training loop nor a scrape ever waits on a slow query."""

    def __init__(self, reader: GpuReader, labels: dict[str, str], note: Note | None = None) -> None:
        self.reader = reader
        self.labels = labels
        self._note = note
        self._fuse = Fuse(f"GPU metrics (GPU {reader.gpu.index})")
        self._lock = threading.Lock()
        self._refreshing = False
        self._lost = False
        self._refresh_in_background()

    def samples(self) -> list[Sample]:
        if self._lost or not self._fuse.ok:
            return []
        try:
            out = self.reader.read(self.labels)
        except GpuLost as exc:
            self._on_lost(exc)
            return []
        except Exception as exc:
            self._fuse.blow(exc)
            return []
        if self.reader.slow_due():
            self._refresh_in_background()
        return out

    def _refresh_in_background(self) -> None:
        with self._lock:
            if self._refreshing:
                return
            self._refreshing = True
        threading.Thread(target=self._refresh, name="ddpmon-gpu-slow", daemon=True).start()

    def _refresh(self) -> None:
        try:
            self.reader.refresh_slow()
        except GpuLost as exc:
            self._on_lost(exc)
        except Exception as exc:
            self._fuse.blow(exc)
        finally:
            with self._lock:
                self._refreshing = False

    def close(self) -> None:
        """Stop sampling and release this source's NVML initialisation (at detach)."""
        with self._lock:
            if self._lost:
                return
            self._lost = True
        close_nvml(self.reader.nv)

    def _on_lost(self, exc: GpuLost) -> None:
        if not self._lost:
            self._lost = True
            gpu = self.reader.gpu
            text = f"GPU {gpu.index} ({gpu.uuid}): {exc}; its metrics are off"
            log.warning("ddpmon: rank %s: %s", self.labels.get("rank"), text)
            if self._note is not None:
                self._note(text)


def rank_gpu(
    job: str,
    rank: int | str,
    cuda_index: int,
    uuid: str | None = None,
    pci_bus_id: str | None = None,
    visible: str | None = None,
    slow_interval: float = SLOW_INTERVAL,
    note: Note | None = None,
) -> RankGpu | None:
    """The GPU source of one rank, or None (after one log line, also given to ``note``)
    when NVML cannot serve it. A mapping it could not confirm, or a MIG instance, is served
    with one warning (and note) that says so. ``visible`` defaults to this process's
    CUDA_VISIBLE_DEVICES."""
    who = f"rank {rank}"
    nv = open_nvml(who, note)
    if nv is None:
        return None
    if visible is None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        gpu, how = resolve(nv, cuda_index, visible, uuid, pci_bus_id)
    except Exception as exc:
        reason = str(exc) if isinstance(exc, LookupError) else explain(exc)
        _off(
            who,
            f"cannot find cuda:{cuda_index} in NVML: {reason} (the node daemon, `ddpmon "
            "daemon`, still exports every GPU of the node)",
            note,
        )
        close_nvml(nv)
        return None
    caveat = None
    if in_mig_mode(nv, gpu):
        caveat = (
            f"cuda:{cuda_index} is a MIG instance of NVML GPU {gpu.index} ({gpu.uuid}): the GPU "
            "metrics are the whole GPU's, shared with its other instances, and NVML has no "
            "utilization in MIG mode (dcgm-exporter has per-instance figures)"
        )
    elif how == "unconfirmed":
        caveat = (
            f"cuda:{cuda_index} taken to be NVML GPU {gpu.index} ({gpu.uuid}) without "
            "confirmation by UUID or PCI bus id (torch reports neither)"
        )
    if caveat is not None:
        log.warning("ddpmon: %s: %s", who, caveat)
        if note is not None:
            note(caveat)
    else:
        log.info(
            "ddpmon: %s: cuda:%d is NVML GPU %d (%s), confirmed by %s",
            who,
            cuda_index,
            gpu.index,
            gpu.uuid,
            how,
        )
    labels = {"job": str(job), "rank": str(rank), "gpu": str(gpu.index), "gpu_uuid": gpu.uuid}
    return RankGpu(GpuReader(nv, gpu, slow_interval), labels, note)


# -- XID errors (node daemon) --------------------------------------------------------------------


def _handle_key(handle: Any) -> int:
    """A value identifying a device handle (NVML hands out the same pointer per device)."""
    try:
        return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)
    except (TypeError, ctypes.ArgumentError):
        return id(handle)


class XidWatcher:
    """Waits for XID error events on every GPU (a thread) and reports each to ``on_xid(gpu,
    code, unix_time)``. GPUs that do not support the event are skipped with one log line."""

    def __init__(
        self,
        nv: Any,
        gpus: list[Gpu],
        on_xid: Callable[[Gpu, int, float], None],
        wait_ms: int = 500,
    ) -> None:
        self.nv = nv
        self._on_xid = on_xid
        self._wait_ms = wait_ms
        self._stop = threading.Event()
        self._by_handle: dict[int, Gpu] = {}
        self._set: Any = None
        self._thread = threading.Thread(target=self._run, name="ddpmon-xid-events", daemon=True)
        self._gpus = gpus

    def start(self) -> bool:
        """Register the GPUs; True when at least one reports XID events."""
        nv = self.nv
        try:
            self._set = nv.nvmlEventSetCreate()
        except Exception as exc:
            log.warning("ddpmon: daemon: XID errors are not watched: %s", explain(exc))
            return False
        for gpu in self._gpus:
            try:
                supported = nv.nvmlDeviceGetSupportedEventTypes(gpu.handle)
                if not supported & XID_CRITICAL_ERROR_EVENT:
                    raise RuntimeError("the GPU does not report XID events")
                nv.nvmlDeviceRegisterEvents(gpu.handle, XID_CRITICAL_ERROR_EVENT, self._set)
                self._by_handle[_handle_key(gpu.handle)] = gpu
            except Exception as exc:
                why = explain(exc) if type(exc).__name__.startswith("NVMLError") else str(exc)
                log.warning(
                    "ddpmon: daemon: GPU %d (%s): XID errors are not watched: %s",
                    gpu.index,
                    gpu.uuid,
                    why,
                )
        if not self._by_handle:
            self._free()
            return False
        self._thread.start()
        return True

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._free()

    def _free(self) -> None:
        if self._set is not None and not self._thread.is_alive():
            try:
                self.nv.nvmlEventSetFree(self._set)
            except Exception:
                pass
            self._set = None

    def _run(self) -> None:
        failing: str | None = None
        while not self._stop.is_set():
            try:
                data = self.nv.nvmlEventSetWait(self._set, self._wait_ms)
            except Exception as exc:
                name = type(exc).__name__
                if name == "NVMLError_Timeout":
                    continue
                if name != failing:  # say each kind of failure once, then keep waiting
                    failing = name
                    log.warning(
                        "ddpmon: daemon: waiting for XID events failed: %s; retrying", explain(exc)
                    )
                self._stop.wait(1.0)
                continue
            failing = None
            try:
                if data.eventType & XID_CRITICAL_ERROR_EVENT:
                    gpu = self._by_handle.get(_handle_key(data.device))
                    if gpu is not None:
                        self._on_xid(gpu, int(data.eventData), time.time())
            except Exception as exc:  # the loop cannot die
                log.warning("ddpmon: daemon: an XID event could not be handled: %r", exc)
