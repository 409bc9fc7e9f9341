"""Device discovery behind one interface: `cuda` through NVML, `cpu` for hosts without a GPU.

The daemon sees devices only as `DeviceBackend`; `open_backend` picks one and says
why, so an operator reading the log knows whether the GPU was found or skipped.
"""

from __future__ import annotations

import abc
import hashlib
import logging
import os
import platform
import re
import socket
import threading
from dataclasses import dataclass, field
from typing import Any, Final

from nodeagent.nvml import NA, Nvml, NvmlError, NvmlGpuLost, NvmlUnavailable

log = logging.getLogger("nodeagent.devices")

BACKEND_KINDS: Final = ("auto", "cuda", "cpu")


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """One device as seen now; None means the backend cannot measure that value."""

    index: int
    uuid: str
    name: str
    backend: str  # "cuda" | "cpu"
    memory_total_bytes: int
    memory_used_bytes: int | None
    utilization_percent: float | None


@dataclass(frozen=True, slots=True)
class DeviceProcess:
    """A compute process on a device; used memory is None where the driver does not report it.

    ``pid`` is as the driver reports it: the host's pid namespace on most drivers (see
    :class:`nodeagent.procwatch.PidTranslator`). ``mps_client``: listed by NVML as a
    client of the device's MPS server (whose own process is listed apart)."""

    pid: int
    used_memory_bytes: int | None
    mps_client: bool = False


@dataclass(frozen=True, slots=True)
class DeviceFault:
    """NVML reported Xid ``xid`` on ``device`` (an ``nvmlEventTypeXidCriticalError`` event)."""

    device: int
    xid: int
    # Compute processes on the device outside MPS (neither its server nor a client) seen in the pass
    # before the fault or the one with it: 0 means only MPS had contexts there, so an MPS client
    # faulted; None: not looked (the backend alone cannot say).
    outside_mps: int | None = None
    # Of those, the ones visible in the daemon's pid namespace, as :class:`nodeagent.memory.ProcessUse`
    # (pid and parents, read while each was alive): the loop takes out those its MPS sessions own,
    # a client NVML lists only among the compute processes (no MPS list on the driver).
    outside_processes: tuple = field(default=(), compare=False)

    @property
    def ends_contexts(self) -> bool:
        """Whether the Xid is a fault of the work on the GPU that ends the CUDA context it happened
        in (under MPS: every client's of the faulting server). Which Xids: docs/internals.md."""
        return self.xid in CONTEXT_FAULT_XIDS


CONTEXT_FAULT_XIDS: Final = frozenset({13, 31, 43, 45, 94})
_EVENTS_PER_READ = 64  # Xid events taken per read: a storm of them cannot hold the watcher


_CUDA_UUID = re.compile(r"^(GPU|MIG)-[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}$")


def cuda_visible_name(info: DeviceInfo) -> str | None:
    """How ``CUDA_VISIBLE_DEVICES`` names ``info``'s GPU whatever the process inherited and
    whatever order CUDA enumerates in: its UUID as NVML gave it (``GPU-...``); None when NVML
    gave none (then only the index is known, which is NVML's, not CUDA's)."""
    return info.uuid if _CUDA_UUID.match(info.uuid) else None


class DeviceError(Exception):
    """A device cannot be used as asked; the message says what to do instead."""


class DeviceLostError(DeviceError):
    """The GPU has failed (NVML: lost, or needs a reset); its contexts are gone with it."""

    def __init__(self, index: int, uuid: str, detail: str) -> None:
        super().__init__(f"cuda backend: GPU {index} ({uuid}) is lost: {detail}; "
                         "check it with nvidia-smi and reset or replace it")
        self.index = index
        self.uuid = uuid


