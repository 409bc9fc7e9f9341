"""Each device's token (:class:`Tokens`): the only writer of the schedulers and the carrying-out of
their actions (grants, yields, enforcement), each client session's token state (:class:`TokenHold`),
and the co-run pace boards (:class:`Pacing`). Detail: docs/internals.md.
"""

from __future__ import annotations

import logging
import os
import signal
import stat
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from client_lib import protocol as p
from client_lib.pace import Pace, PaceBoardError, PaceBoardWriter
from nodeagent import enforce, runtime
from nodeagent.metrics import Metrics
from nodeagent.config import ServeConfig
from nodeagent.daemon.bus import Bus, DelegatedAction, DeviceFacts, Granted, SliceEnded
from nodeagent.daemon.history import DeviceStats
from nodeagent.daemon.sessions import Session, SessionTable
from sharing import AskYield, Enforce, Grant, Revoked, SchedulerPolicy, SessionState, TokenScheduler, Workload
from sharing.yield_grace import YieldGrace
from sharing.corun import CoRunScheduler, PaceController, board_slot

log = logging.getLogger("nodeagent.daemon.tokens")
pace_log = logging.getLogger("nodeagent.daemon.pace")  # the name operators and bench.colocate read

Send = Callable[[object, object], None]  # (route, message)
JournalWrite = Callable[..., bool]  # (write(journal), session=...) -> written


@dataclass(slots=True, eq=False)
class TokenHold:
    """A client session's token state, kept by :class:`Tokens` alone (by session id, from
    :meth:`Tokens.add` until :meth:`Tokens.remove`); others read it through ``Tokens``' views."""

    grant: int | None = None  # grant id while holding the token
    granted_at: float | None = None
    wait_started: float | None = None  # when it last asked for the token
    stopped: bool = False  # SIGSTOPped by the daemon (journalled first); continued before its next grant


_NO_HOLD = TokenHold()  # what a session with no token state reads as (never changed: reads only)


