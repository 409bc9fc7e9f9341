"""Measured device memory against declarations, as part of
:class:`nodeagent.server.AgentServer`: a watcher thread reads per-process
memory off the loop thread (an NVML call can take milliseconds) and the loop
applies ``memory.policy`` (warn, revoke, stop) to sessions over their
declaration.

A mixin over the server's state: it uses ``_memory_readings``, ``_sessions``,
``_schedulers``, ``config``, ``metrics`` and the server's ``_stop``,
``_end_slice`` and ``_apply``.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

from nodeagent import memory
from nodeagent.devices import DeviceBackend, DeviceError
from nodeagent.sessions import Session

log = logging.getLogger("nodeagent.memory_watch")


class MemoryPolicyMixin:
    """The memory policy applied to measured use (see the module docstring)."""

    def _apply_memory_readings(self) -> None:
        """Act on what the memory watcher measured (it runs on its own thread)."""
        while True:
            try:
                readings = self._memory_readings.get_nowait()
            except queue.Empty:
                return
            now = self._clock()
            for device, processes in readings.items():
                sessions = [s for s in self._sessions.values() if s.device == device]
                over = {o.session.id: o for o in memory.measure(sessions, processes)}
                for s in sessions:
                    if s.id in over and not s.over_memory:
                        self._on_overuse(s, over[s.id].used_bytes, now)
                    s.over_memory = s.id in over

    def _on_overuse(self, s: Session, used_bytes: int, now: float) -> None:
        policy = self.config.memory_policy
        log.warning("[memory] over session=%s name=%s device=%d used_mb=%d declared_mb=%d policy=%s",
                    s.id, s.name, s.device, used_bytes // memory.MiB, s.memory_mb, policy)
        self.metrics.memory_violations.labels(str(s.device), policy).inc()
        if s.grant is None or policy == "warn":
            return
        if policy == "stop" and self._stop(s):
            self._end_slice(s, now)
            self._apply(self._schedulers[s.device].preempt(s.id, now), now)
            self.metrics.enforcements.labels("stop").inc()
        else:
            self.metrics.enforcements.labels("revoke").inc()
            self._apply(self._schedulers[s.device].revoke(s.id, now, "memory"), now)


class MemoryWatcher(threading.Thread):
    """Reads per-process device memory every ``interval_s`` off the loop thread
    (an NVML call can take milliseconds) and hands the readings to the loop."""

    def __init__(self, backend: DeviceBackend, interval_s: float, out: queue.SimpleQueue,
                 wake: Callable[[], None]) -> None:
        super().__init__(name="nodeagent-memory-watch", daemon=True)
        self._backend = backend
        self._interval_s = interval_s
        self._out = out
        self._wake = wake
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=5)

    def run(self) -> None:
        while not self._stop_event.wait(self._interval_s):
            try:
                readings = {i: self._backend.processes(i) for i in range(self._backend.count())}
            except DeviceError as exc:
                log.warning("[memory] reading device memory failed: %s", exc)
                continue
            self._out.put(readings)
            self._wake()
