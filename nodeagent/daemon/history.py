"""The daemon's record of grants and slices: each device's recent token history, for ``status`` and
``nodeagent top`` (:class:`DeviceStats`), and each training job's attained GPU-seconds, kept across
restarts (:class:`AttainedService`, the signal Tiresias-style placement reads). Detail: docs/internals.md.
"""

from __future__ import annotations

import logging
import math
from collections import Counter, deque
from typing import TYPE_CHECKING, Callable

from client_lib import protocol as p
from nodeagent.daemon.bus import Granted, SliceEnded
from nodeagent.daemon.journal_writer import JournalWriter
from nodeagent.daemon.sessions import Session, SessionTable
from sharing import Workload

if TYPE_CHECKING:  # tokens.py imports this module (DeviceStats)
    from nodeagent.daemon.tokens import Tokens

log = logging.getLogger("nodeagent.daemon.history")

MAX_HOLDERS_PER_BUCKET = 8
MANY = "*"  # several sessions beyond MAX_HOLDERS_PER_BUCKET shared the bucket (never a session id: "s-...")
IDLE = ""  # in a timeline: the token was free for most of the bucket


def percentile(ordered: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of an ascending, non-empty list."""
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


class DeviceStats:
    """Recent token history of one device (see docs/internals.md)."""

    def __init__(self, *, bucket_s: float = 1.0, buckets: int = 60, wait_window: int = 512) -> None:
        if not (bucket_s > 0 and math.isfinite(bucket_s)) or buckets < 1 or wait_window < 1:
            raise ValueError(f"bad DeviceStats bounds: bucket_s={bucket_s!r} buckets={buckets!r} "
                             f"wait_window={wait_window!r}")
        self.bucket_s = bucket_s
        self.buckets = buckets
        # Slot b % buckets holds absolute bucket b (its number in _tags); a stale slot is cleared on use.
        self._tags = [-1] * buckets
        self._held: list[dict[str, list]] = [{} for _ in range(buckets)]  # session -> [seconds, name]
        self._best: list[tuple[int, str] | None] = [None] * buckets  # (bucket, its winner) once complete
        self._open: dict[int, tuple[str, str, float]] = {}  # lane -> (session, name, since): slices running now
        self._waits: deque[float] = deque(maxlen=wait_window)  # seconds
        self.grants = 0
        self.preemptions = 0  # yield asked because a higher class waited
        self.quantum_yields = 0  # yield asked at the end of a slice, a session of the class waiting
        self.enforcements = 0  # holders stopped or revoked past their yield deadline

    # ------------------------------------------------------------ events

    def granted(self, session: str, name: str, now: float, waited_s: float, lane: int = 0) -> None:
        """``session`` holds ``lane``'s token from ``now``; a slice of that lane still open ends here."""
        self.grants += 1
        if waited_s >= 0:  # the scheduler's, never negative; NaN would fail this too
            self._waits.append(waited_s)
        if lane in self._open:
            self._close(lane, now)
        self._open[lane] = (session, name, now)

    def slice_ended(self, session: str, now: float) -> None:
        """``session``'s slice is over (released, revoked, gone); a no-op if it holds no token."""
        for lane, (holder, _, _) in list(self._open.items()):
            if holder == session:
                self._close(lane, now)

    def yield_asked(self, reason: str) -> None:
        if reason == "preempted":
            self.preemptions += 1
        else:
            self.quantum_yields += 1

    def enforced(self) -> None:
        self.enforcements += 1

    # ------------------------------------------------------------ reading

    def report(self, now: float, holders: tuple[str, ...]) -> p.TokenActivity:
        """The history as of ``now`` for a status reply (its ``suspensions`` are counted by the
        suspension component). ``holders`` are the scheduler's (one per lane): an open slice of
        another session (whose end this object was not told) ends now."""
        for lane, (session, _, _) in list(self._open.items()):
            if session not in holders:
                self._close(lane, now)
        timeline, holders, names = self._timeline(now)
        waits = sorted(self._waits)
        return p.TokenActivity(
            grants=self.grants, preemptions=self.preemptions, quantum_yields=self.quantum_yields,
            enforcements=self.enforcements, waits=len(waits),
            wait_p50_ms=percentile(waits, 50) * 1e3 if waits else None,
            wait_p99_ms=percentile(waits, 99) * 1e3 if waits else None,
            bucket_ms=self.bucket_s * 1e3, timeline=timeline, names=names, holders=holders)

    def _timeline(self, now: float) -> tuple[list[str], list[list[str]], dict[str, str]]:
        """Per bucket, oldest first and ending with the one ``now`` is in: the session that
        held the token longest (or ``MANY``), or ``IDLE`` if it was free for longer; every
        session that held a token in it, longest first; and the names of the ids in either.
        A past bucket's winner is kept until a slice closing into it changes it."""
        bs = self.bucket_s
        current = int(now // bs)
        running = list(self._open.values())
        open_from = min((int(since // bs) for _, _, since in running), default=current + 1)
        timeline: list[str] = []
        holders: list[list[str]] = []
        names: dict[str, str] = {}
        for b in range(current - self.buckets + 1, current + 1):
            i = b % self.buckets
            slot = self._held[i] if self._tags[i] == b else None
            extra: dict[str, float] = {}  # session -> seconds of its running slice in this bucket
            if b < open_from and b < current:  # complete, and no running slice in it
                cached = self._best[i]
                if cached is None or cached[0] != b:
                    cached = self._best[i] = (b, _winner(slot, bs, {}))
                best = cached[1]
            else:
                start = b * bs
                for session, _, since in running:
                    seconds = min(now, start + bs) - max(start, since)
                    if seconds > 0:
                        extra[session] = extra.get(session, 0.0) + seconds
                best = _winner(slot, min(now, start + bs) - start, extra)
            timeline.append(best)
            seconds = Counter({sid: entry[0] for sid, entry in (slot or {}).items()})
            seconds.update(extra)
            held = sorted((sid for sid, s in seconds.items() if s > 0), key=lambda sid: -seconds[sid])
            holders.append(held)
            for sid in held:
                if sid != MANY and sid not in names:
                    names[sid] = (slot[sid][1] if slot is not None and sid in slot
                                  else next(name for session, name, _ in running if session == sid))
        return timeline, holders, names

    # ------------------------------------------------------------ bucket arithmetic

    def _close(self, lane: int, end: float) -> None:
        """End ``lane``'s open slice: add its held time to the buckets it covers (at most ``buckets`` of them)."""
        session, name, start = self._open.pop(lane)
        bs = self.bucket_s
        b = int(start // bs)
        if end <= (b + 1) * bs:  # the usual slice: within one bucket
            if end > start:
                self._add(b, session, name, end - start)
            return
        last = int(end // bs)
        if last - b >= self.buckets:  # older than the timeline reaches
            b = last - self.buckets + 1
            start = b * bs
        while b <= last:
            seconds = min(end, (b + 1) * bs) - max(start, b * bs)
            if seconds > 0:
                self._add(b, session, name, seconds)
            b += 1

    def _add(self, b: int, session: str, name: str, seconds: float) -> None:
        i = b % self.buckets
        if self._tags[i] != b:  # a bucket of an earlier round: start it afresh
            self._tags[i] = b
            self._held[i] = {}
        self._best[i] = None
        slot = self._held[i]
        if session in slot or len(slot) < MAX_HOLDERS_PER_BUCKET:
            slot.setdefault(session, [0.0, name])[0] += seconds
        else:  # the rest pooled
            slot.setdefault(MANY, [0.0, MANY])[0] += seconds

def _winner(slot: dict[str, list] | None, length_s: float, running: dict[str, float]) -> str:
    """Who held a token longest in a bucket ``length_s`` long: a session of ``slot`` (plus what
    ``running`` adds: session -> seconds of a slice still open), or ``IDLE`` if no token was held
    for longer than the longest holder held one."""
    best, best_s, total = IDLE, 0.0, sum(running.values())
    for sid, seconds in running.items():
        if (slot is None or sid not in slot) and seconds > best_s:
            best, best_s = sid, seconds
    if slot:
        for sid, entry in slot.items():
            seconds = entry[0] + running.get(sid, 0.0)
            total += entry[0]
            if seconds > best_s:
                best, best_s = sid, seconds
    return best if best_s > length_s - min(total, length_s) else IDLE


# ------------------------------------------------------------------ attained service

FLUSH_S = 1.0
MAX_JOBS = 4096  # jobs remembered; past it the smallest of those with no session here is forgotten


def job_of(s: Session) -> str | None:
    """The training job whose service ``s``'s slices are, or None (inference, or no borrower)."""
    return s.borrower if s.borrower is not None and s.workload is not Workload.INFERENCE else None


class AttainedService:
    """The attained-service ledger: owns each job's GPU-seconds and their journal rows, journalled
    at most ``flush_s`` behind (a daemon SIGKILLed loses at most that much of each job's service)."""

    def __init__(self, *, sessions: SessionTable, tokens: Tokens, journal: JournalWriter,
                 clock: Callable[[], float], flush_s: float = FLUSH_S, max_jobs: int = MAX_JOBS) -> None:
        self._sessions = sessions
        self._tokens = tokens
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
            since = self._tokens.held_since(s) if job is not None else None
            if since is not None:
                running[job] = running.get(job, 0.0) + max(0.0, now - since)
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