class Tokens:
    """The schedulers of every device and the carrying-out of their actions."""

    def __init__(self, *, config: ServeConfig, devices: DeviceFacts, sessions: SessionTable, metrics: Metrics,
                 journal: JournalWrite, send: Send, bus: Bus, clock: Callable[[], float]) -> None:
        device_count = devices.count
        self.sharing = config.sharing_for(devices.name)
        self._policy = config.policy()
        self._device_total = device_count  # grant ids interleave across devices (new_scheduler)
        self.schedulers = [self.new_scheduler(i) for i in range(device_count)]
        self._enforce_mode = config.enforce  # "stop" (SIGSTOP a verified overrunner) or "revoke"
        self._late = YieldGrace()  # how long each session's yields take; a late one is waited for once
        self._sessions = sessions
        self._metrics = metrics
        self._journal = journal
        self._send = send
        self._bus = bus
        # Client sessions' token state, by session id. A session on a scheduler without one is a
        # sub-session another component holds the token for (serving's queues): its actions are
        # published (DelegatedAction) for that component to carry out.
        self._holds: dict[str, TokenHold] = {}
        self._clock = clock
        self._children: dict[tuple, object] = {}  # (family, device, class) -> its child, kept: no lookup per grant
        self._handoff_hist = [metrics.token_handoff.labels(str(i)) for i in range(device_count)]
        self.stats = [DeviceStats() for _ in range(device_count)]  # recent history for status (`nodeagent top`)
        # Co-run devices: their pace boards and controllers (a part of this component, reading the schedulers).
        self._pacing = Pacing(sessions=sessions,
                             devices=range(device_count) if self.sharing == "corun" else (),
                             new_controller=config.pace_controller, clock=clock, metrics=metrics)

    def new_scheduler(self, device: int, first_grant: int = 1) -> TokenScheduler | CoRunScheduler:
        """A fresh scheduler for ``device``: one lane per class under co-run, else one token.
        Its grant ids interleave with the other devices': device ``d`` of ``n`` issues
        ``first_grant + d``, then every ``n`` (each co-run lane its own, ``3 * n`` apart), so
        an id is unique per boot across devices, and a session's ids still only grow."""
        total = self._device_total
        if self.sharing == "corun":
            return CoRunScheduler(device, self._policy, first_grant=first_grant + device * len(Workload),
                                  grant_stride=total)
        return TokenScheduler(device, self._policy, first_grant=first_grant + device, grant_step=total)

    # ------------------------------------------------------------------ commands
    # The only way a scheduler changes: every component asks here, and what the scheduler
    # decides is carried out at once (``apply``), in the same loop turn. Sessions and the
    # serving component's sub-sessions are named the same way, by (device, id).

    def add(self, device: int, sid: str, workload: Workload, weight: float, now: float, *,
            delegated: bool = False, stopped: bool = False) -> None:
        """``sid`` joins ``device``; ``delegated``: a sub-session whose actions another component carries
        out (published as :class:`DelegatedAction`), not a client session; ``stopped``: the journal
        says the daemon before this one left it stopped (a restored session: :meth:`cont` it)."""
        self.schedulers[device].add_session(sid, workload, weight, now)
        if not delegated:
            self._holds[sid] = TokenHold(stopped=stopped)
        self._pacing.joined(device, sid, workload)

    def remove(self, device: int, sid: str, now: float) -> None:
        """``sid`` left the device: a token it held passes on at once."""
        self._late.forget(sid)
        self.apply(self.schedulers[device].remove_session(sid, now), now, handoff_from=now)
        self._pacing.drop(sid)
        self._holds.pop(sid, None)

    def request(self, device: int, sid: str, now: float, waiting_since: float | None = None) -> None:
        self.apply(self.schedulers[device].request(sid, now, waiting_since=waiting_since), now)

    def cancel(self, device: int, sid: str, now: float) -> None:
        self.apply(self.schedulers[device].cancel(sid, now), now)

    def time_wait(self, s: Session, now: float, *, again: bool = False) -> None:
        """``s`` asked for the token: its wait (``nodeagent_token_wait_seconds``) is timed from
        ``now``, unless it holds or is timed already; ``again``: from ``now`` whatever came before."""
        hold = self._holds[s.id]
        if again or (hold.grant is None and hold.wait_started is None):
            hold.wait_started = now

    def release(self, device: int, sid: str, grant: int, now: float, requeue: bool = False) -> None:
        """``sid`` gives ``grant`` back; NotHolderError (nothing changed) if it does not hold it."""
        self.apply(self.schedulers[device].release(sid, grant, now, requeue=requeue), now, handoff_from=now)

    def release_session(self, s: Session, grant: int, now: float, requeue: bool = False) -> None:
        """Client session ``s`` gives ``grant`` back (NotHolderError, nothing changed, if it does
        not hold it): its slice is over, and the next holder hears before anything is counted."""
        actions = self.schedulers[s.device].release(s.id, grant, now, requeue=requeue)
        self._late.yielded(s.id, now)
        hold = self._holds[s.id]
        held_since = hold.granted_at
        hold.grant = hold.granted_at = None
        if requeue:
            hold.wait_started = now
        self.apply(actions, now, handoff_from=now)
        self.count_slice(s, held_since, now)

    def cancel_session(self, s: Session, now: float) -> None:
        """Client session ``s`` stops waiting (a no-op for a holder: it must release); its wait is no
        longer timed (one being suspended: its resume asks again, :meth:`time_wait`)."""
        actions = self.schedulers[s.device].cancel(s.id, now)
        hold = self._holds[s.id]
        if hold.grant is None:
            hold.wait_started = None
        self.apply(actions, now)

    def revoke(self, device: int, sid: str, now: float, reason: str) -> None:
        self.apply(self.schedulers[device].revoke(sid, now, reason), now, handoff_from=now)

    def preempt(self, s: Session, now: float) -> None:
        """Put the holder ``s`` back in line without its consent (the daemon stopped it); its slice ends first."""
        self.end_slice(s, now)
        self.apply(self.schedulers[s.device].preempt(s.id, now), now, handoff_from=now)

    def set_weight(self, s: Session, weight: float, now: float) -> bool:
        """Client session ``s``'s share within its class is ``weight`` from now (a holder's time so
        far is charged at the old one), journalled; False if the journal could not take it (the
        weight is changed all the same: a restart would bring back the old one)."""
        self.schedulers[s.device].set_weight(s.id, weight, now)
        s.weight = weight
        return self._journal(lambda j: j.set_weight(s.id, weight), session=s.id)

    def set_policy(self, device: int, policy: SchedulerPolicy, now: float) -> None:
        self.apply(self.schedulers[device].set_policy(policy, now), now)

    def told_queue(self, s: Session, now: float, waiting: int | None, oldest_wait_ms: float | None,
                   released: bool = False) -> None:
        """``s`` said with a slice request (``released``: a release) how many of its requests wait;
        its pace controller hears it (co-run devices)."""
        self._pacing.told_queue(s, now, waiting, oldest_wait_ms, released=released)

    def renew(self, first_grant: int) -> None:
        """Fresh schedulers whose grant ids start at ``first_grant`` (a restart: ids continue above
        the old daemon's); in place, so every view of the list sees them."""
        self.schedulers[:] = [self.new_scheduler(i, first_grant) for i in range(len(self.schedulers))]

    # ------------------------------------------------------------------ views

    @property
    def device_count(self) -> int:
        return len(self.schedulers)

    def grant_of(self, s: Session) -> int | None:
        """The grant client session ``s`` holds (None: none, or it is not a session here)."""
        return self._holds.get(s.id, _NO_HOLD).grant

    def held_since(self, s: Session) -> float | None:
        """When ``s``'s grant was made (None while it holds none)."""
        return self._holds.get(s.id, _NO_HOLD).granted_at

    def waiting_since(self, s: Session) -> float | None:
        """When ``s`` last asked for the token, while its wait is timed (None: not waiting, or holding)."""
        return self._holds.get(s.id, _NO_HOLD).wait_started

    def stopped(self, s: Session) -> bool:
        """Whether the daemon has ``s``'s process SIGSTOPped (journalled; continued before its next grant)."""
        return self._holds.get(s.id, _NO_HOLD).stopped

    def state(self, device: int, sid: str) -> SessionState:
        return self.schedulers[device].state(sid)

    def on_device(self, device: int, sid: str) -> bool:
        return sid in self.schedulers[device]

    def sessions_on(self, device: int) -> int:
        return len(self.schedulers[device])

    def policy(self, device: int) -> SchedulerPolicy:
        return self.schedulers[device].policy

    def corun(self, device: int) -> bool:
        return self.schedulers[device].corun

    def holders(self, device: int) -> tuple[str, ...]:
        return self.schedulers[device].holders()

    def lane_holder(self, device: int, sid: str) -> str | None:
        """Who holds the token ``sid`` takes turns at (its class's, on a co-run device)."""
        return self.schedulers[device].lane_of(sid).holder()

    def wanted_by(self, device: int, workload: Workload) -> bool:
        return self.schedulers[device].wanted_by(workload)

    def waiting_count(self, device: int) -> int:
        return self.schedulers[device].waiting_count()

    def snapshot(self, device: int, now: float):
        return self.schedulers[device].snapshot(now)

    def activity(self, now: float) -> list:
        """Each device's recent history (``status``'s ``activity``, ``nodeagent top``), in index order."""
        return [stats.report(now, self.holders(i)) for i, stats in enumerate(self.stats)]

    def pace_board(self, device: int) -> str:
        """The pace board a lower-class session on ``device`` reads ("" where the device does not co-run)."""
        return self._pacing.board_path(device)

    # ------------------------------------------------------------------ pace boards

    def open_pace_boards(self, socket_path: str | None, state_dir: str) -> None:
        """Create the co-run devices' pace boards beside the socket (``state_dir`` over tcp)."""
        self._pacing.start(socket_path, state_dir)

    def write_pace_boards(self) -> None:
        """Write the boards from the lanes and controllers (after every loop turn)."""
        self._pacing.refresh_all(self.schedulers)

    def close_pace_boards(self) -> None:
        """Remove the boards: a board left behind says nobody is paced."""
        self._pacing.close()

    # ------------------------------------------------------------------ timers

    def next_deadline(self, now: float) -> float | None:
        """The earliest scheduler deadline of any device (a yield or slice timer), or the pacing's
        (a queue-steered pause's projection); None if nothing is pending."""
        deadlines = (self._pacing.next_deadline(), *(scheduler.next_deadline() for scheduler in self.schedulers))
        return min((deadline for deadline in deadlines if deadline is not None), default=None)

    def on_timers(self, now: float) -> None:
        for scheduler in self.schedulers:
            deadline = scheduler.next_deadline()
            if deadline is not None and deadline <= now:
                self.apply(scheduler.tick(now), now)

    # ------------------------------------------------------------------ actions

    def apply(self, actions: list, now: float, handoff_from: float | None = None) -> None:
        """Carry out scheduler actions: notices to clients, metrics, enforcement."""
        for action in actions:
            if action.session not in self._holds:  # delegated: a client's server-side inference queue
                self._note_delegated(action, now)
                self._bus.publish(DelegatedAction(action, now))
                continue
            kind = type(action)
            if kind is Grant:
                s = self._sessions[action.session]
                hold = self._holds[s.id]
                hold.grant = action.grant
                hold.granted_at = now
                was_stopped = hold.stopped
                if was_stopped:  # its turn again: it runs before it hears it may
                    enforce.send(s, signal.SIGCONT)
                    hold.stopped = False
                    self._sessions.touch(s, now)  # it could not heartbeat while stopped
                self._send(s.route, p.Grant(grant=action.grant, device=s.device, slice_ms=action.slice_ms))
                self._pacing.granted(s, now, self.schedulers[s.device])
                self.stats[s.device].granted(s.id, s.name, now, action.waited_s, lane=self._lane(s.device, s.workload))
                self._bus.publish(Granted(s, action.grant, action.waited_s * 1e3))
                if was_stopped:
                    self._journal(lambda j, sid=s.id: j.set_stopped(sid, False), session=s.id)
                self._observe_wait(s, hold, now)
                if handoff_from is not None:
                    self._handoff_hist[s.device].observe(self._clock() - handoff_from)
            elif kind is AskYield:
                s = self._sessions[action.session]
                self._send(s.route, p.YieldRequest(grant=action.grant, deadline_ms=action.deadline_ms,
                                                   reason=action.reason))
                self._bus.event("preempt", s.device, s.id, grant=action.grant, reason=action.reason,
                            deadline_ms=action.deadline_ms)
                self._metrics.yield_requests.labels(str(s.device), action.reason).inc()
                self.stats[s.device].yield_asked(action.reason)
                self._late.asked(s.id, now)
                log.debug("[token] ask-yield session=%s grant=%d reason=%s", s.id, action.grant, action.reason)
            elif kind is Enforce:
                self._enforce(action, now)
            elif kind is Revoked:
                s = self._sessions[action.session]
                self.end_slice(s, now)
                self._send(s.route, p.Revoke(grant=action.grant, reason=action.reason))

    def _enforce(self, action: Enforce, now: float) -> None:
        """A holder overran its yield deadline: stop it if it is verified, policy allows and the stop
        could be journalled (ahead of SIGSTOP), else revoke; the waiter is granted before the log line."""
        s = self._sessions[action.session]
        if self._wait_for_late_yield(s, action, now):
            return
        self.stats[s.device].enforced()
        if self._enforce_mode == "stop" and self.stop(s):
            self._late.stopped(s.id)
            self.preempt(s, now)
            self._metrics.enforcements.labels("stop").inc()
            self._bus.event("preempt", s.device, s.id, grant=action.grant, reason="overrun", action="stop")
            log.warning("[token] enforce session=%s grant=%d overrun_ms=%.1f action=stop pid=%s pgid=%s",
                        s.id, action.grant, action.overrun_ms, s.pid, s.managed_pgid)
            return
        self._late.ended(s.id)
        self.apply(self.schedulers[s.device].revoke(s.id, now, "overrun"), now, handoff_from=now)
        self._metrics.enforcements.labels("revoke").inc()
        self._bus.event("preempt", s.device, s.id, grant=action.grant, reason="overrun", action="revoke")
        log.warning("[token] enforce session=%s grant=%d overrun_ms=%.1f action=revoke verified=%s",
                    s.id, action.grant, action.overrun_ms, enforce.can_signal(s))

    def _wait_for_late_yield(self, s: Session, action: Enforce, now: float) -> bool:
        """A verified holder that would be stopped is first warned and waited for once in this
        ask, by what its own yields take (:mod:`sharing.yield_grace`): a cooperative client on a
        loaded host is late, not hostile. True if it was given that time."""
        if self._enforce_mode != "stop" or not enforce.can_signal(s):
            return False
        scheduler = self.schedulers[s.device]
        extra_s = self._late.extension_s(s.id, scheduler.policy.grace_ms / 1000.0)
        if extra_s is None or not scheduler.extend_yield(s.id, now, extra_s):
            return False
        slowest = self._late.slowest_s(s.id)
        log.warning("[token] late yield session=%s grant=%d overrun_ms=%.1f: waiting %.0f ms more before a stop "
                    "(its yields took up to %s)", s.id, action.grant, action.overrun_ms, extra_s * 1e3,
                    "%.0f ms" % (slowest * 1e3) if slowest is not None else "? ms: none measured yet")
        return True

    # ------------------------------------------------------------------ stopping

    def stop(self, s: Session) -> bool:
        """SIGSTOP a verified session's process; False if it cannot be (or is gone). Write-ahead: the
        journal says "stopped" first, so a daemon killed after leaves its successor a record to continue
        the process by (continuing a running one is harmless); if that write fails, no stop: False."""
        hold = self._holds.get(s.id)
        if hold is None or not enforce.can_signal(s):
            return False
        if not self._journal(lambda j: j.set_stopped(s.id, True), session=s.id):
            # Unjournalled, a stop would outlive a crash of this daemon: take the token instead.
            log.warning("[token] not stopping session=%s: its stop could not be journalled", s.id)
            return False
        if not enforce.send(s, signal.SIGSTOP):
            return False  # gone: its session ends, and with it the record
        hold.stopped = True
        return True

    def cont(self, s: Session, *, anyway: bool = False) -> bool:
        """SIGCONT a session the daemon stopped. Never leaves a process stopped it can reach.
        ``anyway``: undo the daemon's stop even if it does not know of one (a launched program's
        session ending). A launched program's own launcher's stop is never undone here: the daemon
        thaws only its own freezer, and leaves a process group to its launcher (:mod:`nodeagent.enforce`)."""
        hold = self._holds.get(s.id)
        was_stopped = hold is not None and hold.stopped
        if not (was_stopped or anyway):
            return False
        try:
            sent = enforce.send(s, signal.SIGCONT)
        except PermissionError:  # no process it can reach (a restored row whose process went first,
            sent = False  # or one that names none): nothing of the daemon's is left stopped there
        if was_stopped:
            hold.stopped = False
        if was_stopped and s.id in self._sessions:
            self._journal(lambda j: j.set_stopped(s.id, False), session=s.id)
        return sent

    # ------------------------------------------------------------------ measuring

    def _child(self, family, s: Session):
        """``family``'s series for ``s``'s device and class."""
        key = (family, s.device, s.workload)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = family.labels(str(s.device), s.workload.wire)
        return child

    def _observe_wait(self, s: Session, hold: TokenHold, now: float) -> None:
        if hold.wait_started is not None:
            self._child(self._metrics.token_wait, s).observe(now - hold.wait_started)
            hold.wait_started = None

    def end_slice(self, s: Session, now: float) -> None:
        hold = self._holds.get(s.id)
        held_since = None
        if hold is not None:
            held_since = hold.granted_at
            hold.grant = hold.granted_at = None
        self.count_slice(s, held_since, now)

    def count_slice(self, s: Session, held_since: float | None, now: float) -> None:
        self.stats[s.device].slice_ended(s.id, now)
        if held_since is not None:  # a session that left while holding counts its last slice too
            self._bus.publish(SliceEnded(s, max(0.0, now - held_since)))
        if held_since is not None and s.id in self._sessions:
            self._child(self._metrics.slice_seconds, s).inc(max(0.0, now - held_since))
            self._pacing.slice_ended(s, now, self.schedulers[s.device])
        else:
            self._pacing.forget(s)

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


