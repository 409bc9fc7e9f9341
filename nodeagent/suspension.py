"""Whole-device suspension, as part of :class:`nodeagent.server.AgentServer`.

A suspension moves None -> requested (suspend notice sent) -> suspended (the
client parked its state and released the device) or -> stopped (deadline
missed; a verified process is SIGSTOPped) -> None again on resume (a stopped
one is continued first). ``memory.make_room = "suspend"`` starts suspensions
to admit an inference session that would not fit.

A mixin over the server's state: it uses ``_sessions``, ``_schedulers``,
``_suspending``, ``config``, ``metrics`` and the server's ``_send``,
``_error``, ``_apply``, ``_stop``, ``_continue``, ``_end_slice``,
``_session_for``, the cluster mixin's ``_event``, ``_suspend_finished``
and ``_admission_refusal``, and ``_lost_devices`` and ``_request_token``
(:mod:`nodeagent.memory_watch`), and the serving mixin's ``_workers_share``.
"""

from __future__ import annotations

import logging
import math

from client_lib import protocol as p
from nodeagent import memory, procwatch
from nodeagent.cluster import ClusterRoute
from nodeagent.sessions import Session
from sharing import Workload

log = logging.getLogger("nodeagent.suspension")


class SuspensionMixin:
    """Whole-device suspension handlers (see the module docstring)."""

    def _authorize(self, route: bytes, request_id: int, frame, target_id: str) -> Session | None:
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

    def _on_suspend_session(self, route: bytes, msg: p.SuspendSession, frame, now: float) -> None:
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
            self._begin_suspend(s, msg.deadline_ms, now, reason="requested")

    def _begin_suspend(self, s: Session, deadline_ms: float, now: float, reason: str) -> None:
        s.suspend_state = "requested"
        s.suspend_started = now
        s.suspend_deadline = now + deadline_ms / 1000.0
        self._suspending.add(s)
        self._send(s.route, p.SuspendNotice(deadline_ms=deadline_ms, reason=reason))
        self._apply(self._schedulers[s.device].cancel(s.id, now), now)  # a waiter stops waiting
        s.wait_started = None
        self._event("suspend", s.device, s.id, outcome="requested", reason=reason, deadline_ms=deadline_ms)
        log.info("[suspend] request session=%s name=%s deadline_ms=%.0f holding=%s reason=%s",
                 s.id, s.name, deadline_ms, s.grant is not None, reason)

    def _make_room_plan(self, wanted: int | None, workload: Workload, memory_mb: int,
                        borrower: str | None = None) -> tuple[int | None, list[Session]]:
        """A device where suspending lower-class sessions lets ``memory_mb`` fit, and those sessions."""
        count = len(self._schedulers)
        for i in ([wanted] if wanted is not None else range(count)):
            if self._admission_refusal(i, workload.wire, borrower) is not None or self._lost_devices.is_lost(i):
                continue  # draining, lent to another borrower, or failed
            if self._class_cap_problem(i, workload.wire, memory_mb) is not None:
                continue  # suspending lower classes never lifts this class's own cap
            capacity = memory.capacity_mb(self._device_info[i], self.config.memory_reserve_mb)
            need = (memory.declared_mb(self._sessions.values(), i) + memory.held_mb(self._workers_share(i))
                    + memory_mb - capacity)
            victims = memory.room_makers(self._sessions.values(), i, workload, need)
            if victims:
                return i, victims
        return None, []

    def _unblock(self, victim: Session, now: float) -> None:
        """``victim`` is off the device (or gone): sessions waiting on it may ask for the token."""
        for s in list(self._sessions.values()):
            if victim.id in s.blocked_by:
                s.blocked_by.discard(victim.id)
                if not s.blocked_by and s.acquire_pending:
                    s.acquire_pending = False
                    self._request_token(s.id, s.device, now)  # held while the device is lost

    def _on_suspended(self, route: bytes, msg: p.Suspended, frame, now: float) -> None:
        s = self._session_for(route, msg.id, now)
        if s is None or s.suspend_state != "requested":
            return  # resumed (or stopped) meanwhile: its resume notice is already on the way
        if s.grant is not None:  # it should have released; make sure the device is free
            self._apply(self._schedulers[s.device].revoke(s.id, now, "suspended"), now, handoff_from=now)
        s.suspend_state = "suspended"
        s.bytes_parked = msg.bytes_parked
        self.metrics.parked_bytes.inc(max(0, msg.bytes_parked))
        self.metrics.suspend_seconds.observe(max(0.0, msg.suspend_ms) / 1000.0)
        self._finish_suspend(s, "suspended", now, suspend_ms=msg.suspend_ms)

    def _finish_suspend(self, s: Session, outcome: str, now: float, suspend_ms: float = 0.0) -> None:
        self._suspending.discard(s)
        elapsed_ms = (now - s.suspend_started) * 1000.0
        for route, request_id in s.suspend_waiters:
            self._send(route, p.SuspendResult(id=request_id, session=s.id, outcome=outcome, elapsed_ms=elapsed_ms,
                                              bytes_parked=s.bytes_parked, suspend_ms=suspend_ms))
        s.suspend_waiters.clear()
        self.metrics.suspends.labels(outcome).inc()
        self._unblock(s, now)
        log.info("[suspend] %s session=%s elapsed_ms=%.1f bytes_parked=%d", outcome, s.id, elapsed_ms,
                 s.bytes_parked)
        self._suspend_finished(s, outcome, elapsed_ms, now)  # events, a reclaim waiting on it (cluster.py)

    def _on_resume_session(self, route: bytes, msg: p.ResumeSession, frame, now: float) -> None:
        s = self._authorize(route, msg.id, frame, msg.session)
        if s is None:
            return
        state = s.suspend_state
        if state is not None:
            if state == "stopped":
                self._continue(s)
                s.last_seen = now
            elif state == "requested":
                self._finish_suspend(s, "cancelled", now)
            s.suspend_state = None
            s.bytes_parked = 0
            self._send(s.route, p.ResumeNotice())
            self.metrics.resumes.inc()
            self._event("resume", s.device, s.id, was=state)
            log.info("[suspend] resume session=%s was=%s", s.id, state)
        self._send(route, p.Ok(id=msg.id))

    def _on_resumed(self, route: bytes, msg: p.Resumed, frame, now: float) -> None:
        s = self._session_for(route, msg.id, now)
        if s is not None:
            self.metrics.resume_seconds.observe(max(0.0, msg.resume_ms) / 1000.0)

    def _answer_pending_suspends(self) -> None:
        """Shutdown: every ``suspend_session`` still waiting for its outcome is answered
        ``E_SHUTTING_DOWN`` now, not left to its own timeout (reclaims: ``_close_cluster``)."""
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

    def _check_suspend_deadlines(self, now: float) -> None:
        for s in [s for s in self._suspending if now >= s.suspend_deadline]:
            self._suspending.discard(s)
            if self._stop(s):
                scheduler = self._schedulers[s.device]
                if s.grant is not None:
                    self._end_slice(s, now)
                    self._apply(scheduler.revoke(s.id, now, "suspended"), now, handoff_from=now)
                s.suspend_state = "stopped"
                self._finish_suspend(s, "stopped", now)
            else:  # reported once; it may still suspend later
                self._finish_suspend(s, "timeout", now)

