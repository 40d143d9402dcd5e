"""What a node can see of itself before a job: its GPUs (through NVML, every query bounded in
time), free disk where checkpoints go, ``/dev/shm``, the open-file limit. Torch-free.

Each check ends in a *problem* (the host is named, with the fix) or a *warning* (printed,
never named): a GPU's PCIe generation, for one, drops while it idles, so a generation below
the maximum is only a warning, while a narrower link is a problem.
"""

from __future__ import annotations

import os
import resource
import shutil
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ..collectors import nvml

MIN_SHM_BYTES = 256 * 2**20
"""Under this, DataLoader workers fail with "bus error" (Docker's default is 64 MiB)."""
MIN_OPEN_FILES = 4096
"""An open-file limit under this is a warning: DataLoader workers pass tensors as files."""
GPU_SECONDS = 10.0
"""NVML gets this long for all of a node's GPU checks; a driver that hangs is a problem."""
THROTTLE_BAD = {
    "hw_slowdown",
    "sw_thermal_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
}
"""Clock event reasons that slow a GPU for a fault (heat, power brake), not by choice."""
NVLINK_MAX_LINKS = 18
NVLINK_ERROR_COUNTERS = (("replay", 0), ("recovery", 1), ("crc_flit", 2), ("crc_data", 3))


@dataclass
class NodeCheck:
    """One node's view of itself, as ``checks`` in ``ddpmon preflight --json``."""

    host: str
    node: int
    checkpoint_dir: str
    free_disk_bytes: int | None = None
    shm_bytes: int | None = None
    open_files_soft: int | None = None
    open_files_hard: int | None = None
    gpus: list[dict[str, Any]] = field(default_factory=list)
    clock_offset_seconds: float | None = None
    """This node's clock minus node 0's (NTP-style through the store)."""
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def check_node(host: str, node: int, checkpoint_dir: str, min_free_disk: int) -> NodeCheck:
    """Every check of this node but the clock (measured against node 0 by the caller)."""
    check = NodeCheck(host=host, node=node, checkpoint_dir=os.path.abspath(checkpoint_dir))
    _disk(check, min_free_disk)
    _shm(check)
    _open_files(check)
    _gpus(check)
    return check


def _disk(check: NodeCheck, min_free: int) -> None:
    path = check.checkpoint_dir
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)  # not made yet: the disk it will be made on
    try:
        check.free_disk_bytes = shutil.disk_usage(path).free
    except OSError as exc:
        check.problems.append(f"cannot read the free space of {check.checkpoint_dir}: {exc}")
        return
    if check.free_disk_bytes < min_free:
        check.problems.append(
            f"{check.free_disk_bytes / 2**30:.1f} GiB free in {check.checkpoint_dir}, under "
            f"--min-free-disk {min_free / 2**30:.1f} GiB: free space, or point "
            "--checkpoint-dir at the disk the job writes its checkpoints to"
        )


def _shm(check: NodeCheck) -> None:
    try:
        check.shm_bytes = shutil.disk_usage("/dev/shm").total
    except OSError:
        check.warnings.append("no /dev/shm: DataLoader workers cannot share memory here")
        return
    if check.shm_bytes < MIN_SHM_BYTES:
        check.problems.append(
            f"/dev/shm is {check.shm_bytes / 2**20:.0f} MiB, under {MIN_SHM_BYTES // 2**20} MiB: "
            "DataLoader workers will fail with 'bus error'; give the container more "
            "(docker run --shm-size=8g, or a memory emptyDir at /dev/shm in Kubernetes)"
        )


def _open_files(check: NodeCheck) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    check.open_files_soft, check.open_files_hard = soft, hard
    if soft != resource.RLIM_INFINITY and soft < MIN_OPEN_FILES:
        check.warnings.append(
            f"open-file limit {soft}, under {MIN_OPEN_FILES}: DataLoader workers may fail with "
            f"'Too many open files'; raise it (ulimit -n {min(hard, 65536)} before the job)"
        )


def _gpus(check: NodeCheck) -> None:
    """The GPU checks in a thread given ``GPU_SECONDS``: a hung NVML call is a finding, not a
    hang of preflight."""
    out: list[dict[str, Any]] = []
    found: list[str] = []
    done = threading.Event()

    if not _has_nvidia():
        return  # no NVIDIA driver here: nothing to check, nothing to say

    def work() -> None:
        try:
            nv = nvml.open_nvml(f"preflight on {check.host}")
            if nv is None:
                return  # no GPU, or NVML off: said once in the log
            try:
                for gpu in nvml.list_gpus(nv):
                    out.append(gpu_health(nv, gpu, found))
            finally:
                nvml.close_nvml(nv)
        except Exception as exc:
            found.append(f"NVML failed: {nvml.explain(exc)}")
        finally:
            done.set()

    threading.Thread(target=work, name="ddpmon-preflight-nvml", daemon=True).start()
    if not done.wait(GPU_SECONDS):
        check.problems.append(
            f"NVML did not answer within {GPU_SECONDS:g} s (a hung driver or GPU): "
            "run nvidia-smi on this node; drain it if that hangs too"
        )
        return
    check.gpus = out
    check.problems.extend(found)


