"""Whole-device suspension of one session, as a pure machine (:class:`Suspension`: RUNNING,
REQUESTED, SUSPENDED, STOPPED, drawn on :class:`SuspendState`; time passed in, actions
returned), and the gate in front of the token (:func:`token_gate`). Detail: docs/internals.md.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Union

__all__ = ["SuspendState", "Suspension", "Notify", "StopProcess", "ContinueProcess", "TakeToken", "LeaveLine",
           "AskToken", "Report", "SuspendAction", "Gate", "token_gate", "SuspensionError"]


class SuspendState(enum.Enum):
    """Where a session stands with a suspension::

                      request                  client parked ("suspended")
          ┌─────────┐ ───────► ┌───────────┐ ─────────────────────────► ┌───────────┐
          │ RUNNING │          │ REQUESTED │                            │ SUSPENDED │
          └─────────┘ ◄─────── └───────────┘ ─────────┐                 └───────────┘
               ▲       resume     │   ▲  deadline,    │ deadline,             │
               │    ("cancelled") │   │  not stoppable│ stopped               │
               │                  └───┘ ("timeout",   ▼                       │
               │                        still asked) ┌─────────┐               │
               └──────────────────────────────────── │ STOPPED │ ◄─────────────┘ (no)
                          resume (continued)         └─────────┘
                          resume from SUSPENDED too
    """

    RUNNING = "running"
    REQUESTED = "requested"
    SUSPENDED = "suspended"
    STOPPED = "stopped"

    @property
    def wire(self) -> str | None:
        """``SessionInfo.suspended`` on the wire: None while running."""
        return None if self is SuspendState.RUNNING else self.value


# ------------------------------------------------------------------ actions


@dataclass(frozen=True, slots=True)
class Notify:
    """Tell the client: ``"suspend"`` (with the time left) or ``"resume"``."""

    what: str
    deadline_ms: float = 0.0
    reason: str = ""


@dataclass(frozen=True, slots=True)
class StopProcess:
    """SIGSTOP the session's verified process (the deadline passed). The machine has moved
    to STOPPED already: an unstoppable session must be reported with :meth:`Suspension.not_stopped`."""


@dataclass(frozen=True, slots=True)
class ContinueProcess:
    """SIGCONT what the daemon stopped (a resume from STOPPED)."""


@dataclass(frozen=True, slots=True)
class TakeToken:
    """Revoke the session's token if it holds it (it must not keep the device)."""

    reason: str


@dataclass(frozen=True, slots=True)
class LeaveLine:
    """Take the session out of the token's line if it waits (its wish is kept in the machine)."""


@dataclass(frozen=True, slots=True)
class AskToken:
    """Ask for the token again on the session's behalf (a wish kept while it was suspended)."""


@dataclass(frozen=True, slots=True)
class Report:
    """The suspension's outcome for whoever waits on it: suspended, stopped, timeout,
    cancelled or gone, ``elapsed_ms`` after the request."""

    outcome: str
    elapsed_ms: float


SuspendAction = Union[Notify, StopProcess, ContinueProcess, TakeToken, LeaveLine, AskToken, Report]


class SuspensionError(Exception):
    """A step the machine refuses in its state; nothing changed."""


# ------------------------------------------------------------------ the machine


