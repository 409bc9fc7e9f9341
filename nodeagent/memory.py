"""Device memory: admission by declaration (``hello.memory_mb``, beside the ctxpool workers'
:class:`WorkerShare`), and measured use against it (:func:`measure`). Detail: docs/internals.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Container, Iterable

from nodeagent.devices import DeviceInfo
from nodeagent.daemon.sessions import Session

MiB = 1 << 20


def capacity_mb(info: DeviceInfo, reserve_mb: int) -> int:
    return max(0, info.memory_total_bytes // MiB - reserve_mb)


def declared_mb(sessions: Iterable[Session], device: int, suspended: Container[str]) -> int:
    """Declarations on ``device``, less those of the ``suspended`` sessions (ids of those
    suspended or being suspended: their state is, or is about to be, in host memory;
    ``Suspensions.suspended_ids``)."""
    return sum(s.memory_mb for s in sessions if s.device == device and s.id not in suspended)


def room_makers(sessions: Iterable[Session], device: int, workload, need_mb: int,
                suspended: Container[str]) -> list[Session] | None:
    """Sessions of a lower class than ``workload`` on ``device``, not already ``suspended``,
    whose suspension frees ``need_mb``: lowest class first, then the largest declarations.
    None if suspending all of them would not be enough."""
    candidates = sorted((s for s in sessions if s.device == device and s.id not in suspended
                         and s.workload > workload and s.memory_mb > 0),
                        key=lambda s: (-s.workload, -s.memory_mb, s.id))
    chosen, freed = [], 0
    for s in candidates:
        if freed >= need_mb:
            break
        chosen.append(s)
        freed += s.memory_mb
    return chosen if freed >= need_mb else None


RESIDENT_FRACTION = 0.5  # of the memory free when workers start, what their resident models may take


def auto_resident_mb(capacity_mb: int, workers: int, context_mb: int, pool_mb: int, declared_mb: int) -> int:
    """``ctxpool.resident_mb = "auto"``: each worker's budget for resident models, in MiB:
    ``RESIDENT_FRACTION`` of what the device's ``capacity_mb`` (less ``memory.reserve_mb``) leaves
    after each worker's context and pool and what sessions had ``declared_mb`` when the workers
    started, split evenly between them. Why half, why even: docs/internals.md."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    free_mb = capacity_mb - workers * (context_mb + pool_mb) - declared_mb
    return max(0, int(free_mb * RESIDENT_FRACTION)) // workers


@dataclass(frozen=True, slots=True)
class WorkerShare:
    """What one device's ctxpool workers may hold, counted in admission like a declaration
    that never leaves: each worker's context allowance, its pool (``ctxpool.pool_mb``) and its
    budget for resident models (``ctxpool.resident_mb``; None: no bound, not counted)."""

    workers: int
    context_mb: int  # each
    pool_mb: int  # each
    resident_mb: int | None  # each

    @property
    def total_mb(self) -> int:
        return self.workers * (self.context_mb + self.pool_mb + (self.resident_mb or 0))

    def describe(self) -> str:
        resident = ("unbounded resident models, not counted (ctxpool.resident_mb = 0)" if self.resident_mb is None
                    else f"{self.resident_mb} resident models (ctxpool.resident_mb)")
        return (f"{self.total_mb} MiB held for {self.workers} ctxpool worker(s): {self.context_mb} context + "
                f"{self.pool_mb} pool + {resident} each")


def held_mb(workers: WorkerShare | None) -> int:
    """What admission holds for a device's workers (0 where none run)."""
    return workers.total_mb if workers is not None else 0


def admission_problem(info: DeviceInfo, reserve_mb: int, declared: int, want_mb: int,
                      workers: WorkerShare | None = None) -> str | None:
    """Why a session declaring ``want_mb`` does not fit ``info``'s device beside the other
    sessions' ``declared`` MiB and its ``workers``' share, or None."""
    capacity = capacity_mb(info, reserve_mb)
    held = held_mb(workers)
    if declared + held + want_mb <= capacity:
        return None
    return (f"device {info.index} has {max(0, capacity - held - declared)} MiB free for declarations "
            f"({declared} of {capacity} MiB declared by other sessions"
            f"{f', {workers.describe()}' if workers is not None and held else ''}"
            f"{f', {reserve_mb} MiB reserved' if reserve_mb else ''}); this session declares {want_mb} MiB")


