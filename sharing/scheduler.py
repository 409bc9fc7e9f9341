"""Token scheduler for one GPU (:class:`TokenScheduler`): who may run now, and who must give way.

Pure: every call takes ``now`` and returns the actions the daemon carries out. Strict priority
between classes, weighted fair share inside one, a quantum per class, a grace before one
``Enforce``, and a linger for bursts. The policy and its costs: docs/internals.md.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Union

from sharing.fairqueue import FairQueue

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


class Workload(enum.IntEnum):
    """Workload class of a session; a lower value is a higher priority."""

    INFERENCE = 0
    TRAINING = 1
    BEST_EFFORT = 2

    @classmethod
    def parse(cls, name: str) -> Workload:
        """The class named by its wire name ("inference", "training", "best-effort")."""
        try:
            return _WORKLOAD_BY_WIRE[name]
        except (KeyError, TypeError):
            valid = ", ".join(repr(wire) for wire in _WORKLOAD_BY_WIRE)
            raise ValueError(f"unknown workload {name!r}; expected one of {valid}") from None

    @property
    def wire(self) -> str:
        """The name used on the wire and in config files."""
        return _WIRE_BY_WORKLOAD[self]


_WIRE_BY_WORKLOAD: dict[Workload, str] = {
    Workload.INFERENCE: "inference",
    Workload.TRAINING: "training",
    Workload.BEST_EFFORT: "best-effort",
}
_WORKLOAD_BY_WIRE: dict[str, Workload] = {wire: w for w, wire in _WIRE_BY_WORKLOAD.items()}


def _positive_finite(name: str, value: object) -> float:
    """``value`` as a float, or ValueError naming ``name`` if not a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return float(value)


def _default_quantum_ms() -> Mapping[Workload, float]:
    return {Workload.INFERENCE: 50.0, Workload.TRAINING: 200.0, Workload.BEST_EFFORT: 200.0}


@dataclass(frozen=True, slots=True)
class SchedulerPolicy:
    """The token policy's knobs: slice length per class and grace before enforcement. ``quantum_ms`` keys
    may be :class:`Workload` members or their wire names (stored read-only, in class order); an invalid
    value raises ValueError naming the field."""

    quantum_ms: Mapping[Workload, float] = field(default_factory=_default_quantum_ms, hash=False)
    grace_ms: float = 100.0
    # After a holder releases while only lower classes wait, the token stays free this long for
    # the holder's class to ask again: a burst of short requests pays one preemption of the
    # lower class, not one per request. 0: the lower class is granted at once.
    linger_ms: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.quantum_ms, Mapping):
            raise ValueError(f"quantum_ms must be a mapping of workload to ms, got {self.quantum_ms!r}")
        given: dict[Workload, object] = {}
        for key, value in self.quantum_ms.items():
            try:
                workload = key if isinstance(key, Workload) else Workload.parse(key)
            except ValueError as exc:
                raise ValueError(f"quantum_ms has a bad key: {exc}") from None
            given[workload] = value
        quanta: dict[Workload, float] = {}
        for workload in Workload:
            if workload not in given:
                raise ValueError(f"quantum_ms[{workload.wire}] is missing")
            quanta[workload] = _positive_finite(f"quantum_ms[{workload.wire}]", given[workload])
        object.__setattr__(self, "quantum_ms", MappingProxyType(quanta))
        object.__setattr__(self, "grace_ms", _positive_finite("grace_ms", self.grace_ms))
        linger = self.linger_ms
        if isinstance(linger, bool) or not isinstance(linger, (int, float)) or not 0 <= linger < math.inf:
            raise ValueError(f"linger_ms must be a finite number >= 0, got {linger!r}")
        object.__setattr__(self, "linger_ms", float(linger))

    def quantum_s(self, workload: Workload) -> float:
        """Slice length of ``workload`` in seconds."""
        return self.quantum_ms[workload] / 1000.0


