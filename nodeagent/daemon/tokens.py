"""Each device's token: its scheduler, and the carrying-out of what the scheduler decides.

The schedulers (:class:`sharing.scheduler.TokenScheduler`, pure logic) say what
should happen; this component makes it happen: a grant or a yield request is
sent to the session's client, an overrun is enforced (SIGSTOP of a verified
process, journalled first, else the token is revoked), a stopped process is
continued when its turn comes again, and the waits, slices and handoffs are
measured. It also owns the successor hints of one-hop handoffs
(:mod:`nodeagent.daemon.one_hop`).

A component: it owns the schedulers and the measurement state, and is given in
its constructor what it may touch: the session table, metrics, the journal
writer, how to answer a peer (``send``), how to publish an event (``event``),
and which sessions are the serving component's (``delegated`` / ``delegate``:
a client's server-side inference queue holds the token through a sub-session
whose actions the serving component carries out).
"""

from __future__ import annotations

import logging
import signal
from typing import Callable

from client_lib import protocol as p
from nodeagent import enforce
from nodeagent.metrics import Metrics
from nodeagent.daemon.device_stats import DeviceStats
from nodeagent.daemon.one_hop import OneHop
from nodeagent.daemon.pace import Pacing
from nodeagent.daemon.sessions import Session, SessionTable
from sharing import AskYield, Enforce, Grant, Revoked, SchedulerPolicy, TokenScheduler, Workload
from sharing.corun import CoRunScheduler, PaceController

log = logging.getLogger("nodeagent.daemon.tokens")

Send = Callable[[object, object], None]  # (route, message)
Event = Callable[..., None]  # (kind, device, session, **data)
JournalWrite = Callable[..., bool]  # (write(journal), session=...) -> written


