"""Measured device memory against declarations, lost devices and Xid faults (:class:`MemoryPolicy`):
it owns the watcher thread that reads per-process memory off the loop, and its readings, which the
loop acts on (``memory.policy``). Detail: docs/internals.md.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Union

from client_lib import protocol as p
from nodeagent import memory, procwatch
from nodeagent.config import ServeConfig
from nodeagent.devices import DeviceBackend, DeviceError, DeviceFault, DeviceLostError, DeviceProcess
from nodeagent.metrics import Metrics
from nodeagent.daemon.sessions import Session, SessionTable
from nodeagent.daemon.bus import Bus, DeviceFacts, LoopHandle, MpsFaulted
from nodeagent.daemon.bus import DeviceBack as BusDeviceBack
from nodeagent.daemon.bus import DeviceLost as BusDeviceLost
from nodeagent.daemon.tokens import Send, Tokens

log = logging.getLogger("nodeagent.memory_watch")

CUDA_CONTEXT_ALLOWANCE_MB = 512  # a CUDA context with cuBLAS/cuDNN loaded: 0.3-0.6 GB, depending on the GPU


def context_allowance_mb(setting: int | str, backend: str) -> int:
    """``memory.context_allowance_mb`` resolved: "auto" is 512 MiB on cuda (a process's CUDA
    context, which NVML counts as its memory) and 0 where nothing has a context."""
    if setting == "auto":
        return CUDA_CONTEXT_ALLOWANCE_MB if backend == "cuda" else 0
    return int(setting)


@dataclass(frozen=True, slots=True)
class DeviceReading:
    """The processes on ``device`` now, as the daemon sees them."""

    device: int
    processes: list[memory.ProcessUse]


@dataclass(frozen=True, slots=True)
class DeviceLost:
    """NVML reported ``device`` lost (or needing a reset); sent once, when first seen."""

    device: int
    message: str


@dataclass(frozen=True, slots=True)
class DeviceBack:
    """A device reported lost answers NVML again (after a reset)."""

    device: int


Reading = Union[DeviceReading, DeviceLost, DeviceBack, DeviceFault]


class MemoryPolicy:
    """The memory policy applied to measured use, and lost and faulted devices."""

    def __init__(self, *, config: ServeConfig, devices: DeviceFacts, loop: LoopHandle, sessions: SessionTable,
                 tokens: Tokens, metrics: Metrics, send: Send, bus: Bus) -> None:
        self._config = config
        self._backend = devices.backend
        self._clock = loop.clock
        self._sessions = sessions
        self._tokens = tokens  # token commands, stopping a verified process
        self._metrics = metrics
        self._wake = loop.wake
        self._send = send
        self._bus = bus
        self._readings: queue.SimpleQueue = queue.SimpleQueue()  # filled by the watcher thread
        self._watcher: MemoryWatcher | None = None
        self._over: set[str] = set()  # sessions flagged over their declaration, until back under

    # ------------------------------------------------------------------ life

    def start(self) -> None:
        """Start the watcher thread where the backend measures per-process memory (cuda: NVML)."""
        if not self._backend.measures_process_memory:
            return
        self._watcher = MemoryWatcher(self._backend, self._config.memory_watch_ms / 1000.0, self._readings,
                                      self._wake, host_proc=self._config.memory_host_proc or None)
        self._watcher.start()

    def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()

    # -------------------------------------------------------------- readings

    def over_memory(self, s: Session) -> bool:
        """Whether ``s`` was last measured over its declaration (a read-only view)."""
        return s.id in self._over

    def apply_readings(self) -> None:
        """Act on what the memory watcher measured (it runs on its own thread)."""
        while True:
            try:
                readings = self._readings.get_nowait()
            except queue.Empty:
                return
            self.on_readings(readings, self._clock())

    def on_readings(self, readings: list[Reading], now: float) -> None:
        """Act on one pass of the watcher: over-memory sessions, devices lost or back."""
        allowance_bytes = context_allowance_mb(self._config.memory_context_allowance_mb,
                                               self._backend.name) * memory.MiB
        health = {DeviceLost: self._on_device_lost, DeviceBack: self._on_device_back, DeviceFault: self._on_device_fault}
        for reading in readings:
            if type(reading) in health:
                health[type(reading)](reading, now)
                continue
            sessions = [s for s in self._sessions.values() if s.device == reading.device]
            over = {o.session.id: o for o in memory.measure(sessions, reading.processes, allowance_bytes)}
            for s in sessions:
                if s.id in over and s.id not in self._over:
                    self._on_overuse(s, over[s.id], now)
                    self._over.add(s.id)
                elif s.id not in over:
                    self._over.discard(s.id)
        self._over = {sid for sid in self._over if sid in self._sessions}  # ended sessions let go

    def _on_overuse(self, s: Session, over: memory.Overuse, now: float) -> None:
        policy = self._config.memory_policy
        log.warning("[memory] over session=%s name=%s device=%d used_mb=%d declared_mb=%d allowed_mb=%d policy=%s",
                    s.id, s.name, s.device, over.used_bytes // memory.MiB, s.memory_mb,
                    over.allowed_bytes // memory.MiB, policy)
        self._metrics.memory_violations.labels(str(s.device), policy).inc()
        if self._tokens.grant_of(s) is None or policy == "warn":
            return
        if policy == "stop" and self._tokens.stop(s):
            self._tokens.preempt(s, now)
            self._metrics.enforcements.labels("stop").inc()
        else:
            self._metrics.enforcements.labels("revoke").inc()
            self._tokens.revoke(s.device, s.id, now, "memory")

    def _on_device_lost(self, lost: DeviceLost, now: float) -> None:
        """A failed GPU: a health event, the holder's token revoked (``device_lost``) and every session
        on it told with an ``E_DEVICE`` notice (their CUDA contexts died with the device)."""
        sessions = [s for s in self._sessions.values() if s.device == lost.device]
        log.error("[device] lost device=%d sessions=%d: %s", lost.device, len(sessions), lost.message)
        self._bus.event("health", lost.device, None, device_state="lost", reason=lost.message)
        notice = (f"device {lost.device} has failed ({lost.message}); the work on it is lost: "
                  "end this session and start again on another device")
        # The token gate hears first (its waiters leave the line and are held), then serving's queues.
        self._bus.publish(BusDeviceLost(lost.device, notice, now, lost.message))
        for s in sessions:
            if self._tokens.grant_of(s) is not None:
                self._tokens.revoke(s.device, s.id, now, "device_lost")
        for s in sessions:
            self._send(s.route, p.Error(id=0, code=p.ErrorCode.DEVICE, message=notice))

    def _on_device_fault(self, fault: DeviceFault, now: float) -> None:
        """An Xid on a device: a context-ending one under MPS ended every client of the server, whose
        tokens are revoked (``mps_fault``) and who are told; any other is counted, logged and published
        (NVML does not say which process faulted). See docs/internals.md."""
        device = fault.device
        if not 0 <= device < self._tokens.device_count:
            return
        shared = [s for s in self._sessions.values() if s.device == device and s.mps] if fault.ends_contexts else []
        # Only when nothing but MPS had a context on the device is the fault its clients' (NVML's process
        # lists, read by the watcher); a process outside it may be the one that faulted. A process NVML
        # lists only among the compute processes that one of this device's MPS sessions owns is its
        # client (the daemon put that session on the server), whichever list the driver shows it in.
        outside = fault.outside_mps
        if outside and shared and fault.outside_processes:
            outside -= sum(map(len, memory.owners(shared, fault.outside_processes).values()))
        if outside != 0:
            shared = []
        domain = "mps" if shared else "context" if fault.ends_contexts else "other"
        self._metrics.device_faults.labels(str(device), domain).inc()
        self._bus.event("health", device, None, device_state="fault", xid=fault.xid, domain=domain,
                        sessions=len(shared))
        if not shared:
            log.warning("[device] Xid %d on device=%d (%s): NVML does not say which process; nothing is revoked",
                        fault.xid, device, "not a context fault" if not fault.ends_contexts else
                        f"{outside} processes outside MPS there" if outside else
                        "a fault of one context")
            return
        log.error("[device] Xid %d on device=%d under MPS: the %d sessions on its MPS server lost their CUDA "
                  "contexts", fault.xid, device, len(shared))
        notice = (f"device {device}'s MPS server had a fatal fault (Xid {fault.xid}) in one of its clients: the "
                  "CUDA context of every client of that server is gone; end this process and start it again "
                  "(the server takes new clients once all of its clients have exited)")
        self._bus.publish(MpsFaulted(device, tuple(s.id for s in shared), now))
        for s in shared:
            if self._tokens.grant_of(s) is not None:
                self._tokens.revoke(s.device, s.id, now, "mps_fault")
            self._send(s.route, p.Error(id=0, code=p.ErrorCode.DEVICE, message=notice))

    def _on_device_back(self, back: DeviceBack, now: float) -> None:
        """A lost device answers again: it admits sessions, and the gate makes the requests held on it."""
        log.warning("[device] device=%d answers NVML again: open for sessions and grants", back.device)
        self._bus.event("health", back.device, None, device_state="ok")
        self._bus.publish(BusDeviceBack(back.device, now))


class MemoryWatcher(threading.Thread):
    """Reads per-process device memory every ``interval_s`` off the loop thread for the loop. ``host_proc``:
    the host's /proc as a daemon in a container mounts it; ``proc_root`` and ``translator`` are for tests."""

    def __init__(self, backend: DeviceBackend, interval_s: float, out: queue.SimpleQueue,
                 wake: Callable[[], None], *, host_proc: str | None = None, proc_root: str = "/proc",
                 translator: procwatch.PidTranslator | None = None) -> None:
        super().__init__(name="nodeagent-memory-watch", daemon=True)
        self._backend = backend
        self._interval_s = interval_s
        self._out = out
        self._wake = wake
        self._proc_root = proc_root
        self._translator = translator if translator is not None else procwatch.PidTranslator(proc_root, host_proc)
        self._lost: set[int] = set()
        self._outside: dict[int, set[int]] = {}  # device -> pids outside MPS in the last pass (fault attribution)
        self._stop_event = threading.Event()
        log.info("[memory] watching per-process device memory: %s", self._translator.describe())

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=5)

    def run(self) -> None:
        while not self._stop_event.wait(self._interval_s):
            readings = self.read_once()
            if readings:
                self._out.put(readings)
                self._wake()

    def read_once(self) -> list[Reading]:
        """One pass over every device: a reading per device that answered, and
        a lost (or back) notice when a device's state changed."""
        readings: list[Reading] = []
        outside_before, outside = self._outside, {}
        for device in range(self._backend.count()):
            try:
                processes = self._backend.processes(device)
            except DeviceLostError as exc:
                if device not in self._lost:
                    self._lost.add(device)
                    readings.append(DeviceLost(device, str(exc)))
                continue
            except DeviceError as exc:
                log.warning("[memory] reading device=%d memory failed: %s", device, exc)
                continue
            if device in self._lost:
                self._lost.discard(device)
                readings.append(DeviceBack(device))
            # in the daemon's pid namespace, with their parents; not visible here (exited, elsewhere): left out
            readings.append(DeviceReading(device, [use for use in map(self._use, processes) if use is not None]))
            outside[device] = {proc.pid: self._use(proc) for proc in processes
                               if not proc.mps_client and not self._mps_server(proc.pid)}
        self._outside = outside
        try:
            faults = self._backend.faults()
        except DeviceError as exc:
            log.warning("[memory] reading device faults failed: %s", exc)
            faults = []
        for fault in faults:  # with whether only MPS had contexts on its device, now and a pass ago
            seen = {**outside_before.get(fault.device, {}), **outside.get(fault.device, {})}
            readings.append(dataclasses.replace(fault, outside_mps=len(seen), outside_processes=tuple(
                use for use in seen.values() if use is not None)))
        return readings

    def _mps_server(self, nvml_pid: int) -> bool:
        """Whether ``nvml_pid`` is an MPS server (its command name); False where it is not visible here."""
        pid = self._translator.to_local(nvml_pid)
        if pid is None:
            return False
        try:
            with open(f"{self._proc_root}/{pid}/comm", "rb") as f:
                return f.read().startswith(b"nvidia-cuda-mps")
        except OSError:
            return False

    def _use(self, proc: DeviceProcess) -> memory.ProcessUse | None:
        pid = self._translator.to_local(proc.pid)
        stat = procwatch.read_stat(pid, self._proc_root) if pid is not None else None
        if stat is None:
            return None
        chain = (stat.ppid, *procwatch.ancestors(stat.ppid, self._proc_root)) if stat.ppid > 0 else ()
        return memory.ProcessUse(pid, chain, stat.pgrp, proc.used_memory_bytes)
