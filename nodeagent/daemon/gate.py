"""What may be granted (:class:`TokenGate`): every request for a session's token passes here, in
:func:`sharing.suspension.token_gate`'s order, and it owns what keeps one back: make-room blocks,
restore windows and the lost devices (:class:`LostDevices`). Detail: docs/internals.md.
"""

from __future__ import annotations

import logging

from nodeagent.daemon.bus import DeviceBack, DeviceFacts, DeviceLost, MakeRoomFinished, MayAsk
from nodeagent.daemon.sessions import Session, SessionTable
from nodeagent.daemon.suspension import Suspensions
from nodeagent.daemon.tokens import Tokens
from sharing import SessionState
from sharing.suspension import Gate, token_gate

log = logging.getLogger("nodeagent.daemon.gate")


class LostDevices:
    """Devices NVML reports lost, and the token requests held back on them: a lost device
    takes no new session and grants nothing until it answers again. Pure: no I/O, no clock.
    Written by the token gate alone; admission, serving and the cluster endpoint read it."""

    def __init__(self) -> None:
        self._why: dict[int, str] = {}  # device -> what NVML said
        self._held: dict[int, dict[str, float]] = {}  # device -> session -> waiting since, in order

    def lose(self, device: int, message: str) -> None:
        self._why[device] = message
        self._held.setdefault(device, {})

    def back(self, device: int) -> dict[str, float]:
        """The device answers again: the requests held on it (session -> waiting since), in order."""
        self._why.pop(device, None)
        return self._held.pop(device, {})

    def is_lost(self, device: int) -> bool:
        return device in self._why

    def refusal(self, device: int) -> str | None:
        """Why ``device`` takes no new session now (a sentence for the peer), or None."""
        why = self._why.get(device)
        if why is None:
            return None
        return (f"device {device} has failed ({why}); it takes no new sessions and grants nothing until it "
                "answers again: use another device")

    def hold(self, device: int, session: str, since: float) -> bool:
        """Hold a token request of ``session`` if ``device`` is lost (True), else False."""
        held = self._held.get(device)
        if held is None:
            return False
        held.setdefault(session, since)
        return True

    def forget(self, session: str) -> None:
        """The session withdrew its request (cancel) or ended."""
        for held in self._held.values():
            held.pop(session, None)


