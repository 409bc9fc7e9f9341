"""The daemon's synchronous event bus (:class:`Bus`), its typed events, and the small handles
components are given (:class:`LoopHandle`, :class:`Replies`, :class:`ServerView`, :class:`DeviceFacts`:
read-only where they are state). A subscriber runs inside ``publish``, in the same loop turn, so a grant
is still written in the same wake-up as the release that caused it; the server makes every
subscription, so a component's constructor says what it publishes (it takes the bus), not whom it tells.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

log = logging.getLogger("nodeagent.daemon.bus")

E = TypeVar("E")


# ------------------------------------------------------------------ events


@dataclass(frozen=True, slots=True)
class Published:
    """Something placement clients hear on the events socket (``kind``: grant, preempt,
    session_join, suspend, health, ...); the cluster endpoint's publisher subscribes."""

    kind: str
    device: int | None
    session: str | None
    data: dict = field(default_factory=dict)


@dataclass(slots=True)  # not frozen: on every handoff's path, and a frozen one costs 4x to make
class Granted:
    """``session`` was granted its device's token (``grant``) after waiting ``waited_ms``. Typed, not
    a :class:`Published`, because it is on every handoff's path: the events socket's ``grant``
    event is built from it only where an events socket exists, and the attained-service ledger
    reads the session without a lookup. Subscribers read it, never write it."""

    session: Any  # nodeagent.daemon.sessions.Session
    grant: int
    waited_ms: float


@dataclass(frozen=True, slots=True)
class SuspendFinished:
    """A suspension ended (``outcome``: suspended, stopped, timeout, gone, cancelled)."""

    session: Any  # nodeagent.daemon.sessions.Session
    outcome: str
    elapsed_ms: float
    now: float


@dataclass(frozen=True, slots=True)
class MakeRoomFinished:
    """A suspension that made room for an admitted session ended, whatever its outcome: the
    sessions ``session`` (id) blocked may ask for the token (the token gate hears it). Published
    just before that suspension's :class:`SuspendFinished`, so they ask before a reclaim waiting
    on the same suspension is answered."""

    session: str
    now: float


@dataclass(frozen=True, slots=True)
class DeviceLost:
    """``device`` failed (``reason``: what NVML said): everything on it is told ``notice``."""

    device: int
    notice: str
    now: float
    reason: str = ""


@dataclass(frozen=True, slots=True)
class DeviceBack:
    """A lost ``device`` answers again: the requests held on it are made."""

    device: int
    now: float


@dataclass(frozen=True, slots=True)
class MpsFaulted:
    """A fatal fault on ``device``'s MPS server ended the contexts of ``sessions`` (ids): the MPS
    component takes no session onto that server until they have all left."""

    device: int
    sessions: tuple[str, ...]
    now: float


@dataclass(frozen=True, slots=True)
class MayAsk:
    """Ask for the token again for ``session`` (id), which first asked ``since`` (None: now): what
    kept its request back ended. The token gate (:mod:`nodeagent.daemon.gate`) hears it."""

    session: str
    now: float
    since: float | None = None
    claimed: bool = False  # the slice a restarted daemon's restore window lets go first


@dataclass(slots=True)  # not frozen: on every handoff's path (see Granted)
class SliceEnded:
    """``session`` stopped holding its device's token after ``held_s`` seconds (released,
    revoked, stopped, suspended or gone): the attained-service ledger hears it. Read-only to
    subscribers."""

    session: Any  # nodeagent.daemon.sessions.Session
    held_s: float


@dataclass(slots=True)  # not frozen: on a serving queue's every handoff (see Granted)
class DelegatedAction:
    """A scheduler action (Grant, AskYield, Enforce, Revoked) for a sub-session added as delegated:
    the component that holds the token for it (serving's queues) carries it out. Read-only."""

    action: Any  # a sharing action whose .session is the sub-session
    now: float


@dataclass(frozen=True, slots=True)
class DurabilityChanged:
    """Whether ``session`` (None: every session) is journalled changed."""

    session: str | None


# ------------------------------------------------------------------ the bus


class Bus:
    """Synchronous publish/subscribe by event type. A subscriber that raises costs that one
    delivery (logged), never the publisher or the other subscribers."""

    def __init__(self) -> None:
        self._subscribers: dict[type, list[Callable[[Any], None]]] = defaultdict(list)

    def subscribe(self, kind: type[E], handler: Callable[[E], None]) -> None:
        self._subscribers[kind].append(handler)

    def publish(self, event: object) -> None:
        for handler in self._subscribers.get(type(event), ()):
            try:
                handler(event)
            except Exception:
                log.exception("[bus] a subscriber of %s failed; the others still hear it", type(event).__name__)

    def event(self, kind: str, device: int | None = None, session: str | None = None, **data) -> None:
        """Shorthand for publishing a :class:`Published` event."""
        self.publish(Published(kind, device, session, data))


# ------------------------------------------------------------------ handles


@dataclass(frozen=True, slots=True)
class LoopHandle:
    """What a component needs of the loop: its poller (where a component registers the sockets
    and pipes it owns, each with what runs when it is readable), its clock, and a wake-up."""

    poller: Any  # nodeagent.daemon.loop.EventLoopPoller
    clock: Callable[[], float]
    wake: Callable[[], None]  # wake the loop (signal- and thread-safe)


@dataclass(frozen=True, slots=True)
class Replies:
    """Answering peers."""

    send: Callable[[object, object], None]  # (route, message)
    error: Callable[[object, int, str, str], None]  # (route, request id, code, text)
    bad: Callable[[object, int, str], None]  # (route, request id, why): E_BAD_REQUEST, counted
    session_for: Callable[[object, int, float], Any]  # (route, request id, now): its session; None: E_NO_SESSION told


@dataclass(frozen=True, slots=True)
class ServerView:
    """What another endpoint of the daemon (the cluster endpoint) needs of the server."""

    context: Any  # zmq.Context
    handlers: Any  # Mapping[type, handler]: the request table the endpoints share
    dispatch: Callable[..., None]  # (route, body, frame, handlers, where, unhandled=None)
    status: Callable[[float], Any]  # (now) -> StatusReply
    boot: Callable[[], int]  # the incarnation, known once the journal is read
    started: float  # the loop's clock when the daemon started
    metrics: Any  # nodeagent.metrics.Metrics
    replies: Replies
    attained: Callable[[float], dict] = lambda now: {}  # (now) -> GPU-seconds per training job (the ledger)


class DeviceFacts:
    """The devices as admission and the components see them: the backend, its devices'
    latest facts (refreshed by status), and which have failed (the lost-devices table)."""

    def __init__(self, backend, lost) -> None:
        self.backend = backend
        self.name = backend.name
        self.lost = lost  # nodeagent.daemon.gate.LostDevices: written by the token gate alone
        self._info = backend.devices()

    @property
    def count(self) -> int:
        return len(self._info)

    def info(self) -> list:
        """The latest facts of every device (index order)."""
        return self._info

    def refresh(self) -> list:
        """Ask the backend again (status does, each time); keep the last facts if it fails."""
        from nodeagent.devices import DeviceError
        try:
            self._info = self.backend.devices()
        except DeviceError as exc:
            log.warning("[devices] live query failed, using the last values: %s", exc)
        return self._info