class CudaUnavailable(DeviceError):
    """The cuda backend cannot start; `reason` is NVML's own explanation."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"cuda backend: NVML unavailable: {reason}; "
                         "install the NVIDIA driver or run with --backend cpu")
        self.reason = reason


class DeviceBackend(abc.ABC):
    """Devices of one kind, numbered 0..count()-1 for the life of the backend."""

    name: str  # "cuda" | "cpu"
    measures_process_memory: bool = False  # processes() reports per-process device memory

    @abc.abstractmethod
    def count(self) -> int:
        """Number of devices."""

    def devices(self) -> list[DeviceInfo]:
        """Live values for every device."""
        return [self.device(index) for index in range(self.count())]

    @abc.abstractmethod
    def device(self, index: int) -> DeviceInfo:
        """Live values for one device; DeviceError for an index out of range."""

    @abc.abstractmethod
    def processes(self, index: int) -> list[DeviceProcess]:
        """Compute processes on the device."""

    def faults(self) -> list[DeviceFault]:
        """Faults of the work on the devices reported since the last call (none where the
        backend cannot say)."""
        return []

    @abc.abstractmethod
    def close(self) -> None:
        """Release what the backend holds; idempotent."""

    def __enter__(self) -> DeviceBackend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_index(self, index: int) -> None:
        count = self.count()
        if not 0 <= index < count:
            raise DeviceError(f"{self.name} backend: no device {index}; valid indices are 0..{count - 1}")


# --- cpu ---------------------------------------------------------------------


class CpuBackend(DeviceBackend):
    """`count` logical devices that share the host's CPUs and memory.

    Every logical device reports the whole host (memory and utilisation are
    host-wide), so totals must not be summed across devices.
    """

    name = "cpu"

    def __init__(self, count: int = 1) -> None:
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise DeviceError(f"cpu backend: device count must be an integer >= 1, got {count!r}")
        self._count = count
        memory_total_bytes, _ = _read_host_memory()
        if memory_total_bytes is None:
            raise DeviceError("cpu backend: cannot read host memory size from /proc/meminfo or os.sysconf")
        self._memory_total_bytes = memory_total_bytes  # kept for when a later read fails
        self._host_id = hashlib.sha256(_host_identity().encode()).hexdigest()[:8]
        self._label = f"{_cpu_model()}, {os.cpu_count() or 1} cores"
        # Utilisation is a delta between two /proc/stat samples; callers on different
        # threads share one baseline.
        self._cpu_lock = threading.Lock()
        self._last_cpu_jiffies: tuple[int, int] | None = None  # (busy, total)
        self._last_utilization_percent: float | None = None

    def count(self) -> int:
        return self._count

    def devices(self) -> list[DeviceInfo]:
        # One sample for all devices: they are the same host, and a second read a
        # microsecond later would give an empty delta.
        sample = self._sample()
        return [self._info(index, *sample) for index in range(self._count)]

    def device(self, index: int) -> DeviceInfo:
        self._check_index(index)
        return self._info(index, *self._sample())

    def processes(self, index: int) -> list[DeviceProcess]:
        """Always empty: host processes are not tracked as device processes."""
        self._check_index(index)
        return []

    def close(self) -> None:
        pass

    def _info(self, index: int, memory_total_bytes: int, memory_used_bytes: int | None,
              utilization_percent: float | None) -> DeviceInfo:
        return DeviceInfo(index, f"CPU-{self._host_id}-{index}", f"cpu:{index} ({self._label})", self.name,
                          memory_total_bytes, memory_used_bytes, utilization_percent)

    def _sample(self) -> tuple[int, int | None, float | None]:
        memory_total_bytes, memory_used_bytes = _read_host_memory()
        return memory_total_bytes or self._memory_total_bytes, memory_used_bytes, self._utilization_percent()

    def _utilization_percent(self) -> float | None:
        """Host CPU busy share since the previous call; None on the first call or without /proc/stat."""
        jiffies = _read_cpu_jiffies()
        if jiffies is None:
            return None
        with self._cpu_lock:
            if self._last_cpu_jiffies is not None:
                busy_delta = jiffies[0] - self._last_cpu_jiffies[0]
                total_delta = jiffies[1] - self._last_cpu_jiffies[1]
                if total_delta <= 0:
                    # Called again within one clock tick: keep the baseline, repeat the last value.
                    return self._last_utilization_percent
                self._last_utilization_percent = min(100.0, max(0.0, 100.0 * busy_delta / total_delta))
            self._last_cpu_jiffies = jiffies
            return self._last_utilization_percent


def _read_host_memory() -> tuple[int | None, int | None]:
    """(total, used) host memory in bytes: /proc/meminfo, else os.sysconf; None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            lines = [line.partition(":") for line in f]
        kib = {key: int(rest.split()[0]) for key, _, rest in lines if rest.strip()}
    except (OSError, ValueError):
        kib = {}
    if "MemTotal" in kib:
        total_bytes = kib["MemTotal"] * 1024
        available_kib = kib.get("MemAvailable")  # absent before Linux 3.14
        return total_bytes, None if available_kib is None else total_bytes - available_kib * 1024
    try:
        page_bytes = os.sysconf("SC_PAGE_SIZE")
        total_bytes = os.sysconf("SC_PHYS_PAGES") * page_bytes
    except (ValueError, OSError, AttributeError):
        return None, None
    try:
        # Free pages, not "available" (no page cache credit): an over-estimate of used.
        return total_bytes, total_bytes - os.sysconf("SC_AVPHYS_PAGES") * page_bytes
    except (ValueError, OSError):
        return total_bytes, None


