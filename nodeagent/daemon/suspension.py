"""Whole-device suspension (:class:`Suspensions`): each session's
:class:`sharing.suspension.Suspension` machine, journalled before it is acted on, and the host memory
its client keeps for parked state; others read them through its views. Detail: docs/internals.md.
"""

from __future__ import annotations

import logging
import os
import time

from client_lib import protocol as p
from client_lib.limits import DEFAULT_SUSPEND_DEADLINE_MS
from nodeagent.daemon.authz import Act, peer_of
from nodeagent.daemon.authz import refusal as authz_refusal
from nodeagent.daemon.bus import Bus, MakeRoomFinished, MayAsk, Replies, SuspendFinished
from nodeagent.daemon.journal_writer import JournalWriter
from nodeagent.daemon.sessions import Session, SessionTable
from nodeagent.daemon.tokens import Tokens
from nodeagent.metrics import Metrics
from sharing import SessionState
from sharing.suspension import (AskToken, ContinueProcess, LeaveLine, Notify, Report, StopProcess, Suspension,
                                SuspendState, TakeToken)

log = logging.getLogger("nodeagent.suspension")


def _host_memory_bytes() -> int:
    """The host's physical memory: no client keeps more than that for its parked state."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 2**53


HOST_MEMORY_BYTES = _host_memory_bytes()
_RUNNING = Suspension()  # what a session with no machine reads as (never changed: reads only)
MAKE_ROOM = "memory"  # the reason of a suspension that makes room for an admitted session (admission's plan)


class Suspensions:
    """Whole-device suspension handlers (see docs/internals.md)."""

    def __init__(self, *, sessions: SessionTable, tokens: Tokens, metrics: Metrics, replies: Replies, bus: Bus,
                 journal: JournalWriter) -> None:
        """``bus``: suspension events (the cluster's, SuspendFinished, MakeRoomFinished) and MayAsk
        (a session's request for the token, made again at its resume)."""
        self._sessions = sessions
        self._tokens = tokens
        self._metrics = metrics
        self._send = replies.send
        self._error = replies.error
        self._session_for = replies.session_for
        self._bus = bus
        self._journal = journal
        self._waiters: dict[str, list[tuple]] = {}  # session -> (route, request id) awaiting suspend_result
        # Sessions sent a suspend notice with no resumed report since: only their suspended and
        # resumed reports (and the host bytes they carry) are believed.
        self._asked: set[str] = set()
        self._asked_per_device: dict[int, int] = {}  # device -> suspensions begun there (status)
        # Session id -> its machine, from its first suspension until it ends (none: RUNNING).
        self._machines: dict[str, Suspension] = {}
        # Session id -> (bytes, pinned): host memory its client keeps for parked state
        # (suspended/resumed.host_bytes), held whatever the suspension is now.
        self._host_kept: dict[str, tuple[int, bool]] = {}

    # ------------------------------------------------------------- for the loop

    def waiters(self, s: Session) -> tuple:
        """Who awaits ``s``'s ``suspend_result``: (route, request id) pairs (a read-only view)."""
        return tuple(self._waiters.get(s.id, ()))

    def wait_for(self, s: Session, route, request_id: int) -> None:
        """``route``'s request ``request_id`` is answered with ``s``'s next outcome."""
        self._waiters.setdefault(s.id, []).append((route, request_id))

    def asked_on(self, device: int) -> int:
        """How many suspensions were asked of sessions on ``device`` since the daemon started
        (``status``'s ``activity.suspensions``, ``nodeagent top``)."""
        return self._asked_per_device.get(device, 0)

    def under_way(self, s: Session) -> bool:
        """Whether ``s`` was asked to suspend and its deadline has not been acted on yet."""
        return self._machine_of(s).pending_deadline

    # ------------------------------------------------------- read-only views

    def state(self, s: Session) -> SuspendState:
        """Where ``s`` stands with a suspension (RUNNING when none)."""
        return self._machine_of(s).state

    def active(self, s: Session) -> bool:
        """Suspended, stopped, or asked to be: ``s`` may not use the device. (Read at every
        acquire and release: one dict lookup.)"""
        return self._machine_of(s).active

    def suspended_ids(self) -> frozenset[str]:
        """The sessions whose suspension is :meth:`active`: their device memory is, or is about
        to be, in host memory (admission does not count it)."""
        return frozenset(sid for sid, machine in self._machines.items() if machine.active)

    def parked_bytes(self, s: Session) -> int:
        """The device memory ``s``'s client said its last park released (0 since a resume)."""
        return self._machine_of(s).bytes_parked

    def host_kept(self, s: Session) -> tuple[int, bool]:
        """(bytes, pinned): host memory ``s``'s client keeps for its parked state."""
        return self._host_kept.get(s.id, (0, False))

    def record(self, s: Session) -> dict | None:
        """``s``'s suspension as the journal keeps it (None: none)."""
        return self._machine_of(s).to_record(time.monotonic(), time.time())

    # ------------------------------------------------ the gate's token wishes

    def keep_request(self, s: Session) -> None:
        """``s`` asked for the token while suspended: unless it holds one, it is asked for at the
        resume (the machine's ``keep_request``)."""
        machine = self._machines.get(s.id)
        if machine is not None and machine.active:
            machine.keep_request = machine.keep_request or self._tokens.grant_of(s) is None

    def drop_request(self, s: Session) -> None:
        """``s`` cancelled: no request is made for it at its resume."""
        machine = self._machines.get(s.id)
        if machine is not None:
            machine.keep_request = False

    def next_deadline(self, now: float) -> float | None:
        """The earliest suspend deadline pending, or None."""
        return min((machine.deadline for machine in self._machines.values() if machine.pending_deadline),
                   default=None)

    def on_timers(self, now: float) -> None:
        """Act on the suspend deadlines that have passed: stop verified sessions, report the rest."""
        for s in [self._sessions[sid] for sid, machine in self._machines.items() if machine.due(now)]:
            self._carry_out(s, self._machine_of(s).expire(now), now)

    def forget(self, s: Session, now: float) -> None:
        """``s`` ended: a suspension under way is reported ``gone`` to whoever waits on it."""
        if s.id in self._machines:
            self._carry_out(s, self._machines[s.id].gone(now), now, journal=False)
        self._machines.pop(s.id, None)
        self._host_kept.pop(s.id, None)
        self._waiters.pop(s.id, None)
        self._asked.discard(s.id)

    def answer_pending(self) -> None:
        """Shutdown: every ``suspend_session`` still waiting for its outcome is answered
        ``E_SHUTTING_DOWN`` now, not left to its own timeout (reclaims: the cluster endpoint).
        The suspensions themselves stay journalled: the next daemon finishes them."""
        answered = 0
        for sid, waiters in self._waiters.items():
            for route, request_id in waiters:
                self._error(route, request_id, p.ErrorCode.SHUTTING_DOWN,
                            f"daemon is shutting down; the suspension of session {sid} did not finish "
                            "(retry when it is back)")
                answered += 1
        self._waiters.clear()
        if answered:
            log.info("[shutdown] step=suspend-requests answered=%d", answered)

    # ----------------------------------------------------------------- requests

    def on_suspend_session(self, route, msg: p.SuspendSession, frame, now: float) -> None:
        s = self._target(route, msg.id, frame, msg.session, Act.SUSPEND)
        if s is None:
            return
        state = self.state(s)
        if state in (SuspendState.SUSPENDED, SuspendState.STOPPED):
            self._send(route, p.SuspendResult(id=msg.id, session=s.id, outcome=state.value, elapsed_ms=0.0,
                                              bytes_parked=self.parked_bytes(s)))
            return
        self.wait_for(s, route, msg.id)
        if state is SuspendState.RUNNING:  # else already under way: this caller hears the same result
            self.begin(s, msg.deadline_ms, now, reason="requested")

    def begin(self, s: Session, deadline_ms: float, now: float, reason: str) -> None:
        """Ask ``s`` to suspend within ``deadline_ms`` (requested, made room, reclaim)."""
        waiting = self._tokens.state(s.device, s.id) is SessionState.WAITING
        actions = self._machine(s).request(now, deadline_ms, reason, waiting)
        self._asked_per_device[s.device] = self._asked_per_device.get(s.device, 0) + 1
        self._carry_out(s, actions, now)
        self._bus.event("suspend", s.device, s.id, outcome="requested", reason=reason, deadline_ms=deadline_ms)
        log.info("[suspend] request session=%s name=%s deadline_ms=%.0f holding=%s reason=%s",
                 s.id, s.name, deadline_ms, self._tokens.grant_of(s) is not None, reason)

    def on_suspended(self, route, msg: p.Suspended, frame, now: float) -> None:
        s = self._session_for(route, msg.id, now)
        if s is None:
            return  # answered E_NO_SESSION
        if s.id not in self._asked:  # a client reports suspended only after a suspend notice
            self._refuse_claim(route, msg.id, s, "suspended",
                               f"session {s.id} was not asked to suspend; a suspended report is refused")
            return
        if msg.host_bytes > HOST_MEMORY_BYTES:
            self._refuse_claim(route, msg.id, s, "host_bytes",
                               f"host_bytes {msg.host_bytes} is more than this host's memory ({HOST_MEMORY_BYTES})")
            return
        self._host_kept[s.id] = (msg.host_bytes, msg.host_pinned)  # held whatever the suspension is now
        actions = self._machine(s).suspended(now, msg.bytes_parked)
        if not actions:
            return  # resumed (or stopped, or already suspended) meanwhile
        self._metrics.parked_bytes.inc(max(0, msg.bytes_parked))
        self._metrics.suspend_seconds.observe(max(0.0, msg.suspend_ms) / 1000.0)
        self._carry_out(s, actions, now, suspend_ms=msg.suspend_ms)

    def on_resume_session(self, route, msg: p.ResumeSession, frame, now: float) -> None:
        s = self._target(route, msg.id, frame, msg.session, Act.RESUME)
        if s is None:
            return
        state = self.state(s)
        if state is not SuspendState.RUNNING:
            machine = self._machine(s)
            log.info("[suspend] resume session=%s was=%s asked=%s", s.id, state.value, machine.keep_request)
            self._carry_out(s, machine.resume(now), now)
            self._metrics.resumes.inc()
            self._bus.event("resume", s.device, s.id, was=state.value)
        self._send(route, p.Ok(id=msg.id))

    def on_resumed(self, route, msg: p.Resumed, frame, now: float) -> None:
        s = self._session_for(route, msg.id, now)
        if s is None:
            return
        if s.id not in self._asked:
            # Not answered: a client whose suspension a daemon without its journal forgot resumes
            # and says so, and an error it would raise later must not end its program.
            self._metrics.refused_claims.labels("resumed").inc()
            log.info("[suspend] refused claim=resumed session=%s: it was not asked to suspend", s.id)
            return
        if msg.host_bytes is not None and msg.host_bytes > HOST_MEMORY_BYTES:
            self._refuse_claim(route, msg.id, s, "host_bytes",
                               f"host_bytes {msg.host_bytes} is more than this host's memory ({HOST_MEMORY_BYTES})")
            return
        self._asked.discard(s.id)
        self._metrics.resume_seconds.observe(max(0.0, msg.resume_ms) / 1000.0)
        if msg.host_bytes is not None:  # what it keeps for the next park (0: let go)
            _, pinned = self.host_kept(s)
            self._host_kept[s.id] = (msg.host_bytes, pinned and msg.host_bytes > 0)

    # ------------------------------------------------------------------ restart

    def restored(self, s: Session, machine: Suspension, now: float) -> None:
        """``s`` came back from the journal with ``machine``, its suspension from now on (a deadline pending
        stays pending); one the old daemon had stopped is asked again: this daemon continued its process."""
        if not machine.active:
            return
        self._machines[s.id] = machine
        self._asked.add(s.id)  # its welcome says so; its reports are due
        if machine.state is SuspendState.STOPPED:
            machine.state = SuspendState.RUNNING
            machine.request(now, DEFAULT_SUSPEND_DEADLINE_MS, "restart", waiting=False)

    def reattached(self, s: Session, now: float) -> None:
        """A restored session's client is back: a suspension not yet reported parked is asked of it
        again (it parks, or reports that it already has); the welcome told it it is suspended."""
        machine = self._machine_of(s)
        if machine.state is SuspendState.REQUESTED:
            left_ms = max(1.0, ((machine.deadline or now) - now) * 1000.0)
            self._asked.add(s.id)
            self._send(s.route, p.SuspendNotice(deadline_ms=left_ms, reason=machine.reason or "restart"))

    # ---------------------------------------------------------------- internals

    def _machine_of(self, s: Session) -> Suspension:
        """``s``'s machine, to read (a RUNNING one, not kept, when it has none)."""
        return self._machines.get(s.id) or _RUNNING

    def _machine(self, s: Session) -> Suspension:
        """``s``'s machine, to change (made on its first suspension)."""
        return self._machines.setdefault(s.id, Suspension())

    def _target(self, route, request_id: int, frame, target_id: str, act: Act) -> Session | None:
        """The target session if the peer may act on it (:mod:`nodeagent.daemon.authz`)."""
        target = self._sessions.get(target_id)
        if target is None:
            self._error(route, request_id, p.ErrorCode.NO_SESSION, f"no session {target_id}")
            return None
        refusal = authz_refusal(act, peer_of(route, frame, owner_uid=target.uid, owner_namespaces=target.namespaces))
        if refusal is not None:
            self._error(route, request_id, p.ErrorCode.FORBIDDEN, f"session {target_id}: {refusal}")
            return None
        return target

    def _carry_out(self, s: Session, actions: list, now: float, *, journal: bool = True,
                   suspend_ms: float = 0.0) -> None:
        """Do what the machine said, in order; its new state is journalled first."""
        if journal and actions:
            self._journal_state(s, now)
        for action in actions:
            kind = type(action)
            if kind is Notify:
                if action.what == "suspend":
                    self._asked.add(s.id)
                    self._send(s.route, p.SuspendNotice(deadline_ms=action.deadline_ms, reason=action.reason))
                else:
                    self._send(s.route, p.ResumeNotice())
            elif kind is LeaveLine:
                self._tokens.cancel_session(s, now)  # it was waiting, not holding
            elif kind is StopProcess:
                if not self._tokens.stop(s):  # unverifiable (or gone): it was not stopped after all
                    self._carry_out(s, self._machine(s).not_stopped(now), now)
                    return
            elif kind is ContinueProcess:
                self._tokens.cont(s)
                self._sessions.touch(s, now)  # it could not heartbeat while stopped
            elif kind is TakeToken:
                if self._tokens.grant_of(s) is not None:  # it should have released; make sure the device is free
                    self._tokens.end_slice(s, now)
                    self._tokens.revoke(s.device, s.id, now, action.reason)
            elif kind is AskToken:
                self._tokens.time_wait(s, now, again=True)
                self._bus.publish(MayAsk(s.id, now))
            elif kind is Report:
                self._report(s, action.outcome, action.elapsed_ms, now, suspend_ms)

    def _refuse_claim(self, route, request_id: int, s: Session, claim: str, why: str) -> None:
        """A report the daemon did not ask for, or cannot be true: answered, counted, not acted on."""
        self._metrics.refused_claims.labels(claim).inc()
        log.info("[suspend] refused claim=%s session=%s: %s", claim, s.id, why)
        self._error(route, request_id, p.ErrorCode.INVALID, why)

    def _journal_state(self, s: Session, now: float) -> None:
        record = self._machine_of(s).to_record(now, time.time())
        if s.id in self._sessions:
            self._journal.write(lambda j: j.set_suspension(s.id, record), session=s.id)

    def _report(self, s: Session, outcome: str, elapsed_ms: float, now: float, suspend_ms: float) -> None:
        for route, request_id in self._waiters.pop(s.id, ()):
            self._send(route, p.SuspendResult(id=request_id, session=s.id, outcome=outcome, elapsed_ms=elapsed_ms,
                                              bytes_parked=self.parked_bytes(s), suspend_ms=suspend_ms))
        self._metrics.suspends.labels(outcome).inc()
        log.info("[suspend] %s session=%s elapsed_ms=%.1f bytes_parked=%d", outcome, s.id, elapsed_ms,
                 self.parked_bytes(s))
        if self._machine_of(s).reason == MAKE_ROOM:  # the sessions it blocked ask first (the gate), then
            self._bus.publish(MakeRoomFinished(s.id, now))
        self._bus.publish(SuspendFinished(s, outcome, elapsed_ms, now))  # events, a reclaim waiting on it
