"""Restore after a restart (:class:`Restorer`): journalled sessions whose process still lives, the
stops the old daemon left and suspensions; and stale sessions written again while the journal
fails. Detail: docs/internals.md.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time

from nodeagent import cgroup, enforce, procwatch
from nodeagent.config import ServeConfig
from nodeagent.daemon.mps import MpsPartitions
from nodeagent.journal import SessionRecord
from nodeagent.daemon.journal_writer import JournalWriter
from nodeagent.daemon.sessions import Session, SessionTable
from nodeagent.daemon.gate import TokenGate
from nodeagent.daemon.suspension import Suspensions
from nodeagent.daemon.tokens import Tokens
from sharing import Workload
from sharing.suspension import Suspension
from sharing.partition import PartitionError

log = logging.getLogger("nodeagent.restore")

JOURNAL_RETRY_S = 2.0  # how often stale sessions are written again while the journal fails


class Restorer:
    """Restore after a restart, and the journal's retry timer (see docs/internals.md)."""

    def __init__(self, *, config: ServeConfig, journal: JournalWriter, sessions: SessionTable,
                 tokens: Tokens, mps: MpsPartitions, capacities_mb: list[int], suspensions: Suspensions,
                 gate: TokenGate) -> None:
        self._config = config
        self._journal = journal
        self._sessions = sessions
        self._tokens = tokens
        self._mps = mps
        self._capacities_mb = capacities_mb  # per device: the most a session may have declared
        self._suspensions = suspensions
        self._gate = gate
        self._next_retry: float | None = None  # monotonic: when to probe and write stale sessions again

    # ---------------------------------------------------------------- restore

    def restore(self, now: float) -> int:
        """Take back the sessions a previous daemon journalled whose processes still live; returns this
        daemon's boot number (call only with a journal). Grant ids continue above the old ones (boot << 32);
        other requests wait in the restore windows until every restored session has reattached or
        ``heartbeat_timeout_s`` has passed."""
        journal = self._journal.journal
        boot = journal.next_boot()
        self._tokens.renew((boot << 32) + 1)
        restored = dropped = 0
        records, bad = journal.read_sessions()
        windows: dict[int, set[str]] = {}
        for row in bad:  # logged by the journal; a process it stopped must not stay stopped
            continue_orphan(row.values)
            self._journal.write(lambda j, seq=row.seq: j.delete_session_row(seq))
        for rec in records:
            why = unrestorable(rec, self._capacities_mb)
            if why:
                log.info("[restore] drop session=%s name=%s: %s", rec.id, rec.name, why)
                continue_orphan(dataclasses.asdict(rec))
                self._journal.write(lambda j, sid=rec.id: j.delete_session(sid))
                dropped += 1
                continue
            session = Session(
                id=rec.id, key=rec.key, route=None, name=rec.name, claimed_pid=rec.claimed_pid,
                verified_pid=rec.verified_pid, start_ticks=rec.start_ticks, uid=rec.uid,
                workload=Workload.parse(rec.workload), weight=rec.weight, device=rec.device,
                memory_mb=rec.memory_mb, last_seen=now, borrower=rec.borrower)
            if rec.managed_pgid is not None and rec.verified_pid is not None and \
                    enforce.verify_managed_pgid(rec.managed_pgid, rec.verified_pid) is None:
                session.managed_pgid = rec.managed_pgid
                session.managed_pidfd = procwatch.open_pidfd(rec.managed_pgid)
                if session.managed_pidfd is not None:  # found again from the kernel, as at hello
                    session.managed_cgroup, _ = enforce.open_managed_cgroup(rec.managed_pgid, rec.verified_pid,
                                                                            rec.uid)
            try:
                self._mps.join(rec.id, rec.device, rec.memory_mb, rec.uid)
            except PartitionError as exc:
                log.warning("[restore] session=%s keeps no MPS share: %s", rec.id, exc)
            try:
                suspension = Suspension.from_record(rec.suspension, now, time.time())
            except ValueError as exc:
                log.warning("[restore] session=%s: its suspension is not restored: %s", rec.id, exc)
                suspension = Suspension()
            self._tokens.add(session.device, session.id, session.workload, session.weight, now,
                             stopped=rec.stopped)
            self._sessions.add(session)
            if rec.stopped:  # the old daemon died holding it stopped: let it run
                self._tokens.cont(session)
            self._suspensions.restored(session, suspension, now)  # one under way or in force is its again
            windows.setdefault(rec.device, set()).add(rec.id)
            restored += 1
        self._gate.open_windows(windows, now + self._config.heartbeat_timeout_s)
        # A first boot has nothing to restore: that is not news on a fresh start.
        log.log(logging.DEBUG if boot == 1 and not (restored or dropped or bad) else logging.INFO,
                "[restore] boot=%d restored=%d dropped=%d bad=%d", boot, restored, dropped, len(bad))
        return boot

    def next_deadline(self, now: float) -> float | None:
        """When the journal is probed again (None: it is not pending)."""
        return self._next_retry

    # ---------------------------------------------------------- journal retry

    def retry_journal(self, now: float) -> None:
        """After a failed write, every JOURNAL_RETRY_S: probe the journal, then write stale sessions again."""
        writer = self._journal
        if writer.journal is None or (writer.ok and not writer.stale):
            self._next_retry = None
            return
        due = self._next_retry
        if due is None or now >= due:
            self._next_retry = now + JOURNAL_RETRY_S
        if due is None or now < due or not writer.probe():
            return  # the first failure seen, not due yet, or still failing; next time
        for sid in sorted(writer.stale):
            s = self._sessions.get(sid)
            done = writer.put_session(s, suspension=self._suspensions.record(s),
                                      stopped=self._tokens.stopped(s)) if s is not None else \
                writer.write(lambda j, sid=sid: j.delete_session(sid), session=sid)
            if not done:
                return

    on_timers = retry_journal  # the retry is this component's one timer


def unrestorable(rec: SessionRecord, capacities_mb: list[int]) -> str | None:
    """Why a journalled session cannot be restored, or None. ``capacities_mb``: what each
    device can hold (admission's capacity): a row declaring more never passed admission."""
    if not 0 <= rec.device < len(capacities_mb):
        return f"device {rec.device} no longer exists"
    if not 0 <= rec.memory_mb <= capacities_mb[rec.device]:
        return (f"it declares {rec.memory_mb} MB of device memory, beyond device {rec.device}'s "
                f"{capacities_mb[rec.device]} MB (a damaged or forged row)")
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
            uid = values.get("uid")
            cg, _ = enforce.open_managed_cgroup(pgid, pid, uid if _small_int(uid) else None)
            if cg is not None:  # a launched program the old daemon froze
                cgroup.act(cg, "thaw")
                cg.close()
    except ProcessLookupError:
        return False
    finally:
        os.close(pidfd)
    log.warning("[restore] continued pid=%d pgid=%s: the old daemon left it stopped and its row cannot be restored",
                pid, pgid)
    return True


def _small_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and -2**31 <= value < 2**31