def _read_cpu_jiffies() -> tuple[int, int] | None:
    """(busy, total) jiffies for all CPUs from the first line of /proc/stat, or None."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 5 or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal; guest time is already in user/nice.
    jiffies = [int(value) for value in fields[1:9]]
    total = sum(jiffies)
    idle = jiffies[3] + jiffies[4]
    return total - idle, total


def _host_identity() -> str:
    """A string stable for this host: machine-id where there is one, else the hostname."""
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            with open(path, encoding="ascii") as f:
                machine_id = f.read().strip()
        except (OSError, UnicodeDecodeError):
            continue
        if machine_id:
            return machine_id
    return socket.gethostname()


def _cpu_model() -> str:
    """CPU model name from /proc/cpuinfo (x86 "model name", arm "Hardware"), else the platform's guess."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Hardware", "cpu model") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


# --- cuda --------------------------------------------------------------------


class CudaBackend(DeviceBackend):
    """NVIDIA GPUs discovered through NVML (never through torch, so no CUDA context is made).

    Indices are NVML's, which ignore CUDA_VISIBLE_DEVICES and may differ from the
    order CUDA enumerates in: a process is pointed at a GPU by its UUID
    (:func:`cuda_visible_name`), never by index. An injected `nvml` stays open on
    close(); one this backend made itself is shut down.
    """

    name = "cuda"
    measures_process_memory = True

    def __init__(self, nvml: Nvml | None = None) -> None:
        self._owns_nvml = nvml is None
        self._nvml = Nvml() if nvml is None else nvml
        self._closed = False
        self._events = None  # the Xid event set: None until faults() first runs, False where there is none
        try:
            self._handles, self._uuids, self._names, self._first_memory_total_bytes = self._discover()
        except BaseException:
            self.close()
            raise

    def _discover(self) -> tuple[list[Any], list[str], list[str], list[int]]:
        try:
            count = self._query("nvmlDeviceGetCount")
        except NvmlUnavailable as exc:
            raise CudaUnavailable(str(exc)) from exc
        if not count:  # 0 or NA
            raise CudaUnavailable(f"NVML found no GPU (nvmlDeviceGetCount returned {count!r})")
        handles, uuids, names, memory_totals = [], [], [], []
        for index in range(count):
            handle = self._query("nvmlDeviceGetHandleByIndex", index, device=index)
            if handle is NA:
                raise DeviceError(f"cuda backend: GPU {index} is not accessible through NVML (no permission); "
                                  "check it with nvidia-smi or run with --backend cpu")
            uuid = self._query("nvmlDeviceGetUUID", handle, device=index)
            name = self._query("nvmlDeviceGetName", handle, device=index)
            memory = self._query("nvmlDeviceGetMemoryInfo", handle, device=index)
            if memory is NA:
                log.warning("[devices] memory size not reported gpu=%d; using 0 bytes", index)
            if uuid is NA:
                log.warning("[devices] UUID not reported gpu=%d; its workers are pointed at it by PCI bus order",
                            index)
            handles.append(handle)
            uuids.append(f"GPU-unknown-{index}" if uuid is NA else uuid)
            names.append("NVIDIA GPU" if name is NA else name)
            memory_totals.append(0 if memory is NA else int(memory.total))
        return handles, uuids, names, memory_totals

    def count(self) -> int:
        return len(self._handles)

    def device(self, index: int) -> DeviceInfo:
        self._check_open()
        self._check_index(index)
        handle = self._handles[index]
        memory = self._query("nvmlDeviceGetMemoryInfo", handle, device=index)
        utilization = self._query("nvmlDeviceGetUtilizationRates", handle, device=index)
        return DeviceInfo(index, self._uuids[index], self._names[index], self.name,
                          self._first_memory_total_bytes[index] if memory is NA else int(memory.total),
                          None if memory is NA else int(memory.used),
                          None if utilization is NA else float(utilization.gpu))

    def processes(self, index: int) -> list[DeviceProcess]:
        """Compute processes NVML sees on the GPU, MPS clients included; [] where it cannot say.

        Under MPS the compute list holds the MPS server (which owns the memory of
        every client) and the MPS list holds the clients, each with its own use;
        some drivers list the clients in the compute list too. Both are read, one
        entry per pid, with the larger known use; a pid in the MPS list is an MPS
        client whichever list also shows it. DeviceLostError if the GPU has failed."""
        self._check_open()
        self._check_index(index)
        handle = self._handles[index]
        used_by: dict[int, int | None] = {}
        clients: set[int] = set()
        for func_name, mps_client in (("nvmlDeviceGetComputeRunningProcesses", False),
                                      ("nvmlDeviceGetMPSComputeRunningProcesses", True)):
            running = self._query(func_name, handle, device=index)
            if running is NA:
                continue
            for process in running:
                pid, used = int(process.pid), getattr(process, "usedGpuMemory", None)
                used = None if used is None else int(used)
                if mps_client:
                    clients.add(pid)
                if pid not in used_by or (used or 0) > (used_by[pid] or 0):
                    used_by[pid] = used
        return [DeviceProcess(pid, used, mps_client=pid in clients) for pid, used in used_by.items()]

    def faults(self) -> list[DeviceFault]:
        """The Xid critical errors NVML reported since the last call (at most a bounded number
        per call; the rest come next time), [] where NVML cannot report them. The event set is
        made on the first call, on the thread that reads (the memory watcher's)."""
        self._check_open()
        if self._events is None:
            self._events = self._open_events()
        if self._events is False:
            return []
        found: list[DeviceFault] = []
        for _ in range(_EVENTS_PER_READ):
            try:
                data = self._nvml.wait_event(self._events)
            except NvmlError as exc:
                log.warning("[nvml] reading Xid events failed: %s; not reading them any more", exc)
                self._events = False
                break
            if data is None or data is NA:
                break
            uuid = self._nvml.query("nvmlDeviceGetUUID", data.device)
            if uuid in self._uuids:
                found.append(DeviceFault(self._uuids.index(uuid), int(data.eventData)))
        return found

    def _open_events(self):
        """An NVML event set with every device's Xid critical errors registered, or False
        (logged once) where NVML cannot give one."""
        try:
            event_type = self._nvml.constant("nvmlEventTypeXidCriticalError")
            events = self._nvml.query("nvmlEventSetCreate")
            if event_type is None or events is NA:
                log.info("[nvml] no Xid events here: a fault under MPS is noticed only as its clients exit")
                return False
            for handle in self._handles:
                if self._nvml.query("nvmlDeviceRegisterEvents", handle, event_type, events) is NA:
                    log.info("[nvml] a device takes no Xid event registration: faults are not watched")
                    return False
            return events
        except NvmlError as exc:
            log.info("[nvml] no Xid events (%s): a fault under MPS is noticed only as its clients exit", exc)
            return False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._events:
            try:
                self._nvml.query("nvmlEventSetFree", self._events)
            except NvmlError:
                pass
        if self._owns_nvml:
            self._nvml.shutdown()

    def _check_open(self) -> None:
        if self._closed:
            raise DeviceError("cuda backend: already closed; open a new backend")

    def _query(self, func_name: str, *args: Any, device: int | None = None) -> Any:
        """Nvml.query with real NVML failures turned into DeviceError, the one error this interface raises
        (DeviceLostError when NVML says GPU ``device`` has failed)."""
        try:
            return self._nvml.query(func_name, *args)
        except NvmlError as exc:
            if isinstance(exc, NvmlGpuLost) and device is not None:
                uuids = getattr(self, "_uuids", None)  # not yet known while discovering
                uuid = uuids[device] if uuids is not None and device < len(uuids) else "UUID not read yet"
                raise DeviceLostError(device, uuid, str(exc)) from exc
            raise DeviceError(f"cuda backend: {exc}; check the GPU with nvidia-smi") from exc


