"""MPS partition planning, pure: which share of a GPU's SMs and memory each session gets
(:func:`plan_partition`), as the environment variables the CUDA driver reads at context creation.
Anything that does not fit raises :class:`PartitionError`. The rules of a plan: docs/internals.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

__all__ = [
    "ACTIVE_THREAD_PERCENTAGE_ENV",
    "PINNED_MEM_LIMIT_ENV",
    "PartitionError",
    "PartitionPlan",
    "PartitionTable",
    "plan_partition",
]

ACTIVE_THREAD_PERCENTAGE_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
PINNED_MEM_LIMIT_ENV = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"

_EPS = 1e-9  # float slack when flooring exact shares such as 100/3 * 3


class PartitionError(ValueError):
    """A partition that cannot be planned; the message names the sessions and numbers."""

    code = "E_PARTITION"


@dataclass(frozen=True)
class PartitionPlan:
    """Integer SM shares and memory limits (MiB) per session, for one device; read-only
    mappings, ``memory_limits_mb`` holding only the sessions that have a limit."""

    shares: Mapping[str, int]
    memory_limits_mb: Mapping[str, int] = field(default_factory=dict)
    total: int = 100

    def __post_init__(self) -> None:
        object.__setattr__(self, "shares", MappingProxyType(dict(self.shares)))
        object.__setattr__(self, "memory_limits_mb", MappingProxyType(dict(self.memory_limits_mb)))

    def env_for(self, session: str, device_ordinal: int = 0) -> dict[str, str]:
        """The variables ``session`` must have set before it initialises CUDA. ``device_ordinal``
        is the device as the client enumerates it: 0 under a per-GPU control daemon started with
        ``CUDA_VISIBLE_DEVICES=<uuid>``, where the client sees that one GPU."""
        if session not in self.shares:
            raise KeyError(f"session {session!r} has no share in this plan")
        if isinstance(device_ordinal, bool) or not isinstance(device_ordinal, int) or device_ordinal < 0:
            raise ValueError(f"device_ordinal must be an integer >= 0, got {device_ordinal!r}")
        env = {ACTIVE_THREAD_PERCENTAGE_ENV: str(self.shares[session])}
        limit_mb = self.memory_limits_mb.get(session)
        if limit_mb is not None:
            env[PINNED_MEM_LIMIT_ENV] = f"{device_ordinal}={limit_mb}M"
        return env


def plan_partition(
    requested: Mapping[str, float | None],
    *,
    min_percent: int = 5,
    total: int = 100,
    memory_total_mb: int | None = None,
    memory_requests_mb: Mapping[str, int] | None = None,
) -> PartitionPlan:
    """Plan shares for every session in ``requested`` (``None``: no explicit request). The explicit
    memory requests, the only ones that become limits, must fit ``memory_total_mb`` (the memory the
    device has for MPS clients) when it is known; a session without one is left uncapped."""
    total = _int_in_range("total", total, 1, 100)
    min_percent = _int_in_range("min_percent", min_percent, 1, total)
    explicit: dict[str, float] = {}
    open_sessions: list[str] = []
    for session, percent in requested.items():
        if not isinstance(session, str) or not session:
            raise PartitionError(f"session ids must be non-empty strings, got {session!r}")
        if percent is None:
            open_sessions.append(session)
            continue
        if isinstance(percent, bool) or not isinstance(percent, (int, float)) or not 0 < percent < math.inf:
            raise PartitionError(f"percent of session {session!r} must be a finite number > 0, got {percent!r}")
        value = float(percent)
        if value < min_percent:
            raise PartitionError(f"session {session!r} asks for {_pct(value)} of the SMs; "
                                 f"the minimum share is {min_percent}%")
        explicit[session] = value

    asked = sum(explicit.values())
    if asked > total + _EPS:
        listing = ", ".join(f"{s}={_pct(v)}" for s, v in sorted(explicit.items()))
        raise PartitionError(f"SM requests sum to {_pct(asked)} ({listing}), over the {total}% available")
    exact = dict(explicit)
    if open_sessions:
        left = total - asked
        each = left / len(open_sessions)
        if each < min_percent - _EPS:
            names = ", ".join(repr(s) for s in sorted(open_sessions))
            raise PartitionError(f"session(s) {names} without a request would share the {_pct(left)} "
                                 f"left by explicit requests, {_pct(each)} each, below the "
                                 f"{min_percent}% minimum")
        exact.update((s, each) for s in open_sessions)

    shares = _largest_remainder(exact)
    limits = _plan_memory(list(requested), memory_total_mb, memory_requests_mb or {})
    return PartitionPlan(shares, limits, total)


class PartitionTable:
    """The partition of one MPS device as sessions come and go. Every change re-plans all present
    sessions and is atomic: an infeasible one raises :class:`PartitionError` and changes nothing. A
    client reads its share once, at context creation (the MPS docs), so a share handed out with
    :meth:`issue` stays with that process; :meth:`stale` lists sessions whose issued share differs
    from the plan now that others came or went (they get the new one only with a new context)."""

    def __init__(self, device: int, *, min_percent: int = 5, memory_total_mb: int | None = None) -> None:
        self.device = device
        self._options = {"min_percent": min_percent, "memory_total_mb": memory_total_mb}
        self._percent: dict[str, float | None] = {}
        self._memory_mb: dict[str, int] = {}
        self._issued: dict[str, tuple[bool, dict[str, str]]] = {}  # session -> (uncapped, env)
        self._plan = plan_partition({}, **self._options)  # also validates the options

    @property
    def plan(self) -> PartitionPlan:
        return self._plan

    def sessions(self) -> list[str]:
        return list(self._percent)

    def join(self, session: str, percent: float | None = None, memory_mb: int | None = None) -> PartitionPlan:
        """Add ``session`` with its own request (None: share the remainder)."""
        if session in self._percent:
            raise PartitionError(f"session {session!r} is already in the partition of device {self.device}")
        percent_by = {**self._percent, session: percent}
        memory_by = dict(self._memory_mb)
        if memory_mb is not None:
            memory_by[session] = memory_mb
        return self._commit(percent_by, memory_by)

    def leave(self, session: str) -> PartitionPlan:
        """Drop ``session`` (its share returns to the others); unknown sessions are ignored."""
        if session not in self._percent:
            return self._plan
        percent_by = {s: p for s, p in self._percent.items() if s != session}
        memory_by = {s: m for s, m in self._memory_mb.items() if s != session}
        plan = self._commit(percent_by, memory_by)
        self._issued.pop(session, None)
        return plan

    def partition(self, percents: Mapping[str, float | None],
                  memory_mb: Mapping[str, int] | None = None) -> PartitionPlan:
        """Set the whole partition: named sessions (all present) get their percent, the others none;
        ``memory_mb``, if given, replaces every memory request the same way."""
        unknown = sorted(set(percents) - set(self._percent)) + sorted(set(memory_mb or {}) - set(self._percent))
        if unknown:
            raise PartitionError(f"no session(s) {', '.join(map(repr, dict.fromkeys(unknown)))} "
                                 f"on device {self.device}")
        percent_by = {s: percents.get(s) for s in self._percent}
        memory_by = dict(memory_mb) if memory_mb is not None else dict(self._memory_mb)
        return self._commit(percent_by, memory_by)

    def issue(self, session: str, uncapped: bool = False) -> dict[str, str]:
        """The environment to give ``session`` now (as device 0: see :meth:`PartitionPlan.env_for`);
        remembered as what it runs with. ``uncapped``: a session whose share nobody set explicitly gets
        no SM cap (co-run, where MPS client priority rather than a split decides who runs)."""
        env = self._env(session, uncapped)
        self._issued[session] = (uncapped, env)
        return dict(env)

    def stale(self) -> list[str]:
        """Sessions whose issued environment differs from what the plan gives them now."""
        return sorted(s for s, (uncapped, env) in self._issued.items() if self._env(s, uncapped) != env)

    def _env(self, session: str, uncapped: bool) -> dict[str, str]:
        env = self._plan.env_for(session)
        if uncapped and self._percent.get(session) is None:
            env.pop(ACTIVE_THREAD_PERCENTAGE_ENV, None)
        return env

    def _commit(self, percent_by: dict[str, float | None], memory_by: dict[str, int]) -> PartitionPlan:
        plan = plan_partition(percent_by, memory_requests_mb=memory_by, **self._options)
        self._percent, self._memory_mb, self._plan = percent_by, memory_by, plan
        return plan


# --------------------------------------------------------------------------
# internals
# --------------------------------------------------------------------------


def _largest_remainder(exact: Mapping[str, float]) -> dict[str, int]:
    """Integers that sum to floor(sum(exact)), each its value rounded down or up: the units left after
    flooring go to the largest fractional parts, ties to the smaller id (Hamilton's method)."""
    floors = {s: math.floor(v + _EPS) for s, v in exact.items()}
    target = math.floor(sum(exact.values()) + _EPS)
    spare = target - sum(floors.values())
    by_remainder = sorted(exact, key=lambda s: (-(exact[s] - floors[s]), s))
    for session in by_remainder[:max(spare, 0)]:
        floors[session] += 1
    return {s: floors[s] for s in exact}


def _plan_memory(sessions: list[str], total_mb: int | None, requests_mb: Mapping[str, int]) -> dict[str, int]:
    unknown = sorted(set(requests_mb) - set(sessions))
    if unknown:
        raise PartitionError(f"memory requested for session(s) {', '.join(map(repr, unknown))} "
                             "that have no SM request entry")
    limits = {s: _int_in_range(f"memory of session {s!r} (MiB)", mb, 1, None) for s, mb in requests_mb.items()}
    if total_mb is None:
        return limits
    total_mb = _int_in_range("memory_total_mb", total_mb, 1, None)
    asked = sum(limits.values())
    if asked > total_mb:
        listing = ", ".join(f"{s}={mb} MiB" for s, mb in sorted(limits.items()))
        raise PartitionError(f"memory requests sum to {asked} MiB ({listing}), over the {total_mb} MiB "
                             "the device has")
    return limits


def _int_in_range(name: str, value: object, low: int, high: int | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"in {low}..{high}" if high is not None else f">= {low}"
        raise PartitionError(f"{name} must be an integer {bound}, got {value!r}")
    return value


def _pct(value: float) -> str:
    return f"{value:g}%" if value == int(value) else f"{value:.4g}%"
