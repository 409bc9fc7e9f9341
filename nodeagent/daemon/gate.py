"""The token gate (:class:`TokenGate`): every request for a session's token passes here, in
:func:`sharing.suspension.token_gate`'s order (kept while suspended or blocked by make-room,
parked in a restore window, held on a failed device, else asked of the scheduler).
"""

from __future__ import annotations

import logging

from nodeagent.daemon.bus import DeviceFacts, MayAsk, SuspendFinished
from nodeagent.daemon.sessions import Session, SessionTable
from nodeagent.daemon.tokens import Tokens
from sharing.suspension import Gate, token_gate

log = logging.getLogger("nodeagent.daemon.gate")


class TokenGate:
    """See docs/internals.md."""

    def __init__(self, *, sessions: SessionTable, tokens: Tokens, devices: DeviceFacts, restorer) -> None:
        """``restorer``: its ``restoring(device)`` and ``park(session)`` (a restart's window)."""
        self._sessions = sessions
        self._tokens = tokens
        self._lost = devices.lost
        self._restorer = restorer

    def ask(self, s: Session, now: float, since: float | None = None, claimed: bool = False) -> Gate:
        """Where ``s``'s request for the token went (see docs/internals.md). ``claimed``: it is
        the slice a restart's restore window lets go first."""
        decision = token_gate(suspended=s.suspension.active, blocked=bool(s.blocked_by),
                              restoring=not claimed and self._restorer.restoring(s.device),
                              device_lost=self._lost.is_lost(s.device))
        if decision is Gate.KEEP:
            if s.suspension.active:
                s.suspension.keep_request = s.suspension.keep_request or s.grant is None
            else:
                s.acquire_pending = True
        elif decision is Gate.PARK:
            self._restorer.park(s)
        elif decision is Gate.HOLD:
            self._lost.hold(s.device, s.id, now if since is None else since)
            log.debug("[device] held a token request session=%s on lost device=%d", s.id, s.device)
        else:
            self._tokens.request(s.device, s.id, now, waiting_since=since)
        return decision

    def withdraw(self, s: Session) -> None:
        """``s`` cancelled: a request the gate kept (suspended, blocked), parked (a restore window)
        or held (a failed device) is forgotten too."""
        s.acquire_pending = False
        s.suspension.keep_request = False
        self._restorer.unpark(s)
        self._lost.forget(s.id)

    def block(self, s: Session, victims) -> None:
        """``s`` (just admitted by make-room) may not ask for the token until each of ``victims``
        is off the device: their suspensions end first (:meth:`on_suspend_finished`)."""
        s.blocked_by.update(victim.id for victim in victims)

    def on_suspend_finished(self, event: SuspendFinished) -> None:
        """The bus's :class:`SuspendFinished`: the session is off the device (or gone), so
        sessions it blocked that no one else blocks ask for the token they asked for meanwhile."""
        victim = event.session
        for s in list(self._sessions.values()):
            if victim.id in s.blocked_by:
                s.blocked_by.discard(victim.id)
                if not s.blocked_by and s.acquire_pending:
                    s.acquire_pending = False
                    self.on_may_ask(MayAsk(s.id, event.now, s.wait_started))

    def on_may_ask(self, event: MayAsk) -> None:
        """The bus's :class:`MayAsk`: ask again, if the session is still there and on its device."""
        s = self._sessions.get(event.session)
        if s is not None and self._tokens.on_device(s.device, s.id):
            self.ask(s, event.now, event.since, event.claimed)