class Tokens:
    """The schedulers of every device and the carrying-out of their actions."""

    def __init__(self, *, device_count: int, policy: SchedulerPolicy, enforce_mode: str, sessions: SessionTable,
                 metrics: Metrics, journal: JournalWrite, send: Send, event: Event,
                 delegated: Callable[[str], bool], delegate: Callable[[object, float], None],
                 clock: Callable[[], float], sharing: str = "exclusive",
                 pace_controller: Callable[[], PaceController] = PaceController) -> None:
        if sharing not in ("corun", "exclusive"):
            raise ValueError(f"sharing must be corun or exclusive, got {sharing!r}")
        self.sharing = sharing
        self._policy = policy
        self.schedulers = [self.new_scheduler(i) for i in range(device_count)]
        self._enforce_mode = enforce_mode  # "stop" (SIGSTOP a verified overrunner) or "revoke"
        self._sessions = sessions
        self._metrics = metrics
        self._journal = journal
        self._send = send
        self._event = event
        self._delegated = delegated
        self._delegate = delegate
        self._clock = clock
        self._wait_hist: dict[tuple[int, Workload], object] = {}
        self._handoff_hist = [metrics.token_handoff.labels(str(i)) for i in range(device_count)]
        # Successor hints and wake channels (one-hop handoffs): a part of this component.
        self.one_hop = OneHop(schedulers=self.schedulers, sessions=sessions, send=send, delegated=delegated,
                              clock=clock, grace_s=policy.grace_ms / 1000.0,
                              stop=lambda s: self._enforce_mode == "stop" and self.stop(s),
                              apply=lambda actions, now: self.apply(actions, now, handoff_from=now))
        self.stats = [DeviceStats() for _ in range(device_count)]  # recent history for status (`nodeagent top`)
        # Co-run devices: their pace boards and controllers (a part of this component).
        controllers = {i: pace_controller() for i in range(device_count)} if sharing == "corun" else {}
        self.pacing = Pacing(schedulers=self.schedulers, sessions=sessions, controllers=controllers, metrics=metrics)

    def new_scheduler(self, device: int, first_grant: int = 1) -> TokenScheduler | CoRunScheduler:
        """A fresh scheduler for ``device``: one lane per class under co-run, else one token."""
        if self.sharing == "corun":
            return CoRunScheduler(device, self._policy, first_grant=first_grant)
        return TokenScheduler(device, self._policy, first_grant=first_grant)

    # ------------------------------------------------------------------ timers

    def next_deadline(self) -> float | None:
        """The earliest scheduler deadline of any device (a yield or slice timer), or the
        answer due for a withdrawn one-hop promise; None if nothing is pending."""
        soonest = self.one_hop.next_deadline()
        for scheduler in self.schedulers:
            deadline = scheduler.next_deadline()
            if deadline is not None and (soonest is None or deadline < soonest):
                soonest = deadline
        return soonest

    def on_timers(self, now: float) -> None:
        self.one_hop.on_timers(now)
        for scheduler in self.schedulers:
            deadline = scheduler.next_deadline()
            if deadline is not None and deadline <= now:
                self.apply(scheduler.tick(now), now)

    # ------------------------------------------------------------------ actions

    def apply(self, actions: list, now: float, handoff_from: float | None = None) -> None:
        """Carry out scheduler actions: notices to clients, metrics, enforcement."""
        for action in actions:
            if self._delegated(action.session):  # a client's server-side inference queue
                self._note_delegated(action, now)
                self._delegate(action, now)
                continue
            kind = type(action)
            if kind is Grant:
                s = self._sessions[action.session]
                s.grant = action.grant
                s.granted_at = now
                s.grants += 1
                was_stopped = s.stopped
                if was_stopped:  # its turn again: it runs before it hears it may
                    enforce.send(s, signal.SIGCONT)
                    s.stopped = False
                    s.last_seen = now  # it could not heartbeat while stopped
                self._send(s.route, p.Grant(grant=action.grant, device=s.device, slice_ms=action.slice_ms))
                self.pacing.granted(s)
                self.stats[s.device].granted(s.id, s.name, now, action.waited_s, lane=self._lane(s.device, s.workload))
                self._event("grant", s.device, s.id, grant=action.grant, waited_ms=action.waited_s * 1e3)
                if was_stopped:
                    self._journal(lambda j, sid=s.id: j.set_stopped(sid, False), session=s.id)
                self.observe_wait(s, now)
                if handoff_from is not None:
                    self._handoff_hist[s.device].observe(self._clock() - handoff_from)
                requeue = self.one_hop.take_early_release(s, action.grant)
                if requeue is not None:  # it was woken, and is done already: its release came first
                    self.end_slice(s, now)
                    if requeue:
                        s.wait_started = now
                    self.apply(self.schedulers[s.device].release(s.id, action.grant, now, requeue=requeue), now,
                               handoff_from=now)
            elif kind is AskYield:
                s = self._sessions[action.session]
                self.one_hop.refresh(s.device)  # a withdrawn hint must reach the holder before the ask
                self._send(s.route, p.YieldRequest(grant=action.grant, deadline_ms=action.deadline_ms,
                                                   reason=action.reason))
                self._event("preempt", s.device, s.id, grant=action.grant, reason=action.reason,
                            deadline_ms=action.deadline_ms)
                self._metrics.yield_requests.labels(str(s.device), action.reason).inc()
                self.stats[s.device].yield_asked(action.reason)
                log.debug("[token] ask-yield session=%s grant=%d reason=%s", s.id, action.grant, action.reason)
            elif kind is Enforce:
                self._enforce(action, now)
            elif kind is Revoked:
                s = self._sessions[action.session]
                self.end_slice(s, now)
                self._send(s.route, p.Revoke(grant=action.grant, reason=action.reason))

    def _enforce(self, action: Enforce, now: float) -> None:
        """A holder overran its yield deadline: stop it if its identity is
        verified, policy allows and the stop could be journalled, else take the
        token away. The waiter is granted before the log line; the journal write
        stays ahead of SIGSTOP."""
        s = self._sessions[action.session]
        self.stats[s.device].enforced()
        if self._enforce_mode == "stop" and self.stop(s):
            self.end_slice(s, now)
            self.apply(self.schedulers[s.device].preempt(s.id, now), now, handoff_from=now)
            self._metrics.enforcements.labels("stop").inc()
            self._event("preempt", s.device, s.id, grant=action.grant, reason="overrun", action="stop")
            log.warning("[token] enforce session=%s grant=%d overrun_ms=%.1f action=stop pid=%s pgid=%s",
                        s.id, action.grant, action.overrun_ms, s.pid, s.managed_pgid)
            return
        self.apply(self.schedulers[s.device].revoke(s.id, now, "overrun"), now, handoff_from=now)
        self._metrics.enforcements.labels("revoke").inc()
        self._event("preempt", s.device, s.id, grant=action.grant, reason="overrun", action="revoke")
        log.warning("[token] enforce session=%s grant=%d overrun_ms=%.1f action=revoke verified=%s",
                    s.id, action.grant, action.overrun_ms, enforce.can_signal(s))

    # ------------------------------------------------------------------ stopping

    def stop(self, s: Session) -> bool:
        """SIGSTOP a verified session's process; False if it cannot be (or is gone).

        Write-ahead: the journal says "stopped" before the signal is sent, so a
        daemon killed at any moment after leaves a record that makes its
        successor continue the process (continuing a running one is harmless).
        If that write fails (disk full), the process is not stopped: False."""
        if not enforce.can_signal(s):
            return False
        if not self._journal(lambda j: j.set_stopped(s.id, True), session=s.id):
            # Unjournalled, a stop would outlive a crash of this daemon: take the token instead.
            log.warning("[token] not stopping session=%s: its stop could not be journalled", s.id)
            return False
        if not enforce.send(s, signal.SIGSTOP):
            return False  # gone: its session ends, and with it the record
        s.stopped = True
        return True

    def cont(self, s: Session) -> bool:
        """SIGCONT a session the daemon stopped. Never leaves a process stopped it can reach."""
        if not s.stopped:
            return False
        sent = enforce.send(s, signal.SIGCONT)
        s.stopped = False
        if s.id in self._sessions:
            self._journal(lambda j: j.set_stopped(s.id, False), session=s.id)
        return sent

    # ------------------------------------------------------------------ measuring

    def observe_wait(self, s: Session, now: float) -> None:
        if s.wait_started is None:
            return
        key = (s.device, s.workload)
        hist = self._wait_hist.get(key)
        if hist is None:
            hist = self._metrics.token_wait.labels(str(s.device), s.workload.wire)
            self._wait_hist[key] = hist
        hist.observe(now - s.wait_started)
        s.wait_started = None

    def end_slice(self, s: Session, now: float) -> None:
        held_since = s.granted_at
        s.grant = s.granted_at = None
        self.count_slice(s, held_since, now)

    def count_slice(self, s: Session, held_since: float | None, now: float) -> None:
        self.stats[s.device].slice_ended(s.id, now)
        if held_since is not None and s.id in self._sessions:
            self._metrics.slice_seconds.labels(str(s.device), s.workload.wire).inc(max(0.0, now - held_since))
            self.pacing.slice_ended(s, now - held_since)
        else:
            self.pacing.forget(s)

    def _lane(self, device: int, workload: Workload) -> int:
        """Which token of ``device`` a grant to ``workload`` is of: its class's on a co-run device."""
        return int(workload) if self.schedulers[device].corun else 0

    def _note_delegated(self, action, now: float) -> None:
        """A serving sub-session's grant, yield request, overrun or revoke counts in its device's history."""
        device = next((i for i, scheduler in enumerate(self.schedulers) if action.session in scheduler), None)
        if device is None:
            return
        stats = self.stats[device]
        kind = type(action)
        if kind is Grant:
            owner = self._sessions.get(action.session.rpartition(":")[0])  # "<session>:serve"
            stats.granted(action.session, f"{owner.name} (server-side)" if owner is not None else action.session,
                          now, action.waited_s, lane=self._lane(device, Workload.INFERENCE))
        elif kind is AskYield:
            stats.yield_asked(action.reason)
        elif kind is Enforce:
            stats.enforced()
        elif kind is Revoked:
            stats.slice_ended(action.session, now)
