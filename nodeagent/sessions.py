"""Sessions as the daemon sees them: who the client is and how to reach it.

Token state (idle, waiting, holding, yielding) is owned by the device's
:class:`sharing.TokenScheduler`; this record holds the rest. A session lives
from a ``welcome`` until one of: ``bye``, its process exiting (pidfd), its
heartbeats stopping, its connection becoming unreachable, or daemon shutdown.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from sharing import Workload


def new_session_id() -> str:
    return "s-" + secrets.token_hex(6)


def new_session_key() -> str:
    return secrets.token_urlsafe(18)


@dataclass(slots=True, eq=False)
class Session:
    id: str
    key: str
    route: bytes | None  # ZeroMQ routing id of the main connection; None until a restored session reattaches
    name: str
    claimed_pid: int  # what hello said: never used to signal anything
    verified_pid: int | None  # from the kernel (SO_PEERCRED); None over tcp
    start_ticks: int | None  # with verified_pid, identifies the process across pid reuse
    uid: int | None
    workload: Workload
    weight: float
    device: int
    memory_mb: int
    created: float
    last_seen: float
    pidfd: int | None = None
    managed_pgid: int | None = None  # verified process group of a program launched by nodeagent run
    managed_pidfd: int | None = None  # pidfd of that group's leader
    stopped: bool = False  # SIGSTOPped by the daemon; continued before its next grant
    memory_used_bytes: int | None = None  # measured by the memory watcher (cuda)
    over_memory: bool = False  # flagged by the watcher; cleared when back under
    suspend_state: str | None = None  # requested | suspended | stopped (see nodeagent.server)
    suspend_started: float = 0.0
    suspend_deadline: float = 0.0
    suspend_waiters: list = field(default_factory=list)  # (route, request id) awaiting suspend_result
    bytes_parked: int = 0
    blocked_by: set = field(default_factory=set)  # sessions suspending to make room for this one
    acquire_pending: bool = False  # asked for the token while blocked_by was not empty
    grant: int | None = None  # grant id while holding the token
    granted_at: float | None = None
    wait_started: float | None = None  # when it last asked for the token
    grants: int = field(default=0)
    borrower: str | None = None  # hello.borrower: the training job it belongs to (cluster lending)

    @property
    def pid(self) -> int:
        return self.verified_pid if self.verified_pid is not None else self.claimed_pid
