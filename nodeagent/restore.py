"""The journal and restore after a restart, as part of
:class:`nodeagent.server.AgentServer`.

Sessions are journalled on open, close and change (never per grant). A
starting daemon increments the boot counter, numbers grants from ``boot << 32``,
restores each journalled session whose process still lives, continues any the
old daemon left stopped, and opens a restore window per device in which the
client that was using it reclaims its slice before parked requests run.

A mixin over the server's state: it uses ``journal``, ``_sessions``,
``_schedulers``, ``_policy``, ``_partitions``, ``_restoring``, ``_parked``,
``config`` and the server's ``_add_session``, ``_continue`` and ``_apply``.
"""

from __future__ import annotations

import logging
import time

from nodeagent import enforce, procwatch
from nodeagent.journal import SessionRecord
from nodeagent.sessions import Session
from sharing import TokenScheduler, Workload
from sharing.partition import PartitionError

log = logging.getLogger("nodeagent.restore")


class RestoreMixin:
    """Journal writes and restore after a restart (see the module docstring)."""

    def _journal(self, write) -> None:
        """Run one journal write; a failing journal is logged, never fatal to the loop."""
        if self.journal is None:
            return
        try:
            write(self.journal)
        except Exception as exc:  # JournalError, or a bug: the session state in memory stays right
            log.error("[journal] write failed: %s", exc)

    def _journal_put(self, s: Session) -> None:
        self._journal(lambda j: j.put_session(SessionRecord(
            id=s.id, key=s.key, name=s.name, claimed_pid=s.claimed_pid, verified_pid=s.verified_pid,
            start_ticks=s.start_ticks, uid=s.uid, workload=s.workload.wire, weight=s.weight, device=s.device,
            memory_mb=s.memory_mb, created_unix=time.time(), managed_pgid=s.managed_pgid, stopped=s.stopped,
            borrower=s.borrower)))

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
        for rec in self.journal.sessions():
            why = unrestorable(rec, len(self._schedulers))
            if why:
                log.info("[restore] drop session=%s name=%s: %s", rec.id, rec.name, why)
                self._journal(lambda j: j.delete_session(rec.id))
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
            if rec.device in self._partitions:
                try:
                    self._partitions[rec.device].join(rec.id, None, rec.memory_mb or None)
                except PartitionError as exc:
                    log.warning("[restore] session=%s keeps no MPS share: %s", rec.id, exc)
            self._add_session(session, now)
            if session.stopped:  # the old daemon died holding it stopped: let it run
                self._continue(session)
            self._restoring.setdefault(rec.device, set()).add(rec.id)
            self._parked.setdefault(rec.device, [])
            restored += 1
        self._restore_deadline = now + self.config.heartbeat_timeout_s
        log.info("[restore] boot=%d restored=%d dropped=%d", self.boot, restored, dropped)

    def _end_restore(self, device: int, now: float) -> None:
        """Close a device's restore window and hand its parked requests to the scheduler."""
        self._restoring.pop(device, None)
        parked = self._parked.pop(device, [])
        log.info("[restore] device=%d open for grants, parked requests=%d", device, len(parked))
        scheduler = self._schedulers[device]
        for sid in parked:
            s = self._sessions.get(sid)
            if s is not None:  # waited through the window: keeps its wait, no sleeper clamp
                self._apply(scheduler.request(sid, now, waiting_since=s.wait_started), now)


def unrestorable(rec: SessionRecord, devices: int) -> str | None:
    """Why a journalled session cannot be restored, or None."""
    if not 0 <= rec.device < devices:
        return f"device {rec.device} no longer exists"
    if rec.verified_pid is not None:
        stat = procwatch.read_stat(rec.verified_pid)
        if stat is None or stat.start_ticks != rec.start_ticks:
            return f"process {rec.verified_pid} is gone"
    return None
