"""The journal and restore after a restart, as part of
:class:`nodeagent.server.AgentServer`.

Sessions are journalled on open, close and change (never per grant). A
starting daemon increments the boot counter, numbers grants from ``boot << 32``,
restores each journalled session whose process still lives, continues any the
old daemon left stopped, and opens a restore window per device in which the
client that was using it reclaims its slice before parked requests run.

A journal that fails to write (disk full, I/O error) never stops the loop:
:class:`JournalWriter` logs and counts it, publishes a ``health`` event, and
marks the sessions it concerned stale (not durable: their clients are told)
until a later write succeeds. The daemon never SIGSTOPs a process whose stop it
could not journal (``_stop`` in server.py takes the token away instead), so a
successor always knows which processes to continue.

A mixin over the server's state: it uses ``journal``, ``_journal_writer``,
``_sessions``, ``_schedulers``, ``_policy``, ``_mps`` (the MPS component), ``_restoring``,
``_parked``, ``config`` and the server's ``_add_session``, ``_continue`` and ``_apply``,
and the memory mixin's ``_request_token``.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Callable

from nodeagent import enforce, procwatch
from nodeagent.journal import Journal, SessionRecord
from nodeagent.metrics import Metrics
from nodeagent.sessions import Session
from sharing import TokenScheduler, Workload
from sharing.partition import PartitionError

log = logging.getLogger("nodeagent.restore")

JOURNAL_RETRY_S = 2.0  # how often stale sessions are written again while the journal fails


class JournalWriter:
    """Runs the daemon's journal writes and knows whether the journal keeps up.

    A failed write is logged and counted (``nodeagent_journal_write_failures``);
    the first failure sets ``nodeagent_journal_ok`` to 0 and publishes a
    ``health`` event with ``journal="failed"``. Only :meth:`probe` sets them back
    (``journal="ok"``): a write that changes nothing succeeds even on a full disk.
    A session a failed write concerned is stale (its row is missing or out of
    date) until a write of it succeeds."""

    def __init__(self, journal: Journal | None, metrics: Metrics, publish: Callable[..., None],
                 on_durability: Callable[[str | None], None] = lambda session: None) -> None:
        self.journal = journal
        self._metrics = metrics
        self._publish = publish  # publish(**data): a cluster "health" event
        # on_durability(session): what durable() says of that session (None: of every session) changed
        self._on_durability = on_durability
        self.ok = True  # no write has failed since the last successful probe
        self.stale: set[str] = set()  # session ids whose journal row is missing or out of date
        self.next_retry: float | None = None  # monotonic: when to probe and write stale sessions again
        metrics.journal_ok.set(1 if journal is not None else 0)

    def write(self, fn: Callable[[Journal], object], session: str | None = None) -> bool:
        """Run one write; False if it failed (logged, counted). True when there is no journal to write."""
        if self.journal is None:
            return True
        try:
            fn(self.journal)
        except Exception as exc:  # JournalError, KeyError (row missing), or a bug: memory stays right
            self._metrics.journal_write_failures.inc()
            newly_stale = session is not None and session not in self.stale
            if session is not None:
                self.stale.add(session)
            log.error("[journal] write failed session=%s: %s", session, exc)
            if self.ok:
                self.ok = False
                self._metrics.journal_ok.set(0)
                self._publish(journal="failed", error=str(exc)[:200])
                self._on_durability(None)
            elif newly_stale:
                self._on_durability(session)
            return False
        if session is not None and session in self.stale:
            self.stale.discard(session)
            if self.ok:
                self._on_durability(session)
        return True

    def probe(self) -> bool:
        """Write a row that always changes; True (and healthy again) if the journal took it."""
        try:
            self.journal.put_meta("probe_unix", repr(time.time()))
        except Exception as exc:
            self._metrics.journal_write_failures.inc()
            log.debug("[journal] probe failed: %s", exc)
            return False
        if not self.ok:
            self.ok = True
            self._metrics.journal_ok.set(1)
            log.warning("[journal] writes succeed again; stale sessions=%d", len(self.stale))
            self._publish(journal="ok", stale_sessions=len(self.stale))
            self._on_durability(None)
        return True

    def durable(self, session_id: str) -> bool:
        """Whether a daemon restarted now would restore this session as it is."""
        return self.journal is not None and self.ok and session_id not in self.stale


class RestoreMixin:
    """Journal writes and restore after a restart (see the module docstring)."""

    def _journal(self, write, session: str | None = None) -> bool:
        """Run one journal write (about ``session``, if given); False if it failed. Never raises."""
        return self._journal_writer.write(write, session)

    def _journal_put(self, s: Session) -> bool:
        return self._journal(lambda j: j.put_session(SessionRecord(
            id=s.id, key=s.key, name=s.name, claimed_pid=s.claimed_pid, verified_pid=s.verified_pid,
            start_ticks=s.start_ticks, uid=s.uid, workload=s.workload.wire, weight=s.weight, device=s.device,
            memory_mb=s.memory_mb, created_unix=time.time(), managed_pgid=s.managed_pgid, stopped=s.stopped,
            borrower=s.borrower)), session=s.id)

    def _journal_retry(self, now: float) -> None:
        """After a failed write, every JOURNAL_RETRY_S: probe the journal, then write stale sessions again."""
        writer = self._journal_writer
        if writer.journal is None or (writer.ok and not writer.stale):
            writer.next_retry = None
            return
        if writer.next_retry is None or now < writer.next_retry:
            if writer.next_retry is None:
                writer.next_retry = now + JOURNAL_RETRY_S
            return
        writer.next_retry = now + JOURNAL_RETRY_S
        if not writer.probe():
            return  # still failing; next time
        for sid in sorted(writer.stale):
            s = self._sessions.get(sid)
            done = self._journal_put(s) if s is not None else \
                self._journal(lambda j, sid=sid: j.delete_session(sid), session=sid)
            if not done:
                return

    def _restore(self, now: float) -> None:
        """Take back the sessions a previous daemon journalled whose processes still live.

        Grant ids continue above the old ones (boot << 32). Devices with restored
        sessions enter a restore window: the client that was using the device may
        claim its slice back; other requests wait until every restored session
        has reattached or ``heartbeat_timeout_s`` has passed."""
        self.boot = self.journal.next_boot()
        self._schedulers = [TokenScheduler(i, self._policy, first_grant=(self.boot << 32) + 1)
                            for i in range(len(self._schedulers))]
        restored = dropped = 0
        records, bad = self.journal.read_sessions()
        for row in bad:  # logged by the journal; a process it stopped must not stay stopped
            continue_orphan(row.values)
            self._journal(lambda j, seq=row.seq: j.delete_session_row(seq))
        for rec in records:
            why = unrestorable(rec, len(self._schedulers))
            if why:
                log.info("[restore] drop session=%s name=%s: %s", rec.id, rec.name, why)
                continue_orphan({"stopped": rec.stopped, "verified_pid": rec.verified_pid,
                                 "start_ticks": rec.start_ticks, "managed_pgid": rec.managed_pgid})
                self._journal(lambda j, sid=rec.id: j.delete_session(sid))
                dropped += 1
                continue
            session = Session(
                id=rec.id, key=rec.key, route=None, name=rec.name, claimed_pid=rec.claimed_pid,
                verified_pid=rec.verified_pid, start_ticks=rec.start_ticks, uid=rec.uid,
                workload=Workload.parse(rec.workload), weight=rec.weight, device=rec.device,
                memory_mb=rec.memory_mb, created=now, last_seen=now, stopped=rec.stopped, borrower=rec.borrower)
            if rec.managed_pgid is not None and rec.verified_pid is not None and \
                    enforce.verify_managed_pgid(rec.managed_pgid, rec.verified_pid) is None:
                session.managed_pgid = rec.managed_pgid
                session.managed_pidfd = procwatch.open_pidfd(rec.managed_pgid)
            try:
                self._mps.join(rec.id, rec.device, rec.memory_mb)
            except PartitionError as exc:
                log.warning("[restore] session=%s keeps no MPS share: %s", rec.id, exc)
            self._add_session(session, now)
            if session.stopped:  # the old daemon died holding it stopped: let it run
                self._continue(session)
            self._restoring.setdefault(rec.device, set()).add(rec.id)
            self._parked.setdefault(rec.device, [])
            restored += 1
        self._restore_deadline = now + self.config.heartbeat_timeout_s
        log.info("[restore] boot=%d restored=%d dropped=%d bad=%d", self.boot, restored, dropped, len(bad))

    def _end_restore(self, device: int, now: float) -> None:
        """Close a device's restore window and hand its parked requests to the scheduler."""
        self._restoring.pop(device, None)
        parked = self._parked.pop(device, [])
        log.info("[restore] device=%d open for grants, parked requests=%d", device, len(parked))
        for sid in parked:
            s = self._sessions.get(sid)
            if s is not None:  # waited through the window: keeps its wait, no sleeper clamp; held if lost
                self._request_token(sid, device, now, waiting_since=s.wait_started)


