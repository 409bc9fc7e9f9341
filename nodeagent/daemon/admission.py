"""Admission (:class:`Admission`): which device a new session joins, and whom to suspend to make
room for it. A component with no state of its own (docs/internals.md).
"""

from __future__ import annotations

from typing import Callable

from client_lib import protocol as p
from nodeagent import memory
from nodeagent.config import ServeConfig
from nodeagent.daemon.bus import DeviceFacts
from nodeagent.daemon.sessions import Session, SessionTable
from nodeagent.daemon.suspension import Suspensions
from nodeagent.daemon.tokens import Tokens
from sharing import Workload

Refusal = Callable[[int, str, str | None], str | None]  # (device, workload, borrower) -> why not, or None
WorkersShare = Callable[[int], memory.WorkerShare | None]  # (device) -> what admission holds for its workers


class Admission:
    """Device choice and make-room plans."""

    def __init__(self, *, config: ServeConfig, devices: DeviceFacts, sessions: SessionTable, tokens: Tokens,
                 suspensions: Suspensions, refusal: Refusal, workers_share: WorkersShare) -> None:
        self._config = config
        self._devices = devices
        self._sessions = sessions
        self._tokens = tokens
        self._suspended = suspensions.suspended_ids  # read-only: whose declarations are in host memory
        self._refusal = refusal
        self._workers_share = workers_share

    def pick_device(self, wanted: int | None, memory_mb: int, workload: str = "training",
                    borrower: str | None = None) -> tuple[int | None, str, str]:
        """(device, "", "") for a new session (the least loaded that fits), or (None, code, why)."""
        count = self._tokens.device_count
        lost_devices = self._devices.lost
        if wanted is not None and not 0 <= wanted < count:
            return None, p.ErrorCode.DEVICE, (f"no device {wanted}; this node has devices 0..{count - 1} "
                                              f"(backend {self._devices.name})")
        candidates = [wanted] if wanted is not None else \
            sorted(range(count), key=lambda i: (self._tokens.sessions_on(i), i))  # least loaded first
        lost = [lost_devices.refusal(i) for i in candidates if lost_devices.is_lost(i)]
        candidates = [i for i in candidates if not lost_devices.is_lost(i)]
        if not candidates:  # a failed GPU takes no session until it answers again
            return None, p.ErrorCode.DEVICE, "; ".join(lost)
        problems, refusals = [], []
        info = self._devices.info()
        suspended = self._suspended()
        for i in candidates:
            refusal = self._refusal(i, workload, borrower)  # lent, draining
            if refusal is not None:
                refusals.append(refusal)
                continue
            declared = memory.declared_mb(self._sessions.values(), i, suspended)
            problem = (self.class_cap_problem(i, workload, memory_mb)
                       or memory.admission_problem(info[i], self._config.memory_reserve_mb,
                                                   declared, memory_mb, self._workers_share(i)))
            if problem is None:
                return i, "", ""
            problems.append(problem)
        if not problems:
            return None, p.ErrorCode.STATE, "; ".join(refusals)
        return None, p.ErrorCode.NO_MEMORY, "; ".join(problems)

    def class_cap_problem(self, device: int, workload: str, memory_mb: int) -> str | None:
        cap = self._config.memory_class_cap_percent.get(workload)
        return memory.class_cap_problem(self._devices.info()[device], self._config.memory_reserve_mb,
                                        self._sessions.values(), Workload.parse(workload), memory_mb, cap,
                                        self._suspended())

    def make_room_plan(self, wanted: int | None, workload: Workload, memory_mb: int,
                       borrower: str | None = None) -> tuple[int | None, list[Session]]:
        """A device where suspending lower-class sessions lets ``memory_mb`` fit, and those sessions."""
        count = self._tokens.device_count
        info = self._devices.info()
        suspended = self._suspended()
        for i in ([wanted] if wanted is not None else range(count)):
            if self._refusal(i, workload.wire, borrower) is not None or self._devices.lost.is_lost(i):
                continue  # draining, lent to another borrower, or failed
            if self.class_cap_problem(i, workload.wire, memory_mb) is not None:
                continue  # suspending lower classes never lifts this class's own cap
            capacity = memory.capacity_mb(info[i], self._config.memory_reserve_mb)
            need = (memory.declared_mb(self._sessions.values(), i, suspended)
                    + memory.held_mb(self._workers_share(i)) + memory_mb - capacity)
            victims = memory.room_makers(self._sessions.values(), i, workload, need, suspended)
            if victims:
                return i, victims
        return None, []
