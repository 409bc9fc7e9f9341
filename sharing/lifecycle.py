"""Device lifecycle for cluster lending (:class:`DeviceLifecycle`): may this GPU be lent to training now?

Pure, like :mod:`sharing.scheduler`: every call takes ``now`` (seconds on the caller's monotonic
clock) and returns what changed, which the daemon turns into events, journal rows and reclaims.
``PROTECT`` keeps a device whose inference just went idle from being lent for ``protect_s``:
inference comes in bursts (after DeepBoot). How the daemon drives it: docs/internals.md.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Union

from sharing.scheduler import Workload

__all__ = [
    "DeviceLifecycle",
    "DeviceState",
    "LifecycleError",
    "LifecycleEvent",
    "ReclaimDue",
    "Transition",
]


class DeviceState(str, enum.Enum):
    """Where a device stands with the cluster placement layer.

    ::

        FREE --inference active--> RUN --inference idle--> PROTECT --protect_s passed--> FREE
        PROTECT --inference active--> RUN
        FREE --lend(b)--> LENT(b) --reclaim--> PROTECT (inference gets the protect window) --> RUN/FREE
        LENT --max_s passed--> (tick returns ReclaimDue once; the server reclaims)
        any --drain--> DRAINING --undrain--> FREE/RUN (by observation)

    Entering PROTECT resolves at once when it can: with inference already
    active it goes on to RUN, with ``protect_s == 0`` to FREE (both
    transitions are returned). While LENT or DRAINING, inference observations
    are recorded but change nothing: a LENT device goes back to inference only
    by ``reclaim`` (the placement layer's decision), a DRAINING one by ``undrain``.
    """

    FREE = "FREE"  # no inference wants the device; may be lent
    RUN = "RUN"  # an inference session holds or waits for the device
    PROTECT = "PROTECT"  # inference went idle less than protect_s ago; not lendable yet
    LENT = "LENT"  # lent to the training sessions of one borrower until reclaimed
    DRAINING = "DRAINING"  # no new sessions; those there are asked to leave


class LifecycleError(Exception):
    """The device's ``state`` refuses the call, which changed nothing; ``retry_at``, for a refusal in
    PROTECT, is when the window ends (caller's clock); ``code`` is the wire error code."""

    code = "E_STATE"

    def __init__(self, message: str, *, state: DeviceState, retry_at: float | None = None) -> None:
        super().__init__(message)
        self.state = state
        self.retry_at = retry_at


@dataclass(frozen=True, slots=True)
class Transition:
    """``device`` moved from ``old`` to ``new`` because of ``reason``, at ``at`` (the call's ``now``)."""

    device: int
    old: DeviceState
    new: DeviceState
    reason: str
    at: float


@dataclass(frozen=True, slots=True)
class ReclaimDue:
    """The lend of ``device`` to ``borrower`` ran out at ``at`` (its ``lent_until``): the server is to
    reclaim it. Returned by one ``tick`` only."""

    device: int
    borrower: str
    at: float


LifecycleEvent = Union[Transition, ReclaimDue]


_BOUNDS = {"": lambda seconds: True, " >= 0": lambda seconds: seconds >= 0, " > 0": lambda seconds: seconds > 0}


def _seconds(name: str, value: object, bound: str = "") -> float:
    """``value`` as float seconds; ValueError naming ``name`` unless it is a finite number within ``bound``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not _BOUNDS[bound](value):
        raise ValueError(f"{name} must be a finite number of seconds{bound}, got {value!r}")
    return float(value)


class DeviceLifecycle:
    """The lifecycle of one device (:class:`DeviceState`). Every call is O(1) and keeps: ``borrower`` set
    iff LENT; ``lent_until`` only while LENT (and only with a ``max_s``); ``protect_until`` iff PROTECT."""

    def __init__(self, device: int, protect_s: float = 60.0) -> None:
        if isinstance(device, bool) or not isinstance(device, int) or device < 0:
            raise ValueError(f"device must be an index >= 0, got {device!r}")
        self.device = device
        self._protect_s = _seconds("protect_s", protect_s, " >= 0")
        self._state = DeviceState.FREE
        self._borrower: str | None = None
        self._lent_until: float | None = None
        self._protect_since: float | None = None
        self._inference_active: bool | None = None  # the last observation; None: none yet
        self._reclaim_reported = False

    @classmethod
    def restore(cls, device: int, state: DeviceState | str, *, borrower: str | None = None,
                lent_until: float | None = None, protect_until: float | None = None,
                protect_s: float = 60.0) -> DeviceLifecycle:
        """A lifecycle in ``state`` as journalled (times on the caller's clock; RUN: inference taken as
        active until ``observe`` says otherwise); ValueError if the fields break an invariant."""
        life = cls(device, protect_s)
        try:
            state = DeviceState(state)
        except ValueError:
            valid = ", ".join(s.value for s in DeviceState)
            raise ValueError(f"unknown device state {state!r}; expected one of {valid}") from None
        if (borrower is not None) != (state is DeviceState.LENT):
            raise ValueError(f"borrower must be set exactly when LENT (state {state.value}, borrower {borrower!r})")
        if lent_until is not None and state is not DeviceState.LENT:
            raise ValueError(f"lent_until given for state {state.value}; it belongs to LENT only")
        if (protect_until is not None) != (state is DeviceState.PROTECT):
            raise ValueError(f"protect_until must be set exactly when PROTECT (state {state.value})")
        if borrower is not None:
            life._borrower = _check_borrower(borrower)
        if lent_until is not None:
            life._lent_until = _seconds("lent_until", lent_until)
        if protect_until is not None:
            life._protect_since = _seconds("protect_until", protect_until) - life._protect_s
        life._state = state
        life._inference_active = True if state is DeviceState.RUN else None
        return life

    # ------------------------------------------------------------ read-only view

    @property
    def state(self) -> DeviceState:
        return self._state

    @property
    def borrower(self) -> str | None:
        return self._borrower

    @property
    def lent_until(self) -> float | None:
        return self._lent_until

    @property
    def protect_until(self) -> float | None:
        if self._state is not DeviceState.PROTECT or self._protect_since is None:
            return None
        return self._protect_since + self._protect_s

    @property
    def protect_s(self) -> float:
        return self._protect_s

    @property
    def inference_active(self) -> bool | None:
        """The last observation: does an inference session hold or wait for the device? None: not told yet."""
        return self._inference_active

    def __repr__(self) -> str:
        return (f"DeviceLifecycle(device={self.device}, state={self._state.value}, borrower={self._borrower!r}, "
                f"lent_until={self._lent_until!r}, protect_until={self.protect_until!r})")

    # ------------------------------------------------------------ calls

    def observe(self, inference_active: bool, now: float) -> list[Transition]:
        """Record whether inference wants the device (holds or waits). Cheap when nothing changes."""
        now = _seconds("now", now)
        out: list[Transition] = []
        self._inference_active = bool(inference_active)
        self._settle(now, out)
        if self._state is DeviceState.FREE and self._inference_active:
            self._move(DeviceState.RUN, "inference active", now, out)
        elif self._state is DeviceState.RUN and not self._inference_active:
            self._enter_protect(now, "inference idle", out)
        return out

    def lend(self, borrower: str, now: float, max_s: float | None = None) -> list[Transition]:
        """FREE -> LENT(borrower), for at most ``max_s`` seconds; [] when already lent to ``borrower``, whose
        ``lent_until`` stays (a retried request must not extend it). LifecycleError if the state refuses,
        ValueError for a bad argument."""
        now = _seconds("now", now)
        borrower = _check_borrower(borrower)
        max_s = None if max_s is None else _seconds("max_s", max_s, " > 0")
        out: list[Transition] = []
        # A protect window that ran out but was not ticked yet must not refuse the lend.
        self._settle(now, out)
        state = self._state
        if state is DeviceState.LENT:
            if self._borrower == borrower:
                return out
            raise LifecycleError(
                f"device {self.device} is lent to {self._borrower!r}; reclaim it before lending it to {borrower!r}",
                state=state)
        if state is DeviceState.RUN:
            raise LifecycleError(
                f"device {self.device} is RUN: inference is using it; it can be lent once inference has been "
                f"idle for protect_s={self._protect_s:g}s", state=state)
        if state is DeviceState.PROTECT:
            until = self.protect_until
            raise LifecycleError(
                f"device {self.device} is PROTECT: inference went idle less than protect_s={self._protect_s:g}s ago; "
                f"it can be lent in {max(0.0, until - now):.1f}s (or lower protect_s with set_policy)",
                state=state, retry_at=until)
        if state is DeviceState.DRAINING:
            raise LifecycleError(
                f"device {self.device} is DRAINING; cancel the drain before lending it", state=state)
        self._borrower = borrower
        self._lent_until = None if max_s is None else now + max_s
        self._reclaim_reported = False
        reason = f"lent to {borrower}" + ("" if max_s is None else f" for {max_s:g}s")
        self._move(DeviceState.LENT, reason, now, out)
        return out

    def renew(self, borrower: str, now: float, max_s: float) -> float:
        """A new term for the lend to ``borrower``: it ends ``max_s`` seconds from ``now`` (sooner or later
        than before; a lend without an end gets one); returns ``lent_until``. Only a lend not yet run out
        is renewed (LifecycleError): a lease that ran out is being reclaimed, and a controller that has
        not seen the reclaim and a new lend must not extend another job's lease."""
        now = _seconds("now", now)
        borrower = _check_borrower(borrower)
        max_s = _seconds("max_s", max_s, " > 0")
        if self._state is not DeviceState.LENT:
            raise LifecycleError(f"device {self.device} is {self._state.value}, not lent: nothing to renew; "
                                 f"lend it to {borrower!r} instead", state=self._state)
        if self._borrower != borrower:
            raise LifecycleError(f"device {self.device} is lent to {self._borrower!r}, not to {borrower!r}",
                                 state=self._state)
        if self._reclaim_reported or (self._lent_until is not None and now >= self._lent_until):
            raise LifecycleError(f"the lend of device {self.device} to {borrower!r} ran out and is being "
                                 "reclaimed; lend it again once it is FREE", state=self._state)
        self._lent_until = now + max_s
        return self._lent_until

    def reclaim(self, now: float) -> list[Transition]:
        """LENT -> PROTECT, so inference gets the protect window; [] when not LENT (idempotent)."""
        now = _seconds("now", now)
        out: list[Transition] = []
        if self._state is DeviceState.LENT:
            self._enter_protect(now, f"reclaimed from {self._borrower}", out)
        return out

    def drain(self, now: float) -> list[Transition]:
        """Any state -> DRAINING (a lend ends with it); [] when already DRAINING."""
        now = _seconds("now", now)
        out: list[Transition] = []
        if self._state is not DeviceState.DRAINING:
            reason = "drain" if self._borrower is None else f"drain (lend to {self._borrower} ended)"
            self._move(DeviceState.DRAINING, reason, now, out)
        return out

    def undrain(self, now: float) -> list[Transition]:
        """DRAINING -> RUN or FREE, by the last inference observation; [] when not DRAINING."""
        now = _seconds("now", now)
        out: list[Transition] = []
        if self._state is DeviceState.DRAINING:
            new = DeviceState.RUN if self._inference_active else DeviceState.FREE
            self._move(new, "drain cancelled", now, out)
        return out

    def set_protect_s(self, protect_s: float) -> None:
        """Change the protect window. A window in progress is measured from its start with the new
        length; if that makes it over, the next ``tick`` moves to FREE (``next_deadline`` says so)."""
        self._protect_s = _seconds("protect_s", protect_s, " >= 0")

    def tick(self, now: float) -> list[LifecycleEvent]:
        """Apply the deadlines that passed: protect window over (-> FREE), lend expired (ReclaimDue, once)."""
        now = _seconds("now", now)
        out: list[LifecycleEvent] = []
        self._settle(now, out)  # type: ignore[arg-type]
        if (self._state is DeviceState.LENT and self._lent_until is not None
                and not self._reclaim_reported and now >= self._lent_until):
            self._reclaim_reported = True
            out.append(ReclaimDue(self.device, self._borrower, self._lent_until))  # type: ignore[arg-type]
        return out

    def next_deadline(self) -> float | None:
        """When ``tick`` next has something to do (caller's clock), or None."""
        if self._state is DeviceState.PROTECT:
            return self.protect_until
        if self._state is DeviceState.LENT and self._lent_until is not None and not self._reclaim_reported:
            return self._lent_until
        return None

    def admits(self, workload: str | Workload, borrower: str | None) -> str | None:
        """None when a new session of ``workload`` (for ``borrower``) may join this device, else why not. A
        LENT device admits inference and its borrower's sessions only (a local job would take the lent
        job's time; docs/cluster.md); a session with a borrower joins only a device lent to it."""
        if not isinstance(workload, Workload):
            workload = Workload.parse(workload)  # ValueError naming the valid ones
        if self._state is DeviceState.DRAINING:
            return f"device {self.device} is DRAINING and admits no new sessions"
        if workload is Workload.INFERENCE:
            return None
        if borrower is None:
            if self._state is DeviceState.LENT:
                return (f"device {self.device} is lent to {self._borrower!r}: only its sessions (hello.borrower = "
                        f"{self._borrower!r}) and inference may join; pick another device")
            return None
        if self._state is DeviceState.LENT and self._borrower == borrower:
            return None
        if self._state is DeviceState.LENT:
            return f"device {self.device} is lent to {self._borrower!r}, not to {borrower!r}"
        return f"device {self.device} is {self._state.value}, not lent to {borrower!r}; lend it to {borrower!r} first"

    # ------------------------------------------------------------ internals

    def _move(self, new: DeviceState, reason: str, now: float, out: list) -> None:
        old = self._state
        self._state = new
        if new is not DeviceState.LENT:
            self._borrower = None
            self._lent_until = None
            self._reclaim_reported = False
        if new is not DeviceState.PROTECT:
            self._protect_since = None
        out.append(Transition(self.device, old, new, reason, now))

    def _enter_protect(self, now: float, reason: str, out: list) -> None:
        self._move(DeviceState.PROTECT, reason, now, out)
        self._protect_since = now
        self._settle(now, out)

    def _settle(self, now: float, out: list) -> None:
        """Resolve PROTECT: inference back -> RUN; window over -> FREE."""
        if self._state is not DeviceState.PROTECT:
            return
        if self._inference_active:
            self._move(DeviceState.RUN, "inference active", now, out)
        elif now >= self.protect_until:  # type: ignore[operator]
            self._move(DeviceState.FREE, f"protect window of {self._protect_s:g}s over", now, out)


def _check_borrower(borrower: object) -> str:
    if not isinstance(borrower, str) or not borrower.strip():
        raise ValueError(f"borrower must be a non-empty name, got {borrower!r}")
    return borrower