class SessionState(enum.Enum):
    """Where a session stands with its device's token.

    ::

                      request()                 grant
         ┌──────┐ ──────────────► ┌─────────┐ ──────────► ┌─────────┐
         │ IDLE │                 │ WAITING │             │ HOLDING │
         └──────┘ ◄────────────── └─────────┘ ◄────────── └─────────┘
            ▲         cancel()         ▲   release(requeue)   │ AskYield
            │                          │                      │ "quantum" | "preempted"
            │                          │   release(requeue)   ▼
            │                          └──────────────── ┌──────────┐
            └─────────────────────────────────────────── │ YIELDING │
                 release() / revoke(), from HOLDING too  └──────────┘
                                          preempt() (daemon stopped it): HOLDING/YIELDING -> WAITING

    ``add_session`` starts a session in IDLE; ``remove_session`` drops it from any
    state. A YIELDING holder past its deadline gets one ``Enforce`` and stays
    YIELDING until it releases or the daemon revokes.
    """

    IDLE = "idle"
    WAITING = "waiting"
    HOLDING = "holding"
    YIELDING = "yielding"


# --------------------------------------------------------------------------
# Actions: what the daemon must do after a call
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Grant:
    """``session`` now holds the token under id ``grant``, for a slice of ``slice_ms``."""

    session: str
    grant: int
    slice_ms: float
    waited_s: float


@dataclass(frozen=True, slots=True)
class AskYield:
    """Ask the holder to give ``grant`` back within ``deadline_ms``; ``reason`` is "preempted" (a
    higher class waits) or "quantum" (slice over and a session of the same class waits)."""

    session: str
    grant: int
    deadline_ms: float
    reason: str


@dataclass(frozen=True, slots=True)
class Enforce:
    """The holder is ``overrun_ms`` past its yield deadline; the daemon decides what to do.
    Emitted once per grant; the scheduler keeps the holder until ``revoke()`` or ``release()``."""

    session: str
    grant: int
    overrun_ms: float


@dataclass(frozen=True, slots=True)
class Revoked:
    """``grant`` was taken from ``session`` by ``revoke()``; tell the client."""

    session: str
    grant: int
    reason: str


Action = Union[Grant, AskYield, Enforce, Revoked]


# --------------------------------------------------------------------------
# Errors: a refused call changed nothing
# --------------------------------------------------------------------------


class SchedulerError(Exception):
    """A call the scheduler refused; it changed nothing. ``code`` is the wire error code."""

    code = "E_INTERNAL"


class UnknownSessionError(SchedulerError, KeyError):
    """The session id is not on this scheduler (never added, or removed)."""

    code = "E_NO_SESSION"

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return Exception.__str__(self)


class NotHolderError(SchedulerError):
    """The session does not hold the token (or holds it under another grant id)."""

    code = "E_NOT_HOLDER"


class DuplicateSessionError(SchedulerError):
    """A session with that id is already on this scheduler."""


# --------------------------------------------------------------------------
# Read-only views
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SessionView:
    """One session as of a snapshot's ``now``; times include the running slice."""

    session: str
    workload: Workload
    weight: float
    state: SessionState
    gpu_time_s: float
    vtime_s: float
    grants: int
    waiting_since: float | None


@dataclass(frozen=True, slots=True)
class SchedulerSnapshot:
    """The whole scheduler as of one instant, for status replies and metrics."""

    device: int
    holder: str | None
    grant: int | None
    queue: tuple[str, ...]  # WAITING sessions in the order they would be granted
    sessions: tuple[SessionView, ...]


@dataclass(slots=True, eq=False)
class _Session:
    """Mutable record of one session; :class:`SessionView` is its public copy."""

    id: str
    workload: Workload
    weight: float
    state: SessionState = SessionState.IDLE
    gpu_time_s: float = 0.0
    vtime_s: float = 0.0  # GPU time / weight, charged when the token is given up
    grants: int = 0
    waiting_since: float | None = None
    # Its SessionView while it is not the holder; cleared by every change to a
    # non-holder (the holder's view is rebuilt each time: its slice runs).
    view: SessionView | None = None