def gpu_health(nv: Any, gpu: nvml.Gpu, problems: list[str]) -> dict[str, Any]:
    """One GPU's health facts; what is wrong is added to ``problems`` with its fix. A query
    the GPU does not support is left out."""
    h = gpu.handle
    name = f"GPU {gpu.index} ({gpu.pci_bus_id})"

    def ask(fn: str, *args: Any) -> Any:
        try:
            return getattr(nv, fn)(h, *args)
        except Exception as exc:
            if nvml.is_lost(exc):
                raise
            return None

    facts: dict[str, Any] = {"index": gpu.index, "uuid": gpu.uuid, "name": gpu.name}
    ecc = ask("nvmlDeviceGetTotalEccErrors", 1, 0)  # uncorrected, volatile
    facts["ecc_uncorrected"] = ecc
    if ecc:
        problems.append(
            f"{name}: {ecc} uncorrected ECC errors since the driver loaded: reset or replace "
            "the GPU"
        )
    pending = ask("nvmlDeviceGetRetiredPagesPendingStatus")
    facts["retired_pages_pending"] = pending
    if pending:
        problems.append(f"{name}: memory pages wait to be retired: reset the GPU (nvidia-smi -r)")
    rows = ask("nvmlDeviceGetRemappedRows")
    if rows is not None:
        _, _, row_pending, row_failed = rows
        facts["remapped_rows_pending"], facts["remapped_rows_failed"] = (
            bool(row_pending),
            bool(row_failed),
        )
        if row_failed:
            problems.append(f"{name}: a row remapping failed: replace the GPU")
        elif row_pending:
            problems.append(
                f"{name}: remapped rows wait for a reset: reset the GPU (nvidia-smi -r)"
            )
    reasons = ask("nvmlDeviceGetCurrentClocksEventReasons")
    if reasons is None:
        reasons = ask("nvmlDeviceGetCurrentClocksThrottleReasons")
    if reasons is not None:
        active = [n for n, bit in nvml.CLOCK_EVENT_REASONS if int(reasons) & bit]
        facts["clock_events"] = active
        bad = sorted(THROTTLE_BAD.intersection(active))
        if bad:
            problems.append(
                f"{name}: clocks slowed ({', '.join(bad)}): check its cooling and power"
            )
    width, max_width = ask("nvmlDeviceGetCurrPcieLinkWidth"), ask("nvmlDeviceGetMaxPcieLinkWidth")
    gen, max_gen = (
        ask("nvmlDeviceGetCurrPcieLinkGeneration"),
        ask("nvmlDeviceGetMaxPcieLinkGeneration"),
    )
    facts["pcie"] = {
        "width": width,
        "max_width": max_width,
        "generation": gen,
        "max_generation": max_gen,
    }
    if width is not None and max_width and width < max_width:
        problems.append(
            f"{name}: PCIe link x{width}, the device's maximum x{max_width}: reseat the GPU or "
            "check its riser"
        )
    if gen is not None and max_gen and gen < max_gen:
        facts["pcie_generation_note"] = "below the maximum (normal while the GPU idles)"
    nvlinks: list[dict[str, Any]] = []
    for link in range(NVLINK_MAX_LINKS):
        state = ask("nvmlDeviceGetNvLinkState", link)
        if state is None:
            continue
        errors = {
            c: ask("nvmlDeviceGetNvLinkErrorCounter", link, code) or 0
            for c, code in NVLINK_ERROR_COUNTERS
        }
        nvlinks.append({"link": link, "active": bool(state), "errors": errors})
    if nvlinks:
        facts["nvlinks"] = nvlinks
        if any(link["active"] for link in nvlinks):
            down = [link["link"] for link in nvlinks if not link["active"]]
            if down:
                problems.append(
                    f"{name}: NVLink {', '.join(map(str, down))} "
                    "down while others are up: reset the GPU or drain the node"
                )
        crc = sum(link["errors"]["crc_flit"] + link["errors"]["crc_data"] for link in nvlinks)
        if crc:
            problems.append(f"{name}: {crc} NVLink CRC errors: a failing link; drain the node")
    return facts


def watch_xids(host: str) -> tuple[list[str], Any]:
    """Start watching XID errors for the time preflight runs; (the list they are written
    to, a ``stop()``); a node without NVML or without the event gets a no-op."""
    seen: list[str] = []
    nv = nvml.open_nvml(f"preflight on {host}") if _has_nvidia() else None
    if nv is None:
        return seen, lambda: None
    watcher = nvml.XidWatcher(
        nv,
        nvml.list_gpus(nv),
        lambda gpu, code, at: seen.append(
            f"GPU {gpu.index} ({gpu.pci_bus_id}): XID {code} at "
            f"{time.strftime('%H:%M:%S', time.localtime(at))}: "
            "see NVIDIA's XID table; drain the node if it repeats"
        ),
    )
    if not watcher.start():
        nvml.close_nvml(nv)
        return seen, lambda: None

    def stop() -> None:
        watcher.stop()
        nvml.close_nvml(nv)

    return seen, stop


def _has_nvidia() -> bool:
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia")
