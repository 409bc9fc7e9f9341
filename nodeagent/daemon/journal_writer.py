"""Every journal write the daemon makes goes through :class:`JournalWriter`, which knows whether the
journal keeps up; writing stale sessions again is the restorer's timer
(:meth:`nodeagent.daemon.restore.Restorer.retry_journal`).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from nodeagent.daemon.bus import Bus, DurabilityChanged
from nodeagent.journal import Journal, SessionRecord
from nodeagent.metrics import Metrics
from nodeagent.daemon.sessions import Session

log = logging.getLogger("nodeagent.restore")  # the name its log lines have always had


class JournalWriter:
    """A failed write never stops the loop: it is logged and counted (``nodeagent_journal_write_failures``),
    and the first sets ``nodeagent_journal_ok`` to 0 and publishes a ``health`` event (``journal="failed"``).
    Only :meth:`probe` sets them back (``journal="ok"``): a write that changes nothing succeeds even on a
    full disk. A session a failed write concerned is stale (not durable: its client is told, through
    :class:`DurabilityChanged`) until a write of it succeeds."""

    def __init__(self, journal: Journal | None, metrics: Metrics, bus: Bus) -> None:
        self.journal = journal
        self._metrics = metrics
        self._bus = bus
        self.ok = True  # no write has failed since the last successful probe
        self.stale: set[str] = set()  # session ids whose journal row is missing or out of date
        metrics.journal_ok.set(1 if journal is not None else 0)

    def attach(self, journal: Journal) -> None:
        """The journal, opened after the daemon's addresses were bound."""
        self.journal = journal
        self._metrics.journal_ok.set(1)

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
                self._bus.event("health", journal="failed", error=str(exc)[:200])
                self._bus.publish(DurabilityChanged(None))
            elif newly_stale:
                self._bus.publish(DurabilityChanged(session))
            return False
        if session is not None and session in self.stale:
            self.stale.discard(session)
            if self.ok:
                self._bus.publish(DurabilityChanged(session))
        return True

    def put_session(self, s: Session, *, suspension: dict | None = None, stopped: bool = False) -> bool:
        """Write ``s``'s row as it is now (open, change, or again after a failure); ``suspension``:
        its suspension's record (``Suspensions.record``; None: none, as at its hello); ``stopped``:
        whether the daemon holds its process stopped (``Tokens.stopped``; not at its hello)."""
        return self.write(lambda j: j.put_session(SessionRecord(
            id=s.id, key=s.key, name=s.name, claimed_pid=s.claimed_pid, verified_pid=s.verified_pid,
            start_ticks=s.start_ticks, uid=s.uid, workload=s.workload.wire, weight=s.weight, device=s.device,
            memory_mb=s.memory_mb, created_unix=time.time(), managed_pgid=s.managed_pgid, stopped=stopped,
            borrower=s.borrower, suspension=suspension)), session=s.id)

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
            self._bus.event("health", journal="ok", stale_sessions=len(self.stale))
            self._bus.publish(DurabilityChanged(None))
        return True

    def durable(self, session_id: str) -> bool:
        """Whether a daemon restarted now would restore this session as it is."""
        return self.journal is not None and self.ok and session_id not in self.stale
