"""Device memory: admission by declaration, and measured use against it.

A session declares ``memory_mb`` in its hello. It is admitted to a device only
if every declaration on that device still fits its capacity (total memory less
the configured reserve). On ``cuda`` the watcher reads each process's device
memory through NVML and flags sessions using more than they declared; on
``cpu`` nothing is measurable per process, so the declarations are the account.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from nodeagent.devices import DeviceInfo, DeviceProcess
from nodeagent.sessions import Session

MiB = 1 << 20


def capacity_mb(info: DeviceInfo, reserve_mb: int) -> int:
    return max(0, info.memory_total_bytes // MiB - reserve_mb)


def declared_mb(sessions: Iterable[Session], device: int) -> int:
    """Declarations on ``device``, less those of sessions suspended or being
    suspended (their state is, or is about to be, in host memory)."""
    return sum(s.memory_mb for s in sessions if s.device == device and s.suspend_state is None)


def room_makers(sessions: Iterable[Session], device: int, workload, need_mb: int) -> list[Session] | None:
    """Sessions of a lower class than ``workload`` on ``device`` whose suspension
    frees ``need_mb``: lowest class first, then the largest declarations. None if
    suspending all of them would not be enough."""
    candidates = sorted((s for s in sessions if s.device == device and s.suspend_state is None
                         and s.workload > workload and s.memory_mb > 0),
                        key=lambda s: (-s.workload, -s.memory_mb, s.id))
    chosen, freed = [], 0
    for s in candidates:
        if freed >= need_mb:
            break
        chosen.append(s)
        freed += s.memory_mb
    return chosen if freed >= need_mb else None


def admission_problem(info: DeviceInfo, reserve_mb: int, declared: int, want_mb: int) -> str | None:
    """Why a session declaring ``want_mb`` does not fit ``info``'s device, or None."""
    capacity = capacity_mb(info, reserve_mb)
    if declared + want_mb <= capacity:
        return None
    return (f"device {info.index} has {max(0, capacity - declared)} MiB free for declarations "
            f"({declared} of {capacity} MiB declared by other sessions"
            f"{f', {reserve_mb} MiB reserved' if reserve_mb else ''}); this session declares {want_mb} MiB")


@dataclass(frozen=True, slots=True)
class Overuse:
    session: Session
    used_bytes: int


def measure(sessions: Iterable[Session], processes: Iterable[DeviceProcess]) -> list[Overuse]:
    """Record each session's measured use (by verified pid) and return those over their declaration."""
    used_by_pid = {proc.pid: proc.used_memory_bytes for proc in processes}
    over = []
    for s in sessions:
        if s.verified_pid is None:
            continue
        used = used_by_pid.get(s.verified_pid)
        if used is None and s.managed_pgid is not None:
            used = used_by_pid.get(s.managed_pgid)
        s.memory_used_bytes = used
        if used is not None and used > s.memory_mb * MiB:
            over.append(Overuse(s, used))
    return over
