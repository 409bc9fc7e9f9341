"""Attained service per training job: GPU-seconds summed over the job's sessions and kept
across the daemon's restarts, the signal Tiresias-style placement reads.

A job is a session's ``borrower`` (``hello.borrower``): the name a cluster engine gives a
training job, whose sessions the daemon admits only on a device lent to that job, so one
job cannot charge its time to another by naming it. Inference sessions and sessions with no
borrower are no job's: their time shows per session only (``SessionInfo.gpu_time_s``).

A slice counts when it ends (:class:`~nodeagent.daemon.bus.SliceEnded`: released, revoked,
stopped, suspended, or its session gone). The ledger is journalled every ``flush_s`` while it
changes or a job's session holds a token (the running slice counted up to then), and at a
clean shutdown; never per grant. A daemon SIGKILLed loses at most the last ``flush_s`` of
each job's service.
"""

from __future__ import annotations

import logging
import math
from typing import Callable

from nodeagent.daemon.bus import Granted, SliceEnded
from nodeagent.daemon.journal_writer import JournalWriter
from nodeagent.daemon.sessions import Session, SessionTable
from sharing import Workload

log = logging.getLogger("nodeagent.daemon.attained")

FLUSH_S = 1.0
MAX_JOBS = 4096  # jobs remembered; past it the smallest of those with no session here is forgotten


def job_of(s: Session) -> str | None:
    """The training job whose service ``s``'s slices are, or None (inference, or no borrower)."""
    return s.borrower if s.borrower is not None and s.workload is not Workload.INFERENCE else None


class AttainedService:
    """The attained-service ledger: owns each job's GPU-seconds and their journal rows.

    Given the sessions it reads (who holds a token now, for the running slices), the journal
    writer it writes through, and the loop's clock."""

    def __init__(self, *, sessions: SessionTable, journal: JournalWriter, clock: Callable[[], float],
                 flush_s: float = FLUSH_S, max_jobs: int = MAX_JOBS) -> None:
        self._sessions = sessions
        self._journal = journal
        self._clock = clock
        self._flush_s = flush_s
        self._max_jobs = max_jobs
        self._banked: dict[str, float] = {}  # job -> GPU-seconds of its ended slices (and the journal's)
        self._dirty: set[str] = set()  # changed since the last journal write
        self._forgotten: set[str] = set()  # evicted, to be deleted from the journal at the next write
        self._next_flush = math.inf

    # ------------------------------------------------------------------ life

    def restore(self) -> None:
        """What the journal kept (a restart); the most recently written ``max_jobs`` when there are more."""
        journal = self._journal.journal
        if journal is None:
            return
        rows = sorted(journal.attained().items(), key=lambda item: item[1][1], reverse=True)
        self._banked = {job: gpu_s for job, (gpu_s, _) in rows[:self._max_jobs]}
        self._forgotten = {job for job, _ in rows[self._max_jobs:]}
        if self._forgotten:
            self._next_flush = self._clock()
        if rows:
            log.info("[attained] restored jobs=%d gpu_s=%.1f", len(self._banked), sum(self._banked.values()))

    def close(self, now: float) -> None:
        """A clean shutdown: write what changed."""
        self.flush(now)

    # ------------------------------------------------------------------ bus

    def on_slice_ended(self, event: SliceEnded) -> None:
        job = job_of(event.session)
        if job is None or event.held_s <= 0.0:
            return
        self._banked[job] = self._banked.get(job, 0.0) + event.held_s
        self._dirty.add(job)
        self._forgotten.discard(job)
        self._schedule()
        if len(self._banked) > self._max_jobs:
            self._evict()

    def on_granted(self, event: Granted) -> None:
        """A grant to a job's session: its running slice is journalled every ``flush_s`` from now."""
        if job_of(event.session) is not None:
            self._schedule()

    # ------------------------------------------------------------------ reading

    def snapshot(self, now: float) -> dict[str, float]:
        """Every job's GPU-seconds now: its ended slices plus those its sessions are in."""
        totals = dict(self._banked)
        for job, running_s in self._running(now).items():
            totals[job] = totals.get(job, 0.0) + running_s
        return totals

    def of(self, job: str, now: float) -> float:
        """``job``'s GPU-seconds now (0.0 for a job never seen)."""
        return self.snapshot(now).get(job, 0.0)

    # ------------------------------------------------------------------ timers

    def next_deadline(self, now: float) -> float:
        return self._next_flush

    def on_timers(self, now: float) -> None:
        if now >= self._next_flush:
            self.flush(now)

    def flush(self, now: float) -> bool:
        """Journal the jobs that changed or hold a token now; the next write is due in ``flush_s``
        while one holds. False if the journal did not take it (tried again at the next flush)."""
        running = self._running(now)
        changed = self._dirty | set(running)
        self._next_flush = now + self._flush_s if running else math.inf
        if not changed and not self._forgotten:
            return True
        rows = {job: self._banked.get(job, 0.0) + running.get(job, 0.0) for job in changed}
        forget = tuple(sorted(self._forgotten))
        if not self._journal.write(lambda j: j.put_attained(rows, forget)):
            self._schedule()
            return False
        self._dirty.clear()
        self._forgotten.clear()
        return True

    # ------------------------------------------------------------------ internals

    def _running(self, now: float) -> dict[str, float]:
        running: dict[str, float] = {}
        for s in self._sessions.values():
            job = job_of(s)
            if job is not None and s.granted_at is not None:
                running[job] = running.get(job, 0.0) + max(0.0, now - s.granted_at)
        return running

    def _schedule(self) -> None:
        if self._next_flush == math.inf:
            self._next_flush = self._clock() + self._flush_s

    def _evict(self) -> None:
        """Forget the smallest ledger entry of a job with no session here (bounded memory and journal)."""
        live = {job_of(s) for s in self._sessions.values()}
        idle = [job for job in self._banked if job not in live]
        if not idle:
            return
        job = min(idle, key=lambda j: self._banked[j])
        del self._banked[job]
        self._dirty.discard(job)
        self._forgotten.add(job)
        log.info("[attained] forgot job=%s: more than %d jobs", job, self._max_jobs)