# --- choosing a backend ------------------------------------------------------


def open_backend(kind: str = "auto", *, cpu_devices: int = 1, nvml: Nvml | None = None) -> tuple[DeviceBackend, str]:
    """Open the backend `kind` names and return it with a sentence saying why it was chosen.

    "auto" takes cuda when NVML starts and sees at least one GPU, else cpu with `cpu_devices`.
    """
    if kind == "cpu":
        backend: DeviceBackend = CpuBackend(cpu_devices)
        reason = f"cpu: requested, {cpu_devices} device(s)"
    elif kind == "cuda":
        backend = CudaBackend(nvml)
        reason = f"cuda: requested, NVML found {backend.count()} device(s)"
    elif kind == "auto":
        try:
            backend = CudaBackend(nvml)
            reason = f"auto: NVML found {backend.count()} device(s)"
        except CudaUnavailable as exc:
            backend = CpuBackend(cpu_devices)
            reason = f"auto: no NVIDIA GPU (NVML: {exc.reason}), using cpu with {cpu_devices} device(s)"
    else:
        raise DeviceError(f"unknown device backend {kind!r}; valid kinds are {', '.join(BACKEND_KINDS)}")
    log.debug("[devices] backend=%s count=%d reason=%s", backend.name, backend.count(), reason)  # serve says it
    return backend, reason
