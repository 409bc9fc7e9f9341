"""Whole-device suspension: the :class:`Suspensions` component.

A suspension moves None -> requested (suspend notice sent) -> suspended (the
client parked its state and released the device) or -> stopped (deadline
missed; a verified process is SIGSTOPped) -> None again on resume (a stopped
one is continued first). ``memory.make_room = "suspend"`` starts suspensions
to admit an inference session that would not fit.

A component: it owns the suspensions under way (requested, deadline pending;
the per-session state is on :class:`nodeagent.daemon.sessions.Session`) and is given
what it may touch in its constructor. Which sessions to suspend to make room is
admission's plan (:mod:`nodeagent.daemon.admission`).
"""

from __future__ import annotations

import logging
import math
from typing import Callable

from client_lib import protocol as p
from nodeagent import procwatch
from nodeagent.daemon.bus import Bus, Replies, SuspendFinished, SuspensionAsked
from nodeagent.daemon.cluster import ClusterRoute
from nodeagent.metrics import Metrics
from nodeagent.daemon.sessions import Session, SessionTable
from nodeagent.daemon.tokens import Tokens
from sharing import SessionState

log = logging.getLogger("nodeagent.suspension")



class Suspensions:
    """Whole-device suspension handlers (see the module docstring)."""

    def __init__(self, *, sessions: SessionTable, tokens: Tokens, metrics: Metrics, replies: Replies, bus: Bus,
                 request_token: Callable[..., None]) -> None:
        """``tokens``: the token commands, and stopping and continuing verified processes;
        ``bus``: suspension events (the cluster's, and SuspendFinished, SuspensionAsked);
        ``request_token(session id, device, now)``: ask for the token again (held while the
        device is lost)."""
        self._sessions = sessions
        self._tokens = tokens
        self._metrics = metrics
        self._send = replies.send
        self._error = replies.error
        self._session_for = replies.session_for
        self._bus = bus
        self._request_token = request_token
        self._suspending: set[Session] = set()  # suspend requested, deadline pending

    # ------------------------------------------------------------- for the loop

    def under_way(self, s: Session) -> bool:
        """Whether ``s`` was asked to suspend and its deadline has not been acted on yet."""
        return s in self._suspending

    def next_deadline(self) -> float | None:
        """The earliest suspend deadline pending, or None."""
        return min((s.suspend_deadline for s in self._suspending), default=None)

    def on_timers(self, now: float) -> None:
        """Act on the suspend deadlines that have passed: stop verified sessions, report the rest."""
        for s in [s for s in self._suspending if now >= s.suspend_deadline]:
            self._suspending.discard(s)
            if self._tokens.stop(s):
                if s.grant is not None:
                    self._tokens.end_slice(s, now)
                    self._tokens.revoke(s.device, s.id, now, "suspended")
                s.suspend_state = "stopped"
                self._finish(s, "stopped", now)
            else:  # reported once; it may still suspend later
                self._finish(s, "timeout", now)

    def forget(self, s: Session, now: float) -> None:
        """``s`` ended: a suspension under way, or callers waiting for one, hear ``gone``."""
        if s.suspend_waiters or s in self._suspending:
            self._finish(s, "gone", now)

    def answer_pending(self) -> None:
        """Shutdown: every ``suspend_session`` still waiting for its outcome is answered
        ``E_SHUTTING_DOWN`` now, not left to its own timeout (reclaims: the cluster endpoint)."""
        answered = 0
        for s in self._sessions.values():
            for route, request_id in s.suspend_waiters:
                self._error(route, request_id, p.ErrorCode.SHUTTING_DOWN,
                            f"daemon is shutting down; the suspension of session {s.id} did not finish "
                            "(retry when it is back)")
                answered += 1
            s.suspend_waiters.clear()
        self._suspending.clear()
        if answered:
            log.info("[shutdown] step=suspend-requests answered=%d", answered)

    # ----------------------------------------------------------------- requests

    def _authorize(self, route, request_id: int, frame, target_id: str) -> Session | None:
        """The target session if the peer may act on it (root, the session's own user, or an
        authenticated placement client on the cluster endpoint)."""
        target = self._sessions.get(target_id)
        if target is None:
            self._error(route, request_id, p.ErrorCode.NO_SESSION, f"no session {target_id}")
            return None
        if type(route) is ClusterRoute:  # proved an allowed CURVE key: root-equivalent
            return target
        creds = procwatch.peer_credentials(frame)
        if creds is None or (creds.uid != 0 and creds.uid != target.uid):
            who = "an unverifiable peer" if creds is None else f"uid {creds.uid}"
            self._error(route, request_id, p.ErrorCode.FORBIDDEN,
                        f"{who} may not suspend or resume session {target_id} (root or its owner only)")
            return None
        return target

    def on_suspend_session(self, route, msg: p.SuspendSession, frame, now: float) -> None:
        if not (math.isfinite(msg.deadline_ms) and 0 < msg.deadline_ms <= 3_600_000):
            self._error(route, msg.id, p.ErrorCode.INVALID,
                        f"deadline_ms must be in (0, 3600000], got {msg.deadline_ms}")
            return
        s = self._authorize(route, msg.id, frame, msg.session)
        if s is None:
            return
        if s.suspend_state in ("suspended", "stopped"):
            self._send(route, p.SuspendResult(id=msg.id, session=s.id, outcome=s.suspend_state, elapsed_ms=0.0,
                                              bytes_parked=s.bytes_parked))
            return
        s.suspend_waiters.append((route, msg.id))
        if s.suspend_state != "requested":  # else already under way: this caller hears the same result
            self.begin(s, msg.deadline_ms, now, reason="requested")

    def begin(self, s: Session, deadline_ms: float, now: float, reason: str) -> None:
        """Ask ``s`` to suspend within ``deadline_ms`` (requested, made room, reclaim)."""
        s.suspend_state = "requested"
        s.suspend_started = now
        s.suspend_deadline = now + deadline_ms / 1000.0
        self._suspending.add(s)
        self._bus.publish(SuspensionAsked(s.device))
        self._send(s.route, p.SuspendNotice(deadline_ms=deadline_ms, reason=reason))
        if self._tokens.state(s.device, s.id) is SessionState.WAITING:
            s.acquire_pending = True  # a waiter stops waiting; its request is made again at resume
        self._tokens.cancel(s.device, s.id, now)
        s.wait_started = None
        self._bus.event("suspend", s.device, s.id, outcome="requested", reason=reason, deadline_ms=deadline_ms)
        log.info("[suspend] request session=%s name=%s deadline_ms=%.0f holding=%s reason=%s",
                 s.id, s.name, deadline_ms, s.grant is not None, reason)

    def _unblock(self, victim: Session, now: float) -> None:
        """``victim`` is off the device (or gone): sessions waiting on it may ask for the token."""
        for s in list(self._sessions.values()):
            if victim.id in s.blocked_by:
                s.blocked_by.discard(victim.id)
                if not s.blocked_by and s.acquire_pending and s.suspend_state is None:
                    s.acquire_pending = False
                    self._request_token(s.id, s.device, now)  # held while the device is lost

    def on_suspended(self, route, msg: p.Suspended, frame, now: float) -> None:
        s = self._session_for(route, msg.id, now)
        if s is None or s.suspend_state != "requested":
            return  # resumed (or stopped) meanwhile: its resume notice is already on the way
        if s.grant is not None:  # it should have released; make sure the device is free
            self._tokens.revoke(s.device, s.id, now, "suspended")
        s.suspend_state = "suspended"
        s.bytes_parked = msg.bytes_parked
        self._metrics.parked_bytes.inc(max(0, msg.bytes_parked))
        self._metrics.suspend_seconds.observe(max(0.0, msg.suspend_ms) / 1000.0)
        self._finish(s, "suspended", now, suspend_ms=msg.suspend_ms)

    def _finish(self, s: Session, outcome: str, now: float, suspend_ms: float = 0.0) -> None:
        self._suspending.discard(s)
        elapsed_ms = (now - s.suspend_started) * 1000.0
        for route, request_id in s.suspend_waiters:
            self._send(route, p.SuspendResult(id=request_id, session=s.id, outcome=outcome, elapsed_ms=elapsed_ms,
                                              bytes_parked=s.bytes_parked, suspend_ms=suspend_ms))
        s.suspend_waiters.clear()
        self._metrics.suspends.labels(outcome).inc()
        self._unblock(s, now)
        log.info("[suspend] %s session=%s elapsed_ms=%.1f bytes_parked=%d", outcome, s.id, elapsed_ms,
                 s.bytes_parked)
        self._bus.publish(SuspendFinished(s, outcome, elapsed_ms, now))  # events, a reclaim waiting on it

    def on_resume_session(self, route, msg: p.ResumeSession, frame, now: float) -> None:
        s = self._authorize(route, msg.id, frame, msg.session)
        if s is None:
            return
        state = s.suspend_state
        if state is not None:
            if state == "stopped":
                self._tokens.cont(s)
                s.last_seen = now
            elif state == "requested":
                self._finish(s, "cancelled", now)
            s.suspend_state = None
            s.bytes_parked = 0
            self._send(s.route, p.ResumeNotice())
            self._metrics.resumes.inc()
            self._bus.event("resume", s.device, s.id, was=state)
            log.info("[suspend] resume session=%s was=%s asked=%s", s.id, state, s.acquire_pending)
            if s.acquire_pending and not s.blocked_by:  # asked while suspended: honoured now, after the notice
                s.acquire_pending = False
                s.wait_started = now
                self._request_token(s.id, s.device, now)
        self._send(route, p.Ok(id=msg.id))

    def on_resumed(self, route, msg: p.Resumed, frame, now: float) -> None:
        s = self._session_for(route, msg.id, now)
        if s is not None:
            self._metrics.resume_seconds.observe(max(0.0, msg.resume_ms) / 1000.0)