# ------------------------------------------------------------------ pacing: a part of Tokens

PACE_DIR = "pace"


class Pacing:
    """The pace boards of the co-run devices and their controllers: a part of :class:`Tokens`, which
    hands it, call by call, the schedulers it reads (docs/internals.md)."""

    def __init__(self, *, sessions: SessionTable, devices: Iterable[int],
                 new_controller: Callable[[], PaceController], clock: Callable[[], float], metrics=None) -> None:
        self._sessions = sessions
        self._devices = tuple(devices)  # the co-run devices
        self._new_controller = new_controller
        self._clock = clock
        self._metrics = metrics
        self._boards: dict[int, PaceBoardWriter] = {}
        self._dir: str | None = None
        # One controller per higher-class session (inference, and training for best-effort), fed by
        # its own slices; a best-effort one has none: nobody is below it.
        self._controllers: dict[str, PaceController] = {}
        self._on_device: dict[int, dict[str, tuple[Workload, PaceController]]] = {d: {} for d in self._devices}
        self._period_us = new_controller().period_us if self._devices else 0  # the boards' (all made alike)
        self._duty_shown: dict[int, int] = {}  # device -> the duty the gauge shows
        # A board is written again only when something it depends on may have changed: a
        # controller was told something (dirty), the lanes or holders differ, or a deadline passed.
        self._dirty: set[int] = set(self._devices)
        self._seen: dict[int, tuple] = {}  # device -> (lanes, holders) its board was last written from
        self._due: dict[int, float | None] = {}  # device -> its controllers' soonest deadline at that write

    # ---------------------------------------------------------------- life

    def start(self, socket_path: str | None, state_dir: str) -> None:
        """Create ``<socket dir>/pace/dev<N>`` for each co-run device (the state dir over tcp); a board
        the last daemon left is reused in place or replaced by rename, never truncated under its readers."""
        if not self._devices:
            return
        if self._metrics is not None:  # each co-run device's series from the start: 0 changes yet
            for device in self._devices:
                self._metrics.pace_changes.labels(str(device))
        base = os.path.dirname(socket_path) if socket_path else state_dir
        directory = os.path.join(base or ".", PACE_DIR)
        system = os.geteuid() == 0
        try:
            # The socket's group reads the boards (the nodeagent group's where there is no socket).
            gid = (os.stat(socket_path).st_gid if socket_path else runtime.socket_gid()) if system else None
            os.makedirs(directory, mode=0o750 if system else 0o700, exist_ok=True)
            st = os.lstat(directory)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                pace_log.warning("[pace] %s is not a directory of this daemon's user; lower classes are paced by "
                            "MPS priority alone", directory)
                return
            if gid is not None:
                os.chown(directory, 0, gid)
            for device in self._devices:
                self._boards[device] = PaceBoardWriter(os.path.join(directory, f"dev{device}"),
                                                       mode=0o640 if system else 0o600, gid=gid)
        except (OSError, PaceBoardError) as exc:
            pace_log.warning("[pace] cannot prepare the pace boards in %s (%s); lower classes are paced by MPS "
                        "priority alone", directory, getattr(exc, "strerror", None) or exc)
            self.close()  # the boards made so far (no directory is kept yet)
            return
        self._dir = directory
        pace_log.info("[pace] co-run devices=%s boards=%s", sorted(self._boards), directory)

    def close(self) -> None:
        """Remove the boards, and their emptied directory (a clean stop leaves nothing)."""
        for board in self._boards.values():
            board.close()
        self._boards.clear()
        if self._dir is not None:
            runtime.remove_empty_dir(self._dir)
            self._dir = None

    def board_path(self, device: int) -> str:
        """The board a session on ``device`` reads ("" where the device does not co-run)."""
        board = self._boards.get(device)
        return board.path if board is not None else ""

    def controller(self, session: str) -> PaceController | None:
        """``session``'s controller (None: it has none yet, or is of the lowest class)."""
        return self._controllers.get(session)

    # ---------------------------------------------------------------- turns

    def refresh_all(self, schedulers: Sequence) -> None:
        """Write every board from its device's lanes (``schedulers``, read only) and controllers
        (after each loop turn)."""
        if not self._boards:
            return
        now = self._clock()
        for device, board in self._boards.items():
            scheduler = schedulers[device]
            lanes = scheduler.pace()
            holders = scheduler.holders()
            seen = (lanes, holders, scheduler.waiting_count())
            due = self._due.get(device)
            if device not in self._dirty and self._seen.get(device) == seen and (due is None or now < due):
                continue
            self._dirty.discard(device)
            self._seen[device] = seen
            wants = []  # (class, want, holding) of each higher-class session with a controller
            for sid, (workload, controller) in self._on_device[device].items():
                holding = sid in holders
                in_line = holding or not controller.queue_steered or \
                    scheduler.state(sid) is SessionState.WAITING
                wants.append((workload, self._counted(device, controller.want, now, in_line), holding))
            deadlines = (controller.next_deadline() for _, controller in self._on_device[device].values())
            self._due[device] = min((deadline for deadline in deadlines if deadline is not None), default=None)
            period_us = self._period_us
            for workload, (present, active) in enumerate(lanes):
                if workload == Workload.BEST_EFFORT and len(scheduler) <= lanes[-1][0]:
                    board.set(workload, Pace(present, active, 1000, period_us))  # nobody of it is there
                    continue
                slot = board_slot(present, ((w, h) for k, w, h in wants if k < workload), period_us)
                board.set(workload, Pace(present, slot.active, slot.duty_permille, period_us, slot.armed))
                if workload == Workload.TRAINING and self._metrics is not None \
                        and self._duty_shown.get(device) != slot.duty_permille:
                    self._duty_shown[device] = slot.duty_permille
                    self._metrics.pace_duty.labels(str(device)).set(slot.duty_permille)

    def next_deadline(self) -> float | None:
        """When a controller's want may change with nothing said (a waiting request's projected
        latency reaching its target, a held pause's gap ending)."""
        return min((due for due in self._due.values() if due is not None), default=None)  # as of the last write

    # ---------------------------------------------------------------- slices

    def told_queue(self, s: Session, now: float, waiting: int | None, oldest_wait_ms: float | None,
                   released: bool = False) -> None:
        """``s`` said with a slice request (or, ``released``, a release) how many of its requests
        wait (None: nothing; see :meth:`sharing.corun.PaceController.tell_queue`)."""
        controller = self.joined(s.device, s.id, s.workload)
        if controller is None:
            return
        self._counted(s.device, controller.tell_queue, now, waiting,
                      None if oldest_wait_ms is None else oldest_wait_ms / 1000.0, released=released)
        self._dirty.add(s.device)

    def granted(self, s: Session, now: float, scheduler) -> None:
        """``s`` was granted (``scheduler``: its device's, read only): its controller notes the duty
        and whether a lower class holds."""
        controller = self.joined(s.device, s.id, s.workload)
        if controller is not None:
            controller.set_slo(s.slo_ms / 1000.0 if s.slo_ms else None)
            self._counted(s.device, controller.slice_started, now, self._lower_active(s, scheduler.holders()))
            self._dirty.add(s.device)

    def slice_ended(self, s: Session, now: float, scheduler) -> None:
        """``s``'s slice ended at ``now`` (``scheduler``: its device's, read only): its controller learns."""
        controller = self._controllers.get(s.id)
        if controller is None:
            return
        self._dirty.add(s.device)
        if self._counted(s.device, controller.slice_ended, now, self._lower_active(s, scheduler.holders())):
            pace_log.info("[pace] device=%d session=%s duty_permille=%d (reference %s)", s.device, s.id,
                     controller.duty_permille,
                     "%.2f ms" % (controller.reference_s() * 1e3) if controller.reference_s() else "unknown")

    def forget(self, s: Session) -> None:
        """``s``'s slice ended uncounted; a session that is gone loses its controller."""
        if s.id not in self._sessions:
            self.drop(s.id)

    def drop(self, sid: str) -> None:
        """``sid`` left its device: its controller goes."""
        if self._controllers.pop(sid, None) is not None:
            for device, members in self._on_device.items():
                if members.pop(sid, None) is not None:
                    self._dirty.add(device)

    # ---------------------------------------------------------------- internals

    def joined(self, device: int, sid: str, workload: Workload) -> PaceController | None:
        """``sid`` of class ``workload`` is on ``device``: a higher-class session gets its controller."""
        if device not in self._on_device or workload is Workload.BEST_EFFORT:
            return None
        controller = self._controllers.get(sid)
        if controller is None:
            controller = self._controllers[sid] = self._new_controller()
            self._on_device[device][sid] = (workload, controller)
            self._dirty.add(device)
        return controller

    def _counted(self, device: int, step: Callable, *args, **kwargs):
        """``step`` of a controller, its duty changes counted in the metrics."""
        controller = step.__self__
        before = controller.changes
        result = step(*args, **kwargs)
        if controller.changes != before and self._metrics is not None:
            self._metrics.pace_changes.labels(str(device)).inc(controller.changes - before)
        return result

    def _lower_active(self, s: Session, holders: tuple[str, ...]) -> bool:
        """Whether a session of a lower class than ``s`` is among ``holders``."""
        return any(self._sessions[h].workload > s.workload for h in holders if h in self._sessions)