def class_cap_problem(info: DeviceInfo, reserve_mb: int, sessions: Iterable[Session], workload,
                      want_mb: int, cap_percent: float | None, suspended: Container[str]) -> str | None:
    """Why a ``workload`` session declaring ``want_mb`` would take its class past
    ``cap_percent`` of the device's capacity (the ``suspended`` sessions' declarations not
    counted), or None. Caps keep one class from declaring a device away from the others;
    making room never lifts them."""
    if cap_percent is None or cap_percent >= 100:
        return None
    cap_mb = int(capacity_mb(info, reserve_mb) * cap_percent / 100)
    ours = declared_mb((s for s in sessions if s.workload == workload), info.index, suspended)
    if ours + want_mb <= cap_mb:
        return None
    return (f"device {info.index}: {workload.wire} sessions may declare at most {cap_mb} MiB "
            f"(memory.class_cap_percent.{workload.wire} = {cap_percent:g}); {ours} MiB declared, "
            f"this session declares {want_mb} MiB")


@dataclass(frozen=True, slots=True)
class ProcessUse:
    """A process on a device as the memory watcher read it, in the daemon's pid namespace."""

    pid: int
    ancestors: tuple[int, ...]  # parent, grandparent, ... (nodeagent.procwatch.ancestors)
    pgrp: int | None
    used_memory_bytes: int | None


@dataclass(frozen=True, slots=True)
class Overuse:
    session: Session
    used_bytes: int
    allowed_bytes: int  # the declaration, plus the context allowance of each of its processes


def owners(sessions: Iterable[Session], processes: Iterable[ProcessUse]) -> dict[str, list[ProcessUse]]:
    """The processes each session owns (by session id): a session owns its verified
    process and every descendant, and the whole process group ``nodeagent run``
    launched for it. A process belongs to the nearest session process among itself
    and its ancestors (a client started by another session's process is its own);
    failing that, to the session whose managed group it is in (children that
    outlived their parents). Sessions without a verified pid own nothing."""
    roots: dict[int, Session] = {}
    groups: dict[int, Session] = {}
    for s in sessions:
        if s.verified_pid is None:
            continue
        roots.setdefault(s.verified_pid, s)
        if s.managed_pgid is not None:
            roots.setdefault(s.managed_pgid, s)  # the group's leader, a child of the verified launcher
            groups.setdefault(s.managed_pgid, s)
    owned: dict[str, list[ProcessUse]] = {}
    for proc in processes:
        owner = next((roots[pid] for pid in (proc.pid, *proc.ancestors) if pid in roots), None)
        if owner is None and proc.pgrp is not None:
            owner = groups.get(proc.pgrp)
        if owner is not None:
            owned.setdefault(owner.id, []).append(proc)
    return owned


def measure(sessions: Iterable[Session], processes: Iterable[ProcessUse],
            context_allowance_bytes: int = 0) -> list[Overuse]:
    """Record each session's measured use (the sum over the processes it owns, see
    :func:`owners`) and return those over their declaration. Each process may use
    ``context_allowance_bytes`` beyond it: its CUDA context, which NVML counts in
    the process's memory but no session declares."""
    sessions = list(sessions)
    owned = owners(sessions, processes)
    over = []
    for s in sessions:
        if s.verified_pid is None:
            continue
        known = [p.used_memory_bytes for p in owned.get(s.id, ()) if p.used_memory_bytes is not None]
        used = sum(known) if known else None
        s.memory_used_bytes = used
        allowed = s.memory_mb * MiB + len(known) * context_allowance_bytes
        if used is not None and used > allowed:
            over.append(Overuse(s, used, allowed))
    return over