@dataclass(slots=True)
class Suspension:
    """One session's suspension state (RUNNING when none). Mutable; every change goes through
    a method, which returns what to do."""

    state: SuspendState = SuspendState.RUNNING
    reason: str = ""
    started: float = 0.0  # when it was requested (the loop's clock)
    deadline: float | None = None  # while REQUESTED: when to stop it; None once the deadline was acted on
    bytes_parked: int = 0
    keep_request: bool = False  # the session wants the token once it may have it

    @property
    def active(self) -> bool:
        """Suspended, stopped, or asked to be: the session may not use the device."""
        return self.state is not SuspendState.RUNNING

    @property
    def pending_deadline(self) -> bool:
        """Requested, and the deadline not yet acted on (a reclaim waits for it)."""
        return self.state is SuspendState.REQUESTED and self.deadline is not None

    def request(self, now: float, deadline_ms: float, reason: str, waiting: bool) -> list[SuspendAction]:
        """Ask the session to suspend within ``deadline_ms``; ``waiting``: it is in the token's line
        now (it leaves it; its wish is kept). SuspensionError unless RUNNING."""
        if self.state is not SuspendState.RUNNING:
            raise SuspensionError(f"a suspension is already {self.state.value}")
        if not (math.isfinite(deadline_ms) and deadline_ms > 0):
            raise SuspensionError(f"deadline_ms must be finite and > 0, got {deadline_ms!r}")
        self.state = SuspendState.REQUESTED
        self.reason = reason
        self.started = now
        self.deadline = now + deadline_ms / 1000.0
        self.bytes_parked = 0
        self.keep_request = self.keep_request or waiting
        return [Notify("suspend", deadline_ms, reason), LeaveLine()]

    def suspended(self, now: float, bytes_parked: int) -> list[SuspendAction]:
        """The client says it parked and gave the device up. Ignored (no actions) unless
        REQUESTED: a resume may have crossed it."""
        if self.state is not SuspendState.REQUESTED:
            return []
        self.state = SuspendState.SUSPENDED
        self.deadline = None
        self.bytes_parked = max(0, int(bytes_parked))
        return [TakeToken("suspended"), Report("suspended", self._elapsed_ms(now))]

    def due(self, now: float) -> bool:
        return self.state is SuspendState.REQUESTED and self.deadline is not None and now >= self.deadline

    def expire(self, now: float) -> list[SuspendAction]:
        """The deadline passed: stop the process (STOPPED). If the daemon cannot stop it, it calls
        :meth:`not_stopped`. Nothing unless the deadline is due."""
        if not self.due(now):
            return []
        self.state = SuspendState.STOPPED
        self.deadline = None
        return [StopProcess(), TakeToken("suspended"), Report("stopped", self._elapsed_ms(now))]

    def not_stopped(self, now: float) -> list[SuspendAction]:
        """The process could not be stopped (unverifiable, gone): back to REQUESTED without a
        deadline (it may still suspend later), and the outcome is ``timeout``. The token it holds
        is not taken: only a stop makes that safe (the cluster may revoke it itself)."""
        if self.state is not SuspendState.STOPPED:
            raise SuspensionError(f"not_stopped() needs STOPPED, the suspension is {self.state.value}")
        self.state = SuspendState.REQUESTED
        self.deadline = None
        return [Report("timeout", self._elapsed_ms(now))]

    def resume(self, now: float) -> list[SuspendAction]:
        """Let the session have the device again. From REQUESTED the suspension is cancelled;
        from STOPPED the process is continued first. Nothing while RUNNING."""
        state = self.state
        if state is SuspendState.RUNNING:
            return []
        actions: list[SuspendAction] = []
        if state is SuspendState.STOPPED:
            actions.append(ContinueProcess())
        elif state is SuspendState.REQUESTED and self.deadline is not None:
            actions.append(Report("cancelled", self._elapsed_ms(now)))
        self.state = SuspendState.RUNNING
        self.deadline = None
        self.bytes_parked = 0
        actions.append(Notify("resume"))
        if self.keep_request:
            self.keep_request = False
            actions.append(AskToken())
        return actions

    def gone(self, now: float) -> list[SuspendAction]:
        """The session ended; a suspension with its deadline pending is reported ``gone``."""
        pending = self.pending_deadline
        self.state = SuspendState.RUNNING
        self.deadline = None
        self.keep_request = False
        return [Report("gone", self._elapsed_ms(now))] if pending else []

    def _elapsed_ms(self, now: float) -> float:
        return max(0.0, (now - self.started) * 1000.0)

    # ------------------------------------------------------------ journal form

    def to_record(self, now: float, wall: float) -> dict | None:
        """What the journal keeps (None while RUNNING); times as unix seconds, to survive a restart."""
        if self.state is SuspendState.RUNNING:
            return None
        return {"state": self.state.value, "reason": self.reason, "bytes_parked": self.bytes_parked,
                "keep_request": self.keep_request,
                "deadline_unix": None if self.deadline is None else wall + (self.deadline - now)}

    @classmethod
    def from_record(cls, doc: dict | None, now: float, wall: float) -> Suspension:
        """The machine a journalled record describes (ValueError naming the field if it is not one)."""
        if doc is None:
            return cls()
        try:
            state = SuspendState(doc["state"])
        except (KeyError, ValueError, TypeError):
            raise ValueError(f"suspension state must be one of {[s.value for s in SuspendState]}, "
                             f"got {doc.get('state')!r}") from None
        deadline_unix = doc.get("deadline_unix")
        if deadline_unix is not None and not (isinstance(deadline_unix, (int, float)) and math.isfinite(deadline_unix)):
            raise ValueError(f"suspension deadline_unix must be a number or null, got {deadline_unix!r}")
        bytes_parked = doc.get("bytes_parked", 0)
        if isinstance(bytes_parked, bool) or not isinstance(bytes_parked, int) or bytes_parked < 0:
            raise ValueError(f"suspension bytes_parked must be an integer >= 0, got {bytes_parked!r}")
        deadline = None
        if state is SuspendState.REQUESTED and deadline_unix is not None:
            deadline = now + (deadline_unix - wall)
        return cls(state=state, reason=str(doc.get("reason", ""))[:64], started=now, deadline=deadline,
                   bytes_parked=bytes_parked, keep_request=bool(doc.get("keep_request", False)))


# ------------------------------------------------------------------ the gate


class Gate(enum.Enum):
    """Where a session's request for the token goes."""

    QUEUE = "queue"  # to the device's scheduler
    KEEP = "keep"  # kept (suspended, or waiting on sessions suspending to make room): made when it may
    PARK = "park"  # a restart's restore window: only the slice that was running may be granted now
    HOLD = "hold"  # the device failed: held, made when it answers again


def token_gate(*, suspended: bool, blocked: bool, restoring: bool, device_lost: bool) -> Gate:
    """The one order every request for the token passes through, wherever it is made (an
    acquire, a resume, an unblock, a device back, a restore window closing)."""
    if suspended or blocked:
        return Gate.KEEP
    if restoring:
        return Gate.PARK
    if device_lost:
        return Gate.HOLD
    return Gate.QUEUE
