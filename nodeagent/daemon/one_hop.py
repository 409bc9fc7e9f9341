"""One-hop token handoffs: a holder told who is next wakes it itself.

A two-hop handoff (the holder's ``release`` to the daemon, the daemon's
``grant`` to the next holder) costs two process wake-ups in a row, and no
daemon, however fast, brings that within 2.5x of a pipe ping-pong. So while a
session holds the token and another waits first in line, the daemon promises
the waiter the token (:meth:`sharing.TokenScheduler.bind_successor`, grant id
``g'``) and tells both:

* the waiter S: ``standby(g', secret)``;
* the holder H: ``successor(g, next=g', wake=S's FIFO, secret)``.

When H releases, its library writes ``secret + g'`` to S's wake channel (a
named FIFO per session, in ``<socket dir>/wake/``: any language's standard
library opens one) and then sends ``release(g, handed=g')``. S, which waits on
its socket and its FIFO, runs on the FIFO's word. The daemon still grants S
(S takes it as a duplicate), since the scheduler holds S as the promised
successor.

The promise binds: however H's slice ends (release with or without
``handed``, revoke, a SIGSTOP, H's death), S gets ``g'``, because H may have
written the FIFO, whatever it says. It is taken back only with S's word, since
only S knows whether it woke (issue 21: a suspended successor and a lying
holder each made two honest clients hold one grant). When the promise must go
(a higher class now comes first, S cancels or is being suspended) the daemon
withdraws it from both ends, H first (a ``successor`` notice with no ``next``,
ahead of any yield request) then S (``standby`` with ``withdrawn``), and
grants nobody the token until S answers ``standby_ack``: ``woken`` (S took
``g'`` from the word, so S holds it, and gives way at once if a higher class
waits) or not (S stopped listening first: ``g'`` is burnt, never given, and
the usual order decides). An S that does not answer within the grace period
is stopped (it is verified: one-hop needs it) and counted as not woken. S
leaving ends the promise at once (it wakes on nothing). A daemon restart
forgets hints; FIFOs left by a crashed daemon are removed at start, and a
clean stop removes the directory.

Only local, verified sessions that asked for it in ``hello`` (``one_hop``)
and speak protocol 2.3 or later (they answer a withdrawal) take part; anyone
else keeps the two-hop path. The FIFO belongs to S's user
and the socket's group, whatever that is (mode 0620 under a root daemon: only S reads it, the
socket's group may write), and the one-time 16-byte secret keeps other local
users from forging a wake-up.

A component: it is given the schedulers, the session table, how to send a
notice and which sessions belong to the serving component.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from typing import Callable

from client_lib import protocol as p
from nodeagent import runtime
from nodeagent.daemon.sessions import Session, SessionTable
from sharing import TokenScheduler

log = logging.getLogger("nodeagent.daemon.one_hop")

WAKE_DIR = "wake"
FIFO_MODE_SYSTEM = 0o620  # S reads, the socket's group writes
FIFO_MODE_USER = 0o600  # a per-user daemon: every client is its user


@dataclass(slots=True)
class _Hint:
    holder: str
    grant: int
    successor: str
    next_grant: int
    withdrawn: bool = False
    answer_by: float | None = None  # while withdrawn: when the successor's standby_ack is due


class OneHop:
    """Wake channels of one-hop sessions and the successor hints of every device."""

    def __init__(self, *, schedulers: list[TokenScheduler], sessions: SessionTable,
                 send: Callable[[object, object], None], delegated: Callable[[str], bool],
                 clock: Callable[[], float], grace_s: float,
                 stop: Callable[[Session], bool], apply: Callable[[list, float], None]) -> None:
        self._schedulers = schedulers
        self._sessions = sessions
        self._send = send
        self._delegated = delegated
        self._clock = clock
        self._grace_s = grace_s  # how long a successor has to answer a withdrawal
        self._stop = stop  # SIGSTOP a verified session (journalled first); False if it could not be or
        # may not be (scheduler.enforce = "revoke" never signals: the promise is then settled unanswered)
        self._apply = apply  # carry out scheduler actions (a settled promise may grant)
        self.unanswered = 0  # withdrawals whose successor did not answer in time (stopped instead)
        self._dir: str | None = None
        self._gid = 0  # the socket's group: the wake FIFOs' under a root daemon
        # Per (device, lane): a co-run device has a token, and so a successor, per class.
        self._hints: dict[tuple[int, int], _Hint] = {}
        self._channels: set[str] = set()  # sessions with a wake channel: without any, no hint can be given
        # Releases that came before their grant: session -> (promised grant, requeue). A woken
        # successor may finish its slice and release before the daemon has read the holder's
        # release (two connections, no order between them); it is carried out at the grant.
        self._early: dict[str, list] = {}

    # ------------------------------------------------------------ channels

    def start(self, socket_path: str | None) -> None:
        """Prepare ``<socket dir>/wake`` (none for a tcp endpoint: no one-hop there),
        removing FIFOs a crashed daemon left. Under a root daemon the directory and the
        FIFOs get the socket's group, so whoever may connect may wake a successor."""
        if socket_path is None:
            return
        directory = os.path.join(os.path.dirname(socket_path) or ".", WAKE_DIR)
        try:
            self._gid = os.stat(socket_path).st_gid
            os.makedirs(directory, mode=0o750 if os.geteuid() == 0 else 0o700, exist_ok=True)
            st = os.lstat(directory)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                log.warning("[one-hop] %s is not a directory of this daemon's user; one-hop handoffs are off",
                            directory)
                return
            # Only nodeagent makes a wake/ beside its socket, and this daemon holds the socket's
            # lock: one that is there was left by a daemon that crashed, and is this one's now.
            if os.geteuid() == 0:
                os.chown(directory, 0, self._gid)
                os.chmod(directory, 0o750)
            for name in os.listdir(directory):
                path = os.path.join(directory, name)
                if stat.S_ISFIFO(os.lstat(path).st_mode):
                    os.unlink(path)
        except OSError as exc:
            log.warning("[one-hop] cannot prepare %s (%s); one-hop handoffs are off", directory, exc.strerror)
            return
        self._dir = directory

    def open_channel(self, s: Session) -> str:
        """Create (or keep, on a resume) ``s``'s wake FIFO; its path, or "" if there is none to have."""
        if self._dir is None or s.verified_pid is None or s.uid is None:
            return ""
        path = os.path.join(self._dir, s.id)
        if s.wake == path and os.path.exists(path):
            return path
        system = os.geteuid() == 0
        if not system and s.uid != os.geteuid():
            return ""  # a per-user daemon cannot give another user a FIFO it may read
        try:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            os.mkfifo(path, 0o600)
            if system:
                os.chown(path, s.uid, self._gid)
                os.chmod(path, FIFO_MODE_SYSTEM)
        except OSError as exc:
            log.warning("[one-hop] no wake channel for session=%s (%s); it hands off in two hops",
                        s.id, exc.strerror)
            self._unlink(path)
            return ""
        s.wake = path
        self._channels.add(s.id)
        return path

    def close_channel(self, s: Session) -> None:
        if s.wake:
            self._unlink(s.wake)
            s.wake = None
        self._channels.discard(s.id)

    def close(self) -> None:
        """Remove every wake channel, and the emptied directory (a clean stop leaves nothing)."""
        for s in self._sessions.values():
            self.close_channel(s)
        self._hints.clear()
        if self._dir is not None:
            runtime.remove_empty_dir(self._dir)
            self._dir = None

    @staticmethod
    def _unlink(path: str) -> None:
        try:
            os.unlink(path)
        except OSError:
            pass

    # ------------------------------------------------------------ hints

    def refresh_all(self) -> None:
        if not self._hints and not self._channels:
            return  # nobody asked for one-hop handoffs: nothing to do each loop turn
        for device in range(len(self._schedulers)):
            self.refresh(device)

    def refresh(self, device: int) -> None:
        """Bring ``device``'s hints (one per lane) in line with its scheduler."""
        for lane_index, lane in enumerate(self._schedulers[device].lanes()):
            self._refresh_lane((device, lane_index), lane)

    def _refresh_lane(self, key: tuple[int, int], scheduler: TokenScheduler) -> None:
        """Bring a lane's hint in line with it: forget one whose promise the scheduler no longer
        holds (kept or dropped), withdraw one that no longer names the first in line or whose
        successor stopped waiting, give one where a one-hop holder has a one-hop waiter first
        in line and none is out."""
        device = key[0]
        hint = self._hints.get(key)
        if hint is not None and (scheduler.bound_successor() != hint.successor
                                 or scheduler.promised_grant() != hint.next_grant):
            del self._hints[key]  # kept (the successor was granted) or gone with its successor
            hint = None
        if hint is not None:
            if hint.withdrawn:
                return  # the token is held for the successor's answer
            successor = self._sessions.get(hint.successor)
            if scheduler.promise_withdrawing() or scheduler.first_in_line() != hint.successor:
                scheduler.withdraw_successor()
                self._withdraw(hint, successor, why="successor stopped waiting" if scheduler.promise_withdrawing()
                               and scheduler.first_in_line() == hint.successor else "not first in line")
            return
        holder_id = scheduler.holder()
        holder = self._sessions.get(holder_id) if holder_id is not None else None
        if holder is None or holder.grant is None:
            return
        first = scheduler.first_in_line()
        if first is None or not self._takes_part(holder):
            return
        successor = self._sessions.get(first)
        if successor is None or not successor.wake or not self._takes_part(successor):
            return
        if successor.workload > holder.workload and scheduler.policy.linger_ms > 0:
            return  # the token lingers for the holder's class after its slice: no promise to a lower one
        next_grant = scheduler.bind_successor(first)
        secret = os.urandom(p.WAKE_SECRET_BYTES)
        self._hints[key] = _Hint(holder_id, holder.grant, first, next_grant)
        # The successor hears first: its secret is in its socket before the holder can write the FIFO.
        self._send(successor.route, p.Standby(grant=next_grant, secret=secret))
        self._send(holder.route, p.Successor(grant=holder.grant, next=next_grant, wake=successor.wake,
                                             secret=secret))
        log.debug("[one-hop] hint device=%d holder=%s grant=%d successor=%s next=%d", device, holder_id,
                  holder.grant, first, next_grant)

    def _withdraw(self, hint: _Hint, successor: Session | None, why: str) -> None:
        """Take a promise back from both ends: the holder (if it still holds that slice) is told
        not to hand on, the successor to stop listening and answer; nobody is granted meanwhile."""
        hint.withdrawn = True
        hint.answer_by = self._clock() + self._grace_s
        holder = self._sessions.get(hint.holder)
        if holder is not None and holder.grant == hint.grant and holder.route is not None:
            self._send(holder.route, p.Successor(grant=hint.grant))
        if successor is not None and successor.route is not None:
            self._send(successor.route, p.Standby(grant=hint.next_grant, secret=b"", withdrawn=True))
        log.debug("[one-hop] withdraw holder=%s grant=%d successor=%s next=%d (%s)", hint.holder, hint.grant,
                  hint.successor, hint.next_grant, why)

    def on_answer(self, s: Session, grant: int, woken: bool, now: float) -> None:
        """``s`` answered the withdrawal of its promise of ``grant`` (standby_ack): settle it.
        An answer for anything else (late, or a promise already settled) is ignored."""
        key, scheduler = self._lane(s)
        hint = self._hints.get(key)
        if scheduler is None or hint is None or not hint.withdrawn or hint.successor != s.id \
                or hint.next_grant != grant or scheduler.bound_successor() != s.id:
            return
        del self._hints[key]
        log.debug("[one-hop] answered session=%s next=%d woken=%s", s.id, grant, woken)
        self._apply(scheduler.settle_successor(bool(woken), now), now)

    def next_deadline(self) -> float | None:
        """When the earliest withdrawal's answer is due (None: none is awaited)."""
        due = [h.answer_by for h in self._hints.values() if h.withdrawn and h.answer_by is not None]
        return min(due) if due else None

    def on_timers(self, now: float) -> None:
        """A successor that did not answer its withdrawal in time: it may have woken, so it is
        stopped (verified: one-hop needs it) before anyone else is granted; then not woken."""
        for key, hint in list(self._hints.items()):
            if not hint.withdrawn or hint.answer_by is None or hint.answer_by > now:
                continue
            del self._hints[key]
            scheduler = self._schedulers[key[0]].lanes()[key[1]]
            successor = self._sessions.get(hint.successor)
            if successor is not None and not successor.stopped:
                stopped = self._stop(successor)
                log.warning("[one-hop] session=%s did not answer the withdrawal of grant %d within %.0f ms; %s",
                            hint.successor, hint.next_grant, self._grace_s * 1e3,
                            "stopped until its next grant" if stopped else "it could not be stopped")
            self.unanswered += 1
            if scheduler.bound_successor() == hint.successor:
                self._apply(scheduler.settle_successor(False, now), now)

    def promised(self, s: Session) -> int | None:
        """The grant ``s`` is promised (it is the bound successor of its device), else None."""
        key, scheduler = self._lane(s)
        hint = self._hints.get(key)
        if hint is None or scheduler is None or hint.successor != s.id or scheduler.bound_successor() != s.id:
            return None
        return hint.next_grant

    def release_early(self, s: Session, grant: int, requeue: bool) -> bool:
        """``s`` releases ``grant`` before it was granted: if that is the grant it is
        promised (it was woken, finished, and its release overtook the holder's), keep
        it for the grant; True if kept. Nothing is done to the holder on its word."""
        if grant != self.promised(s):
            return False
        self._early[s.id] = [grant, requeue]
        return True

    def acquire_early(self, s: Session) -> bool:
        """An acquire from ``s`` after its early release: it wants the token again (True: noted)."""
        early = self._early.get(s.id)
        if early is None:
            return False
        early[1] = True
        return True

    def take_early_release(self, s: Session, grant: int) -> bool | None:
        """At ``s``'s grant: None if no release of it came early, else its requeue."""
        early = self._early.pop(s.id, None)
        if early is None or early[0] != grant:
            return None
        return early[1]

    def forget(self, s: Session) -> None:
        """``s`` left or cancelled: an early release of a promise it no longer has goes (one it
        still has, being withdrawn, stays: it may answer that it woke, and hold until then)."""
        if self.promised(s) is None:
            self._early.pop(s.id, None)

    def _lane(self, s: Session) -> tuple[tuple[int, int], TokenScheduler | None]:
        """The key of ``s``'s lane and the lane (None if ``s`` is on no scheduler)."""
        device = self._schedulers[s.device]
        lanes = device.lanes()
        index = 0 if len(lanes) == 1 else int(s.workload)
        lane = lanes[index]
        return (s.device, index), (lane if s.id in lane else None)

    def _takes_part(self, s: Session) -> bool:
        return s.one_hop and s.route is not None and not self._delegated(s.id)