class TokenGate:
    """The token gate; a timed component: restore windows close at their deadline."""

    def __init__(self, *, sessions: SessionTable, tokens: Tokens, devices: DeviceFacts,
                 suspensions: Suspensions) -> None:
        """``devices``: the lost-devices table (``devices.lost``), which this component writes."""
        self._sessions = sessions
        self._tokens = tokens
        self._suspensions = suspensions
        self._lost: LostDevices = devices.lost
        self._blocked_by: dict[str, set[str]] = {}  # session -> sessions suspending to make room for it
        # Asked for the token while blocked (kept): asked for once unblocked; cancel clears it.
        # (A wish made while suspended is the suspension component's: keep_request.)
        self._pending: set[str] = set()
        # Restore windows: devices whose restored sessions have not all reattached yet. Only the
        # slice in progress may be granted there; other requests wait (parked), in order.
        self._restoring: dict[int, set[str]] = {}
        self._parked: dict[int, dict[str, None]] = {}  # device -> the parked requests' sessions, in order
        self._restore_deadline = 0.0

    # ------------------------------------------------------------------ asking

    def ask(self, s: Session, now: float, since: float | None = None, claimed: bool = False) -> Gate:
        """Where ``s``'s request for the token went (see docs/internals.md). ``claimed``: it is
        the slice a restart's restore window lets go first."""
        suspended = self._suspensions.active(s)
        decision = token_gate(suspended=suspended, blocked=s.id in self._blocked_by,
                              restoring=not claimed and s.device in self._parked,
                              device_lost=self._lost.is_lost(s.device))
        if decision is Gate.KEEP:
            if suspended:
                self._suspensions.keep_request(s)
            else:
                self._pending.add(s.id)
        elif decision is Gate.PARK:
            self._parked[s.device].setdefault(s.id)  # once, in the order first asked
        elif decision is Gate.HOLD:
            self._lost.hold(s.device, s.id, now if since is None else since)
            log.debug("[device] held a token request session=%s on lost device=%d", s.id, s.device)
        else:
            self._tokens.request(s.device, s.id, now, waiting_since=since)
        return decision

    def withdraw(self, s: Session) -> None:
        """``s`` cancelled: a request the gate kept (suspended, blocked), parked (a restore window)
        or held (a failed device) is forgotten too."""
        self._pending.discard(s.id)
        self._suspensions.drop_request(s)
        for parked in self._parked.values():
            parked.pop(s.id, None)
        self._lost.forget(s.id)

    def forget(self, s: Session, now: float) -> None:
        """``s`` ended: nothing of it is kept, parked or held, and its restore window waits for
        it no longer."""
        self.withdraw(s)  # its suspension's wish too, where the suspension component has not ended it yet
        self._blocked_by.pop(s.id, None)
        self._reattached(s, now)

    def kept(self, s: Session) -> bool:
        """Whether a request of ``s`` is kept until its blocks end (read-only view)."""
        return s.id in self._pending

    def on_may_ask(self, event: MayAsk) -> None:
        """The bus's :class:`MayAsk`: ask again, if the session is still there and on its device."""
        s = self._sessions.get(event.session)
        if s is not None and self._tokens.on_device(s.device, s.id):
            self.ask(s, event.now, event.since, event.claimed)

    # ------------------------------------------------------------------ make-room blocks

    def block(self, s: Session, victims) -> None:
        """``s`` (just admitted by make-room) may not ask for the token until each of ``victims``
        is off the device: their suspensions end first (:meth:`on_make_room_finished`)."""
        if victims:
            self._blocked_by.setdefault(s.id, set()).update(victim.id for victim in victims)

    def on_make_room_finished(self, event: MakeRoomFinished) -> None:
        """The bus's :class:`MakeRoomFinished`: the session is off the device (or gone), so
        sessions it blocked that no one else blocks ask for the token they asked for meanwhile."""
        victim = event.session
        for sid, blockers in list(self._blocked_by.items()):
            blockers.discard(victim)
            if blockers:  # blocked by others still (a set kept here is never empty)
                continue
            del self._blocked_by[sid]
            s = self._sessions.get(sid)
            if sid in self._pending and s is not None:
                self._pending.discard(sid)
                self.on_may_ask(MayAsk(sid, event.now, self._tokens.waiting_since(s)))

    # ------------------------------------------------------------------ lost devices

    def on_device_lost(self, event: DeviceLost) -> None:
        """The bus's :class:`DeviceLost`: the device grants nothing until it answers again; its
        waiters leave the line (so that a revoke of its holder grants nobody) and are held."""
        self._lost.lose(event.device, event.reason)
        tokens = self._tokens
        for s in list(self._sessions.values()):
            if s.device == event.device and tokens.state(s.device, s.id) is SessionState.WAITING:
                tokens.cancel(s.device, s.id, event.now)
                since = tokens.waiting_since(s)
                self._lost.hold(event.device, s.id, since if since is not None else event.now)

    def on_device_back(self, event: DeviceBack) -> None:
        """The bus's :class:`DeviceBack`: the requests held on the device ask again in the order
        they were made, keeping their wait (suspended ones are kept)."""
        held = self._lost.back(event.device)
        log.info("[device] device=%d held requests=%d ask again", event.device, len(held))
        for sid, since in held.items():
            self.on_may_ask(MayAsk(sid, event.now, min(since, event.now)))

    # ------------------------------------------------------------------ restore windows

    def open_windows(self, restored: dict[int, set[str]], deadline: float) -> None:
        """A restart restored ``restored`` (device -> session ids): each device waits for them to
        reattach, until ``deadline`` at the latest, before parked requests are made."""
        for device, sids in restored.items():
            self._restoring.setdefault(device, set()).update(sids)
            self._parked.setdefault(device, {})
        self._restore_deadline = deadline

    def honour_claim(self, s: Session, claim: int | None, now: float) -> None:
        """A resumed client that was using the device when it lost us gets the token back first,
        so its slice in progress completes."""
        if claim is not None and self._tokens.grant_of(s) is None:
            self.on_may_ask(MayAsk(s.id, now, claimed=True))
        self._reattached(s, now)

    def awaited(self) -> set[str]:
        """The restored sessions that have not reattached yet (read-only view)."""
        return {sid for pending in self._restoring.values() for sid in pending}

    def next_deadline(self, now: float) -> float | None:
        """When the restore windows close (None: none is open)."""
        return self._restore_deadline if self._restoring else None

    def on_timers(self, now: float) -> None:
        """Close every restore window still open at its deadline."""
        if self._restoring and now >= self._restore_deadline:
            for device in list(self._restoring):
                self._end_restore(device, now)

    def _reattached(self, s: Session, now: float) -> None:
        restoring = self._restoring.get(s.device)
        if restoring is not None:
            restoring.discard(s.id)
            if not restoring:
                self._end_restore(s.device, now)

    def _end_restore(self, device: int, now: float) -> None:
        """Close a device's restore window and make its parked requests."""
        self._restoring.pop(device, None)
        parked = self._parked.pop(device, {})
        log.info("[restore] device=%d open for grants, parked requests=%d", device, len(parked))
        for sid in parked:
            s = self._sessions.get(sid)
            if s is not None:  # waited through the window: keeps its wait, no sleeper clamp; held if lost
                self.on_may_ask(MayAsk(sid, now, self._tokens.waiting_since(s)))