class TokenScheduler:
    """Arbitrates one device's token between its sessions (see docs/internals.md)."""

    __slots__ = (
        "_device",
        "_policy",
        "_quantum_s",
        "_grace_s",
        "_linger_s",
        "_sessions",
        "_queues",
        "_holder",
        "_grant",
        "_granted_at",
        "_charged_at",
        "_slice_end",
        "_yield_deadline",
        "_enforced",
        "_next_grant",
        "_grant_step",
        "_last_now",
        "_linger_until",
        "_linger_class",
    )

    def __init__(self, device: int, policy: SchedulerPolicy | None = None, *, first_grant: int = 1,
                 grant_step: int = 1) -> None:
        if isinstance(device, bool) or not isinstance(device, int):
            raise TypeError(f"device must be an int, got {device!r}")
        if isinstance(first_grant, bool) or not isinstance(first_grant, int) or first_grant < 1:
            raise ValueError(f"first_grant must be an int >= 1, got {first_grant!r}")
        if isinstance(grant_step, bool) or not isinstance(grant_step, int) or grant_step < 1:
            raise ValueError(f"grant_step must be an int >= 1, got {grant_step!r}")
        self._device = device
        self._set_policy_fields(SchedulerPolicy() if policy is None else policy)
        self._sessions: dict[str, _Session] = {}
        # WAITING sessions per class in fair order, indexed by Workload value.
        self._queues: tuple[FairQueue[_Session], ...] = tuple(FairQueue() for _ in Workload)
        # The holder and its grant; the fields below it mean nothing while it is None.
        self._holder: _Session | None = None
        self._grant = 0
        self._granted_at = 0.0
        self._charged_at = 0.0  # start of the holder's time not yet added to its totals
        self._slice_end = 0.0  # granted_at + quantum; kept exact for next_deadline()
        self._yield_deadline = 0.0  # valid while the holder is YIELDING
        self._enforced = False
        self._next_grant = first_grant
        # Grant ids go first_grant, first_grant + grant_step, ...: the co-run scheduler's
        # lanes share a device's id space without ever issuing the same id.
        self._grant_step = grant_step
        self._last_now = -math.inf
        # While the token lingers after a release (see SchedulerPolicy.linger_ms): until when,
        # and for which class and those above it. None: not lingering.
        self._linger_until: float | None = None
        self._linger_class = Workload.INFERENCE

    @property
    def device(self) -> int:
        return self._device

    @property
    def policy(self) -> SchedulerPolicy:
        return self._policy

    def __len__(self) -> int:
        return len(self._sessions)

    def wanted_by(self, workload: Workload) -> bool:
        """True if a session of ``workload`` holds or waits for the token. O(1): the
        daemon asks after every loop turn to feed the device lifecycle."""
        holder = self._holder
        return bool(self._queues[workload]) or (holder is not None and holder.workload is workload)

    def __contains__(self, session: object) -> bool:
        return session in self._sessions

    def __repr__(self) -> str:
        grant = self._grant if self._holder is not None else None
        return (
            f"TokenScheduler(device={self._device}, sessions={len(self._sessions)}, "
            f"holder={self.holder()!r}, grant={grant})"
        )

    # ---------------------------------------------------------------- events

    def add_session(self, session: str, workload: Workload, weight: float, now: float) -> None:
        """Register a session in IDLE with virtual time 0 (clamped on its first request)."""
        if session in self._sessions:
            raise DuplicateSessionError(f"session {session!r} is already on device {self._device}")
        if not isinstance(workload, Workload):
            raise TypeError(f"workload must be a Workload, got {workload!r}; use Workload.parse()")
        weight = _positive_finite("weight", weight)
        self._advance(now)
        self._sessions[session] = _Session(session, workload, weight)

    def remove_session(self, session: str, now: float) -> list[Action]:
        """Drop a session that left; if it held the token, the next waiter gets it now."""
        s = self._get(session)
        self._advance(now)
        del self._sessions[session]
        if s.state is SessionState.WAITING:
            self._queues[s.workload].discard(session)
        elif s is self._holder:
            self._take_token(s, now)
            return self._grant_next(now, [])
        return []

    def request(self, session: str, now: float, waiting_since: float | None = None) -> list[Action]:
        """IDLE -> WAITING (a no-op in any other state); grants at once if the token is free.
        ``waiting_since``: made then and held back by the caller (a restart's restore window): it keeps
        its place in line and, having waited rather than slept, gets no sleeper clamp."""
        s = self._get(session)
        self._advance(now)
        if s.state is not SessionState.IDLE:
            return []
        if waiting_since is None:
            self._clamp_sleeper(s, now)
        elif not waiting_since <= now:
            raise ValueError(f"waiting_since={waiting_since!r} is after now={now!r}")
        self._enqueue(s, now if waiting_since is None else waiting_since)
        holder = self._holder
        if holder is None:
            if self._linger_until is not None:
                if s.workload > self._linger_class:
                    return []  # the token waits for the class that just had it
                self._linger_until = None
            return self._grant_next(now, [])
        if holder.state is SessionState.HOLDING and s.workload < holder.workload:
            return [self._ask_yield(holder, now, "preempted")]
        return []

    def cancel(self, session: str, now: float) -> list[Action]:
        """WAITING -> IDLE; a no-op in any other state (a holder must release)."""
        s = self._get(session)
        self._advance(now)
        if s.state is SessionState.WAITING:
            self._queues[s.workload].discard(session)
            s.state = SessionState.IDLE
            s.waiting_since = None
            s.view = None
        return []

    def release(self, session: str, grant: int, now: float, requeue: bool = False) -> list[Action]:
        """The holder gives ``grant`` back (to WAITING with ``requeue``); the next waiter gets it now."""
        s = self._get(session)
        self._check_holder(s)
        if grant != self._grant:  # a stale id from an earlier grant of this session
            raise NotHolderError(
                f"session {session!r} holds grant {self._grant} of device {self._device}, not grant {grant!r}"
            )
        self._advance(now)
        self._take_token(s, now)
        if requeue:  # no sleeper clamp: a quick re-request keeps its fair share
            self._enqueue(s, now)
        elif self._linger_s > 0 and self._only_lower_classes_wait(s.workload):
            self._linger_until = now + self._linger_s
            self._linger_class = s.workload
            return []
        return self._grant_next(now, [])

    def revoke(self, session: str, now: float, reason: str) -> list[Action]:
        """Take the token from the holder (which goes IDLE) and grant the next waiter."""
        s = self._get(session)
        self._check_holder(s)
        self._advance(now)
        grant = self._take_token(s, now)
        return self._grant_next(now, [Revoked(session, grant, reason)])

    def preempt(self, session: str, now: float) -> list[Action]:
        """Put the holder back in line without its consent (the daemon stopped it)
        and grant the next waiter. It is charged for its time and queued by the
        usual fair order, so it runs again when its turn comes."""
        s = self._get(session)
        self._check_holder(s)
        self._advance(now)
        self._take_token(s, now)
        self._enqueue(s, now)
        return self._grant_next(now, [])

    def set_weight(self, session: str, weight: float, now: float) -> None:
        """Change a session's share; a holder's time so far is charged at the old weight."""
        s = self._get(session)
        weight = _positive_finite("weight", weight)
        self._advance(now)
        if s is self._holder:
            self._charge(s, now)
        s.weight = weight  # a waiter's key stays: its virtual time changes only when charged
        s.view = None

    def set_policy(self, policy: SchedulerPolicy, now: float) -> list[Action]:
        """Adopt new quanta and grace, then ``tick(now)``: the running slice is re-measured against
        the new quantum; a yield deadline already announced to a client keeps its value."""
        self._check_now(now)
        self._set_policy_fields(policy)
        if self._holder is not None:
            self._slice_end = self._granted_at + self._quantum_s[self._holder.workload]
        return self.tick(now)

    def tick(self, now: float) -> list[Action]:
        """Emit what time alone makes due: a quantum or preemption ask, or one Enforce."""
        self._advance(now)
        h = self._holder
        if h is None:
            if self._linger_until is not None and now >= self._linger_until:
                self._linger_until = None
                return self._grant_next(now, [])
            return []
        if h.state is SessionState.HOLDING:
            # No higher class waits behind a HOLDING holder: the line is served highest class
            # first, and request() asks a lower holder to yield at once.
            if now >= self._slice_end and self._queues[h.workload]:
                return [self._ask_yield(h, now, "quantum")]
            return []
        if not self._enforced and now >= self._yield_deadline:
            if not self._owed_the_device(h.workload):
                # Whoever the holder was asked to yield to has left: nobody to enforce for.
                h.state = SessionState.HOLDING
                self._slice_end = now + self._quantum_s[h.workload]
                return []
            self._enforced = True
            overrun_ms = (now - self._yield_deadline) * 1000.0
            return [Enforce(h.id, self._grant, overrun_ms)]
        return []

    def extend_yield(self, session: str, now: float, extra_s: float) -> bool:
        """Wait ``extra_s`` more for ``session``, a holder asked to yield that has just been
        enforced (``Enforce`` emitted), before a second ``Enforce``: the daemon's warning step
        for a late but cooperative yield (:mod:`sharing.yield_grace`). False, and nothing
        changed, unless ``session`` is that holder."""
        h = self._holder
        if (h is None or h.id != session or h.state is not SessionState.YIELDING or not self._enforced
                or not (extra_s > 0 and math.isfinite(extra_s))):
            return False
        self._enforced = False
        self._yield_deadline = now + extra_s
        return True

    def _owed_the_device(self, workload: Workload) -> bool:
        """True if a session of this class or a higher one waits."""
        queues = self._queues
        return any(queues[w] for w in range(workload + 1))

    # --------------------------------------------------------------- queries

    def next_deadline(self) -> float | None:
        """The exact time at which ``tick()`` will next emit something; None if nothing is pending.
        It may lie in the past when an event made something due (a same-class waiter arriving
        after the quantum ended): tick at once then."""
        h = self._holder
        if h is None:
            return self._linger_until
        if h.state is SessionState.HOLDING:
            return self._slice_end if self._queues[h.workload] else None
        return None if self._enforced else self._yield_deadline

    def holder(self) -> str | None:
        """Id of the session holding the token (HOLDING or YIELDING), if any."""
        return self._holder.id if self._holder is not None else None

    # The shape a co-run device (sharing.corun.CoRunScheduler) has too: one lane here.
    corun = False

    def holders(self) -> tuple[str, ...]:
        """Every holder of the device: at most one on an exclusive device."""
        return (self._holder.id,) if self._holder is not None else ()

    def lane_of(self, session: str) -> TokenScheduler:
        """The lane ``session`` is on: this scheduler; UnknownSessionError if it is not here."""
        self._get(session)
        return self

    def pace(self) -> tuple[tuple[int, bool], ...]:
        """Per class: nobody is paced on an exclusive device (a higher class preempts instead)."""
        return ((0, False),) * len(Workload)

    def waiting_count(self) -> int:
        """Sessions WAITING for the token, all classes; O(classes), for metrics."""
        return sum(len(line) for line in self._queues)

    def state(self, session: str) -> SessionState:
        return self._get(session).state

    def snapshot(self, now: float) -> SchedulerSnapshot:
        """A frozen copy of every session, with the running slice counted up to ``now``. O(sessions): views
        of sessions unchanged since the last snapshot are reused, each class's line merged from its last."""
        self._check_now(now)
        holder = self._holder
        views = []
        for s in self._sessions.values():
            view = s.view
            if view is None or s is holder:
                view = self._view(s, now)
                if s is not holder:
                    s.view = view
            views.append(view)
        queue = tuple(sid for line in self._queues for sid in line.ordered_ids())
        grant = self._grant if holder is not None else None
        return SchedulerSnapshot(self._device, self.holder(), grant, queue, tuple(views))

    # -------------------------------------------------------------- internals

    def _set_policy_fields(self, policy: SchedulerPolicy) -> None:
        if not isinstance(policy, SchedulerPolicy):
            raise TypeError(f"policy must be a SchedulerPolicy, got {policy!r}")
        self._policy = policy
        self._quantum_s = tuple(policy.quantum_s(w) for w in Workload)
        self._grace_s = policy.grace_ms / 1000.0
        self._linger_s = policy.linger_ms / 1000.0

    def _get(self, session: str) -> _Session:
        try:
            return self._sessions[session]
        except KeyError:
            raise UnknownSessionError(f"no session {session!r} on device {self._device}") from None

    def _check_holder(self, s: _Session) -> None:
        if s is not self._holder:
            holder = self._holder.id if self._holder is not None else None
            raise NotHolderError(
                f"session {s.id!r} does not hold the token of device {self._device} "
                f"(it is {s.state.value}; holder: {holder!r})"
            )

    def _check_now(self, now: float) -> None:
        if not self._last_now <= now < math.inf:  # also refuses NaN
            raise ValueError(
                f"now={now!r} is before the last time seen ({self._last_now!r}) or not finite; "
                "pass seconds from one monotonic clock"
            )

    def _advance(self, now: float) -> None:
        self._check_now(now)
        self._last_now = now

    def _only_lower_classes_wait(self, workload: Workload) -> bool:
        """True if somebody waits and nobody of ``workload`` or a higher class does."""
        return not self._owed_the_device(workload) and any(self._queues[workload + 1:])

    def _clamp_sleeper(self, s: _Session, now: float) -> None:
        """Bound the credit of a session coming back from IDLE to one quantum (CFS min_vruntime)."""
        floor = self._queues[s.workload].min_vtime()
        h = self._holder
        if h is not None and h.workload is s.workload:
            floor = min(floor, h.vtime_s + (now - self._charged_at) / h.weight)
        if floor < math.inf:
            s.vtime_s = max(s.vtime_s, floor - self._quantum_s[s.workload])

    def _charge(self, h: _Session, now: float) -> None:
        """Add the holder's time since the last charge to its GPU and virtual time."""
        held_s = now - self._charged_at
        h.gpu_time_s += held_s
        h.vtime_s += held_s / h.weight
        self._charged_at = now

    def _take_token(self, h: _Session, now: float) -> int:
        """Charge the holder ``h``, leave it IDLE and the token free; return its grant id."""
        self._charge(h, now)
        h.state = SessionState.IDLE
        h.view = None
        self._holder = None
        self._enforced = False
        return self._grant

    def _enqueue(self, s: _Session, waiting_since: float) -> None:
        """Put ``s`` (IDLE, its virtual time final) in its class's line."""
        s.state = SessionState.WAITING
        s.waiting_since = waiting_since
        s.view = None
        self._queues[s.workload].push(s.vtime_s, waiting_since, s.id, s)

    def _grant_next(self, now: float, actions: list[Action]) -> list[Action]:
        """Give the free token to the first in line (highest class, then fair order)."""
        for line in self._queues:
            if line:
                break
        else:
            return actions
        s = line.pop_first()
        grant = self._next_grant
        self._next_grant += self._grant_step
        waited_s = float(now - s.waiting_since) if s.waiting_since is not None else 0.0
        s.state = SessionState.HOLDING
        s.waiting_since = None
        s.grants += 1
        s.view = None
        self._holder = s
        self._grant = grant
        self._granted_at = self._charged_at = now
        self._slice_end = now + self._quantum_s[s.workload]
        actions.append(Grant(s.id, grant, self._policy.quantum_ms[s.workload], waited_s))
        return actions

    def _ask_yield(self, h: _Session, now: float, reason: str) -> AskYield:
        h.state = SessionState.YIELDING
        self._yield_deadline = now + self._grace_s
        return AskYield(h.id, self._grant, self._policy.grace_ms, reason)

    def _view(self, s: _Session, now: float) -> SessionView:
        gpu_time_s, vtime_s = s.gpu_time_s, s.vtime_s
        if s is self._holder:
            running_s = now - self._charged_at
            gpu_time_s += running_s
            vtime_s += running_s / s.weight
        return SessionView(
            s.id, s.workload, s.weight, s.state, gpu_time_s, vtime_s, s.grants, s.waiting_since
        )