def unrestorable(rec: SessionRecord, devices: int) -> str | None:
    """Why a journalled session cannot be restored, or None."""
    if not 0 <= rec.device < devices:
        return f"device {rec.device} no longer exists"
    if rec.verified_pid is not None:
        stat = procwatch.read_stat(rec.verified_pid)
        if stat is None or stat.start_ticks != rec.start_ticks:
            return f"process {rec.verified_pid} is gone"
    return None


def continue_orphan(values: dict) -> bool:
    """SIGCONT the process of a journal row that will not be restored (a bad row, a device
    gone) if the row says the old daemon stopped it and the process is still the one it
    names (pid and start time). True if a signal was sent. Never leaves one stopped."""
    if values.get("stopped") not in (1, True):
        return False
    pid, ticks, pgid = values.get("verified_pid"), values.get("start_ticks"), values.get("managed_pgid")
    if not (_small_int(pid) and pid > 0 and isinstance(ticks, int) and not isinstance(ticks, bool)):
        log.warning("[restore] a stopped session row names no verifiable process; nothing to continue")
        return False
    pidfd = procwatch.open_pidfd(pid)  # first, so that the stat read below is about this very process
    if pidfd is None:
        return False
    try:
        stat = procwatch.read_stat(pid)
        if stat is None or stat.start_ticks != ticks:
            return False  # gone, and the pid perhaps reused: not ours to signal
        signal.pidfd_send_signal(pidfd, signal.SIGCONT)
        if _small_int(pgid) and pgid > 0 and enforce.verify_managed_pgid(pgid, pid) is None:
            os.killpg(pgid, signal.SIGCONT)
    except ProcessLookupError:
        return False
    finally:
        os.close(pidfd)
    log.warning("[restore] continued pid=%d pgid=%s: the old daemon left it stopped and its row cannot be restored",
                pid, pgid)
    return True


def _small_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and -2**31 <= value < 2**31
