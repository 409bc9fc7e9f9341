"""Pure scheduling logic for nodeagent: no I/O, no clock of its own."""

from sharing.scheduler import (
    Action,
    AskYield,
    DuplicateSessionError,
    Enforce,
    Grant,
    NotHolderError,
    Revoked,
    SchedulerError,
    SchedulerPolicy,
    SchedulerSnapshot,
    SessionState,
    SessionView,
    TokenScheduler,
    UnknownSessionError,
    Workload,
)

__all__ = [
    "Action",
    "AskYield",
    "DuplicateSessionError",
    "Enforce",
    "Grant",
    "NotHolderError",
    "Revoked",
    "SchedulerError",
    "SchedulerPolicy",
    "SchedulerSnapshot",
    "SessionState",
    "SessionView",
    "TokenScheduler",
    "UnknownSessionError",
    "Workload",
]
